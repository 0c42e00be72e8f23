"""Writing and loading bundles: what ``write_bundle``/``write_llm_bundle`` write, that it is
what the app loads (``Bundle.load`` with the Swift rules, ``coreai doctor`` clean), that it is
written atomically, and clear errors for bad input at write and at load."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import coreai_torch
from coreai_torch import TorchConverter
from coreai_torch.bundles import (
    AssetMetadata,
    Bundle,
    BundleError,
    BundleNotFoundError,
    CallingConventionError,
    DiffusionConfig,
    Manifest,
    SchedulerDefaults,
    function_signatures,
    read_asset_metadata,
    write_bundle,
    write_llm_bundle,
)
from tests.bundles.support import VOCAB, assert_doctor_clean

pytestmark = pytest.mark.xdist_group("bundles")


def _leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.startswith(".")]


def test_llm_bundle_from_a_program(tmp_path: Path, dynamic_program: Any, model_dirs: dict) -> None:
    started = time.time()
    bundle = write_llm_bundle(
        tmp_path / "Tiny", dynamic_program, model_dir=model_dirs["qwen"], max_context_length=1024
    )
    root = tmp_path / "Tiny"
    assert sorted(p.name for p in root.iterdir()) == ["Tiny.aimodel", "metadata.json", "tokenizer"]
    assert _leftovers(tmp_path) == []
    manifest = json.loads((root / "metadata.json").read_text())
    assert manifest["metadata_version"] == "0.2" and manifest["kind"] == "llm"
    assert manifest["assets"] == {"main": "Tiny.aimodel"}
    assert manifest["language"] == {
        "tokenizer": "model-qwen",
        "vocab_size": VOCAB,
        "max_context_length": 1024,
        "embedded_tokenizer": True,
        "function_map": {"main": ["main"]},
    }
    assert manifest["source"]["converter"].startswith("coreai-torch-converter ")
    assert "date" in manifest["compilation"]
    loaded = Bundle.load(root)
    assert loaded.structure == "dynamic" and loaded.unchecked == []
    assert loaded.manifest == bundle.manifest
    tokenizer = loaded.tokenizer
    assert tokenizer.eos_token == "<|im_end|>"  # the template's turn terminator
    assert {tokenizer.token_id("<|im_end|>"), tokenizer.token_id("<|endoftext|>")} <= set(
        tokenizer.stop_token_ids
    )
    metadata = loaded.asset_metadata()
    assert metadata.license == "apache-2.0"  # from the model card
    assert "coreai-torch-converter" in metadata.description
    assert metadata.producer.startswith("coreai-torch-converter ")
    assert started - 5 <= metadata.creation_date <= time.time() + 5
    assert_doctor_clean(root)


def test_a_saved_asset_is_linked_and_its_metadata_set(
    tmp_path: Path, assets: Path, model_dirs: dict
) -> None:
    source = assets / "dynamic.aimodel"
    before = (source / "metadata.json").read_bytes()
    chosen = AssetMetadata(
        author="Tests", license="MIT", description="tiny", creation_date=1.7e9, custom={"k": [1]}
    )
    write_llm_bundle(
        tmp_path / "b",
        source,
        model_dir=model_dirs["llama3"],
        asset_metadata=chosen,
        name="Tiny LM",
    )
    asset = tmp_path / "b" / "Tiny-LM.aimodel"
    assert (asset / "main.mlirb").stat().st_ino == (source / "main.mlirb").stat().st_ino
    assert (source / "metadata.json").read_bytes() == before  # the source asset is untouched
    written = read_asset_metadata(asset)
    assert (written.author, written.license, written.description) == ("Tests", "MIT", "tiny")
    assert written.creation_date == 1.7e9 and written.custom == {"k": [1]}
    on_disk = json.loads((asset / "metadata.json").read_text())
    assert on_disk["creationDate"].startswith("2023") and on_disk["producer"] == written.producer
    assert Bundle.load(tmp_path / "b").name == "Tiny LM"
    assert_doctor_clean(tmp_path / "b")


def test_signatures_from_the_program_are_those_of_the_saved_asset(tmp_path: Path) -> None:
    """The IR of a converted program (read before saving, at write time) and the saved asset
    (read without its weights, at load time) give the runtime's inputs, outputs and states in
    the same order."""

    class Step(torch.nn.Module):
        def forward(self, ids, positions, keys, values):  # type: ignore[no-untyped-def]
            keys.copy_(keys + 1)
            values.copy_(values * 2)
            logits = (ids.float().unsqueeze(-1) * torch.ones(1, 1, 10)).half()
            return logits, positions.to(torch.uint16)

    dims = [torch.export.Dim(n, min=2, max=64) for n in ("t", "p", "s")]
    cache = torch.zeros(2, 1, 2, 8, 4)
    args = (
        torch.zeros(1, 3, dtype=torch.int32),
        torch.zeros(1, 5, dtype=torch.int32),
        cache,
        cache.half(),
    )
    ep = torch.export.export(
        Step(), args, dynamic_shapes=({1: dims[0]}, {1: dims[1]}, {3: dims[2]}, {3: dims[2]})
    ).run_decompositions(coreai_torch.get_decomp_table())
    program = (
        TorchConverter()
        .add_exported_program(
            ep, input_names=["input_ids", "position_ids"], output_names=["logits", "p16"]
        )
        .to_coreai()
    )
    from_ir = function_signatures(program)
    program.save_asset(tmp_path / "step.aimodel")
    assert from_ir == function_signatures(tmp_path / "step.aimodel")
    main = from_ir["main"]
    assert [t.name for t in main.inputs] == ["input_ids", "position_ids"]
    assert [(t.name, t.dtype, t.shape) for t in main.states] == [
        ("keys", "float32", (2, 1, 2, None, 4)),
        ("values", "float16", (2, 1, 2, None, 4)),
    ]


def _bad_program() -> Any:
    """``main(input_ids int64 [1, 4]) -> float32 logits``: our earlier LLM export's kind of IO."""

    class Bad(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, 8)

        def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
            return self.embed(input_ids) @ self.embed.weight.T

    ids = torch.zeros(1, 4, dtype=torch.int64)
    ep = torch.export.export(Bad(), (ids, ids)).run_decompositions(coreai_torch.get_decomp_table())
    converter = TorchConverter()
    converter.add_exported_program(ep, input_names=["input_ids", "position_ids"])
    return converter.to_coreai()


def test_a_bad_asset_is_refused_before_anything_is_written(
    tmp_path: Path, model_dirs: dict
) -> None:
    with pytest.raises(CallingConventionError, match="is int64; the engines write int32"):
        write_llm_bundle(tmp_path / "bad", _bad_program(), model_dir=model_dirs["qwen"])
    assert list(tmp_path.iterdir()) == []


def test_overwrite_is_atomic(tmp_path: Path, assets: Path, model_dirs: dict) -> None:
    target = tmp_path / "b"
    write_llm_bundle(target, assets / "dynamic.aimodel", model_dir=model_dirs["qwen"])
    before = (target / "metadata.json").read_bytes()
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_llm_bundle(target, assets / "dynamic.aimodel", model_dir=model_dirs["qwen"])
    with pytest.raises(BundleError):  # fails after staging started: nothing changes
        write_llm_bundle(
            target,
            assets / "dynamic.aimodel",
            model_dir=model_dirs["qwen"],
            max_context_length=128,
            overwrite=True,
            tokenizer=model_dirs["qwen"] / "missing",
        )
    assert (target / "metadata.json").read_bytes() == before and _leftovers(tmp_path) == []
    write_llm_bundle(
        target, assets / "dynamic.aimodel", model_dir=model_dirs["gemma"], overwrite=True
    )
    assert Bundle.load(target).tokenizer.eos_token == "<end_of_turn>"
    assert _leftovers(tmp_path) == []


def test_write_bundle_argument_errors(tmp_path: Path, assets: Path, model_dirs: dict) -> None:
    asset = assets / "dynamic.aimodel"
    manifest = Manifest(
        "llm", "m", language=bundle_language(), assets={"main": "m.aimodel", "vision": "v.aimodel"}
    )
    with pytest.raises(
        BundleError, match=r"assets\.vision names 'v\.aimodel', which nothing provides"
    ):
        write_bundle(tmp_path / "x", manifest, {"main": asset}, tokenizer=model_dirs["qwen"])
    manifest = Manifest("llm", "m", language=bundle_language())
    with pytest.raises(BundleError, match="embedded_tokenizer is true but no tokenizer"):
        write_bundle(tmp_path / "x", manifest, {"main": asset})
    with pytest.raises(BundleError, match=r"not the \.aimodel itself"):
        write_bundle(tmp_path / "x.aimodel", manifest, {"main": asset})
    with pytest.raises(BundleError, match="must be a path inside the bundle"):
        write_bundle(tmp_path / "x", manifest, {"main": asset}, files={"/etc/x": asset})
    with pytest.raises(TypeError, match="must be an AIProgram or the path"):
        write_bundle(tmp_path / "x", manifest, {"main": 3}, tokenizer=model_dirs["qwen"])
    assert list(tmp_path.iterdir()) == []


def bundle_language() -> Any:
    from coreai_torch.bundles import LanguageConfig

    return LanguageConfig("tiny", vocab_size=VOCAB, max_context_length=1024)


# ------------------------------------------------------------------------------ loading ---


@pytest.fixture
def bundle(tmp_path: Path, assets: Path, model_dirs: dict) -> Path:
    write_llm_bundle(tmp_path / "b", assets / "dynamic.aimodel", model_dir=model_dirs["qwen"])
    return tmp_path / "b"


def _edit_manifest(bundle: Path, **changes: Any) -> None:
    path = bundle / "metadata.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_load_errors_name_the_file_and_the_fix(bundle: Path, tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="is a model asset, not a model bundle directory"):
        Bundle.load(bundle / "b.aimodel")
    with pytest.raises(BundleNotFoundError, match="does not exist"):
        Bundle.load(tmp_path / "nowhere")
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "config.json").write_text("{}")
    with pytest.raises(BundleNotFoundError, match=r"missingMetadata.*holds config\.json"):
        Bundle.load(tmp_path / "checkpoint")
    (bundle / "metadata.json").write_text("{not json")
    with pytest.raises(BundleError, match="is not valid JSON"):
        Bundle.load(bundle)


def test_a_manifest_naming_an_absent_asset(bundle: Path) -> None:
    _edit_manifest(bundle, assets={"main": "other.aimodel"})
    with pytest.raises(BundleNotFoundError, match=r"asset 'main' not found at .*other\.aimodel"):
        Bundle.load(bundle)


def test_a_compiled_asset_is_found_but_not_checked(bundle: Path) -> None:
    os.rename(bundle / "b.aimodel", bundle / "b.aimodelc")  # what coreai-build compile leaves
    loaded = Bundle.load(bundle)
    assert loaded.asset_path().name == "b.aimodelc"
    assert loaded.unchecked and "compiled .aimodelc" in loaded.unchecked[0]


def test_a_symlinked_asset_is_refused(bundle: Path, tmp_path: Path) -> None:
    shutil.move(bundle / "b.aimodel", tmp_path / "elsewhere.aimodel")
    os.symlink(tmp_path / "elsewhere.aimodel", bundle / "b.aimodel")
    with pytest.raises(BundleError, match=r"symbolic link.*does not follow"):
        Bundle.load(bundle)


def test_tokenizer_problems_at_load(bundle: Path) -> None:
    config_path = bundle / "tokenizer" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "tokenizer_class": "SentencePieceThing"}))
    with pytest.raises(BundleError, match="not in the swift-transformers registry"):
        Bundle.load(bundle)
    (bundle / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(
        BundleNotFoundError, match="would download 'model-qwen' from the Hugging Face Hub"
    ):
        Bundle.load(bundle)
    _edit_manifest(
        bundle,
        language={
            **json.loads((bundle / "metadata.json").read_text())["language"],
            "embedded_tokenizer": False,
        },
    )
    assert Bundle.load(bundle).tokenizer_dir is None


def test_an_asset_breaking_the_convention_is_refused_at_load(bundle: Path, tmp_path: Path) -> None:
    shutil.rmtree(bundle / "b.aimodel")
    _bad_program().save_asset(bundle / "b.aimodel")
    with pytest.raises(CallingConventionError, match=r"b\.aimodel: function 'main': input 0"):
        Bundle.load(bundle)
    assert Bundle.load(bundle, check_assets=False).structure is None


def test_a_bundle_laid_out_by_apples_exporter_loads(tmp_path: Path, assets: Path) -> None:
    """``<out>/<name>/<name>.aimodel``, ``tokenizer/`` from ``AutoTokenizer.save_pretrained``,
    the exporter's ``metadata.json`` (``compression`` null)."""
    from tests.bundles.support import make_tokenizer

    root = tmp_path / "Qwen3-Tiny"
    root.mkdir()
    shutil.copytree(assets / "dynamic.aimodel", root / "Qwen3-Tiny.aimodel")
    make_tokenizer("qwen").save_pretrained(root / "tokenizer")
    (root / "metadata.json").write_text(
        json.dumps(
            {
                "metadata_version": "0.2",
                "kind": "llm",
                "name": "Qwen3-Tiny",
                "assets": {"main": "Qwen3-Tiny.aimodel"},
                "language": {
                    "tokenizer": "Qwen/Qwen3-Tiny",
                    "vocab_size": VOCAB,
                    "max_context_length": 1024,
                    "embedded_tokenizer": True,
                    "function_map": {"main": ["main"]},
                },
                "source": {"model_definition": "torch", "hf_model_id": "Qwen/Qwen3-Tiny"},
                "compression": None,
                "compilation": {"date": "2026-08-21T10:00:00", "targets": []},
            }
        )
    )
    loaded = Bundle.load(root)
    assert loaded.structure == "dynamic" and loaded.language.tokenizer == "Qwen/Qwen3-Tiny"
    # save_pretrained kept eos <|endoftext|>; the app also stops on <|im_end|> (rule 3)
    assert loaded.tokenizer.token_id("<|im_end|>") in loaded.tokenizer.stop_token_ids


# ---------------------------------------------------------------------------- diffusion ---


def _component(inputs: int = 1) -> Any:
    """A small static program with one function ``main``."""
    module = torch.nn.Linear(4, 4)
    ep = torch.export.export(module, (torch.zeros(2, 4),)).run_decompositions(
        coreai_torch.get_decomp_table()
    )
    return TorchConverter().add_exported_program(ep).to_coreai()


def test_diffusion_bundle_with_the_same_writer(tmp_path: Path) -> None:
    clip = tmp_path / "clip"
    clip.mkdir()
    (clip / "vocab.json").write_text('{"a</w>": 0}')
    (clip / "merges.txt").write_text("#version: 0.2\n")
    manifest = Manifest(
        "diffusion",
        "sd-tiny",
        diffusion=DiffusionConfig(
            type="stable-diffusion",
            prediction_type="epsilon",
            image_size=64,
            scheduler=SchedulerDefaults(),
        ),
    )
    component = _component()
    roles = {"text_encoder": component, "unet": component, "vae_decoder": component}
    bundle = write_bundle(
        tmp_path / "sd",
        manifest,
        roles,
        files={"tokenizer": clip},
        asset_metadata=AssetMetadata(description="SD tiny"),
    )
    assert bundle.manifest.assets == {r: f"{r}.aimodel" for r in roles}
    assert (tmp_path / "sd" / "tokenizer" / "merges.txt").is_file()
    loaded = Bundle.load(tmp_path / "sd")
    assert loaded.diffusion.scheduler.beta_schedule == "scaled_linear"
    assert loaded.asset_metadata("unet").description == "SD tiny (unet component)"
    assert_doctor_clean(tmp_path / "sd")
    del roles["vae_decoder"]
    with pytest.raises(CallingConventionError, match="assets lacks vae_decoder"):
        write_bundle(tmp_path / "sd2", manifest, roles)
    with pytest.raises(BundleError, match="go in files="):
        write_bundle(
            tmp_path / "sd2", manifest, {**roles, "vae_decoder": component}, tokenizer=clip
        )
