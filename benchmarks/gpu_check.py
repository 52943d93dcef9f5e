"""The prepared GPU check (issue 26 item 7): on one accelerator, in under five minutes, the HF
GPT-2-style workload of `benchmarks.sdk_overhead` at a GPU's size, under the SDK with its
automatic placement (CUDA, bf16 autocast where the GPU has it, else fp16 with a GradScaler,
pinned memory and non-blocking copies), against the same loop without trainwise.

Writes benchmarks/results/gpu.{json,md}: tokens per second, an MFU estimate (6 x parameters x
tokens/s plus the attention term, over the GPU's dense peak for the autocast dtype from a
stated table; none for a GPU not in it), one checkpoint's cost and its share per step at an
interval of 100 steps, and the SDK's overhead per step.

    bash benchmarks/gpu_check.sh            # what a machine with a GPU runs
    python -m benchmarks.gpu_check --allow-cpu --quick   # a smoke run here (writes nothing)

No GPU and no --allow-cpu: exits 2 with a message (nothing is written).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks import sdk_overhead
from benchmarks.results_io import write_suite_results

NAME = "gpu"
RESULTS_DIR = Path(__file__).resolve().parent / "results"
GPU_MODEL = {"n_layer": 6, "n_head": 6, "n_embd": 384}
GPU_BATCH = 32
# Dense peak TFLOP/s by (name fragment, autocast dtype), from the vendors' data sheets (no
# sparsity). The first fragment found in torch.cuda.get_device_name() wins.
PEAK_TFLOPS = (
    ("H200", "bf16", 989.0), ("H200", "fp16", 989.0),
    ("H100", "bf16", 989.0), ("H100", "fp16", 989.0),
    ("A100", "bf16", 312.0), ("A100", "fp16", 312.0),
    ("L40S", "bf16", 362.0), ("L40S", "fp16", 362.0),
    ("A10G", "bf16", 70.0), ("A10G", "fp16", 70.0),
    ("L4", "bf16", 121.0), ("L4", "fp16", 121.0),
    ("T4", "fp16", 65.0), ("V100", "fp16", 125.0),
)


def peak_tflops(device_name: str, precision: str) -> float | None:
    for fragment, dtype, tflops in PEAK_TFLOPS:
        if fragment in device_name and dtype == precision:
            return tflops
    return None


def flops_per_token(n_params: int, model: dict[str, int], block: int) -> float:
    """Forward and backward: 6 N plus the attention's 12 L d T (PaLM's appendix B estimate)."""
    return 6.0 * n_params + 12.0 * model["n_layer"] * model["n_embd"] * block


def run_check(steps: int, reps: int, allow_cpu: bool) -> dict[str, Any]:
    has_gpu = torch.cuda.is_available()
    if not has_gpu and not allow_cpu:
        raise SystemExit(2)
    device = "cuda" if has_gpu else "cpu"
    model_config = GPU_MODEL if has_gpu else {"n_layer": 2, "n_head": 2, "n_embd": 64}
    batch = GPU_BATCH if has_gpu else 8
    result = sdk_overhead.measure(steps, reps, warmup=5, device=device, precision="auto",
                                  model_config=model_config, batch_size=batch)
    placement = result["workload"]["placement"]
    n_params = sum(p.numel() for p in sdk_overhead.build_model(
        result["workload"]["vocab"], model_config).parameters())
    tokens_per_step = batch * sdk_overhead.BLOCK
    tokens_per_s = tokens_per_step / (result["sdk_step_ms"] / 1e3)
    name = torch.cuda.get_device_name(0) if has_gpu else "cpu"
    peak = peak_tflops(name, placement["precision"]) if has_gpu else None
    achieved = flops_per_token(n_params, model_config, sdk_overhead.BLOCK) * tokens_per_s
    return {**result, "device_name": name, "n_params": n_params,
            "tokens_per_s": tokens_per_s, "achieved_tflops": achieved / 1e12,
            "peak_tflops": peak, "mfu": achieved / (peak * 1e12) if peak else None}


def report(r: dict[str, Any]) -> str:
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "none (GPU not in the peak table)"
    lines = [
        f"# GPU check on {r['device_name']}", "",
        f"Placement: {r['workload']['placement']}; {r['n_params']:,} parameters.", "",
        "| figure | value |", "|---|---|",
        f"| tokens per second under the SDK | {r['tokens_per_s']:,.0f} |",
        f"| achieved TFLOP/s (estimate) | {r['achieved_tflops']:.2f} |",
        f"| MFU (against {r['peak_tflops']} TFLOP/s dense) | {mfu} |",
        f"| one checkpoint | {r['checkpoint_ms_median']:.1f} ms = "
        f"{r['checkpoint_share_per_step']:.2%} per step at every 100 steps |",
        f"| SDK overhead, difference of step medians [95%] | {r['overhead_share']:.2%} "
        f"[{r['overhead_share_ci95'][0]:.2%}, {r['overhead_share_ci95'][1]:.2%}] |",
        f"| time inside `run.step` | {r['in_step_share']:.3%} of a bare step |", "",
        sdk_overhead.report(r),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run on the CPU with a tiny model (a smoke run of the script)")
    parser.add_argument("--quick", action="store_true", help="1 rep x 5 steps, nothing written")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("gpu_check: torch sees no GPU here; run it on a machine with one "
              "(bash benchmarks/gpu_check.sh), or pass --allow-cpu for a smoke run",
              file=sys.stderr)
        sys.exit(2)
    steps, reps = (5, 1) if args.quick else (args.steps, args.reps)
    result = run_check(steps, reps, args.allow_cpu)
    markdown = report(result)
    print(markdown)
    write_suite_results(args.out, args.quick, RESULTS_DIR, NAME, "benchmarks.gpu_check", argv,
                        result, markdown)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
