"""Checkpoints that do not block training (CheckFreq, Mohan et al., FAST 2021).

A checkpoint has two phases:

1. snapshot (on the training thread, blocking): the state is copied in memory, tensors to new CPU
   tensors and arrays to new arrays, so training may change the live ones at once;
2. persist (on a background thread): serialise, write atomically with its manifest
   (`training.checkpoint.save_checkpoint`), call `on_checkpoint`, prune old checkpoints.

One persist at a time: a new snapshot first waits for the previous persist, so memory holds at
most one snapshot in flight and checkpoints become durable in step order. Checkpoints that end a
call (final, preemption, stop, telemetry failure, ...) are persisted synchronously: the call
returns only once they are durable.

Work a kill loses (issue 31, class 7), with interval checkpoints every k steps: the steps since
the newest *durable* checkpoint. While the save of step j is in flight training goes on, so the
durable one is still the save of step j - k; the save of step j + k first waits for the save of
step j. Hence a kill loses at most k + w steps, where w is the number of steps trained while the
newest save was in flight, and w <= k: at most 2k steps in all (`max_lost_steps`), reached by a
kill while the boundary j + k waits for the save of step j. "At most one interval" holds only for
synchronous checkpoints (`async_checkpoints=False`). With a live-tuned interval, k is the larger
of the last two intervals.

Before each write the persister asks `training.run_lock.check_folder_of` whether the run folder
is still the one this process locked; a folder removed or replaced meanwhile stops the run with
`RunFolderReplacedError`, not with a "free disk space" message. A failed write's message follows
its errno: only ENOSPC/EDQUOT say "free disk space".

The writer of telemetry is not thread safe, so the persist thread writes no event: the training
thread collects each finished persist (`poll` / `wait`) and records it.
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training import run_lock
from training.checkpoint import checkpoint_name, manifest_path, prune_checkpoints, save_checkpoint

_FULL_DISK = {errno.ENOSPC, errno.EDQUOT}


def max_lost_steps(interval_steps: int, *, asynchronous: bool) -> int:
    """The most steps a kill can lose with interval checkpoints every `interval_steps` (module
    docstring): one interval plus the steps trained while one background save was in flight."""
    if interval_steps < 1:
        raise ValueError(f"interval_steps={interval_steps} must be >= 1")
    return 2 * interval_steps if asynchronous else interval_steps


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint that is durable on local disk (payload and its commit manifest)."""

    path: Path
    manifest_path: Path
    step: int
    sha256: str
    reason: str


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, I/O error); names the file and the fix."""


@dataclass(frozen=True)
class PersistResult:
    info: CheckpointInfo
    size_bytes: int
    elapsed_s: float  # the run's elapsed seconds at the snapshot (what the checkpoint holds)
    blocking_s: float  # training thread blocked: waiting for the previous persist + snapshot
    snapshot_s: float  # copying the state in memory
    persist_s: float  # serialise + write + fsync + manifest (+ on_checkpoint, prune)
    asynchronous: bool


def snapshot_copy(value: Any, _memo: dict[tuple, torch.Tensor] | None = None) -> Any:
    """A deep copy of a checkpoint state that shares no memory with the live objects.

    Tensors become new CPU tensors; views of one storage with one layout (a tied weight appears
    under two names in a state dict) stay one tensor, so the file still stores it once.
    """
    memo = {} if _memo is None else _memo
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tensor.stride(), tensor.dtype, tensor.device)
        if key not in memo:
            memo[key] = tensor.to("cpu", copy=True)
        return memo[key]
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, dict):
        copied = type(value)((k, snapshot_copy(v, memo)) for k, v in value.items())
        if hasattr(value, "_metadata"):  # a module state dict's versions, read by load_state_dict
            copied._metadata = copy.deepcopy(value._metadata)  # type: ignore[attr-defined]
        return copied
    if isinstance(value, list):
        return [snapshot_copy(v, memo) for v in value]
    if isinstance(value, tuple):
        return tuple(snapshot_copy(v, memo) for v in value)
    if value is None or isinstance(value, (bool, int, float, str, bytes, np.generic)):
        return value  # immutable
    return copy.deepcopy(value)  # anything else must not be shared with the live run either


class CheckpointPersister:
    """Persists snapshots, one at a time, in the background (`submit`) or now (`persist_now`)."""

    def __init__(
        self,
        directory: Path,
        *,
        keep: int,
        on_checkpoint: Callable[[CheckpointInfo], None] | None = None,
    ) -> None:
        self.directory = directory
        self.keep = keep
        self.on_checkpoint = on_checkpoint
        self._thread: threading.Thread | None = None
        self._outcome: PersistResult | BaseException | None = None
        self._in_flight_step: int | None = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    @property
    def in_flight_step(self) -> int | None:
        """The step of the background save not collected yet (None when there is none)."""
        return self._in_flight_step if self._thread is not None else None

    def _fix(self, error: OSError) -> str:
        """What to do about a failed write, by its errno: a wrong "free disk space" sends a
        person after the wrong cause."""
        resume = f"then resume (resume_from={self.directory})"
        if error.errno in _FULL_DISK:
            return f"Free disk space on the file system of {self.directory}, {resume}"
        if error.errno == errno.ENOENT:
            return (f"a file or folder under {self.directory} disappeared during the write: "
                    "something else (a clean-up job, another process) is removing files in the "
                    f"run folder. Stop it, {resume}")
        if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return f"Make {self.directory} writable by this user, {resume}"
        return f"Fix the cause above (the device, the file system), {resume}"

    def _persist(self, state: dict[str, Any], *, step: int, reason: str, elapsed_s: float,
                 blocking_s: float, snapshot_s: float, asynchronous: bool) -> PersistResult:
        began = time.perf_counter()
        path = self.directory / checkpoint_name(step)
        # A folder removed or replaced since the lock was taken: writing would recreate it
        # (mkdir parents) under nobody's lock, or fail with a misleading errno.
        run_lock.check_folder_of(self.directory)
        try:
            sha256 = save_checkpoint(path, state)
        except OSError as error:
            run_lock.check_folder_of(self.directory)  # the likelier cause of an ENOENT
            raise CheckpointWriteError(
                error.errno,
                f"checkpoint {path} (step {step}, {reason}) could not be written ({error}); the "
                f"checkpoints already in {self.directory} are unchanged. "
                f"{self._fix(error)}",
            ) from error
        info = CheckpointInfo(path=path, manifest_path=manifest_path(path), step=step,
                              sha256=sha256, reason=reason)
        size_bytes = path.stat().st_size
        if self.on_checkpoint is not None:
            self.on_checkpoint(info)  # durable first, then announced (e.g. queued for upload)
        prune_checkpoints(self.directory, self.keep)
        return PersistResult(
            info=info, size_bytes=size_bytes, elapsed_s=elapsed_s, blocking_s=blocking_s,
            snapshot_s=snapshot_s, persist_s=time.perf_counter() - began,
            asynchronous=asynchronous,
        )

    def submit(self, state: dict[str, Any], *, step: int, reason: str, elapsed_s: float,
               blocking_s: float, snapshot_s: float) -> None:
        """Starts persisting a snapshot in the background; call `wait` first if one is in flight."""
        if self._thread is not None:
            raise RuntimeError("a checkpoint persist is in flight; wait() for it before submit()")

        def run() -> None:
            try:
                self._outcome = self._persist(
                    state, step=step, reason=reason, elapsed_s=elapsed_s, blocking_s=blocking_s,
                    snapshot_s=snapshot_s, asynchronous=True,
                )
            except BaseException as error:  # handed to the training thread by poll/wait
                self._outcome = error

        # Not a daemon: an interpreter that exits still finishes the write it started.
        self._thread = threading.Thread(target=run, name=f"checkpoint-persist-{step}")
        self._in_flight_step = step
        self._thread.start()

    def persist_now(self, state: dict[str, Any], *, step: int, reason: str, elapsed_s: float,
                    blocking_s: float, snapshot_s: float) -> PersistResult:
        """Persists on the calling thread; the previous persist must have been collected."""
        if self._thread is not None:
            raise RuntimeError("a checkpoint persist is in flight; wait() for it first")
        began = time.perf_counter()
        result = self._persist(state, step=step, reason=reason, elapsed_s=elapsed_s,
                               blocking_s=blocking_s, snapshot_s=snapshot_s, asynchronous=False)
        # Synchronous: the training thread was blocked for the persist too.
        return dataclasses.replace(result, blocking_s=blocking_s + time.perf_counter() - began)

    def poll(self) -> PersistResult | None:
        """The finished persist's result (once), None while it runs or when none was started.
        Raises the persist's error on the training thread."""
        if self._thread is None or self._thread.is_alive():
            return None
        return self._collect()

    def wait(self) -> PersistResult | None:
        """Blocks until the in-flight persist (if any) is durable; returns it like `poll`."""
        if self._thread is None:
            return None
        self._thread.join()
        return self._collect()

    def _collect(self) -> PersistResult:
        assert self._thread is not None
        self._thread.join()
        outcome, self._outcome, self._thread = self._outcome, None, None
        if isinstance(outcome, BaseException):
            raise outcome
        assert outcome is not None
        return outcome

