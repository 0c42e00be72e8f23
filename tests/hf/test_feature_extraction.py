"""``CoreAIModelForFeatureExtraction``: token embeddings of padded batches match the
Hugging Face encoder (pooled outputs with cosine >= 0.99999), padding never changes a real
token's embedding, the save / load round trip, the ``feature-extraction`` pipeline, the
pooling helper and bad input.

BERT is fast; DistilBERT, RoBERTa, XLM-R, ModernBERT and fp16 + int4 are slow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from coreai_torch.errors import UnsupportedModelError
from coreai_torch.hf import CoreAIModelForFeatureExtraction, pool
from coreai_torch.tensors import lazy
from tests.hf.support import assert_streamed, bert_tokenizer, recording_binds
from tests.models.test_encoder_lms import encoder

pytestmark = pytest.mark.xdist_group("hf_feature_extraction")

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a core ai program",
    "language models generate one token at a time and the cache keeps the keys",
]
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "bert": ("BertConfig", "BertModel", dict(pad_token_id=0)),
    "distilbert": (
        "DistilBertConfig",
        "DistilBertModel",
        dict(dim=64, n_layers=2, n_heads=4, hidden_dim=128, pad_token_id=0),
    ),
    "roberta": ("RobertaConfig", "RobertaModel", dict(pad_token_id=1)),
    "xlm-roberta": ("XLMRobertaConfig", "XLMRobertaModel", dict(pad_token_id=1)),
    "modernbert": (
        "ModernBertConfig",
        "ModernBertModel",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            pad_token_id=0,
            global_attn_every_n_layers=2,
            local_attention=8,
        ),
    ),
}


def check_embeddings(coreai: Any, model: Any, inputs: dict[str, torch.Tensor]) -> None:
    """Every pooling of a padded batch has cosine >= 0.99999 with PyTorch's."""
    with torch.no_grad():
        ref = model(**inputs).last_hidden_state
    out = coreai(**inputs).last_hidden_state
    assert out.shape == ref.shape
    for strategy in ("mean", "cls", "last"):
        a, b = (
            pool(out, inputs["attention_mask"], strategy),
            pool(ref, inputs["attention_mask"], strategy),
        )
        cosine = float(torch.nn.functional.cosine_similarity(a, b).min())
        assert cosine >= 0.99999, f"{strategy}: cosine {cosine}"


def save(name: str, root: Path) -> tuple[Any, Any, Path]:
    config, cls, overrides = MODELS[name]
    model = encoder(config, cls, **overrides)
    tok = bert_tokenizer(root / "hf")
    model.save_pretrained(root / "hf")
    tok.save_pretrained(root / "hf")
    return model, tok, root / "hf"


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("hf_bert")
    model, tok, directory = save("bert", root)
    with recording_binds() as bound:
        exported = CoreAIModelForFeatureExtraction.from_pretrained(directory, export=True)
    exported.save_pretrained(root / "coreai")
    exported.close()
    coreai = CoreAIModelForFeatureExtraction.from_pretrained(root / "coreai")
    return {"model": model, "tokenizer": tok, "coreai": coreai, "root": root, "bound": bound}


def test_export_of_a_directory_streams_the_checkpoint(bert: dict[str, Any]) -> None:
    assert_streamed(bert["bound"])


def test_checkpoints_of_task_models_and_bin_files(tmp_path: Path) -> None:
    """A task model's checkpoint (``bert.*`` names) streams into the base encoder; a
    ``pytorch_model.bin`` checkpoint is loaded with ``from_pretrained``."""
    import transformers

    from coreai_torch.hf.feature_extraction import load_encoder

    model = encoder("BertConfig", "BertModel", pad_token_id=0)
    task = transformers.BertForSequenceClassification(model.config).eval()
    task.bert.load_state_dict(model.state_dict(), strict=False)
    task.save_pretrained(tmp_path / "classifier")
    with recording_binds() as bound:
        loaded = load_encoder(tmp_path / "classifier", "test")
    assert_streamed(bound)
    expected = dict(model.named_parameters())
    streamed = dict(loaded.named_parameters())
    assert sorted(streamed) == sorted(expected)
    for name, parameter in streamed.items():
        assert torch.equal(lazy.materialize(parameter), expected[name]), name
    model.save_pretrained(tmp_path / "bin", safe_serialization=False)
    with recording_binds() as bound:
        loaded = load_encoder(tmp_path / "bin", "test")
    assert not bound
    ids = torch.randint(5, 30, (1, 6))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids)[0], model(input_ids=ids)[0])


def test_padded_batch_matches_transformers(bert: dict[str, Any]) -> None:
    inputs = dict(bert["tokenizer"](SENTENCES, padding=True, return_tensors="pt"))
    assert (inputs["attention_mask"] == 0).any() and "token_type_ids" in inputs
    check_embeddings(bert["coreai"], bert["model"], inputs)
    with torch.no_grad():
        ref = bert["model"](**inputs).pooler_output
    out = bert["coreai"](**inputs).pooler_output
    assert float((out - ref).abs().max()) <= 1e-4 * max(1.0, float(ref.abs().max()))


def test_padding_never_changes_a_real_token(bert: dict[str, Any]) -> None:
    tok, coreai = bert["tokenizer"], bert["coreai"]
    batch = dict(tok(SENTENCES, padding=True, return_tensors="pt"))
    padded = coreai(**batch).last_hidden_state
    for row, sentence in enumerate(SENTENCES):
        alone = coreai(**dict(tok(sentence, return_tensors="pt"))).last_hidden_state[0]
        real = int(batch["attention_mask"][row].sum())
        assert float((padded[row, :real] - alone).abs().max()) <= 1e-5


def test_feature_extraction_pipeline_and_round_trip(bert: dict[str, Any]) -> None:
    from transformers import AutoTokenizer, pipeline

    root = bert["root"]
    assert {"model.aimodel", "config.json", "vocab.txt", "coreai_config.json"} <= {
        p.name for p in (root / "coreai").iterdir()
    }
    from coreai_torch.hf import CoreAIModel

    again = CoreAIModel.from_pretrained(root / "coreai")  # the class the directory names
    assert type(again) is CoreAIModelForFeatureExtraction
    again.close()
    tok = AutoTokenizer.from_pretrained(root / "coreai", local_files_only=True)
    ours = pipeline("feature-extraction", model=bert["coreai"], tokenizer=tok)(SENTENCES[0])
    ref = pipeline("feature-extraction", model=bert["model"], tokenizer=tok)(SENTENCES[0])
    assert torch.allclose(torch.tensor(ours), torch.tensor(ref), atol=1e-4)


def test_pool() -> None:
    hidden = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    assert torch.equal(pool(hidden, mask, "cls", normalize=False), hidden[:, 0])
    assert torch.equal(pool(hidden, mask, "last", normalize=False), hidden[[0, 1], [1, 2]])
    mean = pool(hidden, mask, "mean", normalize=False)
    assert torch.equal(mean, torch.stack([hidden[0, :2].mean(0), hidden[1, 1:].mean(0)]))
    assert torch.allclose(pool(hidden, mask).norm(dim=-1), torch.ones(2))
    with pytest.raises(ValueError, match="one of mean, cls, last"):
        pool(hidden, mask, "max")


def test_bad_input(bert: dict[str, Any], tmp_path: Path) -> None:
    coreai = bert["coreai"]
    with pytest.raises(ValueError, match="max_length=64"):
        coreai(input_ids=torch.ones(1, 65, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"attention_mask must be \[batch, tokens\] = \[1, 4\]"):
        coreai(input_ids=torch.ones(1, 4, dtype=torch.int64), attention_mask=torch.ones(1, 5))
    with pytest.raises(ValueError, match="max_context does not apply"):
        CoreAIModelForFeatureExtraction.from_pretrained(bert["root"] / "hf", max_context=8)
    with pytest.raises(ValueError, match="task 'feature-extraction'"):
        from coreai_torch.hf import CoreAIModelForCausalLM

        CoreAIModelForCausalLM.from_pretrained(bert["root"] / "coreai")
    from tests.llm.support import causal_lm

    causal_lm("llama").save_pretrained(tmp_path / "llama")
    with pytest.raises(UnsupportedModelError, match="--task text-generation"):
        CoreAIModelForFeatureExtraction.from_pretrained(tmp_path / "llama", export=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["distilbert", "roberta", "xlm-roberta", "modernbert"])
def test_encoders(name: str, tmp_path: Path) -> None:
    model, tok, directory = save(name, tmp_path)
    coreai = CoreAIModelForFeatureExtraction.from_pretrained(directory, export=True)
    inputs = dict(tok(SENTENCES, padding=True, return_tensors="pt", return_token_type_ids=False))
    check_embeddings(coreai, model, inputs)


@pytest.mark.slow
def test_fp16_int4(tmp_path: Path) -> None:
    model, tok, directory = save("bert", tmp_path)
    coreai = CoreAIModelForFeatureExtraction.from_pretrained(
        directory, export=True, precision="fp16", compress="int4"
    )
    assert coreai.coreai_config["precision"] == "fp16"
    inputs = dict(tok(SENTENCES, padding=True, return_tensors="pt"))
    with torch.no_grad():
        ref = pool(model(**inputs).last_hidden_state, inputs["attention_mask"])
    out = pool(coreai(**inputs).last_hidden_state, inputs["attention_mask"])
    assert float(torch.nn.functional.cosine_similarity(out, ref).min()) >= 0.9
