"""A team's registered job (`[jobs.NAME]` of its project file) launched on the provider's nodes.

`launch_user_job` runs the job's entry point (a script, or `package.module:function` through
`trainwise.sdk.entry`) as the workload of the nodes a `GangSession` (`trainwise.gang`) holds at
the selected provider, with the run spec the SDK reads (`TRAINWISE_RUN_SPEC`). In order:

1. Preflight, before any node is launched: the dataset's shards exist (its `data_shards`
   partition was materialized) and the entry point imports (a child process in the project's
   folder: importing runs the user's top-level code, never in this process); a script entry
   must exist and compile.
2. The session launches the allocation; the job starts; the provider's clock runs once the job
   has called `run.step()` (start-up is inside the changeover the session modelled). A job
   that calls `run.step()` not once within `first_step_timeout_s` is stopped and the run fails
   with the fix (a job under trainwise must call it after each optimizer step).
3. A reclaim notice for the node (the replayed trace decides, emulated) SIGTERMs the job; the
   SDK checkpoints within the notice, commits to the object store and exits 143. The session
   releases the node and launches the replacement (spot refused: on-demand, recorded); the
   job restarts on the replacement's empty disk (its local checkpoints are gone) and the SDK
   resumes from the store.
4. Exit 0 with a completed outcome ends the run; any other exit fails it with the log's tail.
   The provider's bill is the run's cost (`gang.json`), and `user_job.json` records the segments.

Nodes: this launcher runs the job on this machine (the emulated provider's nodes). With a
provider whose nodes boot the node agent (aws), the `user_job_run` asset runs the job on the
nodes instead (`trainwise.agent_launch.AgentJobLaunch`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from telemetry.reader import step_records_written
from training.safe_files import replace_with_new, write_atomic
from trainwise.gang import GangSession
from trainwise.sdk.entry import CHECK_FAILED_EXIT_CODE
from trainwise.sdk.spec import PREEMPTED_EXIT_CODE, RunSpec, with_fields, write_spec
from trainwise.user_project import JobSpec, Project

REPO = Path(__file__).resolve().parents[1]
RECORD_FILE = "user_job.json"
LOG_TAIL_CHARS = 2000


# Frameworks whose own loop sizes its epochs once from the loader's length: the fast layer's
# batch lever cannot reach them, and their callbacks refuse it at init (trainwise.sdk.hf,
# trainwise.sdk.lightning).
LOADER_OWNED_FRAMEWORKS = ("hf_trainer", "lightning")


def spec_for_framework(job: JobSpec, spec: RunSpec) -> RunSpec:
    """`spec` with the levers `job`'s framework can apply: a launcher leaves `batch_scaling`
    out for a Trainer or Lightning job (the spec's default asks for it, and the job's callback
    would refuse the run at its first line)."""
    if job.framework in LOADER_OWNED_FRAMEWORKS and "batch_scaling" in spec.fast_levers:
        return with_fields(spec, fast_levers=tuple(lever for lever in spec.fast_levers
                                                   if lever != "batch_scaling"))
    return spec


class UserJobError(RuntimeError):
    """A registered job that cannot be launched, or a run of it that failed; names the fix."""


def _log_tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return text[-LOG_TAIL_CHARS:].strip() or "(empty log)"


def job_command(job: JobSpec) -> list[str]:
    if job.entry_kind == "script":
        return [sys.executable, str(job.script), *job.args]
    return [sys.executable, "-m", "trainwise.sdk.entry", job.entry, *job.args]


def job_env(project_dir: Path, spec_path: Path | None = None) -> dict[str, str]:
    paths = [str(project_dir), str(REPO), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # nothing reaches a hub
    if spec_path is not None:
        env["TRAINWISE_RUN_SPEC"] = str(spec_path)
    return env


def preflight(job: JobSpec, project_dir: Path, dataset_dir: Path | None,
              timeout_s: float = 120.0) -> None:
    """What can be known before a node is launched (module doc, 1); UserJobError names it."""
    if dataset_dir is not None and not (Path(dataset_dir) / "manifest.json").is_file():
        raise UserJobError(f"job {job.name!r}: dataset {job.dataset!r} has no shards at "
                           f"{dataset_dir}; materialize data_shards for partition "
                           f"{job.dataset!r} first (Dagster UI: data_shards, that partition)")
    if job.entry_kind == "script":
        try:  # compiled only, never run here
            compile(Path(job.script).read_bytes(), str(job.script), "exec")
        except (SyntaxError, ValueError) as error:
            raise UserJobError(f"job {job.name!r}: script {job.script} does not compile "
                               f"({type(error).__name__}: {error}); fix it") from error
        return
    checked = subprocess.run([sys.executable, "-m", "trainwise.sdk.entry", "--check", job.entry],
                             cwd=project_dir, env=job_env(project_dir), capture_output=True,
                             text=True, timeout=timeout_s)
    if checked.returncode != 0:
        last = checked.stderr.strip().splitlines()[-1:] or ["(no message)"]
        why = last[0] if checked.returncode == CHECK_FAILED_EXIT_CODE else checked.stderr[-800:]
        raise UserJobError(f"job {job.name!r}: {why} (nothing was launched)")


@dataclass
class UserJobLaunch:
    """One registered job's run on the session's nodes (module doc)."""

    job: JobSpec
    project_dir: Path
    session: GangSession
    spec: RunSpec  # run_id, run_dir, store_root, max_steps, ...: what the SDK reads
    first_step_timeout_s: float = 300.0
    segment_timeout_s: float = 3600.0
    poll_s: float = 0.1
    segments: list[dict[str, Any]] = field(default_factory=list)
    failure: str = ""
    _child: subprocess.Popen | None = None

    @property
    def run_dir(self) -> Path:
        return Path(self.spec.run_dir)

    def run(self) -> dict[str, Any]:
        self.spec = spec_for_framework(self.job, self.spec)
        self.session.on_stop = self._tell
        status = "interrupted"
        if not self.session.nodes:
            self.session.start()
        try:
            while True:
                code, outcome = self._segment(len(self.segments))
                if code == 0 and (outcome or {}).get("status") == "completed":
                    status = "completed"
                    break
                if code == PREEMPTED_EXIT_CODE and self.session.stop_reason:
                    if not self.session.replace():
                        self.failure = self.session.failure
                        break
                    # The replacement's disk is empty: the SDK resumes from the object store.
                    shutil.rmtree(self.run_dir / "checkpoints", ignore_errors=True)
                    continue
                if not self.failure:
                    self.failure = (f"job {self.job.name!r} exited {code} (segment "
                                    f"{len(self.segments) - 1}) without a notice of ours; its "
                                    f"log ends:\n{_log_tail(self._log(len(self.segments) - 1))}")
                status = "failed" if code != PREEMPTED_EXIT_CODE else "interrupted"
                break
        finally:
            record = self.session.close(status)
        result = {"job": self.job.name, "entry": self.job.entry, "run_id": self.spec.run_id,
                  "status": status, "failure": self.failure, "segments": self.segments,
                  "reclaims": record.get("reclaims"), "cost_usd": record.get("cost_usd"),
                  "steps": self._steps_seen(), "outcome": self._outcome()}
        write_atomic(self.run_dir / RECORD_FILE, (json.dumps(result, indent=1, default=str)
                                                  + "\n").encode())
        return result

    def _log(self, index: int) -> Path:
        return self.run_dir / "user_job" / f"segment-{index}.log"

    def _segment(self, index: int) -> tuple[int, dict[str, Any] | None]:
        spec_path = write_spec(self.spec, self.run_dir / "user_job" / f"segment-{index}.spec.json")
        log = self._log(index)
        seen_before = self._steps_seen()
        began = time.monotonic()
        clock_running = False
        with os.fdopen(replace_with_new(log), "w") as output:
            child = subprocess.Popen(job_command(self.job), cwd=self.project_dir,
                                     env=job_env(self.project_dir, spec_path), stdout=output,
                                     stderr=subprocess.STDOUT, start_new_session=True)
            self._child = child
            try:
                while child.poll() is None:
                    waited_s = time.monotonic() - began
                    if not clock_running:
                        if self._steps_seen() > seen_before:
                            clock_running = True
                            self.session.resume_clock()
                        elif waited_s > self.first_step_timeout_s:
                            self.failure = (
                                f"job {self.job.name!r} called run.step() not once in "
                                f"{self.first_step_timeout_s:.0f} s; a job under trainwise "
                                "calls run.step() after each optimizer step (or uses the "
                                "trainwise callback of its framework), see docs/sdk.md")
                            break
                    else:
                        self.session.check()
                    if waited_s > self.segment_timeout_s:
                        self.failure = (f"job {self.job.name!r} segment {index} ran over "
                                        f"{self.segment_timeout_s:.0f} s; see {log}")
                        break
                    time.sleep(self.poll_s)
            finally:
                if child.poll() is None:
                    os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                self._child = None
        outcome = self._outcome()
        self.segments.append({"index": index, "returncode": child.returncode,
                              "status": (outcome or {}).get("status"),
                              "step": (outcome or {}).get("step"),
                              "wall_s": round(time.monotonic() - began, 3),
                              "stop_reason": self.session.stop_reason, "log": str(log)})
        return child.returncode, outcome

    def _tell(self, nodes: list[Any], reason: str) -> dict[str, Any]:
        """The node's notice reaches the job as the provider's SIGTERM would."""
        child = self._child
        if child is None or child.poll() is not None:
            return {"what": "the job had already exited"}
        os.kill(child.pid, signal.SIGTERM)
        return {"what": f"SIGTERM to the job (pid {child.pid})", "pid": child.pid}

    def _steps_seen(self) -> int:
        return step_records_written(self.run_dir / "telemetry" / self.spec.run_id,
                                    self.spec.rank)

    def _outcome(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.run_dir / f"outcome-rank{self.spec.rank}.json").read_text())
        except (FileNotFoundError, ValueError):
            return None


def registered_job(project: Project, name: str) -> JobSpec:
    if name not in project.jobs:
        known = ", ".join(sorted(project.jobs)) or "none"
        raise UserJobError(f"job {name!r} is not registered in the project file "
                           f"({project.path or 'TRAINWISE_PROJECT_FILE is unset'}); registered: "
                           f"{known}. Add a [jobs.{name}] section, or pick one of those")
    return project.jobs[name]


def log_to_mlflow(tracking_uri: str, experiment: str, result: dict[str, Any], job: JobSpec,
                  spec: RunSpec) -> str:
    """The run in MLflow: the train loss along the steps, the provider's bill and the eval
    loss the job reported (`run.finish(eval_loss=)`) as final metrics; returns its run id."""
    from telemetry.reader import read_run_events
    from trainwise import tracking

    events = read_run_events(Path(spec.run_dir) / "telemetry" / spec.run_id, rank=spec.rank)
    losses = {}
    for event in events:  # a resumed step is logged once, its last value
        if event.get("type") == "step" and event.get("train_loss") == event.get("train_loss"):
            losses[int(event["step"])] = float(event["train_loss"])
    outcome = result.get("outcome") or {}
    final = {"steps": float(result["steps"]), "reclaims": float(result["reclaims"] or 0)}
    if result.get("cost_usd") is not None:
        final["cost/bill_usd"] = float(result["cost_usd"])
    if outcome.get("eval_loss") is not None:
        final["losses/eval"] = float(outcome["eval_loss"])
    record = tracking.RunRecord(
        experiment=experiment, run_name=spec.run_id,
        params={"job": job.name, "entry": job.entry, "dataset": job.dataset,
                "framework": job.framework, "seed": spec.seed, "max_steps": spec.max_steps,
                "instance_type": spec.instance_type, "segments": len(result["segments"])},
        step_metrics=[(step, {"losses/train": loss}) for step, loss in sorted(losses.items())],
        final_metrics=final,
        tags={"trainwise/user_job": job.name, "trainwise/training_run": spec.run_id,
              "trainwise/schedule_version": spec.schedule_version,
              "trainwise/status": result["status"]},
        artifact_root=tracking.default_artifact_root(tracking_uri))
    return tracking.log_run(tracking_uri, record)
