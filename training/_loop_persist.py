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

The writer of telemetry is not thread safe, so the persist thread writes no event: the training
thread collects each finished persist (`poll` / `wait`) and records it.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training.checkpoint import checkpoint_name, manifest_path, prune_checkpoints, save_checkpoint


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

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def _persist(self, state: dict[str, Any], *, step: int, reason: str, elapsed_s: float,
                 blocking_s: float, snapshot_s: float, asynchronous: bool) -> PersistResult:
        began = time.perf_counter()
        path = self.directory / checkpoint_name(step)
        try:
            sha256 = save_checkpoint(path, state)
        except OSError as error:
            raise CheckpointWriteError(
                error.errno,
                f"checkpoint {path} (step {step}, {reason}) could not be written ({error}); the "
                f"checkpoints already in {self.directory} are unchanged. Free disk space or fix "
                f"the device, then resume (resume_from={self.directory})",
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

