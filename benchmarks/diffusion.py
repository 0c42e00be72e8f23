"""`make bench` workload: an SD-1.5-shaped UNet (0.86B parameters) exported from its checkpoint
by ``coreai_torch.diffusers``, against the disk's write floor, and its denoising step on the
runtime.

The checkpoint is written here, one tensor at a time, as a diffusers ``unet/`` folder
(``config.json`` + ``diffusion_pytorch_model.safetensors``, float16, random N(0, 1/fan_in)
weights).  The UNet is then exported as the pipeline export does it (built with empty
parameters bound to the checkpoint, traced for batch 2 at 512x512, converted in float16,
optimized, saved), while the process's RSS is sampled every 20 ms; the write floor is the time
to write and fsync the asset's byte count in the same directory (``benchmarks/large.py``).
Then the asset is loaded on the runtime and one denoising step (batch 2: guidance) is timed
after a warm-up call.  The same is done for the UNet exported in float32 (this CPU runtime's
float16 convolutions are slower than its float32 ones, so both steps are reported).
Wall-clock and CPU seconds of this process are both reported (the CPU time is the steadier
number on a shared machine).

    python -m benchmarks.diffusion [--dir DIR] [--steps 1] [--keep]
    python -m benchmarks.diffusion --tiny [--only FLUX]   # the tiny pipelines vs diffusers (docs)

``--tiny`` measures what docs/text_to_image.md reports for the test pipelines
(``tests/diffusers/support.py``: SD 1.x, SDXL, SD3, FLUX.1, FLUX.2): each exported in fp32
and fp16 (SD 1.x also with mixed-bit palettes), the PSNR of 4 denoising steps' image against
diffusers' on the same weights and seed, and each component's largest error against its
PyTorch module.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.large import write_floor
from benchmarks.memory import rss

GIB = 1 << 30
#: Stable Diffusion 1.5's UNet
UNET_CONFIG: dict[str, Any] = dict(
    sample_size=64,
    in_channels=4,
    out_channels=4,
    block_out_channels=(320, 640, 1280, 1280),
    layers_per_block=2,
    cross_attention_dim=768,
    attention_head_dim=8,
    down_block_types=(
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "DownBlock2D",
    ),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
)
#: SD 1.5's VAE has four blocks (latents 8x smaller than the image)
VAE_BLOCKS = [128, 256, 512, 512]


def write_unet(folder: Path) -> tuple[int, int]:
    """The UNet checkpoint in ``folder`` (float16); returns (parameters, tensor bytes)."""
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel(**UNET_CONFIG)
    folder.mkdir(parents=True, exist_ok=True)
    unet.save_config(folder)
    tensors = [(n, tuple(p.shape)) for n, p in unet.named_parameters()]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        nbytes = 2 * int(torch.tensor(shape).prod())
        header[name] = {
            "dtype": "F16",
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    generator = torch.Generator().manual_seed(0)
    parameters = 0
    with open(folder / "diffusion_pytorch_model.safetensors", "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        for _, shape in tensors:
            tensor = torch.empty(shape, dtype=torch.float16)
            if len(shape) > 1:
                fan_in = int(torch.tensor(shape[1:]).prod())
                tensor.normal_(0, fan_in**-0.5, generator=generator)
            else:
                tensor.fill_(0.01)
            out.write(tensor.view(torch.uint8).numpy().tobytes())
            parameters += tensor.numel()
    return parameters, offset


class PeakRSS:
    """The process's largest RSS, sampled every 20 ms while running."""

    def __init__(self) -> None:
        self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def export_unet(source: Any, directory: Path, precision: str) -> dict[str, Any]:
    """Export the UNet of ``source`` from its checkpoint in ``precision`` into ``directory``,
    sampling the RSS; returns the asset and the times."""
    from coreai_torch.diffusers.components import STABLE_DIFFUSION
    from coreai_torch.diffusers.export import (
        component_precision,
        export_component,
        load_module,
        resolve_options,
    )

    component = next(c for c in STABLE_DIFFUSION.components if c.role == "unet")
    policy, _ = resolve_options(None if precision == "fp32" else precision, None)
    directory.mkdir(parents=True, exist_ok=True)
    baseline = rss()
    sampler = PeakRSS()
    begin, cpu = time.perf_counter(), time.process_time()
    module = load_module(source, "unet")
    done = export_component(
        source,
        component,
        module,
        [(512, 512)],
        {"text_length": 77},
        directory,
        policy=component_precision(source, component, policy, module),
    )
    seconds, cpu_seconds = time.perf_counter() - begin, time.process_time() - cpu
    peak = sampler.stop()
    del module
    return {
        "asset": done.asset,
        "export_seconds": round(seconds, 2),
        "export_cpu_seconds": round(cpu_seconds, 2),
        "asset_bytes": sum(f.stat().st_size for f in done.asset.rglob("*") if f.is_file()),
        "peak_rss_above_baseline_bytes": peak - baseline,
    }


def time_steps(asset: Path, steps: int) -> dict[str, Any]:
    """Load ``asset`` on the runtime, run one warm-up step (batch 2, 512x512), then time
    ``steps`` denoising steps; the fastest is reported."""
    from coreai_torch.diffusers.modules import RuntimeModule

    runner = RuntimeModule(asset, {}, {"main": (512, 512)})
    inputs = {
        "sample": torch.randn(2, 4, 64, 64),
        "timestep": torch.full((2,), 981.0),
        "encoder_hidden_states": torch.randn(2, 77, 768),
    }
    baseline = rss()
    begin = time.perf_counter()
    runner.run("main", **inputs)  # loads the asset and warms up
    load_and_first = time.perf_counter() - begin
    times, cpu_times = [], []
    for _ in range(steps):
        begin, cpu = time.perf_counter(), time.process_time()
        runner.run("main", **inputs)
        times.append(time.perf_counter() - begin)
        cpu_times.append(time.process_time() - cpu)
    resident = rss() - baseline
    runner.close()
    return {
        "load_and_first_step_seconds": round(load_and_first, 2),
        "step_seconds": round(min(times), 2),
        "step_cpu_seconds": round(min(cpu_times), 2),
        "runtime_rss_bytes": resident,
    }


def measure(directory: Path, steps: int = 1) -> dict[str, Any]:
    """Write the checkpoint, export the UNet from it in float16 (against the write floor) and
    time a denoising step; then the same step of the UNet exported in float32."""
    from coreai_torch.diffusers.components import STABLE_DIFFUSION
    from coreai_torch.diffusers.export import PipelineSource

    start = time.perf_counter()
    parameters, checkpoint_bytes = write_unet(directory / "unet")
    written = time.perf_counter() - start
    source = PipelineSource(
        directory,
        "StableDiffusionPipeline",
        STABLE_DIFFUSION,
        {"unet": ("diffusers", "UNet2DConditionModel")},
        {
            "unet": json.loads((directory / "unet" / "config.json").read_text()),
            "vae": {"block_out_channels": VAE_BLOCKS, "latent_channels": 4},
        },
    )
    result: dict[str, Any] = {
        "model": "SD-1.5 UNet",
        "parameters": parameters,
        "checkpoint_bytes": checkpoint_bytes,
        "checkpoint_write_seconds": round(written, 2),
    }
    for precision in ("fp16", "fp32"):
        exported = export_unet(source, directory / precision, precision)
        asset = exported.pop("asset")
        if precision == "fp16":
            exported["write_floor_seconds"] = round(
                write_floor(directory, exported["asset_bytes"]), 2
            )
        print(f"{precision}: {json.dumps(exported)}", flush=True)
        exported.update(time_steps(asset, steps))
        print(f"{precision}: {json.dumps(exported)}", flush=True)
        result[precision] = exported
        shutil.rmtree(asset, ignore_errors=True)
    return result


def measure_tiny(directory: Path, only: str | None = None) -> list[dict[str, Any]]:
    """The tiny SD 1.x / SDXL / SD3 / FLUX pipelines of the tests against diffusers (those
    whose label starts with ``only`` when given)."""
    from coreai_torch.diffusers import CoreAIDiffusionPipeline
    from coreai_torch.diffusers.check import component_errors
    from coreai_torch.diffusers.mixed_bits import MixedBitPalettes
    from tests.diffusers import support

    builders = {"SD 1.x": support.sd_pipeline, "SDXL": support.sdxl_pipeline}
    builders["SD3 (no T5)"] = support.sd3_pipeline
    builders["FLUX.1 (guidance-distilled)"] = support.flux_pipeline
    builders["FLUX.2 [klein]"] = support.flux2_pipeline
    sizes = {"FLUX.1": support.FLUX_EXPORT, "FLUX.2": support.FLUX2_EXPORT}
    rows = []
    for label, build in builders.items():
        if only and not label.startswith(only):
            continue
        source = build(directory)
        sized = sizes.get(label[:6], {})
        expected = support.generate(support.reference(source), **sized)
        variants: dict[str, dict[str, Any]] = {"fp32": {}, "fp16": {"precision": "fp16"}}
        if label == "SD 1.x":
            variants["fp32 + mixed-bit palettes"] = {
                "compress": MixedBitPalettes(target_psnr_db=30.0, candidate_bits=(6, 4, 2))
            }
        for variant, options in variants.items():
            begin = time.perf_counter()
            with CoreAIDiffusionPipeline.from_pretrained(
                source, export=True, **options, **sized
            ) as pipe:
                seconds = time.perf_counter() - begin
                image = support.generate(pipe)
                errors = component_errors(pipe, source)
                mixed = pipe.coreai_config["components"].get("unet", {}).get("mixed_bits")
            rows.append(
                {
                    "pipeline": label,
                    "variant": variant,
                    "export_seconds": round(seconds, 1),
                    "psnr_db": round(support.psnr(image, expected), 1),
                    "components": {
                        f"{e.role}.{e.output}": [e.max_abs_error, e.max_abs_reference]
                        for e in errors
                    },
                    **({"mixed_bits": mixed} if mixed else {}),
                }
            )
            print(f"   {label}, {variant}: {rows[-1]['psnr_db']} dB", flush=True)
    return rows


def tiny_table(rows: list[dict[str, Any]]) -> str:
    """The tiny pipelines' rows as a Markdown table."""
    lines = [
        "| pipeline | variant | image PSNR vs diffusers (4 steps) | largest component error "
        "(max abs, of max ref) |",
        "|---|---|---|---|",
    ]
    for row in rows:
        role, (error, reference) = max(
            row["components"].items(), key=lambda item: item[1][0] / max(1.0, item[1][1])
        )
        lines.append(
            f"| {row['pipeline']} | {row['variant']} | {row['psnr_db']:.1f} dB "
            f"| {error:.2g} ({role}, max ref {reference:.2g}) |"
        )
    return "\n".join(lines)


def table(result: dict[str, Any]) -> str:
    """The benchmark's rows as a Markdown table."""
    if "error" in result:
        return f"SD-1.5 UNet: failed ({result['error']})"
    lines = [
        "| model | export from checkpoint, wall (CPU) | write floor | peak RSS above baseline "
        "(of checkpoint) | asset | load + first step | denoising step, batch 2, 512x512, wall "
        "(CPU) |",
        "|---|---|---|---|---|---|---|",
    ]
    for precision in ("fp16", "fp32"):
        row = result[precision]
        floor = row.get("write_floor_seconds")
        peak = row["peak_rss_above_baseline_bytes"]
        # the float32 export runs after the float16 runtime in the same process, whose freed
        # pages raise its baseline: only the float16 export's peak is the export's own
        memory = (
            f"{peak / GIB:.2f} GiB ({peak / result['checkpoint_bytes']:.0%})"
            if precision == "fp16"
            else "-"
        )
        lines.append(
            f"| {result['model']} ({result['parameters'] / 1e9:.2f} B), fp16 checkpoint -> "
            f"{precision} | {row['export_seconds']:.1f} s ({row['export_cpu_seconds']:.0f} s) "
            f"| {'-' if floor is None else f'{floor:.1f} s'} | {memory} "
            f"| {row['asset_bytes'] / GIB:.2f} GiB "
            f"| {row['load_and_first_step_seconds']:.1f} s | {row['step_seconds']:.1f} s "
            f"({row['step_cpu_seconds']:.0f} s) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", help="scratch directory (default: a temporary one)")
    parser.add_argument("--steps", type=int, default=1, help="timed denoising steps")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and asset")
    parser.add_argument("--tiny", action="store_true", help="the tiny pipelines vs diffusers")
    parser.add_argument("--only", help="--tiny: the pipelines whose label starts with this")
    args = parser.parse_args(argv)
    if args.tiny:
        with tempfile.TemporaryDirectory(prefix="coreai_bench_tiny_") as scratch:
            rows = measure_tiny(Path(scratch), args.only)
        print("RESULT " + json.dumps(rows))
        print(tiny_table(rows))
        return 0
    directory = Path(args.dir or tempfile.mkdtemp(prefix="coreai_bench_diffusion_"))
    try:
        result = measure(directory, args.steps)
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    print("RESULT " + json.dumps(result))
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
