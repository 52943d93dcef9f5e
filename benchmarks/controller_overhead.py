"""Cost of the fast layer per decision: p50/p99 microseconds of `HeuristicFastPolicy.act` and of
the controller path the trainer uses (`MultiTimescaleController.on_step`, which also records the
decision), over many calls on varied observations.

Scenarios: 1 rank (the trainer today) and 8 ranks (straggler shares do real work); 1 % of the
observations carry a preemption notice, so p99 includes the notice path. Timing is
`time.perf_counter_ns` around each call; observations are built beforehand and not timed. The
garbage collector stays on, as in a training loop.

    python -m benchmarks.controller_overhead [--calls 100000] [--step-time-ms 50]

With --step-time-ms the report adds the fast layer's share of step time at the controller's
cadence (one decision every `fast_every_steps` steps plus the per-step cadence check).
Writes benchmarks/results/controller_overhead.json and .md (through `benchmarks.results_io`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.results_io import provenance, write_results
from controllers.decisions import DecisionLog
from controllers.fast_heuristic import HeuristicFastPolicy
from controllers.fast_types import FastObservation
from controllers.multi_timescale import MultiTimescaleController

RESULTS_DIR = Path(__file__).resolve().parent / "results"
NAME = "controller_overhead"
POOL_SIZE = 1000  # distinct observations cycled through
FAST_EVERY_STEPS = 10


def observation_pool(ranks: int, seed: int) -> list[FastObservation]:
    """Varied but valid observations: a noise scale that drifts, noisy per-rank times with one
    slower rank, and a notice on 1 % of them."""
    rng = random.Random(seed)
    pool = []
    for i in range(POOL_SIZE):
        times = tuple(100.0 * (1.6 if r == ranks - 1 and ranks > 1 else 1.0)
                      * math.exp(rng.gauss(0.0, 0.05)) for r in range(ranks))
        pool.append(FastObservation(
            step=i * FAST_EVERY_STEPS, elapsed_s=i * 1.0, train_loss=2.0 + rng.random(),
            grad_norm=rng.uniform(0.5, 2.0), grad_noise_scale=64.0 * math.exp(rng.gauss(0.0, 0.8)),
            micro_batch_size=16, grad_accum_steps=2, learning_rate=1e-3,
            rank_step_time_ms=times, dataloader_queue_depth=rng.randint(0, 8),
            preemption_notice_s=rng.uniform(5.0, 120.0) if rng.random() < 0.01 else None,
            preemption_risk=rng.random() * 0.2, seconds_since_checkpoint=rng.uniform(0.0, 600.0),
            checkpoint_cost_s=rng.uniform(2.0, 20.0)))
    return pool


def time_calls(call: Callable[[FastObservation], object], pool: list[FastObservation],
               calls: int) -> list[int]:
    """Nanoseconds of each call, cycling through the pool."""
    clock = time.perf_counter_ns
    durations = [0] * calls
    n = len(pool)
    for i in range(calls):
        observation = pool[i % n]
        began = clock()
        call(observation)
        durations[i] = clock() - began
    return durations


def percentiles_us(durations_ns: list[int]) -> dict[str, float]:
    ordered = sorted(durations_ns)
    n = len(ordered)

    def at(q: float) -> float:
        return ordered[min(n - 1, int(q * n))] / 1000.0

    return {"p50_us": at(0.50), "p90_us": at(0.90), "p99_us": at(0.99),
            "max_us": ordered[-1] / 1000.0, "mean_us": sum(ordered) / n / 1000.0}


def cadenced_steps(pool: list[FastObservation]) -> list[FastObservation]:
    """One observation per training step (steps 0, 1, 2, ...), for the per-step cadence path."""
    steps = []
    for i, observation in enumerate(pool):
        for k in range(FAST_EVERY_STEPS):
            steps.append(dataclasses.replace(observation, step=i * FAST_EVERY_STEPS + k))
    return steps


def run(calls: int, step_time_ms: float | None, argv: list[str]) -> dict:
    rows = []
    for ranks in (1, 8):
        pool = observation_pool(ranks, seed=ranks)
        policy = HeuristicFastPolicy()
        time_calls(policy.act, pool, min(calls, 5000))  # warm-up
        act = percentiles_us(time_calls(policy.act, pool, calls))
        # A long run keeps a bounded tail of decisions in memory (the sink has them all).
        controller = MultiTimescaleController(HeuristicFastPolicy(), None,
                                              fast_every_steps=FAST_EVERY_STEPS,
                                              decision_log=DecisionLog(max_kept=10_000))
        per_step = percentiles_us(time_calls(controller.on_step, cadenced_steps(pool), calls))
        decided = percentiles_us(time_calls(controller.act, pool, calls))
        row = {"ranks": ranks, "calls": calls, "policy_act": act, "controller_act": decided,
               "controller_on_step": per_step}
        if step_time_ms is not None:
            per_step_us = per_step["mean_us"]
            row["share_of_step_time"] = per_step_us / (step_time_ms * 1000.0)
        rows.append(row)
    return {
        "meta": provenance([Path(sys.executable).name, "-m", "benchmarks.controller_overhead",
                            *argv]),
        "benchmark": NAME,
        "fast_every_steps": FAST_EVERY_STEPS,
        "step_time_ms": step_time_ms,
        "rows": rows,
    }


def to_markdown(result: dict) -> str:
    m = result["meta"]["machine"]
    lines = [
        "# Fast-layer overhead per decision",
        "",
        f"Command: `{result['meta']['command']}`  ",
        f"Machine: {m['platform']}, Python {m['python']}, {m['cpu_count']} CPUs  ",
        f"Controller cadence: fast layer every {result['fast_every_steps']} steps",
        "",
        "| ranks | path | calls | p50 us | p90 us | p99 us | max us |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        for key, label in (("policy_act", "HeuristicFastPolicy.act"),
                           ("controller_act", "controller.act (+ decision record)"),
                           ("controller_on_step", "controller.on_step, every step")):
            p = row[key]
            lines.append(f"| {row['ranks']} | {label} | {row['calls']} | {p['p50_us']:.1f} | "
                         f"{p['p90_us']:.1f} | {p['p99_us']:.1f} | {p['max_us']:.0f} |")
    if result["step_time_ms"] is not None:
        step_ms = result["step_time_ms"]
        lines += ["", f"Share of a {step_ms:g} ms step (mean on_step cost per step):"]
        for row in result["rows"]:
            lines.append(f"- {row['ranks']} rank(s): {row['share_of_step_time']:.4%}")
    lines += ["", "1 % of observations carry a preemption notice; the garbage collector is on."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="controller_overhead", description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=100_000, help="timed calls per path")
    parser.add_argument("--step-time-ms", type=float, default=None,
                        help="training step time to report the fast layer's share of")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.calls < 100:
        parser.error(f"--calls {args.calls}: use at least 100 for a p99")
    if args.step_time_ms is not None and not args.step_time_ms > 0:
        parser.error(f"--step-time-ms {args.step_time_ms}: must be > 0")
    result = run(args.calls, args.step_time_ms, argv)
    markdown = to_markdown(result)
    meta = result.pop("meta")
    write_results(args.out_dir, NAME, result, markdown, meta)
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
