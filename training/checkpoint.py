"""Checkpoints: one self-describing file, written atomically, with an embedded sha256.

File format: one header line `TRAINWISE-CHECKPOINT 1 sha256=<hex> bytes=<n>\\n`, then the
`torch.save` payload. The checksum lives inside the file rather than in a sidecar written after
it: with a sidecar, a process killed between the two renames leaves a valid checkpoint beside a
stale checksum, and the resume after a spot preemption (exactly when that kill happens) would
refuse a good file. One `os.replace` makes the new checkpoint and its checksum appear together.

The state is a plain dict (see `training.loop` for its keys): model and optimizer state dicts,
torch/numpy/python RNG states, step, sampler state, curriculum version, data fingerprint, model
kind + config + fingerprint, train config, tokens seen, cost so far, elapsed seconds. Configs are
stored as dicts, not dataclass objects, so a checkpoint does not depend on class pickles.

Loading uses `torch.load(weights_only=False)`: the numpy and python RNG states are numpy arrays
and tuples that the weights-only unpickler refuses. That is safe for our own files because the
sha256 is checked before unpickling; it protects against corruption, not against a forged file,
so never load a checkpoint from an untrusted source.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from pathlib import Path
from typing import Any

import torch

MAGIC = b"TRAINWISE-CHECKPOINT"
FORMAT_VERSION = 1
_HEADER = re.compile(rb"^TRAINWISE-CHECKPOINT (\d+) sha256=([0-9a-f]{64}) bytes=(\d+)\n$")
_STEP_FILE = re.compile(r"^step-(\d{7})\.pt$")


class CheckpointError(ValueError):
    """A checkpoint cannot be used; the message names the file and the fix."""


class CheckpointCorruptError(CheckpointError):
    pass


class CheckpointMismatchError(CheckpointError):
    pass


def checkpoint_name(step: int) -> str:
    return f"step-{step:07d}.pt"


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> str:
    """Writes `state` to `path` atomically (tmp in the same folder, fsync, os.replace).

    Returns the sha256 of the payload (the same value `read_checksum` reports).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    checksum = hashlib.sha256(payload).hexdigest()
    header = b"%s %d sha256=%s bytes=%d\n" % (
        MAGIC, FORMAT_VERSION, checksum.encode(), len(payload)
    )
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(header)
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    # fsync the folder so the rename itself survives a machine crash.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return checksum


def _read_header(path: Path, handle: Any) -> tuple[str, int]:
    line = handle.readline(256)
    match = _HEADER.match(line)
    if not match:
        raise CheckpointCorruptError(
            f"{path} is not a trainwise checkpoint (no valid header); pass a file written by "
            "training.checkpoint.save_checkpoint"
        )
    if int(match.group(1)) != FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"{path} has checkpoint format {int(match.group(1))}, this trainwise reads "
            f"{FORMAT_VERSION}; resume with the trainwise version that wrote it or start fresh"
        )
    return match.group(2).decode(), int(match.group(3))


def read_checksum(path: str | Path) -> str:
    """The sha256 recorded in a checkpoint's header (not verified; `load_checkpoint` verifies)."""
    path = Path(path)
    with open(path, "rb") as handle:
        return _read_header(path, handle)[0]


def load_checkpoint(
    path: str | Path,
    *,
    expected_model_fingerprint: str | None = None,
    expected_model_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Reads and verifies a checkpoint; refuses one written for another model config.

    Raises FileNotFoundError, CheckpointCorruptError (bad header, truncated, checksum mismatch)
    or CheckpointMismatchError (model fingerprint differs; the message shows both configs).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint {path} does not exist; pass an existing checkpoint file"
        )
    with open(path, "rb") as handle:
        checksum, size = _read_header(path, handle)
        payload = handle.read()
    if len(payload) != size:
        raise CheckpointCorruptError(
            f"{path} is truncated ({len(payload)} of {size} payload bytes); resume from an "
            "earlier checkpoint or start fresh"
        )
    actual = hashlib.sha256(payload).hexdigest()
    if actual != checksum:
        raise CheckpointCorruptError(
            f"{path} fails its checksum (header sha256 {checksum[:12]}..., content "
            f"{actual[:12]}...): the file is corrupt; resume from an earlier checkpoint or "
            "start fresh"
        )
    # weights_only=False: see the module docstring (own files, checksum verified first).
    state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)
    if expected_model_fingerprint is not None:
        found = state.get("model_fingerprint")
        if found != expected_model_fingerprint:
            raise CheckpointMismatchError(
                f"checkpoint {path} was written for model {state.get('model_kind')!r} with config "
                f"{state.get('model_config')} (fingerprint {str(found)[:12]}), but this run builds "
                f"config {expected_model_config if expected_model_config is not None else '?'} "
                f"(fingerprint {expected_model_fingerprint[:12]}); start fresh (no resume_from) or "
                "resume with the model config the checkpoint was written with"
            )
    return state


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The highest-step `step-NNNNNNN.pt` in a folder, or None."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    steps = [p for p in directory.iterdir() if _STEP_FILE.match(p.name)]
    return max(steps, key=lambda p: p.name) if steps else None


def prune_checkpoints(directory: str | Path, keep: int) -> list[Path]:
    """Deletes all but the `keep` newest step checkpoints; returns what it deleted."""
    if keep < 1:
        raise ValueError(f"keep={keep} must be >= 1 (the newest checkpoint is always kept)")
    directory = Path(directory)
    steps = sorted(p for p in directory.iterdir() if _STEP_FILE.match(p.name))
    doomed = steps[:-keep]
    for path in doomed:
        path.unlink()
    return doomed
