"""What the SDK costs a user's job per step, on a Hugging Face workload (issue 26's goals: at most
1% of step time; a fast-layer decision at most 20 us at the median).

The workload: a `transformers` GPT-2-style causal LM built from a `GPT2Config` with random
initial weights (no download), trained on character blocks of tinyshakespeare read through
`datasets` (`load_dataset("text", ...)` on the local file; Python's own standard library
sources when ../shared/data is missing, labelled in the results). Two arms run the same model,
data and optimizer in this process, alternated rep by rep so that drift of the shared machine
falls on both:

- `bare`: a plain loop over a torch DataLoader (random order), no trainwise;
- `sdk`: the same loop under `trainwise.init` / `run.dataloader` / `run.track` / `run.step` (the
  product's SDK, telemetry to a folder, the heuristic fast policy every 10 steps, no interval
  checkpoints: a checkpoint is a feature the bare loop lacks, timed on its own below).

Figures: the median step time of each arm and the overhead as the difference of medians, with a
bootstrap 95% interval over steps; the time inside `run.step` alone (perf_counter around each
call), as a share of the bare step; the fast decision (`policy.act` on the run's own
observation, and the whole tick with its telemetry write), median and p99 in microseconds; one
checkpoint of this model (save, sign, commit to the local object store), ms, and its share per
step at an interval of 100 steps.

    python -m benchmarks.sdk_overhead [--steps 60] [--reps 5] [--quick] [--out DIR]

Writes benchmarks/results/sdk_overhead.{json,md} (through `benchmarks.results_io`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.results_io import write_suite_results

NAME = "sdk_overhead"
RESULTS_DIR = Path(__file__).resolve().parent / "results"
BLOCK = 128
BATCH = 16
MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 128}
FAST_EVERY_STEPS = 10
CHECKPOINT_INTERVAL_STEPS = 100


def corpus_text() -> tuple[str, str]:
    """(text, what it is): tinyshakespeare through `datasets`, else the stand-in."""
    from trainwise import settings

    path = settings.data_dir() / "corpora" / "tinyshakespeare.txt"
    if path.is_file():
        import datasets

        with tempfile.TemporaryDirectory() as cache:
            rows = datasets.load_dataset("text", data_files=str(path), sample_by="document",
                                         split="train", cache_dir=cache)
            return rows[0]["text"], f"tinyshakespeare ({path}) through datasets"
    import inspect
    import json as json_module

    text = inspect.getsource(json_module.decoder) * 20
    return text, "stand-in: Python's json.decoder source (no ../shared/data)"


def blocks(text: str, limit: int = 4096) -> tuple[torch.Tensor, int]:
    vocab = sorted(set(text))
    index = {ch: i for i, ch in enumerate(vocab)}
    ids = torch.tensor([index[ch] for ch in text[: (limit + 1) * BLOCK]], dtype=torch.long)
    n = (ids.numel() - 1) // BLOCK
    return ids[: n * BLOCK].view(n, BLOCK), len(vocab)


def build_model(vocab: int, model: dict[str, int] | None = None) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab, n_positions=BLOCK, bos_token_id=0, eos_token_id=0,
                        **(model or MODEL))
    return GPT2LMHeadModel(config)


def _train_step(model, optimizer, batch: torch.Tensor, autocast: Any) -> torch.Tensor:
    with autocast():
        loss = model(input_ids=batch, labels=batch).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # a step's time is its kernels' time, not their launch's
        torch.cuda.synchronize(device)


def bare_arm(data: torch.Tensor, vocab: int, steps: int, placement: Any,
             model_config: dict[str, int] | None = None, batch_size: int = BATCH) -> list[float]:
    device = placement.device
    model = build_model(vocab, model_config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=True,
                                         pin_memory=device.type == "cuda",
                                         generator=torch.Generator().manual_seed(0))
    times, fetch, cpu, batches = [], [], [], iter(loader)
    last, last_cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        fetched = time.perf_counter()
        batch = next(batches).to(device, non_blocking=True)
        fetch.append(time.perf_counter() - fetched)
        _train_step(model, optimizer, batch, placement.autocast)
        _sync(device)
        now = time.perf_counter()
        times.append(now - last)
        last, cpu_now = now, time.process_time()
        cpu.append(cpu_now - last_cpu)
        last_cpu = cpu_now
    return {"times": times, "fetch": fetch, "cpu": cpu}


def sdk_arm(data: torch.Tensor, vocab: int, steps: int, folder: Path, rep: int,
            device: str = "cpu", precision: str = "auto",
            model_config: dict[str, int] | None = None, batch_size: int = BATCH
            ) -> dict[str, Any]:
    from trainwise.sdk import Run
    from trainwise.sdk.spec import RunSpec

    spec = RunSpec(run_id=f"overhead-{rep}", run_dir=str(folder / f"rep{rep}"), max_steps=None,
                   checkpoint_every_steps=None, fast_every_steps=FAST_EVERY_STEPS,
                   store_root=str(folder / "store"), cpu_threads=torch.get_num_threads(),
                   device=device, precision=precision)
    run = Run(spec, install_signal_handler=False)
    loader = run.dataloader(data, batch_size=batch_size)
    model = build_model(vocab, model_config).to(run.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, optimizer = run.track(model, optimizer)
    times, in_step, fetch, cpu, batches = [], [], [], [], iter(loader)
    last, last_cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        fetched = time.perf_counter()
        batch = run.to_device(next(batches))
        fetch.append(time.perf_counter() - fetched)
        loss = _train_step(model, optimizer, batch, run.autocast)
        _sync(run.device)
        called = time.perf_counter()
        run.step(loss=loss, samples=len(batch), tokens=batch.numel())
        now = time.perf_counter()
        in_step.append(now - called)
        times.append(now - last)
        last, cpu_now = now, time.process_time()
        cpu.append(cpu_now - last_cpu)
        last_cpu = cpu_now
    decision = _time_decisions(run)
    checkpoint_ms = []
    for _ in range(3):
        began = time.perf_counter()
        run.checkpoint("benchmark")
        checkpoint_ms.append((time.perf_counter() - began) * 1e3)
    run.finish()
    return {"times": times, "in_step": in_step, "fetch": fetch, "cpu": cpu,
            "checkpoint_ms": checkpoint_ms,
            "placement": run.placement.record(), **decision}


def _time_decisions(run: Any, calls: int = 2000) -> dict[str, list[float]]:
    """The fast policy's `act` on the run's own observation, and the whole tick (decision,
    batch-size apply, its DecisionEvent written): microseconds per call."""
    observation = run._observation(80.0, None)
    act_us, tick_us = [], []
    for _ in range(calls):
        began = time.perf_counter_ns()
        run.fast_policy.act(observation)
        act_us.append((time.perf_counter_ns() - began) / 1e3)
    for _ in range(calls // 4):
        began = time.perf_counter_ns()
        run._fast_tick(80.0)
        tick_us.append((time.perf_counter_ns() - began) / 1e3)
    return {"act_us": act_us, "tick_us": tick_us}


def _bootstrap_diff(a: list[float], b: list[float], draws: int = 2000) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    a_arr, b_arr = np.asarray(a), np.asarray(b)
    diffs = [np.median(rng.choice(b_arr, b_arr.size)) - np.median(rng.choice(a_arr, a_arr.size))
             for _ in range(draws)]
    return float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5))


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def measure(steps: int, reps: int, warmup: int = 5, device: str = "cpu",
            precision: str = "auto", model_config: dict[str, int] | None = None,
            batch_size: int = BATCH) -> dict[str, Any]:
    from trainwise.sdk import device as sdk_device

    text, source = corpus_text()
    data, vocab = blocks(text)
    placement = sdk_device.choose(device, precision)
    bare, sdk, in_step, act_us, tick_us, ckpt_ms = [], [], [], [], [], []
    bare_fetch, sdk_fetch, bare_cpu, sdk_cpu = [], [], [], []
    with tempfile.TemporaryDirectory() as folder:
        for rep in range(reps):
            # A B, then B A: the arm that runs second in a rep (a warmer allocator, a machine
            # that got busier) changes every rep, so neither arm always has that place.
            if rep % 2:
                result = sdk_arm(data, vocab, steps + warmup, Path(folder), rep, device,
                                 precision, model_config, batch_size)
            plain = bare_arm(data, vocab, steps + warmup, placement, model_config, batch_size)
            bare += plain["times"][warmup:]
            bare_fetch += plain["fetch"][warmup:]
            bare_cpu += plain["cpu"][warmup:]
            if not rep % 2:
                result = sdk_arm(data, vocab, steps + warmup, Path(folder), rep, device,
                                 precision, model_config, batch_size)
            sdk += result["times"][warmup:]
            in_step += result["in_step"][warmup:]
            sdk_fetch += result["fetch"][warmup:]
            sdk_cpu += result["cpu"][warmup:]
            act_us += result["act_us"]
            tick_us += result["tick_us"]
            ckpt_ms += result["checkpoint_ms"]
            print(f"rep {rep + 1}/{reps}: bare {statistics.median(bare) * 1e3:.1f} ms, sdk "
                  f"{statistics.median(sdk) * 1e3:.1f} ms per step", file=sys.stderr)
    bare_ms, sdk_ms = statistics.median(bare) * 1e3, statistics.median(sdk) * 1e3
    low, high = _bootstrap_diff(bare, sdk)
    in_step_ms = statistics.median(in_step) * 1e3
    checkpoint_ms = statistics.median(ckpt_ms)
    # The SDK's own cost per step, measured where it is spent: inside run.step, and the loader's
    # extra time per batch (its sampler positions, the consumption record) over a plain
    # DataLoader's; each far less noisy than the difference of whole-step medians.
    fetch_extra_ms = (statistics.median(sdk_fetch) - statistics.median(bare_fetch)) * 1e3
    direct_ms = in_step_ms + max(0.0, fetch_extra_ms)
    return {
        "workload": {"model": f"GPT2LMHeadModel {model_config or MODEL}, random init",
                     "block": BLOCK, "batch": batch_size, "vocab": vocab,
                     "placement": placement.record(), "data": source, "blocks": int(data.shape[0]),
                     "torch_threads": torch.get_num_threads(), "steps_per_rep": steps,
                     "reps": reps, "warmup_steps": warmup},
        "bare_step_ms": bare_ms, "sdk_step_ms": sdk_ms,
        "overhead_ms": sdk_ms - bare_ms, "overhead_ci95_ms": [low * 1e3, high * 1e3],
        "overhead_share": (sdk_ms - bare_ms) / bare_ms,
        "overhead_share_ci95": [low * 1e3 / bare_ms, high * 1e3 / bare_ms],
        "in_step_call_ms_median": in_step_ms, "in_step_call_ms_p99": _p(in_step, 99) * 1e3,
        "in_step_share": in_step_ms / bare_ms,
        "bare_step_cpu_ms": statistics.median(bare_cpu) * 1e3,
        "sdk_step_cpu_ms": statistics.median(sdk_cpu) * 1e3,
        "fetch_bare_ms_median": statistics.median(bare_fetch) * 1e3,
        "fetch_sdk_ms_median": statistics.median(sdk_fetch) * 1e3,
        "sdk_direct_ms": direct_ms, "sdk_direct_share": direct_ms / bare_ms,
        "decision_act_us_median": statistics.median(act_us), "decision_act_us_p99": _p(act_us, 99),
        "decision_tick_us_median": statistics.median(tick_us),
        "decision_tick_us_p99": _p(tick_us, 99),
        "checkpoint_ms_median": checkpoint_ms,
        "checkpoint_share_per_step": checkpoint_ms / (CHECKPOINT_INTERVAL_STEPS * bare_ms),
    }


def report(r: dict[str, Any]) -> str:
    w = r["workload"]
    ok_share = "met" if r["overhead_share_ci95"][1] <= 0.01 else (
        "not shown" if r["overhead_share"] <= 0.01 else "not met")
    ok_decision = "met" if r["decision_act_us_median"] <= 20 else "not met"
    ok_direct = "met" if r["sdk_direct_share"] <= 0.01 else "not met"
    lines = [
        "# What the SDK costs per step (HF GPT-2-style workload)", "",
        f"Workload: {w['model']}, block {w['block']}, batch {w['batch']}, vocab {w['vocab']}; "
        f"data: {w['data']}; {w['reps']} reps x {w['steps_per_rep']} steps per arm (after "
        f"{w['warmup_steps']} warm-up steps), torch threads {w['torch_threads']}.", "",
        "| figure | value | goal |", "|---|---|---|",
        f"| step, bare loop (median) | {r['bare_step_ms']:.2f} ms | - |",
        f"| step, under the SDK (median) | {r['sdk_step_ms']:.2f} ms | - |",
        f"| step, process CPU time (median): bare loop, under the SDK | "
        f"{r['bare_step_cpu_ms']:.2f} ms, {r['sdk_step_cpu_ms']:.2f} ms | - |",
        f"| overhead: difference of medians [95% bootstrap] | {r['overhead_ms']:.3f} ms "
        f"[{r['overhead_ci95_ms'][0]:.3f}, {r['overhead_ci95_ms'][1]:.3f}] = "
        f"{r['overhead_share']:.2%} [{r['overhead_share_ci95'][0]:.2%}, "
        f"{r['overhead_share_ci95'][1]:.2%}] | at most 1%: {ok_share} |",
        f"| time inside `run.step` (median, p99) | {r['in_step_call_ms_median']:.3f} ms, "
        f"{r['in_step_call_ms_p99']:.3f} ms = {r['in_step_share']:.3%} of a bare step | - |",
        f"| a batch from the loader (median): plain DataLoader, `run.dataloader` | "
        f"{r['fetch_bare_ms_median']:.3f} ms, {r['fetch_sdk_ms_median']:.3f} ms | - |",
        f"| the SDK's own cost per step: `run.step` + the loader's extra time per batch | "
        f"{r['sdk_direct_ms']:.3f} ms = {r['sdk_direct_share']:.3%} of a bare step | at most "
        f"1%: {ok_direct} |",
        f"| fast decision, `policy.act` (median, p99) | {r['decision_act_us_median']:.1f} us, "
        f"{r['decision_act_us_p99']:.1f} us | at most 20 us median: {ok_decision} |",
        f"| fast tick with its telemetry event (median, p99) | "
        f"{r['decision_tick_us_median']:.1f} us, {r['decision_tick_us_p99']:.1f} us | - |",
        f"| one checkpoint (save, sign, commit to the local store; median) | "
        f"{r['checkpoint_ms_median']:.1f} ms = {r['checkpoint_share_per_step']:.2%} per step "
        f"at every {CHECKPOINT_INTERVAL_STEPS} steps | - |", "",
        "The difference of whole-step medians carries the shared machine's noise (its interval "
        "says how much; the arms alternate A B / B A rep by rep); the SDK's own cost is "
        "measured where it is spent: the time inside `run.step` and the loader's extra time "
        "per batch over a plain DataLoader's (its sampler positions and consumption record).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sdk_overhead")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 reps x 10 steps, nothing written")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    steps, reps = (10, 2) if args.quick else (args.steps, args.reps)
    result = measure(steps, reps)
    markdown = report(result)
    print(markdown)
    write_suite_results(args.out, args.quick, RESULTS_DIR, NAME, "benchmarks.sdk_overhead",
                        argv, result, markdown)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
