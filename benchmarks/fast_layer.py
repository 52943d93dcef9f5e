"""The fast layer inside the real trainer: what a decision costs, and a run where it acts.

One char-GPT run on real text (tinyshakespeare, or Python's standard library without the shared
data) with the multi-timescale controller as the trainer's fast policy:

1. every `act` call the loop makes is timed (perf_counter_ns) -> p50/p99 microseconds per
   decision and the fast layer's share of the measured step time;
2. an emulated spot reclaim: a watcher thread (standing in for the cloud) sends the trainer
   SIGTERM once telemetry shows step `--preempt-at-step`; the trainer asks the controller with
   the notice, checkpoints and stops; the run is then resumed from that checkpoint to the end;
3. the batch-scaling decisions (micro-batch x accumulation and learning rate) as they happened.

    python -m benchmarks.fast_layer [--steps 300] [--preempt-at-step 180] [--fast-every-steps 10]

Writes benchmarks/results/fast_layer.json and .md (command, commit, machine).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.results_io import provenance, write_results
from controllers.decisions import DecisionLog
from controllers.fast_heuristic import HeuristicFastPolicy
from controllers.fast_types import FastAction, FastObservation
from controllers.multi_timescale import MultiTimescaleController
from telemetry.reader import read_run_events
from trainwise import settings

RESULTS_DIR = Path(__file__).resolve().parent / "results"
NAME = "fast_layer"


class TimedPolicy:
    """Times each `act` the trainer makes, around the real controller."""

    def __init__(self, inner: MultiTimescaleController) -> None:
        self.inner = inner
        self.name = inner.name
        self.durations_ns: list[int] = []

    def act(self, observation: FastObservation) -> FastAction:
        start = time.perf_counter_ns()
        action = self.inner.act(observation)
        self.durations_ns.append(time.perf_counter_ns() - start)
        return action


def _preempt_when(telemetry_dir: Path, step: int, stop: threading.Event) -> None:
    """The emulated cloud: reclaim the node (SIGTERM) once the run has reached `step`."""
    while not stop.is_set():
        if telemetry_dir.is_dir():
            steps = [e["step"] for e in read_run_events(telemetry_dir) if e["type"] == "step"]
            if steps and max(steps) >= step and not stop.is_set():
                os.kill(os.getpid(), signal.SIGTERM)
                return
        stop.wait(0.05)


def _controller(fast_every_steps: int) -> TimedPolicy:
    return TimedPolicy(MultiTimescaleController(HeuristicFastPolicy(), None,
                                                fast_every_steps=fast_every_steps,
                                                decision_log=DecisionLog()))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(steps: int, preempt_at_step: int, fast_every_steps: int, work_dir: Path) -> dict[str, Any]:
    from training import loop, shards

    partition = ("tinyshakespeare"
                 if (settings.data_dir() / "corpora" / "tinyshakespeare.txt").exists()
                 else "pystdlib")
    shards.build_shards(partition, settings.data_dir(), work_dir / "shards" / partition)
    examples = shards.load_shards(work_dir / "shards" / partition)
    # Two accumulation steps: the trainer measures the gradient noise scale from them, which
    # the batch heuristic needs to move (it no longer splits a single-step batch itself).
    config = loop.TrainConfig(max_steps=steps, micro_batch_size=16, grad_accum_steps=2,
                              eval_every_steps=50, fast_every_steps=fast_every_steps,
                              checkpoint_every_steps=50, price_usd_per_hour=3.06,
                              instance_type="p3.2xlarge", run_id="fast-layer-bench")
    first = _controller(fast_every_steps)
    stop = threading.Event()
    watcher = threading.Thread(target=_preempt_when, daemon=True, args=(
        work_dir / "run" / "telemetry" / config.run_id, preempt_at_step, stop))
    watcher.start()
    preempted = loop.train(config, examples, None, work_dir / "run", fast_policy=first)
    stop.set()
    second = _controller(fast_every_steps)
    resumed = loop.train(config, examples, None, work_dir / "run", fast_policy=second,
                         resume_from=preempted.checkpoint_path)

    records = read_run_events(resumed.telemetry_dir)
    step_ms = [e["step_time_ms"] for e in records if e["type"] == "step"]
    decisions = [e for e in records if e["type"] == "decision"]
    act_us = [d / 1000 for d in first.durations_ns + second.durations_ns]
    batch_changes, last_shape = [], None
    for e in decisions:
        shape = (e["action"].get("micro_batch_size"), e["action"].get("grad_accum_steps"))
        if shape != last_shape:
            batch_changes.append({"step": e["step"], "micro_batch_size": shape[0],
                                  "grad_accum_steps": shape[1],
                                  "learning_rate": e["action"].get("learning_rate"),
                                  "reason": e["reason"]})
            last_shape = shape
    notices = [e for e in records if e["type"] == "preemption"]
    notice_checkpoints = [e for e in records if e["type"] == "checkpoint"
                          and e["reason"] == "preemption"]
    notice_decisions = [e for e in decisions
                        if e["observation"].get("preemption_notice_s") is not None]
    return {
        "partition": partition,
        "steps": steps,
        "fast_every_steps": fast_every_steps,
        "decisions": len(act_us),
        "act_p50_us": _percentile(act_us, 0.50),
        "act_p99_us": _percentile(act_us, 0.99),
        "act_total_s": sum(act_us) / 1e6,
        "step_time_total_s": sum(step_ms) / 1000,
        "step_time_median_ms": statistics.median(step_ms),
        "fast_layer_share_of_step_time": (sum(act_us) / 1e6) / (sum(step_ms) / 1000),
        "batch_changes": batch_changes,
        "preemption": {
            "status_first_call": preempted.status,
            "notice_at_step": notices[0]["step"] if notices else None,
            "notice_response": notices[0]["response"] if notices else None,
            "controller_answer": (notice_decisions[0]["action"].get("preemption_response")
                                  if notice_decisions else None),
            "controller_reason": notice_decisions[0]["reason"] if notice_decisions else None,
            "checkpoint_save_ms": (notice_checkpoints[0]["save_ms"]
                                   if notice_checkpoints else None),
            "resumed_status": resumed.status,
            "final_eval_loss": resumed.final_eval_loss,
            "steps_after_resume": resumed.steps,
        },
    }


def to_markdown(r: dict[str, Any]) -> str:
    p = r["preemption"]
    lines = [
        "# Fast layer inside the real trainer",
        "",
        f"char-GPT on `{r['partition']}`, {r['steps']} steps, one decision every "
        f"{r['fast_every_steps']} steps (and every step while a notice is up), 1 torch thread.",
        "",
        "| decisions | act p50 (us) | act p99 (us) | median step (ms) | fast layer share of "
        "step time |",
        "|---:|---:|---:|---:|---:|",
        f"| {r['decisions']} | {r['act_p50_us']:.1f} | {r['act_p99_us']:.1f} | "
        f"{r['step_time_median_ms']:.1f} | {r['fast_layer_share_of_step_time']:.4%} |",
        "",
        "## Preemption notice (emulated spot reclaim: SIGTERM)",
        "",
        f"- notice at step {p['notice_at_step']}; controller answered "
        f"`{p['controller_answer']}`: {p['controller_reason']}",
        f"- trainer: `{p['notice_response']}`, checkpoint written in "
        f"{p['checkpoint_save_ms']} ms; first call ended `{p['status_first_call']}`",
        f"- resumed from that checkpoint: `{p['resumed_status']}` at step "
        f"{p['steps_after_resume']}, final eval loss {p['final_eval_loss']:.4f}",
        "",
        "## Batch scaling decisions (each change of micro-batch x accumulation)",
        "",
        "| step | micro-batch | accumulation | learning rate | reason |",
        "|---:|---:|---:|---:|---|",
    ]
    for c in r["batch_changes"]:
        lines.append(f"| {c['step']} | {c['micro_batch_size']} | {c['grad_accum_steps']} | "
                     f"{c['learning_rate']:.2e} | {c['reason']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fast_layer", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--preempt-at-step", type=int, default=190)
    parser.add_argument("--fast-every-steps", type=int, default=10)
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if not 0 < args.preempt_at_step < args.steps:
        parser.error(f"--preempt-at-step {args.preempt_at_step} must be in (0, --steps)")
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="trainwise-fast-layer-") as tmp:
        result = run(args.steps, args.preempt_at_step, args.fast_every_steps, Path(tmp))
    markdown = to_markdown(result)
    write_results(args.out_dir, NAME, result, markdown,
                  provenance(["python", "-m", "benchmarks.fast_layer", *argv]))
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
