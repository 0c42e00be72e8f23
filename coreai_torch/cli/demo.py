"""``make demo`` / ``coreai-torch demo``: convert a small transformer, run it, compare with PyTorch.

python -m coreai_torch.cli.demo [--out build/demo]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from coreai_torch.converter import TorchConverter
from coreai_torch.examples.tiny_lm import TinyLM
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.runtime import Session
from coreai_torch.verify import compare, eager_outputs, run_entrypoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("build/demo"),
        help="directory for the .aimodel (default: build/demo)",
    )
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = TinyLM().eval()
    token_ids = torch.randint(0, 256, (1, 16), dtype=torch.int64)
    print(
        f"model: TinyLM, {sum(p.numel() for p in model.parameters()):,} parameters; "
        f"input token_ids {tuple(token_ids.shape)} int64"
    )

    start = time.perf_counter()
    ep = export_decomposed(model, (token_ids,))
    export_s = time.perf_counter() - start
    start = time.perf_counter()
    program = (
        TorchConverter()
        .add_exported_program(ep, input_names=["token_ids"], output_names=["logits", "next_token"])
        .to_coreai()
    )
    convert_s = time.perf_counter() - start
    start = time.perf_counter()
    program.optimize()
    optimize_s = time.perf_counter() - start

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "tiny_lm.aimodel"
    start = time.perf_counter()
    program.save_asset(path)
    save_s = time.perf_counter() - start
    print(
        f"torch.export + decompositions {export_s:.2f} s | to_coreai {convert_s:.3f} s | "
        f"optimize {optimize_s:.3f} s | save_asset {save_s:.3f} s -> {path}"
    )

    expected = eager_outputs(model, (token_ids,))
    start = time.perf_counter()
    with Session(path) as session:
        load_s = time.perf_counter() - start
        start = time.perf_counter()
        actual = run_entrypoint(session, program, (token_ids,))
        run_s = time.perf_counter() - start
    print(f"Core AI runtime: compile + load {load_s:.2f} s, inference {run_s * 1000:.1f} ms")
    print("output                   dtype    shape                max|err|   vs PyTorch")
    results = [
        compare(o.name, e, a)
        for o, e, a in zip(program.signatures["main"].outputs, expected, actual, strict=True)
    ]
    for result in results:
        print(result)
    ok = all(r.ok for r in results)
    print("MATCH: the converted program reproduces PyTorch" if ok else "MISMATCH")
    return 0 if ok else 1


def add_command(commands: Any, common: argparse.ArgumentParser) -> None:
    """Add ``demo`` to the ``coreai-torch`` sub-commands."""
    demo = commands.add_parser(
        "demo", parents=[common], help="convert a small transformer, run it, compare"
    )
    demo.add_argument("--out", help="directory for the .aimodel (default build/demo)")
    demo.set_defaults(func=lambda opts: main(["--out", opts.out] if opts.out else []))


if __name__ == "__main__":
    raise SystemExit(main())
