"""Checkpoints: a payload file plus a detached commit manifest, verified before it is read.

On disk, per checkpoint (format 2):

  step-NNNNNNN.pt                  the `torch.save` payload (tensors and plain data only)
  step-NNNNNNN.pt.manifest.json    {"format", "version", "payload", "step", "sha256", "bytes", ...}

`save_checkpoint` writes the payload atomically (tmp in the same folder, fsync, `os.replace`),
THEN the manifest the same way, then fsyncs the folder. The manifest is the commit: a `.pt`
without its manifest is uncommitted (its writer was killed between the two renames) and is never
loaded; the `.tmp-PID` files of a writer killed earlier are removed by `clean_orphaned_temp_files`.

Why the manifest is detached. Format 1 kept the sha256 in a header inside the payload file and
loaded with `torch.load(weights_only=False)`: a crafted `step-*.pt` declared the checksum of its
own content, passed the check and ran arbitrary code while being unpickled. Now:
- `load_checkpoint` reads the manifest, checks size and sha256 of the payload BEFORE any
  deserialisation, then loads with `torch.load(weights_only=True)` and no extra allow-list: an
  attacker who writes both a payload and a matching manifest still cannot make the load run code
  (the weights-only unpickler refuses every global outside torch's tensor/plain-data set), and
  the refusal is a `CheckpointCorruptError` naming the file.
- Format 1 chose an embedded checksum because a sidecar written after the file could leave a
  stale checksum beside a good file when the writer was killed between the two renames. That
  needed the file to be replaced in place; the loop writes per-step names, so a new checkpoint
  never replaces a committed one: a kill between the renames leaves a new, uncommitted `.pt`
  beside the previous committed checkpoint, which `latest_good_checkpoint` resumes from. (An
  explicit rewrite of the same name that is killed between the renames leaves a payload that
  fails its manifest's digest: refused, never loaded.)
- The state must be tensors, dicts, lists, tuples, sets, str, bytes, int, float, bool and None:
  `save_checkpoint` refuses anything else (a numpy array, a dataclass) with a `TypeError` naming
  the key, instead of writing a file that cannot be loaded. `to_checkpoint_types` converts numpy
  arrays to tensors and numpy scalars to Python numbers; `arrays_from_tensors` converts back.

Format-1 files (the `TRAINWISE-CHECKPOINT 1` header) are refused with an error saying they
predate the safe format: loading them would need an unverified, unrestricted unpickle.

The state is a plain dict (see `training._loop_state.build_state` for its keys): model and
optimizer state dicts, torch/numpy/python RNG states, step, sampler state, curriculum version,
data fingerprint, model kind + config + fingerprint, train config, tokens seen, cost so far,
elapsed seconds.

Around the files: `latest_good_checkpoint` picks the newest checkpoint of a folder that passes
every check and lists what it skipped and why (a corrupt newest file falls back to the previous
one: that is why the loop keeps two); `clean_orphaned_temp_files` removes the temp files of
killed writers; `prune_checkpoints` removes old payloads with their manifests.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT_VERSION = 2
MANIFEST_FORMAT = "trainwise-checkpoint-manifest"
MANIFEST_SUFFIX = ".manifest.json"
LEGACY_MAGIC = b"TRAINWISE-CHECKPOINT"  # the header of format-1 files
MAX_MANIFEST_BYTES = 64 * 1024  # a manifest is ~300 bytes; refuse to read a huge one
_STEP_FILE = re.compile(r"^step-(\d{7})\.pt$")
_STEP_MANIFEST = re.compile(r"^step-(\d{7})\.pt\.manifest\.json$")
# `_write_atomic` temp names: `.<name>.tmp-<pid>` for payloads (`.step-0000008.pt.tmp-123`) and
# manifests (`.step-0000008.pt.manifest.json.tmp-123`).
_TEMP_FILE = re.compile(r"^\..+\.pt(\.manifest\.json)?\.tmp-\d+$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# What a weights-only load rebuilds without an allow-list (torch adds dtypes, devices, Size, ...).
_PLAIN_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.Tensor, torch.dtype,
                 torch.device, torch.Size)


class CheckpointError(ValueError):
    """A checkpoint cannot be used; the message names the file and the fix."""


class CheckpointCorruptError(CheckpointError):
    pass


class CheckpointMismatchError(CheckpointError):
    pass


@dataclass(frozen=True)
class GoodCheckpoint:
    """The newest checkpoint of a folder that passed every check, and the newer ones skipped."""

    path: Path
    step: int
    sha256: str
    skipped: list[tuple[Path, str]] = field(default_factory=list)  # (file, why), newest first


def checkpoint_name(step: int) -> str:
    return f"step-{step:07d}.pt"


def manifest_path(checkpoint_path: str | Path) -> Path:
    """`step-NNNNNNN.pt` -> `step-NNNNNNN.pt.manifest.json` (same folder)."""
    checkpoint_path = Path(checkpoint_path)
    return checkpoint_path.with_name(checkpoint_path.name + MANIFEST_SUFFIX)


# -- plain data ----------------------------------------------------------------------------------
def to_checkpoint_types(value: Any) -> Any:
    """A copy of `value` that a weights-only load can rebuild: numpy arrays become tensors of
    the same dtype (bit-exact), numpy scalars Python numbers, paths strings; containers are rebuilt, tensors
    and plain values are kept as they are. Raises TypeError for other objects."""
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise TypeError(f"numpy array of dtype {value.dtype} cannot go into a checkpoint")
        return torch.from_numpy(np.array(value, copy=True, order="C"))
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {key: to_checkpoint_types(item) for key, item in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return type(value)(to_checkpoint_types(item) for item in value)
    if isinstance(value, _PLAIN_LEAVES):
        return value
    if isinstance(value, os.PathLike):  # a path in a config record: stored as its string
        return os.fspath(value)
    raise TypeError(f"a {type(value).__module__}.{type(value).__qualname__} cannot go into a "
                    "checkpoint (tensors and plain data only); store it as a dict of those")


def arrays_from_tensors(value: Any) -> Any:
    """The inverse of `to_checkpoint_types` for a subtree that held numpy arrays: tensors become
    numpy arrays of the same dtype; containers are rebuilt."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy().copy()
    if isinstance(value, Mapping):
        return {key: arrays_from_tensors(item) for key, item in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return type(value)(arrays_from_tensors(item) for item in value)
    return value


def check_checkpoint_types(value: Any, where: str = "state") -> None:
    """TypeError naming the key (`state['sampler']['order']`) of the first value a weights-only
    load would refuse."""
    if isinstance(value, _PLAIN_LEAVES):
        return
    if isinstance(value, dict):  # OrderedDict (model.state_dict()) included
        for key, item in value.items():
            if not isinstance(key, str | int | float | bool | type(None)):
                raise TypeError(f"{where} has a key of type {type(key).__name__}; use str or "
                                "int keys in a checkpoint")
            check_checkpoint_types(item, f"{where}[{key!r}]")
        return
    if isinstance(value, list | tuple | set | frozenset):
        for index, item in enumerate(value):
            check_checkpoint_types(item, f"{where}[{index}]")
        return
    raise TypeError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which a weights-only "
        "load refuses; a checkpoint holds tensors and plain data only: convert it with "
        "training.checkpoint.to_checkpoint_types (numpy) or store it as a dict"
    )


# -- writing -------------------------------------------------------------------------------------
def _fsync_folder(folder: Path) -> None:
    # fsync the folder so a rename itself survives a machine crash (and in order).
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _write_atomic(path: Path, data: bytes, *, sync_folder: bool = True) -> None:
    """tmp in the same folder, fsync, os.replace, then (by default) fsync of the folder."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    if sync_folder:
        _fsync_folder(path.parent)


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> str:
    """Writes `state` to `path` atomically, then commits it with its manifest (module docstring).

    Raises TypeError (before writing anything) if `state` holds an object a weights-only load
    would refuse. Returns the sha256 of the payload (the one in the manifest).
    """
    path = Path(path)
    check_checkpoint_types(state)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    checksum = hashlib.sha256(payload).hexdigest()
    step = state.get("step")
    match = _STEP_FILE.match(path.name)
    if not isinstance(step, int) or isinstance(step, bool):
        step = int(match.group(1)) if match else None
    manifest = {
        "format": MANIFEST_FORMAT, "version": FORMAT_VERSION, "payload": path.name,
        "step": step, "sha256": checksum, "bytes": len(payload),
        "torch_version": torch.__version__, "written_unix_s": round(time.time(), 3),
    }
    try:
        _write_committed(path, payload, manifest)
    except OSError as error:
        if error.errno is None:
            raise
        # Same errno (so ENOSPC stays ENOSPC), but naming the checkpoint and the fix.
        raise OSError(
            error.errno, f"{error.strerror}: cannot write checkpoint {path} (free space in, or "
            f"fix the permissions of, {path.parent}); earlier checkpoints are unchanged",
            str(path),
        ) from error
    return checksum


def _write_committed(path: Path, payload: bytes, manifest: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # 1: the payload, uncommitted until step 2. Its folder is fsynced once, after step 2: a
    # machine crash before that may keep the manifest's rename and lose the payload's, which
    # reads as "manifest without payload" (skipped, never loaded), so one folder fsync suffices.
    _write_atomic(path, payload, sync_folder=False)
    # 2: the commit.
    _write_atomic(manifest_path(path),
                  (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())


# -- reading -------------------------------------------------------------------------------------
def _fix(path: Path) -> str:
    return (f"resume from an earlier checkpoint (pass the folder {path.parent} to resume from "
            "the newest good one) or start fresh")


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The commit manifest of checkpoint `path`, validated (fields and types), payload unread.

    Raises CheckpointCorruptError if it is missing (uncommitted or format-1 file), unreadable or
    malformed.
    """
    path = Path(path)
    manifest_file = manifest_path(path)
    if not manifest_file.is_file():
        with open(path, "rb") as handle:
            head = handle.read(len(LEGACY_MAGIC))
        if head == LEGACY_MAGIC:
            raise CheckpointCorruptError(
                f"{path} is a format-1 checkpoint, which predates the safe checkpoint format "
                "(verified manifest, weights-only load): this trainwise will not unpickle it "
                "unverified; start fresh (no resume_from)"
            )
        raise CheckpointCorruptError(
            f"{path} has no commit manifest {manifest_file.name}: it is uncommitted (its writer "
            "was killed before committing it) or was not written by "
            f"training.checkpoint.save_checkpoint, and is never loaded; {_fix(path)}"
        )
    try:
        with open(manifest_file, "rb") as handle:
            raw = handle.read(MAX_MANIFEST_BYTES + 1)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ValueError(f"over {MAX_MANIFEST_BYTES} bytes")
        manifest = json.loads(raw.decode("utf-8"))
        if not isinstance(manifest, dict):
            raise ValueError(f"a JSON {type(manifest).__name__}, not an object")
    except (ValueError, UnicodeDecodeError) as error:
        raise CheckpointCorruptError(
            f"commit manifest {manifest_file} is unreadable ({error}); {_fix(path)}"
        ) from None
    if manifest.get("format") != MANIFEST_FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"commit manifest {manifest_file} is format {manifest.get('format')!r} version "
            f"{manifest.get('version')!r}, this trainwise reads {MANIFEST_FORMAT!r} version "
            f"{FORMAT_VERSION}; resume with the trainwise version that wrote it or start fresh"
        )
    checksum, size, step = manifest.get("sha256"), manifest.get("bytes"), manifest.get("step")
    if not isinstance(checksum, str) or not _SHA256.match(checksum) \
            or not isinstance(size, int) or isinstance(size, bool) or size < 0 \
            or not (step is None or (isinstance(step, int) and not isinstance(step, bool))):
        raise CheckpointCorruptError(
            f"commit manifest {manifest_file} has an invalid sha256, bytes or step "
            f"({str(checksum)[:70]!r}, {size!r}, {step!r}); {_fix(path)}"
        )
    return manifest


def read_checksum(path: str | Path) -> str:
    """The sha256 recorded in a checkpoint's manifest (not verified; `load_checkpoint` verifies)."""
    return read_manifest(path)["sha256"]


def _verified_payload(path: Path) -> tuple[bytes, dict[str, Any]]:
    """The payload bytes, after the manifest's size and sha256 matched; nothing deserialised."""
    if path.is_dir():
        raise FileNotFoundError(
            f"checkpoint {path} is a folder; pass a step-NNNNNNN.pt file, or use "
            "training.checkpoint.latest_good_checkpoint(folder) to pick the newest good one"
        )
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint {path} does not exist; pass an existing checkpoint file"
        )
    manifest = read_manifest(path)
    with open(path, "rb") as handle:
        payload = handle.read(manifest["bytes"] + 1)  # one more: detects a longer file
    if len(payload) < manifest["bytes"]:
        raise CheckpointCorruptError(
            f"{path} is truncated ({len(payload)} of {manifest['bytes']} payload bytes); "
            f"{_fix(path)}"
        )
    if len(payload) > manifest["bytes"]:
        raise CheckpointCorruptError(
            f"{path} is longer than the {manifest['bytes']} bytes its manifest commits: it was "
            f"changed after it was committed; {_fix(path)}"
        )
    actual = hashlib.sha256(payload).hexdigest()
    if actual != manifest["sha256"]:
        raise CheckpointCorruptError(
            f"{path} fails its checksum (manifest sha256 {manifest['sha256'][:12]}..., content "
            f"{actual[:12]}...): the file is corrupt, was changed after it was committed, or a "
            f"rewrite of it was interrupted; {_fix(path)}"
        )
    return payload, manifest


def _deserialize(path: Path, payload: bytes) -> dict[str, Any]:
    """Weights-only load, no extra allow-list: plain data and tensors, never code."""
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        reason = str(error).strip().splitlines()[0][:300] if str(error).strip() else "refused"
        raise CheckpointCorruptError(
            f"{path} holds objects a weights-only load refuses ({reason}); it was NOT "
            "deserialised. trainwise checkpoints hold tensors and plain data only, so this file "
            "was not written by training.checkpoint.save_checkpoint (or was forged together "
            f"with its manifest): never load checkpoints from an untrusted source; {_fix(path)}"
        ) from None
    except (RuntimeError, EOFError, ValueError, OSError) as error:
        raise CheckpointCorruptError(
            f"{path} is not a readable torch file ({type(error).__name__}: "
            f"{str(error)[:200]}); {_fix(path)}"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointCorruptError(
            f"{path} holds a {type(state).__name__}, not a checkpoint state dict; {_fix(path)}"
        )
    return state


def load_checkpoint(
    path: str | Path,
    *,
    expected_model_fingerprint: str | None = None,
    expected_model_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Verifies a checkpoint against its manifest, then loads it weights-only; refuses one
    written for another model config.

    Raises FileNotFoundError, CheckpointCorruptError (no manifest, format 1, truncated, checksum
    mismatch, refused by the weights-only load) or CheckpointMismatchError (model fingerprint
    differs; the message shows both configs).
    """
    path = Path(path)
    payload, _ = _verified_payload(path)
    state = _deserialize(path, payload)
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


# -- folders -------------------------------------------------------------------------------------
def _steps_in(directory: Path) -> dict[int, Path]:
    """step -> payload path, for every step that has a payload or a manifest."""
    steps: dict[int, Path] = {}
    for entry in directory.iterdir():
        match = _STEP_FILE.match(entry.name) or _STEP_MANIFEST.match(entry.name)
        if match:
            steps[int(match.group(1))] = directory / checkpoint_name(int(match.group(1)))
    return steps


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The highest-step committed `step-NNNNNNN.pt` (payload + manifest) in a folder, or None.
    Not verified: see `latest_good_checkpoint`."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    committed = [path for _, path in sorted(_steps_in(directory).items())
                 if path.is_file() and manifest_path(path).is_file()]
    return committed[-1] if committed else None


def latest_good_checkpoint(directory: str | Path) -> GoodCheckpoint | None:
    """The newest checkpoint of `directory` that passes every check of `load_checkpoint`
    (manifest, size, sha256, weights-only load), trying newest first; None if none passes.

    `skipped` lists each newer file that failed and why, so the caller can say it fell back.
    Loads each candidate once (a verified checkpoint is loaded again by the caller: resumes are
    rare, and a forged file that passes the digest must not stop the fallback).
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None
    skipped: list[tuple[Path, str]] = []
    for step, path in sorted(_steps_in(directory).items(), reverse=True):
        if not path.is_file():
            skipped.append((path, f"{path} is missing but its manifest exists (deleted after "
                                  "it was committed)"))
            continue
        try:
            payload, manifest = _verified_payload(path)
            _deserialize(path, payload)
        except (CheckpointError, OSError) as error:
            skipped.append((path, str(error)))
            continue
        found_step = manifest["step"] if manifest["step"] is not None else step
        return GoodCheckpoint(path=path, step=found_step, sha256=manifest["sha256"],
                              skipped=skipped)
    return None


def clean_orphaned_temp_files(directory: str | Path) -> list[Path]:
    """Removes the temp files (`.step-NNNNNNN.pt.tmp-PID`, `.step-NNNNNNN.pt.manifest.json.tmp-PID`)
    that writers killed mid-save left behind; returns what it removed.

    Call it only while holding the run folder's lock (`training.run_lock`): then no live writer
    owns one of these files.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for entry in sorted(directory.iterdir()):
        if _TEMP_FILE.match(entry.name) and (entry.is_file() or entry.is_symlink()):
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def prune_checkpoints(directory: str | Path, keep: int) -> list[Path]:
    """Keeps the `keep` newest committed checkpoints; deletes older ones (manifest first, so a
    kill midway leaves an uncommitted payload, never a manifest that commits a missing file),
    and uncommitted payloads older than the oldest kept one. Returns the deleted payloads."""
    if keep < 1:
        raise ValueError(f"keep={keep} must be >= 1 (the newest checkpoint is always kept)")
    directory = Path(directory)
    steps = sorted(_steps_in(directory).items())
    committed = [step for step, path in steps
                 if path.is_file() and manifest_path(path).is_file()]
    if len(committed) < keep:
        return []
    oldest_kept = committed[-keep]
    deleted = []
    for step, path in steps:
        if step >= oldest_kept:
            break
        manifest_path(path).unlink(missing_ok=True)
        if path.is_file():
            path.unlink()
            deleted.append(path)
    return deleted
