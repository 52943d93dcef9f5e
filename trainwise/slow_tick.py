"""One slow-layer tick for a data partition, without Dagster: observe, decide, explain.

The Dagster sensor (`sensors/slow_policy.py`) calls `decide` on its interval. The observation is
built from the live telemetry files of the partition's latest training run (the trainer never
talks to a database, and the files are what is current while it trains) and from the latest
difficulty scores. A run that has finished for good (completed or failed) is not steered.

A decision never touches a running job directly: it is a proposal (a new curriculum whose
candidate carries the live change). Only when the curriculum gate has passed does
`apply_live_change` hand the rate to the running job, and only under the automatic-approval rule
(`live_change_rule`, a file a person switches with `set_live_change_rule`, e.g. from the UI's
`live_change_rule` job). With the rule off, or a change larger than it allows, the change waits
as a pending proposal next to the run's control file. Every outcome is recorded.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from controllers.checkpointing import SPOT_NOTICE_S

# The train job's risk rule; re-exported here, where the tests and benchmarks name it.
from controllers.preemption_risk import observed_reclaim_risk as preemption_risk
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
from telemetry.writer import rank_dir
from training.safe_files import append_bytes

FINISHED = {"completed", "failed"}
RULE_PATH = ("governance", "live_change_rule.json")
# The default rule: a sensor's change of a running job goes live once its gate passed, if the
# rate moves by at most this much (a bigger jump waits for a person).
DEFAULT_MAX_AUTO_RATE_CHANGE = 0.25


@dataclass(frozen=True)
class SlowTick:
    """What one tick found: the run it looked at, and the action or why there is none."""

    partition: str
    run_id: str | None
    action: SlowAction | None
    skip_reason: str = ""
    current_pruning_rate: float | None = None
    # P(reclaim within the horizon) from the run's observed hazard; handed to the trainer.
    preemption_risk: float | None = None
    # The published schedule the tick decided under (trainwise.schedule).
    schedule_version: str = ""


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
            data: DataSummary, gang_record: dict[str, Any] | None = None,
            market: Any = None) -> SlowObservation:
    """The slow observation of a run from its telemetry records and the nodes its provider
    holds for it (`gang.json`; without it: one on-demand node). `market`: the allocation
    policy's view (`trainwise.market_view`), None to keep the nodes."""
    steps = [e for e in events if e["type"] == "step"]
    evals = [e for e in events if e["type"] == "eval" and e.get("eval_loss") is not None]
    saves = [e["save_ms"] / 1000.0 for e in events if e["type"] == "checkpoint"]
    notices = [e for e in events if e["type"] == "preemption"]
    preemptions = len(notices)
    # A reclaim whose on-notice save finished lost nothing: the checkpoint interval need not
    # guard against it (`ClusterSummary.preemptions_saved_by_notice`).
    saved_on_notice = sum(1 for e in events if e["type"] == "checkpoint"
                          and e.get("reason") == "preemption")
    last = steps[-1] if steps else None
    step = last["step"] if last else 0
    elapsed_s = last["elapsed_s"] if last else 0.0
    max_steps = int(request["max_steps"])
    mean_step_s = elapsed_s / step if step else 0.0
    gang_record = gang_record or {}
    nodes = int(gang_record.get("nodes") or 1)
    spot_nodes = nodes if gang_record.get("market") == "spot" else 0
    # Reclaims the provider answered (each also a trainer preemption) or preemptions recorded.
    preemptions = max(preemptions, int(gang_record.get("reclaims") or 0))
    # The notice the trainer gets (the last one it saw, else the request's, else the trainer's
    # default): with it the checkpoint-interval chooser knows whether a save fits, so whether
    # reclaims cost rework.
    notice_s = float(notices[-1].get("notice_s") or 0.0) if notices else float(
        request.get("preemption_notice_s", SPOT_NOTICE_S))
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
        cluster=ClusterSummary(nodes=nodes, spot_nodes=spot_nodes,
                               on_demand_nodes=nodes - spot_nodes,
                               preemptions_observed=preemptions, observed_for_s=elapsed_s,
                               preemptions_saved_by_notice=min(saved_on_notice, preemptions),
                               notice_s=notice_s,
                               checkpoint_cost_s=(sum(saves) / len(saves)) if saves
                               else math.nan,
                               preemption_risk=preemption_risk(preemptions, elapsed_s,
                                                               spot_nodes)),
        market=market,
    )


def slow_policy_for(region: str, allocation_policy: str = "trainwise_heuristic"
                    ) -> tuple[HeuristicSlowPolicy, str]:
    """The tick's slow policy with the published schedule's allocation policy in charge and
    why. The schedule's `trainwise_heuristic` means the region's incumbent: its promoted slow
    champion (`trainwise.champion`, promoted through its own gate), else the heuristic; any
    other named policy is taken as it is (a champion does not override a choice people made)."""
    from cloud.policy_registry import make_policy
    from controllers.allocation_adapter import SlowAllocationAdapter
    from trainwise import champion

    incumbent = make_policy(allocation_policy)
    if allocation_policy == "trainwise_heuristic":
        allocation, why = champion.slow_policy_in_charge(region, incumbent)
    else:
        allocation, why = incumbent, f"{allocation_policy} (the published schedule's)"
    return HeuristicSlowPolicy(allocation_policy=SlowAllocationAdapter(allocation)), why


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
    from trainwise.gang import read_gang
    from trainwise.market_view import market_view

    gang_record = read_gang(state_dir / "runs" / run_id)
    # The provider's market at the run's trace clock, or None and why (then nodes are kept).
    view = market_view(events, request, gang_record)
    observation = observe(events, request, data_summary(np.asarray(table.loss)), gang_record,
                          market=view.observation)
    from trainwise import schedule as schedule_lib

    published = schedule_lib.published(state_dir)
    in_charge = ""
    if policy is None:
        policy, in_charge = slow_policy_for(str(request.get("region") or "us-west-2"),
                                            published.schedule["allocation_policy"])
    action = policy.act(observation)
    if in_charge:
        kept = f" (no market view this tick: nodes kept; {view.reason})" if (
            observation.market is None) else f" (market view: {view.reason})"
        action = replace(action, reason=f"{action.reason}; allocation policy: {in_charge}{kept}")
    # The schedule bounds how far the slow layer may steer a live run's data (issue 28).
    rate, clipped = schedule_lib.clip_rate(action.pruning_rate, published.schedule)
    action = replace(action, pruning_rate=rate, reason=(
        f"{action.reason}; schedule {published.version}" + (f": {clipped}" if clipped else "")))
    return SlowTick(partition, run_id, action, current_pruning_rate=current.pruning_rate,
                    preemption_risk=observation.cluster.preemption_risk,
                    schedule_version=published.version)


def run_decision(state_dir: Path, tick: SlowTick) -> dict[str, Any] | None:
    """A tick's operational decisions for its live run, as a JSON-able record, or None when
    there is nothing to hand over. Reads the run folder, writes nothing: the slow-policy sensor
    stays pure and asks for a recorded Dagster run (`apply_run_decision` job) to apply it.

    The record: the checkpoint interval and the preemption risk (for the trainer's live-control
    file) and a new allocation when the policy's differs from the one the run holds."""
    from trainwise import gang

    if tick.action is None or tick.run_id is None:
        return None
    run_dir = Path(state_dir) / "runs" / tick.run_id
    action = tick.action
    interval = action.checkpoint_interval_s
    interval = float(interval) if interval is not None and math.isfinite(interval) and (
        interval > 0) else None
    current = gang.read_allocation(run_dir)
    held = gang.read_gang(run_dir) or {}
    if current is None and held.get("allocation"):
        current = gang.Allocation(**held["allocation"])
    wanted = gang.allocation_from_action(action.allocation, current)
    if wanted is not None and current is not None and wanted.same_nodes(current):
        wanted = None
    switch = schedule_switch(run_dir, state_dir)
    if interval is None and tick.preemption_risk is None and wanted is None and switch is None:
        return None
    return {"run_id": tick.run_id, "partition": tick.partition,
            "reason": f"slow policy: {action.reason}"[:500],
            "checkpoint_interval_s": interval, "preemption_risk": tick.preemption_risk,
            "allocation": asdict(wanted) if wanted is not None else None,
            "schedule_version": tick.schedule_version, "schedule": switch}


def schedule_switch(run_dir: Path, state_dir: Path) -> dict[str, Any] | None:
    """The published schedule's run fields for a live run that is on another version, or None.
    A run started off the schedule (no version, or an override with a recorded reason) is
    left as it was started."""
    from trainwise import schedule as schedule_lib

    on = schedule_lib.run_schedule_version(run_dir)
    if not on or on.endswith("+override"):
        return None
    published = schedule_lib.published(state_dir)
    if on == published.version:
        return None
    return {"version": published.version,
            **{name: published.schedule[name] for name in schedule_lib.RUN_FIELDS}}


def apply_run_decision(state_dir: Path, decision: dict[str, Any],
                       applied_by: str = "") -> dict[str, Any]:
    """Hands a `run_decision` record to the live run (they change how it runs, not what it
    learns from, so no curriculum gate): the interval and the risk through the run's
    live-control file (`training.live_control`, read by the trainer at its next fast tick), a new
    allocation through `allocation.json` (the in-process engine's provider session checkpoints,
    releases, launches the new nodes and resumes). Recorded in the run folder's
    `slow_decisions.jsonl` with `applied_by` (the Dagster run that applied it) and returned."""
    from training.live_control import LIVE_CONTROL_FILE, write_live_control
    from trainwise import gang
    from trainwise import schedule as schedule_lib

    run_id = str(decision["run_id"])
    rank_dir(Path("."), run_id, 0)  # one safe path part: it names a run folder
    run_dir = Path(state_dir) / "runs" / run_id
    if not run_dir.is_dir():
        raise ValueError(f"run decision for {run_id!r}: no run folder {run_dir}; the run is gone "
                         "or the decision names another deployment's run")
    record: dict[str, Any] = {"event": "slow_decisions", "run_id": run_id, "at_s": time.time(),
                              "reason": decision["reason"], "applied_by": applied_by}
    interval, risk = decision.get("checkpoint_interval_s"), decision.get("preemption_risk")
    switch = decision.get("schedule")
    if interval is not None or risk is not None or switch:
        # A later write keeps the last switch in the file: a trainer that had not polled the
        # file in between still switches (it applies a version it is already on as nothing).
        write_live_control(run_dir / LIVE_CONTROL_FILE, checkpoint_interval_s=interval,
                           preemption_risk=risk, reason=decision["reason"], source="slow_policy",
                           schedule=switch or schedule_lib.last_handed_schedule(run_dir))
        record.update(checkpoint_interval_s=interval, preemption_risk=risk)
    if switch:
        record["schedule"] = switch
    record["schedule_version"] = decision.get("schedule_version", "")
    if decision.get("allocation"):
        wanted = gang.Allocation(**decision["allocation"])
        gang.write_allocation(run_dir, wanted)
        record["allocation"] = {"market": wanted.market, "zone": wanted.zone,
                                "nodes": wanted.nodes}
    record["status"] = "applied"
    # The run folder is shared: a planted link at this predictable name is refused, not appended
    # through (issue 31, class 2).
    append_bytes(run_dir / "slow_decisions.jsonl",
                 (json.dumps(record, sort_keys=True, default=str) + "\n").encode("utf-8"))
    return record


def apply_run_decisions(state_dir: Path, tick: SlowTick, applied_by: str = "") -> dict[str, Any]:
    """`run_decision` then `apply_run_decision` in one call (the CLI and tests; the sensor asks
    for a recorded run instead)."""
    decision = run_decision(state_dir, tick)
    if decision is None:
        return {"status": f"nothing to apply: {tick.skip_reason or 'no change'}"}
    return apply_run_decision(state_dir, decision, applied_by)


def live_change_rule(state_dir: Path) -> dict[str, Any]:
    """The automatic-approval rule for live changes (default: on, up to 0.25 of rate change)."""
    path = state_dir.joinpath(*RULE_PATH)
    if not path.is_file():
        return {"auto_approve": True, "max_rate_change": DEFAULT_MAX_AUTO_RATE_CHANGE,
                "set_by": "default", "why": "trainwise default"}
    return json.loads(path.read_text(encoding="utf-8"))


def set_live_change_rule(state_dir: Path, *, auto_approve: bool, set_by: str, why: str,
                         max_rate_change: float = DEFAULT_MAX_AUTO_RATE_CHANGE) -> dict[str, Any]:
    """Switch the rule (recorded: who, why, when, in the rule file and its history)."""
    from training._data_io import atomic_write_json

    if not set_by.strip() or not why.strip():
        raise ValueError("switching the live-change rule needs `set_by` and `why` (recorded)")
    if not 0.0 <= max_rate_change < 1.0:
        raise ValueError(f"max_rate_change={max_rate_change!r} must be in [0, 1)")
    rule = {"auto_approve": bool(auto_approve), "max_rate_change": float(max_rate_change),
            "set_by": set_by, "why": why, "set_at_s": time.time()}
    path = state_dir.joinpath(*RULE_PATH)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, rule)
    append_bytes(path.with_name("live_change_rule_history.jsonl"),
                 (json.dumps(rule, sort_keys=True) + "\n").encode("utf-8"))
    return rule


def apply_live_change(state_dir: Path, partition: str, change: dict[str, Any],
                      published_version: str) -> dict[str, Any]:
    """After the gate published `published_version`, hand `change` ({"run_id", "pruning_rate",
    "reason", "from_rate"}) to the running job if the rule approves it; else leave it pending.
    The outcome is recorded in the partition's curriculum history and returned."""
    from training import curriculum as curriculum_lib
    from training._data_io import atomic_write_json
    from training.dynamic_pruning import write_pruning_control
    from trainwise.runs import control_path

    run_id, rate = change["run_id"], float(change["pruning_rate"])
    rule = live_change_rule(state_dir)
    record: dict[str, Any] = {"event": "live_change", "run_id": run_id, "pruning_rate": rate,
                              "curriculum_version": published_version, "rule": rule}
    request_path = state_dir / "runs" / run_id / "request.json"
    request = json.loads(request_path.read_text()) if request_path.is_file() else {}
    from_rate = change.get("from_rate")
    moved = abs(rate - float(from_rate)) if from_rate is not None else 0.0
    if request.get("data_selection") != "dynamic":
        record["status"] = "not applicable: the run does not prune dynamically"
    elif not rule["auto_approve"]:
        record["status"] = "pending: automatic approval is off"
    elif moved > rule["max_rate_change"] + 1e-9:
        record["status"] = (f"pending: the rate moves {moved:.2f}, more than the rule's "
                            f"{rule['max_rate_change']:.2f}")
    else:
        write_pruning_control(control_path(state_dir, run_id), pruning_rate=rate,
                              reason=f"slow_policy_sensor via gate ({published_version}): "
                                     f"{change.get('reason', '')}")
        record["status"] = "applied"
        record["approved_by"] = f"auto-approval rule set by {rule['set_by']}"
    if record["status"].startswith("pending"):
        atomic_write_json(control_path(state_dir, run_id).with_name("control.pending.json"),
                          record)
    curriculum_lib.append_history(state_dir / "curricula" / partition, record)
    return record
