"""``llm.export(model_dir)`` streams the checkpoint: the weights stay in the safetensors files
until the asset is written, and the asset is byte for byte the one the in-memory export of the
same model writes.

Each architecture is checked with one precision and compression, so that every architecture,
precision (fp32, fp16, bf16) and compression (none, int4, int8, palettes) appears; the
checkpoints are bf16, as real ones are.  A bad checkpoint is an error naming the file and the
tensor before anything is traced.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import struct
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from coreai_torch import bundles, llm
from coreai_torch.errors import CheckpointError
from coreai_torch.hf.base import load_for_export
from coreai_torch.ir.weights import PendingLazy
from coreai_torch.llm.export import load_causal_lm
from tests.bundles.support import assert_doctor_clean
from tests.llm.support import causal_lm, check_engine, tiny_tokenizer

MAX_CONTEXT = 32

#: (architecture, precision, compression): every architecture once, every precision and
#: compression several times
CASES = [
    ("smollm", "fp16", "int4"),  # tied embeddings
    ("llama", None, None),
    ("mistral", "bf16", "int8"),
    ("qwen2", "fp16", "palette4"),
    ("qwen3", None, "int4"),
    ("gemma", "fp16", None),
    ("gemma2", "bf16", "int4"),
    ("phi3", "fp16", "int8"),
    ("mixtral", "fp16", "int4"),
    ("qwen2_moe", None, "palette4"),
    ("qwen3_moe", "bf16", None),
    ("olmoe", "fp16", "int8"),
    ("deepseek_v3", "fp16", "int4"),
    ("gpt_oss", None, "int4"),
]
FAST = {("smollm", "fp16", "int4")}


def _checkpoint(tmp_path: Path, name: str) -> Path:
    directory = tmp_path / name
    causal_lm(name).to(torch.bfloat16).save_pretrained(directory)
    return directory


def _asset_bytes(asset: Path) -> dict[str, bytes]:
    """The asset's files but the metadata (which records the creation time)."""
    return {f.name: f.read_bytes() for f in sorted(asset.iterdir()) if f.name != "metadata.json"}


@pytest.mark.parametrize(
    ("name", "precision", "compress"),
    [
        pytest.param(
            name,
            precision,
            compress,
            marks=() if (name, precision, compress) in FAST else pytest.mark.slow,
            id=f"{name}-{precision or 'fp32'}-{compress or 'none'}",
        )
        for name, precision, compress in CASES
    ],
)
def test_a_streamed_export_writes_the_in_memory_asset(
    tmp_path: Path, name: str, precision: str | None, compress: str | None
) -> None:
    checkpoint = _checkpoint(tmp_path, name)
    options = dict(max_context=MAX_CONTEXT, precision=precision, compress=compress)

    streamed = llm.export(checkpoint, **options)
    # the weights are still in the checkpoint: placeholders filled when the asset is written
    assert any(isinstance(p, PendingLazy) for p in streamed.weights.pending.values())
    streamed.save_asset(tmp_path / "streamed.aimodel")

    in_memory = llm.export(AutoModelForCausalLM.from_pretrained(checkpoint), **options)
    in_memory.save_asset(tmp_path / "in_memory.aimodel")

    streamed_files = _asset_bytes(tmp_path / "streamed.aimodel")
    assert set(streamed_files) == {"main.mlirb", "main.hash"}
    assert streamed_files == _asset_bytes(tmp_path / "in_memory.aimodel")


def test_a_streamed_static_shape_export_keeps_the_weights_in_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``engine="static"`` from a checkpoint: the static-shape functions are made with every
    weight still in the checkpoint -- the layers' and the token-embedding table
    ``load_embeddings`` returns (it was read, and a float32 copy folded, before) -- read when
    the asset is written; the asset is the in-memory export's byte for byte."""
    checkpoint = _checkpoint(tmp_path, "llama")
    options = dict(max_context=64, engine="static", precision="fp16")
    read: list[str] = []
    materialize = PendingLazy.materialize

    def noted(self: PendingLazy) -> None:
        read.append(self.name)
        materialize(self)

    monkeypatch.setattr(PendingLazy, "materialize", noted)
    streamed = llm.export(checkpoint, **options)
    assert read == []
    pending = {p.name for p in streamed.weights.pending.values() if isinstance(p, PendingLazy)}
    assert "embedding_table" in pending and any(".layers.0." in name for name in pending)
    # stored once, in the compute precision: half the bytes of a float32 table
    assert re.search(r"@load_embeddings\(\) -> \(tensor<\d+x\d+xf16>", str(streamed))
    streamed.save_asset(tmp_path / "streamed.aimodel")
    in_memory = llm.export(AutoModelForCausalLM.from_pretrained(checkpoint), **options)
    in_memory.save_asset(tmp_path / "in_memory.aimodel")
    streamed_files = _asset_bytes(tmp_path / "streamed.aimodel")
    assert streamed_files == _asset_bytes(tmp_path / "in_memory.aimodel")


def test_a_streamed_export_writes_a_bundle(tmp_path: Path) -> None:
    """``llm.export(model_dir, bundle=...)``: the weights are read from the checkpoint while
    the asset is written into the bundle, with the directory's tokenizer and configs."""
    checkpoint = _checkpoint(tmp_path, "smollm")
    tiny_tokenizer().save_pretrained(checkpoint)
    llm.export(checkpoint, max_context=MAX_CONTEXT, bundle=tmp_path / "b")
    bundle = bundles.Bundle.load(tmp_path / "b")
    assert bundle.language.max_context_length == MAX_CONTEXT
    assert (tmp_path / "b" / "config.json").read_text() == (checkpoint / "config.json").read_text()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32)
    with bundles.open_engine(bundle, stop_token_ids=[]) as engine:
        check_engine(engine, model, [5, 6, 7], 8)
    assert_doctor_clean(tmp_path / "b")


# --------------------------------------------------------------------- bad checkpoints ---


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Llama saved in two shards."""
    directory = tmp_path_factory.mktemp("sharded")
    causal_lm("llama").to(torch.bfloat16).save_pretrained(directory, max_shard_size="40KB")
    assert len(list(directory.glob("*.safetensors"))) > 1
    return directory


def _copy(source: Path, target: Path) -> Path:
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    return target


def test_a_missing_shard_is_named_before_anything_is_traced(sharded: Path, tmp_path: Path) -> None:
    broken = _copy(sharded, tmp_path / "broken")
    shard = sorted(broken.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"not in .*{shard.name}.*incomplete"):
        llm.export(broken, max_context=MAX_CONTEXT)


def test_a_truncated_shard_is_named(sharded: Path, tmp_path: Path) -> None:
    broken = _copy(sharded, tmp_path / "broken")
    shard = sorted(broken.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=f"{shard.name} is truncated.*bytes of tensor data"):
        llm.export(broken, max_context=MAX_CONTEXT)


def test_a_tensor_whose_shape_disagrees_with_the_config_is_named(
    sharded: Path, tmp_path: Path
) -> None:
    broken = _copy(sharded, tmp_path / "broken")
    config = json.loads((broken / "config.json").read_text())
    config["intermediate_size"] *= 2
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError, match=r"tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' of .*has shape"
    ) as error:
        llm.export(broken, max_context=MAX_CONTEXT)
    assert "does the configuration match the checkpoint" in str(error.value)


def test_a_missing_tensor_is_named(tmp_path: Path) -> None:
    directory = _checkpoint(tmp_path, "llama")
    shard = next(directory.glob("*.safetensors"))
    data = shard.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    del header["model.norm.weight"]  # its bytes stay, unlisted
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (length - len(text))
    shard.write_bytes(data[:8] + text + data[8 + length :])
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' is not in the checkpoint"):
        llm.export(directory, max_context=MAX_CONTEXT)


def test_a_directory_without_safetensors_is_an_error(tmp_path: Path) -> None:
    directory = _checkpoint(tmp_path, "llama")
    for file in directory.glob("*.safetensors"):
        file.unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors files"):
        llm.export(directory, max_context=MAX_CONTEXT)


@pytest.mark.parametrize(
    ("precision", "engine"),
    [("fp16", "dynamic"), pytest.param("bf16", "static", marks=pytest.mark.slow)],
)
def test_every_function_reads_one_copy_of_each_streamed_weight(
    tmp_path: Path, precision: str, engine: str
) -> None:
    """Each function's trace detaches the weights it reads; the half-precision copy of a
    streamed weight is made once, and the functions of the static-shape engine (prefill
    chunks and single-token steps of every cache length) all read that one resource."""
    options: dict = {"contexts": [32], "query_lengths": [1, 8]} if engine == "static" else {}
    program = llm.export(
        _checkpoint(tmp_path, "llama"),
        max_context=MAX_CONTEXT,
        precision=precision,
        engine=engine,
        **options,
    )
    graphs = str(program.structural_module).split("coreai.graph")[1:]
    read = {
        graph.split("(")[0].strip(): set(re.findall(r"dense_resource<([^>]+)>", graph))
        for graph in graphs
    }
    decoders = [n for n in read if n == "@main" or n.startswith(("@extend_", "@prompt_opt_"))]
    assert len(decoders) == (1 if engine == "dynamic" else 3), sorted(read)
    first = read[decoders[0]]
    assert first and all(read[n] == first for n in decoders)
    if engine == "dynamic":  # set_static_shape_config() reads the weights (its rewrite folds)
        assert len(program.weights.pending) >= len(first)


@contextlib.contextmanager
def transformers_log() -> Iterator[list[str]]:
    """The messages transformers logs inside the block (its ``warning_once`` cache cleared, so
    that a warning an earlier test already printed shows again)."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logging.Logger.warning_once.cache_clear()
    logger, handler = logging.getLogger("transformers"), Collect()
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def test_loading_a_checkpoint_uses_no_deprecated_transformers_argument(tmp_path: Path) -> None:
    """``llm.export`` and the ``coreai_torch.hf`` classes build the model from its config with
    ``dtype=`` (transformers deprecates ``torch_dtype=`` and says so on every export)."""
    directory = _checkpoint(tmp_path, "llama")
    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    with transformers_log() as messages, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_causal_lm(directory)
        load_for_export(AutoModelForCausalLM, config, directory)
    said = messages + [str(w.message) for w in caught]
    assert not [m for m in said if "deprecated" in m], said
