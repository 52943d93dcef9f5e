"""A train run under trainwise's allocation policy: the node engine `run_training` uses when the
request names one (`TrainRequest.allocation_policy`).

The allocation policy (an object: `cloud.policy_registry.make_policy(name)`, or one a caller
built) decides spot, on-demand or waiting and the zone at every tick of a replayed spot trace;
the run's trainer runs as a child process on the node it holds (`trainwise.emulated_worker`),
is sent SIGTERM when the trace reclaims that node or the policy moves, checkpoints within the
notice, uploads each checkpoint to the object store and is resumed by its replacement from the
store. The clock rules, the bill and the decision records are `trainwise.emulated.supervise`'s:
the same engine the `emulated`, `end_to_end` and `fidelity` benchmarks measure, so the figures
they publish are the figures of this path.

What this engine does not take yet, refused before anything is launched with the fix named:
a fast policy given as an object (the trainer is another process: name it), dynamic data
selection (its control file is steered by the slow-policy sensor of the in-process engine),
and an object store other than a local folder. A gang (`nodes` > 1) is held and billed as N
nodes in one zone, but trained by ONE trainer process standing for the gang's work at the full
gang's rate (the emulated cloud's limit, `trainwise/emulated.py` "Gang"); real torchrun ranks
run on the in-process engine.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainwise import settings
from trainwise.emulated import (
    EmulatedResult,
    ReplaySpec,
    emulated_result,
    plan_replay,
    replay_policy,
    result_record,  # re-exported: the driver writes the figures with it
    supervise,
)
from trainwise.object_store import LocalObjectStore, ObjectStore

ENGINE = "supervised"
RECORD_FILE = "supervised.json"  # the run folder's record of the nodes held and the bill


@dataclass(frozen=True)
class TrainerOutcome:
    """The last trainer process's result, as `training.loop.train` returns it to the driver."""

    status: str
    steps: int
    tokens_seen: int
    samples_seen: int
    final_eval_loss: float | None
    final_eval_accuracy: float | None
    cost_usd: float  # the trainer's own estimate (its wall time x list price), not the bill
    elapsed_s: float
    checkpoint_path: str
    checkpoint_sha256: str
    telemetry_dir: Path


@dataclass(frozen=True)
class SupervisedOutcome:
    trainer: TrainerOutcome
    record: dict[str, Any]  # the provider's side, with the keys of `GangSession.record`
    emulated: EmulatedResult  # every figure of the supervised job (bill, waste, holdings)
    uploaded: tuple[str, ...]  # URIs the trainers uploaded (the final checkpoint's among them)
    upload_failed: tuple[tuple[str, str], ...]


def check_supported(*, store: ObjectStore, data_selection: str,
                    fast_policy_object: Any) -> None:
    """What this engine cannot run yet, as one ValueError naming each thing and its fix."""
    problems = []
    if not isinstance(store, LocalObjectStore):
        problems.append(f"object store {type(store).__name__}: the supervised engine's trainers "
                        "upload to a local folder store (set TRAINWISE_OBJECT_STORE to a folder) "
                        "or leave allocation_policy empty")
    if data_selection != "static":
        problems.append(f"data_selection={data_selection!r}: use 'static' under an allocation "
                        "policy (dynamic selection is steered on the in-process engine)")
    if fast_policy_object is not None:
        problems.append("a fast policy given as an object cannot reach the trainer process: "
                        "name it in the request's fast_policy")
    if problems:
        raise ValueError("allocation_policy is set, but " + "; ".join(problems))


def train_supervised(*, config: Any, partition: str, run_id: str, replay: ReplaySpec,
                     allocation_policy: Any, state_dir: Path, run_dir: Path,
                     store: LocalObjectStore, key_prefix: str, fast_policy: str,
                     region: str | None, resume_step: int | None, nodes: int = 1,
                     data_dir: Path | None = None) -> SupervisedOutcome:
    """Trains `config` under `allocation_policy` (an object, or a registered name) on the
    replayed market of `replay`; returns the last trainer's outcome and the provider's record.

    `resume_step`: the step the driver found to resume from (its checkpoint is in the store,
    `run_training` restored or found it); the first trainer restores it from the store."""
    started = time.monotonic()
    data_dir = Path(data_dir) if data_dir is not None else settings.data_dir()
    replay = dataclasses.replace(replay, nodes=nodes)  # the request's gang size
    plan = plan_replay(replay, config.max_steps, data_dir / "spot")
    policy = (replay_policy(allocation_policy, plan, data_dir / "spot")
              if isinstance(allocation_policy, str) else allocation_policy)
    policy_name = str(getattr(policy, "name", type(policy).__name__))
    train_config = dataclasses.asdict(config)
    # The trainer is told the notice it really gets (the provider's, in this machine's seconds),
    # so its fast policy judges whether a save fits in it.
    train_config["preemption_notice_s"] = plan.notice_wall_s
    shards_dir = state_dir / "shards" / partition
    curriculum_dir = state_dir / "curricula" / partition
    job_extra: dict[str, Any] = {"fast_policy_region": region}
    if (curriculum_dir / "manifest.json").exists():
        job_extra["curriculum_dir"] = str(curriculum_dir)
    job, status = supervise(
        plan, policy=policy, run_id=run_id, run_dir=run_dir, shards_dir=shards_dir,
        train_config=train_config, max_steps=config.max_steps, fast_policy=fast_policy,
        store_dir=store.root, store_key_prefix=key_prefix, job_extra=job_extra,
        resume_step=resume_step)
    figures = emulated_result(job, plan, status=status, policy_name=policy_name,
                              wall_s=time.monotonic() - started)
    return SupervisedOutcome(
        trainer=_trainer_outcome(job, status, run_dir, run_id),
        record=provider_record(figures, plan, policy_name),
        emulated=figures,
        uploaded=tuple(job.uploaded), upload_failed=tuple(job.upload_failed))


def _trainer_outcome(job: Any, status: str, run_dir: Path, run_id: str) -> TrainerOutcome:
    last = job.last_result or {}
    # The job's status is the driver's: completed only when the last step was trained.
    done = status == "completed" and job.finish_s is not None
    return TrainerOutcome(
        status="completed" if done else "stopped",
        steps=int(last.get("steps", job.steps)),
        tokens_seen=int(last.get("tokens_seen", 0)),
        samples_seen=int(last.get("samples_seen", 0)),
        final_eval_loss=last.get("final_eval_loss"),
        final_eval_accuracy=last.get("final_eval_accuracy"),
        cost_usd=float(last.get("trainer_cost_usd", 0.0)),
        elapsed_s=float(last.get("elapsed_s", 0.0)),
        checkpoint_path=str(last.get("checkpoint_path") or job.checkpoint_path or ""),
        checkpoint_sha256=str(last.get("checkpoint_sha256") or ""),
        telemetry_dir=Path(last["telemetry_dir"]) if last.get("telemetry_dir")
        else run_dir / "telemetry" / run_id)


def provider_record(figures: EmulatedResult, plan: Any, policy_name: str) -> dict[str, Any]:
    """The provider's side in `GangSession.record`'s keys, so the driver reports both engines
    alike. The fixed schedule (as `GangSession.fixed_schedule`): the same nodes on demand for one
    changeover plus the clock seconds the trainers trained, never interrupted; waste: billed
    node-seconds beyond that (the changeovers after the first, the notices, the replays)."""
    nodes = figures.node_count
    changeover_s = float(plan.rules.changeover_s)
    trained_s = 0.0  # clock seconds a booted set trained, up to its notice or its end
    for holding in figures.holdings:
        if holding.get("end_s") is None:
            continue
        stop_s = holding["notice_at_s"] if holding.get("notice_at_s") is not None else (
            holding["end_s"])
        trained_s += max(0.0, stop_s - holding["launch_s"] - changeover_s)
    trained_s = max(0.0, trained_s / nodes - figures.preemption_waste_s)
    needed_s = nodes * (changeover_s + trained_s)
    billed_s = figures.spot_node_s + figures.on_demand_node_s
    fixed_usd = figures.on_demand_usd_per_hour * needed_s / 3600.0
    last = figures.holdings[-1] if figures.holdings else {}
    return {
        "engine": ENGINE, "provider": "emulated", "allocation_policy": policy_name,
        "instance_type": figures.instance_type, "market": last.get("kind", ""),
        "zone": last.get("zone", figures.zone), "nodes": nodes,
        "cost_usd": figures.cost_usd if math.isfinite(figures.cost_usd) else None,
        "spot_share": figures.spot_share, "reclaims": figures.preemptions,
        "replacements": max(0, figures.launches - 1), "train_provider_s": trained_s,
        "fixed_on_demand_usd": fixed_usd if math.isfinite(fixed_usd) else None,
        "preemption_waste_node_s": max(0.0, billed_s - needed_s), "world_size": 1,
        "deadline_s": figures.deadline_s, "finish_s": figures.finish_s,
        "replay": {"trace_folder": plan.spec.trace_folder,
                   "zone_files": list(plan.spec.zone_files),
                   "window_start_tick": plan.spec.window_start_tick,
                   "seconds_per_tick": plan.spec.seconds_per_tick},
    }

__all__ = ["ENGINE", "RECORD_FILE", "ReplaySpec", "SupervisedOutcome", "TrainerOutcome",
           "check_supported", "provider_record", "result_record", "train_supervised"]
