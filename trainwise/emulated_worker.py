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
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

REQUIRED_KEYS = ("shards_dir", "run_dir", "result_path", "resume_from", "train_config")
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
                            on_checkpoint=uploader.submit if uploader else None)
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
