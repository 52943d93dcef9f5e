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
into this node's empty checkpoint folder first (`trainwise.emulated.restore_from_store`).

Fast layer: optional "fast_policy" (a name of `trainwise.runs.FAST_POLICIES`; absent or null =
no fast policy, the loop's no-op) is passed to `training.loop.train` as `trainwise.runs` does,
so the heuristic adapts the batch at fast ticks and answers the SIGTERM notice (checkpoint when
the measured save fits in the notice, migrate otherwise). The champion lookup of
`runs.fast_policy_in_charge` is not made: an emulated job has no region's champion. Optional
"preemption_risk" (a probability, default 0.0) reaches the fast policy's observation the way the
loop takes a risk: a live-control file (`training.live_control`, source "emulated_job") in the
run folder, read at the first fast tick.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

REQUIRED_KEYS = ("shards_dir", "run_dir", "result_path", "resume_from", "train_config")
FAST_POLICY_KEY = "fast_policy"
RISK_KEY = "preemption_risk"
RESUME_FROM_STORE = "store"
# Seconds the worker waits for its uploads before exiting (a local store takes milliseconds).
UPLOAD_DRAIN_S = 30.0


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """tmp file in the same folder, fsync, rename: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


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


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Trains as the job says; returns the result record (also written to `result_path`)."""
    missing = [k for k in REQUIRED_KEYS if k not in job]
    if missing:
        raise ValueError(f"emulated worker job lacks {missing}; it needs {list(REQUIRED_KEYS)}")
    from training import loop, shards
    from training.model import GPTConfig

    examples = shards.load_shards(Path(job["shards_dir"]))
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
        from trainwise.emulated import restore_from_store
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
    try:
        result = loop.train(config, examples, None, Path(job["run_dir"]), resume_from=resume_from,
                            on_checkpoint=uploader.submit if uploader else None,
                            fast_policy=policy)
    finally:
        report = uploader.drain(UPLOAD_DRAIN_S) if uploader else None
    record = {
        "pid": os.getpid(),
        "status": result.status,
        "run_id": result.run_id,
        "steps": result.steps,
        "final_eval_loss": result.final_eval_loss,
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
    job = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    if job.get("block_sigterm"):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    run_job(job)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
