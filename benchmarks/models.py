"""Benchmark models, built from configs/code with random weights (nothing is downloaded)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass
class BenchModel:
    name: str
    build: Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]
    description: str


class _LogitsOnly(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        out = self.model(*args, return_dict=False)
        return out[0]


def llama_causal_lm(
    hidden: int = 1024,
    layers: int = 16,
    heads: int = 16,
    mlp: int = 2816,
    vocab: int = 32000,
    use_cache: bool = False,
) -> nn.Module:
    """Hugging Face ``LlamaForCausalLM`` of the benchmark layout (default: the 0.27B one)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=mlp,
        vocab_size=vocab,
        max_position_embeddings=512,
        use_cache=use_cache,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).eval()


def llama(
    hidden: int = 1024,
    layers: int = 16,
    heads: int = 16,
    mlp: int = 2816,
    vocab: int = 32000,
    tokens: int = 128,
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Hugging Face Llama decoder returning logits for ``tokens`` token ids."""
    model = llama_causal_lm(hidden, layers, heads, mlp, vocab)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), dtype=torch.int64)
    return _LogitsOnly(model).eval(), (ids,)


def llama_decoder() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Llama-style decoder: hidden 1024, 16 layers, 16 heads, MLP 2816, vocab 32000 (~0.27B)."""
    return llama()


def _small_llama(tokens: int) -> Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]:
    """The benchmark Llama's layout at a quarter of its size: hidden 512, 4 layers."""
    return lambda: llama(hidden=512, layers=4, heads=8, mlp=1408, vocab=8000, tokens=tokens)


def vit_b16() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """ViT-B/16 at 224x224 (86M parameters)."""
    from transformers import ViTConfig, ViTModel

    config = ViTConfig(
        image_size=224,
        patch_size=16,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        attn_implementation="sdpa",
    )
    model = ViTModel(config, add_pooling_layer=False).eval()
    return _LogitsOnly(model).eval(), (torch.randn(1, 3, 224, 224),)


def resnet50() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """ResNet-50 at 224x224 (25M parameters)."""
    from transformers import ResNetConfig, ResNetModel

    config = ResNetConfig(
        layer_type="bottleneck",
        depths=[3, 4, 6, 3],
        hidden_sizes=[256, 512, 1024, 2048],
        embedding_size=64,
    )
    model = ResNetModel(config).eval()
    return _LogitsOnly(model).eval(), (torch.randn(1, 3, 224, 224),)


class _SequenceOutput(nn.Module):
    def __init__(self, rnn: nn.RNNBase) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


def lstm() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A 3-layer, 256-unit LSTM over 160 steps (batch 1): one ``coreai.while`` per layer, 480
    steps of small matmuls (the shape of a speech or sensor model)."""
    rnn = nn.LSTM(256, 256, num_layers=3, batch_first=True)
    return _SequenceOutput(rnn).eval(), (torch.randn(1, 160, 256),)


MODELS = {
    m.name: m
    for m in [
        BenchModel(
            "llama-0.27b", llama_decoder, "Llama decoder, 16 layers, hidden 1024, 128 tokens"
        ),
        BenchModel("vit-b16", vit_b16, "ViT-B/16, 224x224"),
        BenchModel("resnet50", resnet50, "ResNet-50, 224x224"),
        BenchModel("lstm-3x256", lstm, "LSTM, 3 layers of 256 units, 160 steps"),
    ]
}

#: Models of the IR ablation (``--ablation``): small enough to load every variant at once.
ABLATION_MODELS = {
    m.name: m
    for m in [
        BenchModel(
            "llama-small-128", _small_llama(128), "Llama decoder, 4 layers, hidden 512, 128 tokens"
        ),
        BenchModel(
            "llama-small-1", _small_llama(1), "the same, 1 token (the shape of a decode step)"
        ),
    ]
}
