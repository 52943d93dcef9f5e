"""The trainer process of the emulated cloud: `python -m trainwise.emulated_worker JOB.json`.

One process = one emulated node's life. It loads the shards, trains (or resumes from the
checkpoint named in the job file) with `training.loop.train`, and writes what happened to the
job's `result_path` atomically. SIGTERM (the emulated spot reclaim) is handled by the loop: it
checkpoints at the next step boundary and returns status "preempted"; this process then exits 0.

Job file (JSON): {"shards_dir", "run_dir", "result_path", "resume_from" (null or a checkpoint
path), "train_config" (the `TrainConfig` fields; `model` as a dict of `GPTConfig` fields or
absent)}, and optionally "block_sigterm" (fault injection: a trainer that never answers the
notice, so the provider SIGKILLs it; the signal is blocked before torch starts its threads, so
no thread can take it), and "store_dir" + "store_key_prefix" (an object store folder, the
`LocalObjectStore` layout): every checkpoint is uploaded as it is written (drained before the
process exits), and "resume_from": "store" restores the store's newest committed checkpoint
into this node's empty checkpoint folder first (`trainwise.emulated_store.restore_from_store`).

Fast layer: optional "fast_policy" (a name of `trainwise.runs.FAST_POLICIES`; absent or null =
no fast policy, the loop's no-op) is passed to `training.loop.train` as `trainwise.runs` does,
so the heuristic adapts the batch at fast ticks and answers the SIGTERM notice (checkpoint when
the measured save fits in the notice, migrate otherwise). With "fast_policy_region" the
champion lookup of `runs.fast_policy_in_charge` is made for that region (the train job's rule);
without, the named policy itself. Optional "curriculum_dir": the curriculum trained on (absent:
all the shards' examples). Optional
"preemption_risk" (a probability, default 0.0) reaches the fast policy's observation the way the
loop takes a risk: a live-control file (`training.live_control`, source "emulated_job") in the
run folder, read at the first fast tick.

SIGTERM outside the loop (issue 31, class 8): `training.loop` answers SIGTERM only while its
step loop runs. `main` installs a handler first thing (`SigtermOutsideTheLoop`), so a notice
that comes while the process starts (imports, loading the shards) ends it at once with a line on
stderr saying nothing was trained (exit 143, no result file); one that comes inside `train()`
before the loop's own handler is up is passed on to that handler as soon as it is; one that
comes after the loop ended lets the result be written and then says so. Every stop by a notice
ends with one line on stderr starting "trainwise.emulated_worker:".

The result file is written through a temp file with an unpredictable name
(`training.safe_files.write_atomic`): a fixed `.result.json.tmp` could be a planted link.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from trainwise.emulated_store import RESUME_FROM_STORE

REQUIRED_KEYS = ("shards_dir", "run_dir", "result_path", "resume_from", "train_config")
FAST_POLICY_KEY = "fast_policy"
# Optional: the region whose promoted fast champion is in charge of "heuristic" (the train job's
# rule, `trainwise.runs.fast_policy_in_charge`); absent: the heuristic itself.
REGION_KEY = "fast_policy_region"
CURRICULUM_KEY = "curriculum_dir"  # optional: the curriculum the run trains on (absent: all data)
RISK_KEY = "preemption_risk"
# Seconds the worker waits for its uploads before exiting (a local store takes milliseconds).
UPLOAD_DRAIN_S = 30.0
EXIT_SIGTERM = 128 + signal.SIGTERM  # the shell's code for "ended by SIGTERM"
EXIT_FOLDER_IN_USE = 3  # another trainer holds the run folder (no traceback: the message says it)
_PREFIX = "trainwise.emulated_worker:"
_FORWARD_POLL_S = 0.005  # how often a notice waiting for the loop's handler looks for it


class StoppedBeforeTraining(BaseException):
    """SIGTERM while the process started, before `train()` was called (a BaseException, so no
    `except Exception` on the way swallows it)."""


class SigtermOutsideTheLoop:
    """The worker's SIGTERM handler for the times the loop's own handler is not installed.

    Phases: "starting" (stop at once), "training" (inside `train()`: pass the notice on to the
    loop's handler once it is up), "finishing" (`train()` returned: let the result be written).
    `received_in` is the phase of the first notice, None when none came.
    """

    def __init__(self) -> None:
        self.phase = "starting"
        self.received_in: str | None = None
        self._train_returned = threading.Event()
        self._handler = self._handle  # one bound method, so getsignal() can be compared by `is`

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handler)

    def entering_train(self) -> None:
        self.phase = "training"

    def train_returned(self) -> None:
        self.phase = "finishing"
        self._train_returned.set()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = self.received_in is None
        if first:
            self.received_in = self.phase
        if self.phase == "starting":
            raise StoppedBeforeTraining
        if self.phase == "training" and first:
            threading.Thread(target=self._forward, name="sigterm-forward", daemon=True).start()

    def _forward(self) -> None:
        """Inside `train()` before its loop installed its handler: hand the loop the notice once
        it has (`training.loop.request_stop`; the loop then checkpoints and stops as usual). A
        loop that already ended never installs it again: `train()` returns, this thread ends."""
        while not self._train_returned.wait(_FORWARD_POLL_S):
            if signal.getsignal(signal.SIGTERM) is not self._handler:
                # The loop notes notices now: hand it this one directly (no signal to ourselves).
                from training.loop import request_stop

                request_stop("SIGTERM")
                return


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Unpredictable temp file in the same folder, fsync, rename: a reader never sees half a
    file, and a planted link at a temp name cannot redirect the write."""
    from training.safe_files import write_atomic

    write_atomic(Path(path), json.dumps(payload, indent=1).encode("utf-8"))


def notice_message(record: dict[str, Any], guard: SigtermOutsideTheLoop | None) -> str | None:
    """The line a stop by SIGTERM ends with (None: no notice, nothing to say)."""
    where = (f"status {record['status']} at step {record['steps']}, checkpoint "
             f"{record['checkpoint_path']}")
    if record["status"] == "preempted":
        return f"{_PREFIX} stopped by SIGTERM: {where}; run the job again to resume from it"
    if guard is not None and guard.received_in in ("training", "finishing"):
        return (f"{_PREFIX} SIGTERM received after the training loop had ended ({where}); "
                "nothing was lost and the result is written")
    return None


def job_fast_policy(job: dict[str, Any], config: Any = None, examples: Any = None) -> Any:
    """The job's fast policy (None = none), or a ValueError naming the key and the valid names.
    "goodput" is profiled on the job's model and data (`config`, `examples`)."""
    name = job.get(FAST_POLICY_KEY)
    if name is None:
        return None
    from trainwise.runs import FAST_POLICIES, fast_policy

    if not isinstance(name, str) or name not in FAST_POLICIES:
        raise ValueError(f"emulated worker job key {FAST_POLICY_KEY!r}={name!r} is not a fast "
                         f"policy; valid: {', '.join(FAST_POLICIES)} (or null for none)")
    if name == "goodput" and config is not None and examples is not None:
        from trainwise.goodput_lever import goodput_policy

        return goodput_policy(config, examples)[0]
    region = job.get(REGION_KEY)
    if region is not None:
        from trainwise.runs import fast_policy_in_charge

        return fast_policy_in_charge(name, str(region))[0]
    return fast_policy(name)


def job_preemption_risk(job: dict[str, Any]) -> float | None:
    """The job's preemption risk (None when the job gives none), checked as a probability."""
    risk = job.get(RISK_KEY)
    if risk is None:
        return None
    if isinstance(risk, bool) or not isinstance(risk, (int, float)) or not 0.0 <= risk <= 1.0:
        raise ValueError(f"emulated worker job key {RISK_KEY!r}={risk!r} must be a probability "
                         "in [0, 1] (or absent: 0.0)")
    return float(risk)


def feed_preemption_risk(run_dir: Path, risk: float, live_control_path: str = "") -> None:
    """Writes the risk where the loop reads it (the live-control file, at the first fast tick)."""
    from training.live_control import LIVE_CONTROL_FILE, read_live_control, write_live_control

    path = Path(live_control_path) if live_control_path else run_dir / LIVE_CONTROL_FILE
    run_dir.mkdir(parents=True, exist_ok=True)
    interval_s = None
    if path.exists():  # a live interval someone set stays: only the risk is the job's
        try:
            interval_s = read_live_control(path).checkpoint_interval_s
        except ValueError:
            interval_s = None  # a bad file is replaced by a good one
    write_live_control(path, checkpoint_interval_s=interval_s, preemption_risk=risk,
                       source="emulated_job",
                       reason=f"preemption risk {risk:.3f} given by the emulated job")


def run_job(job: dict[str, Any], guard: SigtermOutsideTheLoop | None = None) -> dict[str, Any]:
    """Trains as the job says; returns the result record (also written to `result_path`).
    `guard`: the SIGTERM handler `main` installed, told when `train()` starts and returns."""
    missing = [k for k in REQUIRED_KEYS if k not in job]
    if missing:
        raise ValueError(f"emulated worker job lacks {missing}; it needs {list(REQUIRED_KEYS)}")
    from training import loop, shards
    from training.model import GPTConfig

    examples = shards.load_shards(Path(job["shards_dir"]))
    curriculum = None
    if job.get(CURRICULUM_KEY):
        from training.curriculum import load_curriculum

        curriculum = load_curriculum(Path(job[CURRICULUM_KEY]))
    fields = dict(job["train_config"])
    if isinstance(fields.get("model"), dict):
        fields["model"] = GPTConfig(**fields["model"])
    config = loop.TrainConfig(**fields)
    # Bad names are refused before anything is loaded into the run folder.
    policy = job_fast_policy(job, config, examples)
    risk = job_preemption_risk(job)
    if risk is not None:
        feed_preemption_risk(Path(job["run_dir"]), risk, config.live_control_path)
    uploader, resume_from, restored_step = None, job["resume_from"], None
    if job.get("store_dir"):
        from trainwise.emulated_store import restore_from_store
        from trainwise.object_store import CheckpointUploader, LocalObjectStore

        store = LocalObjectStore(Path(job["store_dir"]))
        uploader = CheckpointUploader(store, job["store_key_prefix"])
        if resume_from == RESUME_FROM_STORE:
            point = restore_from_store(store, job["store_key_prefix"],
                                       Path(job["run_dir"]) / "checkpoints")
            resume_from = str(point.path) if point is not None else None
            restored_step = point.step if point is not None else None
    elif resume_from == RESUME_FROM_STORE:
        raise ValueError("job resumes from the store but names no store_dir")
    if guard is not None:
        guard.entering_train()
    try:
        result = loop.train(config, examples, curriculum, Path(job["run_dir"]),
                            resume_from=resume_from,
                            on_checkpoint=uploader.submit if uploader else None,
                            fast_policy=policy)
    finally:
        if guard is not None:
            guard.train_returned()
        report = uploader.drain(UPLOAD_DRAIN_S) if uploader else None
    record = {
        "pid": os.getpid(),
        "status": result.status,
        "run_id": result.run_id,
        "steps": result.steps,
        "final_eval_loss": result.final_eval_loss,
        "final_eval_accuracy": result.final_eval_accuracy,
        "tokens_seen": result.tokens_seen,
        "samples_seen": result.samples_seen,
        "trainer_cost_usd": result.cost_usd,  # the trainer's own estimate; the bill is the provider's
        "telemetry_dir": str(result.telemetry_dir),
        "checkpoint_path": str(result.checkpoint_path),
        "checkpoint_sha256": result.checkpoint_sha256,
        "elapsed_s": result.elapsed_s,
        "resumed_from": resume_from,
        "fast_policy": getattr(policy, "name", None),  # None: no fast policy (the loop's no-op)
        "fast_policy_requested": job.get(FAST_POLICY_KEY),
        "preemption_risk": risk,
        "restored_from_store_step": restored_step,
        "uploaded": report.uploaded if report else [],
        "upload_failed": report.failed if report else [],
    }
    write_json_atomic(Path(job["result_path"]), record)
    return record


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m trainwise.emulated_worker JOB.json", file=sys.stderr)
        return 2
    guard = SigtermOutsideTheLoop()
    guard.install()  # first: the imports in run_job take seconds
    try:
        job = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
        if job.get("block_sigterm"):
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        record = run_job(job, guard)
    except RuntimeError as error:
        from training.run_lock import RunFolderLockedError

        if not isinstance(error, RunFolderLockedError):
            raise
        print(f"{_PREFIX} {error}", file=sys.stderr)  # the message says whom and what to do
        return EXIT_FOLDER_IN_USE
    except StoppedBeforeTraining:
        print(f"{_PREFIX} SIGTERM received while starting (before training began): nothing was "
              "trained by this process and no result is written; run the job again to "
              "continue the run", file=sys.stderr)
        return EXIT_SIGTERM
    message = notice_message(record, guard)
    if message:
        print(message, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
