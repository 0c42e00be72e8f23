"""Shared pieces of the bundle tests: a tiny language model in the app engines' calling
convention, its greedy reference in eager PyTorch, tokenizers built offline with Llama-3,
Qwen and Gemma chat templates, and ``coreai doctor`` run on a bundle.

The model (:class:`ConventionLM`) is what the app's sequential and pipelined engines call:
``forward(input_ids int32 [1, T], position_ids int32 [1, P], key_cache, value_cache)`` ->
float16 logits ``[1, T, vocab]``, the caches ``[layers, 1, kv_heads, S, head_dim]`` with S of
run-time size, updated in place.  The new tokens sit at positions ``P-T .. P-1``; their keys and
values are written there with ``torch.cat`` of slices and one ``copy_`` of the whole cache (no
write into a tensor of run-time size), and attention reads rows ``0 .. P-1`` only, so rows
``>= P`` (fresh memory, garbage) never matter.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import coreai_torch
from coreai_torch import TorchConverter

VOCAB = 96


class _Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.norm1 = nn.LayerNorm(hidden)
        self.q = nn.Linear(hidden, heads * head_dim)
        self.k = nn.Linear(hidden, kv_heads * head_dim)
        self.v = nn.Linear(hidden, kv_heads * head_dim)
        self.o = nn.Linear(heads * head_dim, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)

    def qkv(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values ``[1, heads, T, head_dim]`` of ``x`` ``[1, T, hidden]``,
        the queries and keys rotated to ``positions``."""
        h, n = self.norm1(x), x.shape[1]
        q = self.q(h).view(1, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(1, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(1, n, self.kv_heads, self.head_dim).transpose(1, 2)
        return _rope(q, positions), _rope(k, positions), v

    def attend(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        visible: torch.Tensor,
        masked: float,
    ) -> torch.Tensor:
        """The block's output: ``x`` plus attention of ``q`` over ``keys``/``values`` where
        ``visible`` (scores elsewhere ``masked``), then the MLP."""
        repeat = self.heads // self.kv_heads
        keys = keys.to(torch.float32).repeat_interleave(repeat, dim=1)
        values = values.to(torch.float32).repeat_interleave(repeat, dim=1)
        scores = q @ keys.transpose(-1, -2) / math.sqrt(self.head_dim)
        scores = torch.where(visible, scores, torch.tensor(masked))
        attended = F.softmax(scores, dim=-1) @ values
        x = x + self.o(attended.transpose(1, 2).reshape(1, x.shape[1], -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[1, heads, T, head_dim]`` at ``positions`` ``[T]``."""
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32) / half))
    angles = positions.to(torch.float32)[:, None] * freqs[None, :]
    cos, sin = angles.cos(), angles.sin()
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class ConventionLM(nn.Module):
    """A small causal transformer with the app engines' calling convention (module docstring)."""

    def __init__(
        self,
        vocab: int = VOCAB,
        hidden: int = 32,
        layers: int = 2,
        heads: int = 4,
        kv_heads: int = 2,
        head_dim: int = 8,
        seed: int = 1,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.vocab, self.layer_count = vocab, layers
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            _Layer(hidden, heads, kv_heads, head_dim) for _ in range(layers)
        )
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)
        with torch.no_grad():  # logits of O(10): greedy choices far from ties in float16
            self.embed.weight.mul_(3.0)
            self.head.weight.mul_(8.0)

    def cache_shape(self, length: int) -> tuple[int, ...]:
        return (self.layer_count, 1, self.kv_heads, length, self.head_dim)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> torch.Tensor:
        new = input_ids.shape[1]
        total = position_ids.shape[1]
        start = total - new
        positions = position_ids[0, start:]
        x = self.embed(input_ids[0]).unsqueeze(0)
        query_pos = torch.arange(new).unsqueeze(1) + start
        key_pos = torch.arange(total).unsqueeze(0)
        visible = key_pos <= query_pos
        keys_out, values_out = [], []
        for index, block in enumerate(self.blocks):
            q, k, v = block.qkv(x, positions)
            cached_k, cached_v = key_cache[index], value_cache[index]
            k_all = torch.cat(
                [cached_k[:, :, :start], k.to(cached_k.dtype), cached_k[:, :, total:]], 2
            )
            v_all = torch.cat(
                [cached_v[:, :, :start], v.to(cached_v.dtype), cached_v[:, :, total:]], 2
            )
            keys_out.append(k_all)
            values_out.append(v_all)
            x = block.attend(x, q, k_all[:, :, :total], v_all[:, :, :total], visible, float("-inf"))
        key_cache.copy_(torch.stack(keys_out))
        value_cache.copy_(torch.stack(values_out))
        return self.head(self.norm(x)).to(torch.float16)

    @torch.no_grad()
    def full_logits(self, ids: list[int], cache_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Eager logits ``[len(ids), vocab]`` (float32 before the float16 cast) of the whole
        sequence at once, from empty caches: the reference the engines are compared with."""
        n = len(ids)
        caches = [torch.zeros(self.cache_shape(n), dtype=cache_dtype) for _ in range(2)]
        out = self(
            torch.tensor([ids], dtype=torch.int32),
            torch.arange(n, dtype=torch.int32).unsqueeze(0),
            *caches,
        )
        return out[0].float()

    def greedy(self, prompt: list[int], new_tokens: int, stop: set[int] = frozenset()) -> list[int]:
        """Eager greedy generation, recomputing the whole sequence at each step."""
        ids, out = list(prompt), []
        for _ in range(new_tokens):
            token = int(torch.argmax(self.full_logits(ids)[-1]))
            out.append(token)
            if token in stop:
                break
            ids.append(token)
        return out


class StaticExtend(nn.Module):
    """``extend_<ctx>_<Q>`` of the static-shape engine for a :class:`ConventionLM` (same
    weights): ``transformer_input [1, Q, hidden]``, uint16 ``position_ids [1, Q]``, float16
    ``causal_mask [1, ctx, 1, Q]`` (0: visible), int32 ``in_step [1]``; writes the batch's
    keys and values at rows ``in_step .. in_step+Q-1`` of the caches
    ``[layers, 1, kv_heads, ctx, head_dim]`` and attends where the mask is 0."""

    def __init__(self, lm: ConventionLM) -> None:
        super().__init__()
        self.lm = lm

    def forward(
        self,
        transformer_input: torch.Tensor,
        position_ids: torch.Tensor,
        causal_mask: torch.Tensor,
        in_step: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> torch.Tensor:
        lm = self.lm
        batch, context = transformer_input.shape[1], causal_mask.shape[1]
        positions = position_ids[0].to(torch.int32)
        x = transformer_input
        rows = torch.arange(context, dtype=torch.int32).unsqueeze(1)
        slots = in_step.to(torch.int32) + torch.arange(batch, dtype=torch.int32).unsqueeze(0)
        onehot = (rows == slots).to(torch.float32)  # [ctx, Q]
        written = (onehot.sum(1) > 0).view(1, 1, context, 1)
        visible = (causal_mask[0, :, 0, :] == 0).transpose(0, 1)  # [Q, ctx]
        keys_out, values_out = [], []
        seen = visible.any(0).view(1, 1, context, 1)  # rows some real query sees
        for index, block in enumerate(lm.blocks):
            q, k, v = block.qkv(x, positions)
            k_all = torch.where(written, (onehot @ k).to(key_cache.dtype), key_cache[index])
            v_all = torch.where(written, (onehot @ v).to(value_cache.dtype), value_cache[index])
            keys_out.append(k_all)
            values_out.append(v_all)
            # finite where masked: a query row of padding (all masked) stays finite; rows no
            # real query sees are zeroed, so garbage (even NaN) in them reaches nothing
            x = block.attend(x, q, k_all, torch.where(seen, v_all, 0.0), visible, -1e4)
        key_cache.copy_(torch.stack(keys_out))
        value_cache.copy_(torch.stack(values_out))
        return lm.head(lm.norm(x)).to(torch.float16)


class _LoadEmbeddings(nn.Module):
    def __init__(self, lm: ConventionLM) -> None:
        super().__init__()
        self.lm = lm

    def forward(self) -> torch.Tensor:
        return self.lm.embed.weight * 1.0


class _Gather(nn.Module):
    def forward(
        self, in_new_token_ids: torch.Tensor, embedding_table: torch.Tensor
    ) -> torch.Tensor:
        return embedding_table[in_new_token_ids[0]].unsqueeze(0)


def convert_static(
    model: ConventionLM,
    contexts: tuple[int, ...] = (64, 128),
    queries: tuple[int, ...] = (4, 16),
    cache_dtype: torch.dtype = torch.float16,
) -> Any:
    """The static-shape family of ``model``: ``load_embeddings``, ``gather_embeddings_<Q>``,
    ``extend_<ctx>_<Q>`` for every pair and ``prompt_opt_<ctx>_<Q>`` for the largest Q."""
    decomp = coreai_torch.get_decomp_table()
    converter = TorchConverter()
    table = model.embed.weight.detach()
    converter.add_exported_program(
        torch.export.export(_LoadEmbeddings(model), ()).run_decompositions(decomp),
        output_names=["embedding_table"],
        entrypoint_name="load_embeddings",
    )
    for q in queries:
        ids = torch.zeros(1, q, dtype=torch.int32)
        converter.add_exported_program(
            torch.export.export(_Gather(), (ids, table)).run_decompositions(decomp),
            input_names=["in_new_token_ids", "embedding_table"],
            output_names=["out_transformer_input"],
            entrypoint_name=f"gather_embeddings_{q}",
        )
    extend = StaticExtend(model)
    for ctx in contexts:
        for q in queries:
            args = (
                torch.zeros(1, q, table.shape[1]),
                torch.arange(q, dtype=torch.int32).to(torch.uint16).unsqueeze(0),
                torch.zeros(1, ctx, 1, q, dtype=torch.float16),
                torch.zeros(1, dtype=torch.int32),
                torch.zeros(model.cache_shape(ctx), dtype=cache_dtype),
                torch.zeros(model.cache_shape(ctx), dtype=cache_dtype),
            )
            ep = torch.export.export(extend, args, strict=False).run_decompositions(decomp)
            names = ["extend"] + (["prompt_opt"] if q == max(queries) else [])
            for name in names:
                converter.add_exported_program(
                    ep,
                    input_names=["transformer_input", "position_ids", "causal_mask", "in_step"],
                    output_names=["out_logits"],
                    entrypoint_name=f"{name}_{ctx}_{q}",
                )
    return converter.to_coreai()


def convert(
    model: ConventionLM,
    *,
    cache_dtype: torch.dtype = torch.float32,
    max_context: int = 1024,
    function: str = "main",
) -> Any:
    """``model`` exported with T, P and S of run-time size and converted: the caches become
    the states ``key_cache``/``value_cache``."""
    tokens = torch.export.Dim("tokens", min=1, max=max_context)
    positions = torch.export.Dim("positions", min=1, max=max_context)
    capacity = torch.export.Dim("capacity", min=2, max=2 * max_context)
    args = (
        torch.zeros(1, 3, dtype=torch.int32),
        torch.arange(5, dtype=torch.int32).unsqueeze(0),
        torch.zeros(model.cache_shape(8), dtype=cache_dtype),
        torch.zeros(model.cache_shape(8), dtype=cache_dtype),
    )
    dynamic = ({1: tokens}, {1: positions}, {3: capacity}, {3: capacity})
    ep = torch.export.export(model, args, dynamic_shapes=dynamic, strict=False)
    ep = ep.run_decompositions(coreai_torch.get_decomp_table())
    converter = TorchConverter()
    converter.add_exported_program(
        ep,
        input_names=["input_ids", "position_ids"],
        output_names=["logits"],
        entrypoint_name=function,
    )
    return converter.to_coreai()


# ------------------------------------------------------------------------------ tokenizers ---

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a core ai program runs on the device",
    "language models generate one token at a time",
]

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] "
    "| trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
QWEN_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}"
    "{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)

#: style -> (special tokens, bos, eos, chat template, tokenizer class)
STYLES: dict[str, tuple[list[str], str, str, str | None, str]] = {
    "llama3": (
        [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ],
        "<|begin_of_text|>",
        "<|end_of_text|>",
        LLAMA3_TEMPLATE,
        "PreTrainedTokenizerFast",
    ),
    "qwen": (
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "<|endoftext|>",
        "<|endoftext|>",
        QWEN_TEMPLATE,
        "Qwen2TokenizerFast",
    ),
    "gemma": (
        ["<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"],
        "<bos>",
        "<eos>",
        GEMMA_TEMPLATE,
        "GemmaTokenizerFast",
    ),
    "mistral": (["<unk>", "<s>", "</s>"], "<s>", "</s>", MISTRAL_TEMPLATE, "LlamaTokenizerFast"),
    "base": (["<unk>", "<s>", "</s>"], "<s>", "</s>", None, "PreTrainedTokenizerFast"),
}


def make_tokenizer(style: str, *, tokenizer_class: str | None = None) -> Any:
    """A BPE tokenizer trained on :data:`CORPUS` (vocabulary < :data:`VOCAB`) with the special
    tokens and chat template of ``style``, as a transformers ``PreTrainedTokenizerFast``
    (saved with ``save_pretrained``; ``tokenizer_class`` overrides the class it records)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials, bos, eos, template, cls = STYLES[style]
    tokenizer = Tokenizer(models.BPE(unk_token=specials[0] if style != "qwen" else None))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=80, special_tokens=specials)
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    assert tokenizer.get_vocab_size() <= VOCAB
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos, eos_token=eos)
    if template is not None:
        fast.chat_template = template
    fast.init_kwargs["tokenizer_class"] = tokenizer_class or cls
    return fast


def model_dir(root: Path, style: str = "qwen", **config: Any) -> Path:
    """A Hugging Face-style model directory (``config.json``, ``generation_config.json``,
    tokenizer files, ``README.md``) for a :class:`ConventionLM`."""
    directory = root / f"model-{style}"
    directory.mkdir(parents=True)
    tokenizer = make_tokenizer(style)
    tokenizer.save_pretrained(directory)
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    settings = {
        "model_type": "llama",
        "vocab_size": VOCAB,
        "max_position_embeddings": 1024,
        "eos_token_id": eos,
        "_name_or_path": f"tests/{style}-tiny",
        **config,
    }
    (directory / "config.json").write_text(json.dumps(settings))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    (directory / "README.md").write_text("---\nlicense: apache-2.0\n---\n# tiny\n")
    return directory


# ------------------------------------------------------------------------- coreai doctor ---


def doctor(bundle: Path) -> dict[str, Any]:
    """``coreai doctor --json`` of ``bundle`` (run from a neutral directory: its
    ENV-CONVERTER-SHADOWED rule fires when the working directory holds a coreai_torch
    checkout)."""
    with tempfile.TemporaryDirectory(prefix="doctor_cwd_") as cwd:
        result = subprocess.run(
            [sys.executable, "-m", "coreai_doctor", str(Path(bundle).resolve()), "--json"],
            cwd=cwd,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": ""},
            timeout=120,
        )
    if not result.stdout.strip():
        raise AssertionError(f"coreai doctor printed nothing: {result.stderr}")
    return json.loads(result.stdout)


#: doctor rules that do not apply to a kind: its tokenizer rule is swift-transformers', which
#: the diffusion pipeline does not use (it reads vocab.json/merges.txt with its own BPE)
NOT_APPLICABLE = {"diffusion": {"TOKENIZER-CLASS-UNREGISTERED"}}


def assert_doctor_clean(bundle: Path) -> dict[str, Any]:
    """``coreai doctor`` finds nothing fatal, silent or runaway in ``bundle``."""
    report = doctor(bundle)
    assert report["kind"] == "bundle", report
    kind = json.loads((Path(bundle) / "metadata.json").read_text()).get("kind")
    skip = NOT_APPLICABLE.get(kind, set())
    bad = [
        f
        for f in report["findings"]
        if f["severity"] in ("fatal", "silent", "runaway") and f["id"] not in skip
    ]
    assert not bad, json.dumps(bad, indent=2)
    return report
