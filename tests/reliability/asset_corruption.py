"""Corrupted copies of a saved asset, and a worker that loads many of them in one process.

``python -m tests.reliability.asset_corruption WORKDIR SEED COUNT [--rehash] [--no-verify-hash]``
writes a reference asset, makes ``COUNT`` corrupted copies and loads each with
:class:`coreai_torch.runtime.Session` in this one process, printing one JSON line per asset
before (``"loading"``) and after (the outcome).  The test runs it as a subprocess: a process
that dies (the Core AI runtime aborting) is seen as a failure, with the asset it was loading.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

#: corruption kinds; those marked "bytecode" are also made with the hash rewritten to match
KINDS = (
    "truncate",
    "flip_weights",
    "flip_bytecode",
    "remove_file",
    "damage_hash",
    "damage_metadata",
)
BYTECODE_KINDS = ("truncate", "flip_weights", "flip_bytecode")


@dataclass
class Corruption:
    name: str
    kind: str
    detail: str


def reference_asset(workdir: Path) -> tuple[Path, dict]:
    """A small convolution + MLP program saved as an asset, and its inputs/outputs."""
    import torch
    import torch.nn as nn

    from coreai_torch import TorchConverter
    from coreai_torch.frontend.export import export_decomposed

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv1d(4, 8, 3, padding=1),
        nn.Flatten(),
        nn.Linear(8 * 16, 64),
        nn.GELU(),
        nn.Linear(64, 10),
    ).eval()
    x = torch.randn(2, 4, 16)
    program = TorchConverter().add_exported_program(export_decomposed(model, (x,))).to_coreai()
    path = workdir / "reference.aimodel"
    program.save_asset(path)
    with torch.no_grad():
        expected = model(x).numpy()
    return path, {"x": x.numpy(), "expected": expected}


def _rehash(asset: Path) -> None:
    digest = hashlib.sha256((asset / "main.mlirb").read_bytes()).digest()
    (asset / "main.hash").write_bytes(digest)


def _flip(data: bytearray, offsets: list[int], rng: random.Random) -> None:
    for offset in offsets:
        data[offset] ^= rng.randrange(1, 256)  # never a no-op


def corrupt(
    reference: Path, target: Path, kind: str, rng: random.Random, rehash: bool
) -> Corruption:
    """Copy ``reference`` to ``target`` and damage it in the way ``kind`` names."""
    from coreai_torch.ir.assets import check_bytecode_layout

    shutil.copytree(reference, target)
    bytecode = target / "main.mlirb"
    data = bytearray(bytecode.read_bytes())
    blobs = check_bytecode_layout(bytecode)
    in_blobs = [o for start, size in blobs for o in range(start, start + size)]
    blob_set = set(in_blobs)
    detail = ""
    if kind == "truncate":
        cut = rng.randrange(0, len(data))
        data = data[:cut]
        detail = f"main.mlirb cut to {cut} of {len(bytecode.read_bytes())} bytes"
    elif kind == "flip_weights":
        offsets = rng.sample(in_blobs, rng.choice((1, 1, 2, 8)))
        _flip(data, offsets, rng)
        detail = f"weight bytes flipped at {sorted(offsets)}"
    elif kind == "flip_bytecode":
        outside = [o for o in range(len(data)) if o not in blob_set]
        offsets = rng.sample(outside, rng.choice((1, 1, 2, 4)))
        _flip(data, offsets, rng)
        detail = f"non-weight bytes flipped at {sorted(offsets)}"
    elif kind == "remove_file":
        name = rng.choice(("main.mlirb", "main.hash", "metadata.json"))
        (target / name).unlink()
        detail = f"{name} removed"
    elif kind == "damage_hash":
        digest = bytearray((target / "main.hash").read_bytes())
        if rng.random() < 0.5:
            digest = digest[: rng.randrange(0, len(digest))]
            detail = f"main.hash cut to {len(digest)} bytes"
        else:
            _flip(digest, [rng.randrange(len(digest))], rng)
            detail = "a byte of main.hash flipped"
        (target / "main.hash").write_bytes(bytes(digest))
    elif kind == "damage_metadata":
        meta = bytearray((target / "metadata.json").read_bytes())
        if rng.random() < 0.5:
            meta = meta[: rng.randrange(0, len(meta))]
            detail = f"metadata.json cut to {len(meta)} bytes"
        else:
            offsets = [rng.randrange(len(meta)) for _ in range(rng.choice((1, 3)))]
            _flip(meta, offsets, rng)
            detail = f"metadata.json bytes flipped at {sorted(offsets)}"
        (target / "metadata.json").write_bytes(bytes(meta))
    else:
        raise ValueError(kind)
    if kind in BYTECODE_KINDS:
        bytecode.write_bytes(bytes(data))
        if rehash:
            _rehash(target)
            detail += ", main.hash rewritten to match"
    return Corruption(target.name, kind, detail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir", type=Path)
    parser.add_argument("seed", type=int)
    parser.add_argument("count", type=int)
    parser.add_argument("--rehash", action="store_true")
    parser.add_argument("--no-verify-hash", action="store_true")
    args = parser.parse_args(argv)

    import numpy as np

    from coreai_torch.errors import InvalidAssetError
    from coreai_torch.runtime import Session

    args.workdir.mkdir(parents=True, exist_ok=True)
    reference, io = reference_asset(args.workdir)
    rng = random.Random(args.seed)
    kinds = BYTECODE_KINDS if args.rehash else KINDS
    for index in range(args.count):
        kind = kinds[index % len(kinds)]
        target = args.workdir / f"c{index:04d}_{kind}.aimodel"
        info = corrupt(reference, target, kind, rng, args.rehash)
        record = {"name": info.name, "kind": kind, "detail": info.detail}
        print(json.dumps({"loading": info.name}), flush=True)
        try:
            with Session(target, verify_hash=not args.no_verify_hash) as session:
                (out,) = session.run({"input": io["x"]}).values()
            record["outcome"] = "ran"
            record["max_diff"] = float(np.nan_to_num(np.abs(out - io["expected"]), nan=1e30).max())
        except InvalidAssetError as error:
            record["outcome"] = "InvalidAssetError"
            record["message"] = str(error)
        except Exception as error:
            record["outcome"] = type(error).__name__
            record["message"] = str(error)
        print(json.dumps(record), flush=True)
        shutil.rmtree(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
