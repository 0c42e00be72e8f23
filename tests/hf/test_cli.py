"""``coreai-torch export --task ...``: a Hugging Face model directory -> a directory the
task's class loads; normal use prints no third-party import noise; wrong tasks, missing
directories and occupied outputs are one-line errors.  ``llm export`` without
``--max-context`` uses the model's own limit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coreai_torch.cli import main
from tests.hf.support import bert_tokenizer
from tests.models.test_encoder_lms import encoder

ROOT = Path(__file__).resolve().parents[2]


def test_export_feature_extraction_quietly(tmp_path: Path) -> None:
    from coreai_torch.hf import CoreAIModelForFeatureExtraction

    model = encoder("BertConfig", "BertModel", pad_token_id=0)
    model.save_pretrained(tmp_path / "bert")
    bert_tokenizer(tmp_path / "bert").save_pretrained(tmp_path / "bert")
    out = tmp_path / "out"
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from coreai_torch.cli import main; sys.exit(main())",
            "--json",
            "export",
            "--task",
            "feature-extraction",
            str(tmp_path / "bert"),
            "-o",
            str(out),
            "--precision",
            "fp32",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    assert data["task"] == "feature-extraction" and data["precision"] == "fp32"
    noise = [
        line
        for line in run.stderr.splitlines()
        if "Failed to load" in line or "_pytree" in line or "Warning" in line
    ]
    assert not noise
    coreai = CoreAIModelForFeatureExtraction.from_pretrained(out)
    ids = torch.randint(5, 40, (2, 7))
    with torch.no_grad():
        expected = model(input_ids=ids).last_hidden_state
    assert float((coreai(input_ids=ids).last_hidden_state - expected).abs().max()) < 1e-4
    assert (out / "vocab.txt").is_file()


def test_export_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    encoder("BertConfig", "BertModel").save_pretrained(tmp_path / "bert")
    args = ["export", "--task", "text-generation", str(tmp_path / "bert"), "-o"]
    assert main([*args, str(tmp_path / "out")]) == 2
    assert "--task feature-extraction" in capsys.readouterr().err
    assert main(["export", "--task", "text-generation", str(tmp_path / "none"), "-o", "x"]) == 2
    assert "never downloads" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "file").write_text("")
    assert main([*args, str(tmp_path / "full")]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    fe = ["export", "--task", "feature-extraction", str(tmp_path / "bert"), "-o", "y"]
    assert main([*fe, "--max-context", "8"]) == 2
    assert "--max-context applies to generative tasks" in capsys.readouterr().err


@pytest.mark.slow
def test_text_generation_exports_write_bundles_of_the_models_context(tmp_path: Path) -> None:
    """``llm export`` and ``export --task text-generation`` write the bundle the app loads,
    its context the model's own limit when ``--max-context`` is not given."""
    from coreai_torch import bundles
    from coreai_torch.llm import Generator
    from tests.bundles.support import assert_doctor_clean
    from tests.llm.support import causal_lm, tiny_tokenizer

    causal_lm("llama", max_position_embeddings=48).save_pretrained(tmp_path / "llama")
    tiny_tokenizer().save_pretrained(tmp_path / "llama")
    bundle = tmp_path / "bundle"
    assert main(["llm", "export", str(tmp_path / "llama"), "-o", str(bundle)]) == 0
    with Generator(bundle) as generator:
        assert generator.max_context == 48
    out = tmp_path / "out"
    args = ["export", "--task", "text-generation", str(tmp_path / "llama"), "-o", str(out)]
    assert main(args) == 0
    assert bundles.Bundle.load(out).language.max_context_length == 48
    for written in (bundle, out):
        assert_doctor_clean(written)
