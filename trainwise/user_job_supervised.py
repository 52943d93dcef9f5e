"""A team's registered job under an allocation policy: the supervised engine for a user's job.

`supervise_user_job` runs the job's entry point (`trainwise.user_jobs.job_command`, its env with
`TRAINWISE_RUN_SPEC`) on the engine the built-in train job runs on under an `allocation_policy`
(`trainwise.emulated.supervise`): the registered policy (on_demand, managed_spot,
uniform_progress, trainwise_heuristic, ...) decides spot, on-demand or waiting at every tick of
a replayed real spot trace; each launch starts the job as a child process (one per node life);
a reclaim or a policy move SIGTERMs it, the SDK commits a checkpoint to the object store and
exits 143; the replacement starts on an empty disk (its local checkpoints are deleted) and the
SDK resumes from the store. The clock rules, the bill and the decision records are the engine's
(`trainwise/emulated.py`), so the figures are comparable with the built-in trainer's.

`UserJobWorkload` is what the engine calls instead of the built-in worker (`_Emulation.workload`):
per spawn it writes the run spec (`emulated/spec-NNN.json`: the caller's spec with the notice the
node really gets in wall seconds, the instance type and the held set's price), and after the
child exits it turns the SDK's `outcome-rank0.json` into the worker's result file
(`emulated/result-NNN.json`). Its telemetry is the SDK's (`run_dir/telemetry/<run_id>/rank0`, the
built-in trainer's layout and schema), which the engine reads for steps and checkpoints.

Each spawn's spec carries the preemption risk the engine gives a new built-in trainer (the
reclaims seen so far over the time observed, `observed_reclaim_risk`): the SDK's fast heuristic
checkpoints on Young's interval for it. What the user's job does not get (the built-in trainer
does): the live checkpoint interval the slow layer writes while it runs (`checkpoint_autotune`);
its interval checkpoints stay at `checkpoint_every_steps`.
`max_steps` is required: the work model and the deadline are in steps.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controllers.preemption_risk import observed_reclaim_risk
from training.safe_files import write_atomic
from trainwise import settings
from trainwise.emulated import (
    EmulatedResult,
    ReplaySpec,
    emulated_result,
    plan_replay,
    replay_policy,
    supervise,
)
from trainwise.sdk.spec import RunSpec, with_fields, write_spec
from trainwise.supervised_run import RECORD_FILE as SUPERVISED_FILE
from trainwise.supervised_run import provider_record, result_record
from trainwise.user_jobs import (
    LOADER_OWNED_FRAMEWORKS,
    RECORD_FILE,
    _log_tail,
    job_command,
    job_env,
    spec_for_framework,
)
from trainwise.user_project import JobSpec

ENGINE = "supervised"

@dataclass
class UserJobWorkload:
    """The user's job as the engine's trainer process (see the module doc)."""

    job: JobSpec
    project_dir: Path
    spec: RunSpec
    notice_s: float  # the provider's notice in this machine's seconds (`ReplayPlan.notice_wall_s`)
    segments: list[dict[str, Any]] = field(default_factory=list)
    emulation: Any = None  # the engine's job state, kept so a failed run still has its bill
    _began: float = 0.0

    @property
    def outcome_path(self) -> Path:
        return Path(self.spec.run_dir) / f"outcome-rank{self.spec.rank}.json"

    def child(self, emulation: Any, index: int, result_path: Path
              ) -> tuple[list[str], dict[str, str], Path]:
        """The spawn's command, env (its own run spec) and folder."""
        self.emulation = emulation
        # The outcome file is the finishing child's: an earlier one must not be read as its.
        self.outcome_path.unlink(missing_ok=True)
        holdings = [emulation.provider.holding(n) for n in emulation.gang]
        held = emulation.held
        # The risk the engine gives the built-in trainer (`_Emulation.trainer_risk`): reclaims
        # seen so far over the time observed, on this machine's clock, 0 on on-demand only.
        risk = observed_reclaim_risk(len(emulation.preemption_times),
                                     emulation.clock.wall_s(emulation.clock.now_s),
                                     held.spot_nodes if held is not None else 0)
        spec = with_fields(self.spec, notice_s=float(self.notice_s),
                           instance_type=emulation.market.instance_type,
                           price_usd_per_hour=float(sum(h.price_usd_per_hour for h in holdings)),
                           preemption_risk=float(min(1.0, max(0.0, risk))))
        spec_path = write_spec(spec, result_path.with_name(f"spec-{index:03d}.json"))
        self._began = time.monotonic()
        return job_command(self.job), job_env(self.project_dir, spec_path), self.project_dir

    def collect(self, emulation: Any, trainer: Any, code: int | None) -> None:
        """The exited child's outcome as the worker's result file (none when it wrote none,
        e.g. SIGKILLed or crashed before `trainwise.init`), and its segment record."""
        outcome = _read_json(self.outcome_path)
        if outcome is not None and outcome.get("run_id") == self.spec.run_id:
            status = str(outcome["status"])
            error = outcome.get("error")
            if status == "completed" and code != 0:
                status, error = "failed", f"exited {code} after run.finish()"
            write_atomic(trainer.result_path, json.dumps({
                "pid": trainer.process.pid, "status": status, "steps": int(outcome["step"]),
                "final_eval_loss": outcome.get("eval_loss"), "final_eval_accuracy": None,
                "checkpoint_path": outcome.get("checkpoint") or emulation.checkpoint_path,
                "elapsed_s": float(outcome.get("elapsed_s") or 0.0), "exit_code": code,
                "error": error, "fast_decisions": outcome.get("fast_decisions"),
                "uploaded": [], "upload_failed": []}, indent=1).encode())
        else:
            outcome = None
        self.segments.append(self._segment(trainer, code, outcome))

    def _segment(self, trainer: Any, code: int | None, outcome: dict[str, Any] | None
                 ) -> dict[str, Any]:
        index = len(self.segments)
        return {"index": index, "returncode": code,
                "status": (outcome or {}).get("status") or (
                    "killed" if trainer.killed or (code is not None and code < 0) else None),
                "step": (outcome or {}).get("step"),
                "wall_s": round(time.monotonic() - self._began, 3),
                "stop_reason": trainer.stop_reason,
                "nodes": [f"{n.market} in {n.zone}" for n in trainer.nodes],
                "log": str(trainer.result_path.with_name(f"worker-{index:03d}.log"))}


@dataclass(frozen=True)
class SupervisedUserJob:
    result: dict[str, Any]  # `user_job.json`: `UserJobLaunch.run`'s keys, engine and policy added
    record: dict[str, Any]  # the provider's side in `GangSession.record`'s keys
    figures: EmulatedResult  # every figure of the supervised job (bill, waste, holdings)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def _stored_step(spec: RunSpec) -> int | None:
    """The newest step committed in the store for this run (a run started again resumes)."""
    from trainwise.object_store import LocalObjectStore
    from trainwise.sdk.resume import store_prefix, store_steps

    steps = store_steps(LocalObjectStore(Path(str(spec.store_root))),
                        store_prefix(spec.checkpoint_key_prefix, spec.rank))
    return max(steps) if steps else None


def supervise_user_job(job: JobSpec, project_dir: Path, spec: RunSpec, replay: ReplaySpec,
                       allocation_policy: Any, data_dir: Path | None = None,
                       fast_policy: str | None = None) -> SupervisedUserJob:
    """Runs the registered `job` under `allocation_policy` (a registered name, or a policy
    object) on the replayed market of `replay` (see the module doc). `spec`: the run (run_id,
    run_dir, store_root, max_steps, seed, checkpoint_every_steps, ...); `fast_policy`: the
    SDK's fast policy ("heuristic" or "noop"; None keeps the spec's). Writes `user_job.json`
    and `supervised.json` in the run folder; a job that fails is a result with status "failed"
    and its log's tail, its nodes released and billed."""
    if spec.max_steps is None:
        raise ValueError(f"job {job.name!r}: an allocation policy needs max_steps (its work "
                         "model and deadline are in steps); set max_steps, or leave "
                         "allocation_policy empty for the fixed market")
    if spec.store_root is None:
        raise ValueError(f"job {job.name!r}: an allocation policy needs store_root (a "
                         "replacement node's disk is empty: it resumes from the object store)")
    if fast_policy is not None:
        spec = with_fields(spec, fast_policy=fast_policy)
    spec = spec_for_framework(job, spec)
    started = time.monotonic()
    data_dir = Path(data_dir) if data_dir is not None else settings.data_dir()
    plan = plan_replay(replay, spec.max_steps, data_dir / "spot")
    policy = (replay_policy(allocation_policy, plan, data_dir / "spot")
              if isinstance(allocation_policy, str) else allocation_policy)
    policy_name = str(getattr(policy, "name", type(policy).__name__))
    run_dir = Path(spec.run_dir)
    workload = UserJobWorkload(job, Path(project_dir), spec, plan.notice_wall_s)
    status, failure = "interrupted", ""
    try:
        emulation, engine_status = supervise(
            plan, policy=policy, run_id=spec.run_id, run_dir=run_dir,
            shards_dir=Path(spec.dataset_dir) if spec.dataset_dir else run_dir,
            train_config={"run_id": spec.run_id, "max_steps": spec.max_steps,
                          "schedule_version": spec.schedule_version},
            max_steps=spec.max_steps, store_dir=Path(spec.store_root),
            store_key_prefix=spec.checkpoint_key_prefix, resume_step=_stored_step(spec),
            workload=workload)
        if engine_status == "completed" and emulation.finish_s is not None:
            status = "completed"
        else:
            failure = (f"job {job.name!r} did not finish within max_wall_s={replay.max_wall_s} s "
                       f"(step {emulation.steps} of {spec.max_steps}"
                       + ("; it never called run.step(): a job under trainwise calls it after "
                          "each optimizer step" if emulation.steps == 0 else "") + ")")
    except RuntimeError as error:  # the child failed; the engine released and billed its nodes
        emulation, engine_status, status = workload.emulation, "failed", "failed"
        if emulation is None:
            raise
        last = workload.segments[-1]["log"] if workload.segments else ""
        failure = f"{error}; its log ends:\n{_log_tail(Path(last)) if last else '(no log)'}"
    if emulation.trainer is not None:  # still running at the wall limit: killed by the engine
        workload.collect(emulation, emulation.trainer, emulation.trainer.process.returncode)
    figures = emulated_result(emulation, plan, status=engine_status, policy_name=policy_name,
                              wall_s=time.monotonic() - started)
    record = provider_record(figures, plan, policy_name)
    write_atomic(run_dir / SUPERVISED_FILE, (json.dumps(
        {**record, "figures": result_record(figures)}, indent=1, default=str) + "\n").encode())
    outcome = _read_json(workload.outcome_path)
    result = {"job": job.name, "entry": job.entry, "run_id": spec.run_id, "status": status,
              "failure": failure, "segments": workload.segments,
              "reclaims": figures.preemptions, "cost_usd": record["cost_usd"],
              "steps": emulation.steps, "outcome": outcome, "engine": ENGINE,
              "allocation_policy": policy_name, "fast_policy": spec.fast_policy,
              "fast_levers": list(spec.fast_levers)}
    if (status == "completed" and outcome is not None
            and outcome.get("status") in ("preempted", "migrated")):
        # Reclaimed during its last step: the engine counts finished work as done (no policy
        # relaunches it), so the job's own code after its loop has not run.
        result["note"] = (f"reclaimed at its last step ({outcome.get('step')}): the weights are "
                          "final and committed, but the job's code after its training loop did "
                          "not run; launch the same run_id again to finish it (it trains "
                          "nothing more)")
    elif status == "completed" and outcome is not None and outcome.get("step") != spec.max_steps:
        result["note"] = (f"the job ended at step {outcome.get('step')}, the run spec said "
                          f"max_steps={spec.max_steps} (its own arguments override the spec); "
                          "the work model and the deadline assumed the spec's")
    write_atomic(run_dir / RECORD_FILE, (json.dumps(result, indent=1, default=str)
                                         + "\n").encode())
    return SupervisedUserJob(result, record, figures)


def replay_for_run() -> ReplaySpec:
    """The replay a user job runs on from the Launchpad: the train job's (`run_training` with no
    replay given: the default trace window, `ReplaySpec()`)."""
    return ReplaySpec()


__all__ = ["ENGINE", "LOADER_OWNED_FRAMEWORKS", "SupervisedUserJob", "UserJobWorkload", "replay_for_run",
           "supervise_user_job"]
