"""One rank's checkpoints, step by step: what a resume of several ranks agrees on.

A single process resumes from its newest good checkpoint (`Run._own_resume`). Ranks resume from
the newest step that *every* rank holds (`trainwise.sdk.ranks.agree_on_step`), so each rank
needs its checkpoints by step: the steps it holds (`held_steps`: local files with their
manifest, and commit markers in the object store), one step's verified state (`load_step`: the
local file, else the store's committed copy, checked as any resume checks it), and the removal
of its local checkpoints past the step the ranks agreed on (`drop_local_after`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from training import checkpoint as ckpt
from training._checkpoint_trust import RunIdentity

SDK_FORMAT = "trainwise-sdk/1"
_STEP_FILE = re.compile(r"^step-(\d{7})\.pt$")
_COMMIT_SUFFIX = ".pt.commit"


def store_prefix(key_prefix: str, rank: int) -> str:
    return f"{key_prefix}/rank{rank}"


def _local_steps(folder: Path) -> dict[int, Path]:
    if not folder.is_dir():
        return {}
    found = {}
    for path in folder.iterdir():
        match = _STEP_FILE.match(path.name)
        if match and ckpt.manifest_path(path).is_file():
            found[int(match.group(1))] = path
    return found


def store_steps(store: Any, prefix: str) -> set[int]:
    """The steps with a commit marker under `prefix` (not verified: `load_step` does that)."""
    if store is None:
        return set()
    return {int(key.rsplit("step-", 1)[1][:7]) for key in store.list_keys(prefix)
            if key.endswith(_COMMIT_SUFFIX)}


def held_steps(folder: Path, store: Any, prefix: str) -> set[int]:
    return set(_local_steps(folder)) | store_steps(store, prefix)


class _OneCommit:
    """The store, listing one commit marker only: `latest_committed_checkpoint` over it fetches
    and verifies exactly that step (sha256 and size against the marker, then the manifest)."""

    def __init__(self, store: Any, commit_key: str) -> None:
        self._store, self._commit_key = store, commit_key

    def list_keys(self, prefix: str) -> list[str]:
        return [self._commit_key]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def _fetch(step: int, folder: Path, store: Any, prefix: str) -> bool:
    from trainwise.object_store import COMMIT_SUFFIX, latest_committed_checkpoint

    if store is None:
        return False
    commit_key = f"{prefix}/{ckpt.checkpoint_name(step)}{COMMIT_SUFFIX}"
    if not store.exists(commit_key):
        return False
    return latest_committed_checkpoint(_OneCommit(store, commit_key), prefix, folder) is not None


def _verified(path: Path, identity: RunIdentity) -> dict[str, Any] | None:
    try:
        if ckpt.fork_problem(path) is not None:
            return None
        return {"path": path, "state": ckpt.load_checkpoint(path, identity=identity)}
    except (ValueError, OSError):  # CheckpointError is a ValueError: a bad file is no resume
        return None


def load_step(step: int, folder: Path, store: Any, prefix: str,
              identity: RunIdentity) -> dict[str, Any] | None:
    """{"path", "state"} of this rank's checkpoint of `step` that passes the resume's checks:
    the local file, else the store's committed copy downloaded beside it; None when neither."""
    path = folder / ckpt.checkpoint_name(step)
    if path.is_file():
        found = _verified(path, identity)
        if found is not None:
            return found
    if _fetch(step, folder, store, prefix):
        return _verified(path, identity)
    return None


def drop_local_after(folder: Path, step: int) -> list[Path]:
    """Deletes this rank's local checkpoints of steps after `step` (manifest first, as pruning
    does): a history the other ranks never reached, which the resume abandoned. Kept, they would
    count among the newest `keep_checkpoints` and prune the new history's checkpoints."""
    dropped = []
    for found, path in sorted(_local_steps(folder).items()):
        if found > step:
            ckpt.manifest_path(path).unlink(missing_ok=True)
            path.unlink(missing_ok=True)
            dropped.append(path)
    return dropped


def resume_problem(found: dict[str, Any] | None, world_size: int) -> str | None:
    """Why the checkpoint `found` cannot resume this run (None when it can, or there is none)."""
    if found is None:
        return None
    state, path = found["state"], found["path"]
    if state.get("format") != SDK_FORMAT:
        return (f"checkpoint {path} was not written by trainwise.sdk; start a new run (another "
                "run_id) for an SDK job")
    written_by = int(state.get("world_size", 1))  # checkpoints before ranks agreed: one rank
    if written_by != world_size:
        return (f"checkpoint {path} was written by a run of {written_by} rank(s), and this run "
                f"has world_size {world_size}: each rank resumes its own rank's state, so "
                f"resume with {written_by} rank(s) (torchrun --nproc-per-node/--nnodes), or "
                "start a new run (another run_id)")
    return None
