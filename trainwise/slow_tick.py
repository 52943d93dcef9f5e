"""One slow-layer tick for a data partition, without Dagster: observe, decide, explain.

The Dagster sensor (`sensors/slow_policy.py`) calls `decide` on its interval. The observation is
built from the live telemetry files of the partition's latest training run (the trainer never
talks to a database, and the files are what is current while it trains) and from the latest
difficulty scores. A run that has finished for good (completed or failed) is not steered.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from controllers.slow_heuristic import HeuristicSlowPolicy
from controllers.slow_types import (
    ClusterSummary,
    DataSummary,
    LossCurve,
    Progress,
    SlowAction,
    SlowObservation,
)
from telemetry.reader import read_run_events

FINISHED = {"completed", "failed"}


@dataclass(frozen=True)
class SlowTick:
    """What one tick found: the run it looked at, and the action or why there is none."""

    partition: str
    run_id: str | None
    action: SlowAction | None
    skip_reason: str = ""
    current_pruning_rate: float | None = None


def latest_run(state_dir: Path, partition: str) -> tuple[str, dict[str, Any]] | None:
    """The newest run of a partition (by the request file each run writes when it starts)."""
    requests = []
    for path in (state_dir / "runs").glob("*/request.json"):
        request = json.loads(path.read_text())
        if request.get("partition") == partition:
            requests.append((path.stat().st_mtime, path.parent.name, request))
    if not requests:
        return None
    _, run_id, request = max(requests)
    return run_id, request


def data_summary(scores_loss: np.ndarray) -> DataSummary:
    mean = float(scores_loss.mean())
    return DataSummary(num_examples=int(scores_loss.size), mean_loss_score=mean,
                       std_loss_score=float(scores_loss.std()),
                       share_below_mean=float((scores_loss < mean).mean()))


def observe(events: list[dict[str, Any]], request: dict[str, Any],
            data: DataSummary) -> SlowObservation:
    """The slow observation of a run from its telemetry records (one on-demand node)."""
    steps = [e for e in events if e["type"] == "step"]
    evals = [e for e in events if e["type"] == "eval" and e.get("eval_loss") is not None]
    saves = [e["save_ms"] / 1000.0 for e in events if e["type"] == "checkpoint"]
    preemptions = sum(1 for e in events if e["type"] == "preemption")
    last = steps[-1] if steps else None
    step = last["step"] if last else 0
    elapsed_s = last["elapsed_s"] if last else 0.0
    max_steps = int(request["max_steps"])
    mean_step_s = elapsed_s / step if step else 0.0
    return SlowObservation(
        time_s=elapsed_s,
        step=step,
        data=data,
        loss_curve=LossCurve(eval_losses=tuple(e["eval_loss"] for e in evals),
                             eval_steps=tuple(e["step"] for e in evals),
                             tokens_seen=last["tokens_seen"] if last else 0),
        progress=Progress(work_done=float(step), work_total=float(max_steps),
                          elapsed_s=elapsed_s,
                          time_left_s=max(0.0, (max_steps - step) * mean_step_s)),
        cluster=ClusterSummary(nodes=1, spot_nodes=0, on_demand_nodes=1,
                               preemptions_observed=preemptions, observed_for_s=elapsed_s,
                               checkpoint_cost_s=(sum(saves) / len(saves)) if saves
                               else math.nan),
    )


def decide(state_dir: Path, partition: str,
           policy: HeuristicSlowPolicy | None = None) -> SlowTick:
    from training import curriculum as curriculum_lib
    from training import scoring

    found = latest_run(state_dir, partition)
    if found is None:
        return SlowTick(partition, None, None, f"no training run of {partition} yet")
    run_id, request = found
    telemetry_dir = state_dir / "runs" / run_id / "telemetry" / run_id
    events = read_run_events(telemetry_dir) if telemetry_dir.is_dir() else []
    ends = [e for e in events if e["type"] == "run_end"]
    if ends and ends[-1]["status"] in FINISHED:
        return SlowTick(partition, run_id, None,
                        f"run {run_id[:8]} is {ends[-1]['status']}: nothing to steer")
    scores_dir = state_dir / "scores" / partition
    if not scores_dir.exists():
        return SlowTick(partition, run_id, None, f"no difficulty scores for {partition}")
    table = scoring.read_scores(scores_dir)
    current = curriculum_lib.load_curriculum(state_dir / "curricula" / partition)
    observation = observe(events, request, data_summary(np.asarray(table.loss)))
    action = (policy or HeuristicSlowPolicy()).act(observation)
    return SlowTick(partition, run_id, action, current_pruning_rate=current.pruning_rate)


def steer_live_run(state_dir: Path, tick: SlowTick, rate: float) -> Path | None:
    """Hand the decided rate to the live run through its control file (dynamic pruning only)."""
    from training.dynamic_pruning import write_pruning_control
    from trainwise.runs import control_path

    if tick.run_id is None or tick.action is None:
        return None
    request_path = state_dir / "runs" / tick.run_id / "request.json"
    request = json.loads(request_path.read_text())
    if request.get("data_selection") != "dynamic":
        return None
    return write_pruning_control(control_path(state_dir, tick.run_id), pruning_rate=rate,
                                 reason=f"slow_policy_sensor: {tick.action.reason}")
