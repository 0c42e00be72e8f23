"""``llm.Generator`` checks token ids against the program's vocabulary, refuses logits no token
can be chosen from, and checks a saved asset before the runtime reads it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from coreai_torch import llm
from coreai_torch.errors import AssetNotFoundError, InvalidAssetError
from tests.llm.support import causal_lm
from tests.reliability.support import run_isolated

pytestmark = pytest.mark.xdist_group("llm_generator_inputs")


@pytest.fixture(scope="module")
def asset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gen") / "model.aimodel"
    llm.export(causal_lm("llama"), max_context=16).save_asset(path)
    return path


@pytest.fixture(scope="module")
def generator(asset: Path) -> Any:
    with llm.Generator(asset, max_context=16) as generator:
        yield generator


def test_token_ids_outside_the_vocabulary_are_named_with_their_position(generator: Any) -> None:
    vocab = generator.vocab_size
    assert vocab == causal_lm("llama").config.vocab_size
    with pytest.raises(
        ValueError, match=r"the prompt holds token id -1 at position 2, which is neg"
    ):
        generator.generate([1, 2, -1, 3])
    with pytest.raises(
        ValueError,
        match=rf"token id {vocab} at position 1, which is >= the vocabulary size {vocab}",
    ):
        generator.generate([0, vocab])
    with pytest.raises(ValueError, match=rf"vocabulary has ids 0\.\.{vocab - 1}"):
        generator.generate([10**12])
    with pytest.raises(TypeError, match=r"the id at position 1 is 2\.5 \(float\)"):
        generator.generate([1, 2.5])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"the id at position 0 is True \(bool\)"):
        generator.generate([True])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"the id at position 0 is '7' \(str\)"):
        generator.generate(["7"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"prompt must be text or a sequence of int token ids"):
        generator.generate(7)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=rf"eos_token_id holds token id {vocab + 5}, which is >="):
        generator.generate([1], max_new_tokens=2, eos_token_id=[2, vocab + 5])
    with pytest.raises(TypeError, match=r"eos_token_id token ids must be ints"):
        generator.generate([1], max_new_tokens=2, eos_token_id=[1.5])  # type: ignore[list-item]


def test_integer_arrays_and_the_vocabulary_edges_are_accepted(generator: Any) -> None:
    vocab = generator.vocab_size
    ids = [0, vocab - 1, 5]
    expected = list(generator.generate(ids, max_new_tokens=3))
    assert list(generator.generate(np.asarray(ids, np.int32), max_new_tokens=3)) == expected
    assert list(generator.generate(torch.tensor(ids), max_new_tokens=3)) == expected
    assert list(generator.generate([np.int64(i) for i in ids], max_new_tokens=3)) == expected


def test_logits_with_nan_are_an_error_not_token_zero(generator: Any, monkeypatch: Any) -> None:
    real = generator._step_logits
    steps = []

    def logits_of(outputs: dict) -> np.ndarray:
        logits = real(outputs).copy()
        steps.append(len(steps))
        if len(steps) > 1:  # the decode steps, after the prefill
            logits[3] = np.nan
        return logits

    monkeypatch.setattr(generator, "_step_logits", logits_of)
    tokens = generator.generate([1, 2, 3], max_new_tokens=4)
    next(tokens)  # the prefill's token is fine
    with pytest.raises(
        ValueError,
        match=r"logits at decode step 1 \(position 3\) hold 1 NaN or \+inf values.*"
        r"coreai_torch\.verify\.verify\(model, args, precision='fp16'\)",
    ):
        next(tokens)


def test_a_damaged_asset_is_refused_before_the_runtime_reads_it(
    asset: Path, tmp_path: Path
) -> None:
    with pytest.raises(AssetNotFoundError, match=r"no such \.aimodel asset"):
        llm.Generator(tmp_path / "missing.aimodel")
    damaged = tmp_path / "damaged.aimodel"
    shutil.copytree(asset, damaged)
    data = bytearray((damaged / "main.mlirb").read_bytes())
    data[len(data) // 2] ^= 0xFF  # a weight byte, most likely
    (damaged / "main.mlirb").write_bytes(bytes(data))
    with pytest.raises(InvalidAssetError, match=r"main.mlirb does not match main.hash"):
        llm.Generator(damaged)


def test_a_truncated_asset_does_not_abort_the_process(asset: Path, tmp_path: Path) -> None:
    """The truncated bytecode aborted the process inside coreai-core (SIGABRT)."""
    damaged = tmp_path / "truncated.aimodel"
    shutil.copytree(asset, damaged)
    with open(damaged / "main.mlirb", "r+b") as file:
        file.truncate(file.seek(0, 2) // 3)
    result = run_isolated(
        f"""
        import json
        from coreai_torch import llm
        out = {{}}
        for verify in (True, False):
            try:
                llm.Generator({str(damaged)!r}, verify_hash=verify)
            except Exception as error:
                out[str(verify)] = [type(error).__name__, str(error)]
        print(json.dumps(out))
        """
    )
    for verify in ("True", "False"):
        assert result[verify][0] == "InvalidAssetError"
        assert "main.mlirb is not a readable Core AI program" in result[verify][1]
        assert "(truncated)" in result[verify][1]
