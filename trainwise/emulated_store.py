"""A replacement node of the emulated cloud (whose disk is new) restores the run's newest committed
checkpoint from the object store (`restore_from_store`); `trainwise/emulated.py` re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

# A trainer job's "resume_from" meaning: restore the store's newest committed checkpoint first.
RESUME_FROM_STORE = "store"


@dataclass(frozen=True)
class RestorePoint:
    """Where a replacement node resumes: a committed checkpoint in its local folder."""

    path: Path
    step: int
    source: str  # "store" (downloaded) or "local" (the folder already held it, or a newer one)
    skipped: tuple[tuple[str, str], ...] = ()  # newer store checkpoints that failed to verify


def restore_from_store(store: Any, key_prefix: str, checkpoints_dir: str | Path
                       ) -> RestorePoint | None:
    """Bring the store's newest committed checkpoint under `key_prefix` into `checkpoints_dir`
    (a node's local checkpoint folder, empty on a replacement node) unless the folder already
    holds a good checkpoint at least as new. None: nothing to resume from (start fresh).

    The download is verified against the commit marker (sha256, bytes) and lands payload first,
    manifest last, so `training.checkpoint.latest_good_checkpoint` (and `runs.is_resumable`)
    see it as any local checkpoint. `trainwise/runs.py` can call this before `_resume_point`
    with `checkpoints/<partition>/<run_id>` (the uploader's prefix) and `run_dir/checkpoints`.
    """
    from training.checkpoint import latest_good_checkpoint
    from trainwise.object_store import latest_committed_checkpoint

    folder = Path(checkpoints_dir)
    local = latest_good_checkpoint(folder) if folder.is_dir() else None
    folder.mkdir(parents=True, exist_ok=True)
    stored = latest_committed_checkpoint(store, key_prefix, folder)
    skipped = tuple(stored.skipped) if stored is not None else ()
    if local is not None and (stored is None or local.step >= stored.step):
        return RestorePoint(Path(local.path), int(local.step), "local", skipped)
    if stored is None:
        return None
    return RestorePoint(stored.path, stored.step, "store", skipped)
