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
elapsed seconds, lineage.

Around the files: `latest_good_checkpoint` picks the newest checkpoint of a folder that passes
every check and lists what it skipped and why (a corrupt newest file falls back to the previous
one: that is why the loop keeps two); `clean_orphaned_temp_files` removes the temp files of
killed writers; `prune_checkpoints` removes old payloads with their manifests.

Hostile files (issue 31). Every file of the folder is read bounded: a manifest of at most
`MAX_MANIFEST_BYTES` and `MAX_JSON_DEPTH` levels (checked before parsing), a payload whose size
the manifest commits is compared with the file's own size (fstat) BEFORE anything is read and
may not exceed `max_payload_bytes()` (half this machine's memory: a larger one could not be
loaded anyway). Payloads and manifests are opened with O_NOFOLLOW and must be regular files: a
symlink (to another run's checkpoint, to /dev/zero, anywhere) is refused, not followed. The
checkpoint FOLDER itself is taken as given (an operator may put it on another disk). Every
failure is a `CheckpointError` naming the file; `latest_good_checkpoint` turns any exception a
candidate raises (but MemoryError, which the bounds prevent, and KeyboardInterrupt/SystemExit)
into a skip with its reason, so one hostile file never stops the fallback. Temp files are
`.<name>.tmp-<pid>-<16 random hex>`, created with O_CREAT|O_EXCL|O_NOFOLLOW: a link planted
under a predictable name cannot redirect a write.

Origin (issue 31: a checksum proves integrity, not origin). Each manifest carries a `binding`
and an `hmac` (see `training._checkpoint_trust`):
  binding = {run_id, lineage, parent_step, parent_sha256, data_fingerprint, model_fingerprint,
             seed, key_id}
  hmac    = HMAC-SHA256(deployment key, canonical JSON of the manifest without `hmac`)
`lineage` is a random id drawn when a run starts fresh and kept across its resumes;
`parent_step`/`parent_sha256` name the checkpoint this one follows (this process's previous
save, else the newest older committed checkpoint of the same run and lineage in the folder).
A load checks, in order: integrity (size, sha256), then the HMAC (a manifest edited or
written elsewhere fails it: another deployment's key is named by its key id), then the label
(the manifest commits this file name, and a `step-NNNNNNN.pt` name agrees with the manifest's
step: a checkpoint of step 8 renamed to step 16 is refused), then what the resuming run is
(`RunIdentity`: run id, data, model config, seed), then the weights-only load, then the state
against its manifest (step, run id). What happens on a mismatch:
- `load_checkpoint` (one file, chosen by the caller) raises: CheckpointOriginError (HMAC,
  label, unbound) or CheckpointMismatchError (another run, data, model config or seed).
- `latest_good_checkpoint` / `scan_checkpoints` (a folder) skip the candidate with the reason
  and fall back to the previous good one; the loop warns and records what it skipped. They also
  skip a candidate whose recorded parent is present in the folder with another sha256 or
  lineage: a fork (a checkpoint of an abandoned history of the run, or planted). A file the
  caller names itself is not refused for a fork (it may be resuming that history on purpose):
  `fork_problem` tells, and the loop warns.
- A resume whose config names no run id cannot check whose checkpoint it is: the loop warns.
With a shared store, origin rests on the key: every machine of one deployment has the same key
(`TRAINWISE_STATE_KEY`, or the same key file), so a checkpoint uploaded by one and downloaded
by another verifies, while one from another deployment, or a manifest edited by someone who
can write the store but lacks the key, does not. Within a deployment the binding tells runs
apart (a checkpoint linked in from another run has another run id and lineage).

Unbound manifests (format 2 written before issue 31: no `binding`, no `hmac`) are REFUSED, after
the integrity check and the weights-only load (so a forged one is still reported for what it
holds): accepting them with a warning would let anyone who can write the folder strip the HMAC
and plant a foreign checkpoint. A checkpoint you trust (your own, written by an older trainwise)
is signed once with `bind_legacy_checkpoint(path)`, which checks it the same way first.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training._checkpoint_trust import (
    RunIdentity,
    StateFileError,
    binding_from_state,
    binding_shape_problem,
    identity_problem,
    loads_bounded,
    open_regular_file,
    read_small_file,
    sign,
    signature_problem,
    state_key,
    verifying_key,
)

FORMAT_VERSION = 2
MANIFEST_FORMAT = "trainwise-checkpoint-manifest"
MANIFEST_SUFFIX = ".manifest.json"
LEGACY_MAGIC = b"TRAINWISE-CHECKPOINT"  # the header of format-1 files
MAX_MANIFEST_BYTES = 64 * 1024  # a manifest is ~800 bytes; refuse to read a huge one
MAX_PAYLOAD_BYTES = 1 << 40  # 1 TiB: above any model this platform trains
# `\Z`, not `$`, in these: `$` also matches before a final newline, so `step-0000001.pt\n`
# would pass for a checkpoint (issue 31, class 8).
_STEP_FILE = re.compile(r"^step-(\d{7})\.pt\Z")
_STEP_MANIFEST = re.compile(r"^step-(\d{7})\.pt\.manifest\.json\Z")
# `_write_atomic` temp names: `.<name>.tmp-<pid>-<16 hex>` for payloads
# (`.step-0000008.pt.tmp-123-0123456789abcdef`) and manifests; the random part makes the name
# unpredictable. Without it: the names of writers before issue 31, still cleaned up.
_TEMP_FILE = re.compile(r"^\..+\.pt(\.manifest\.json)?\.tmp-\d+(-[0-9a-f]{16})?\Z")
_SHA256 = re.compile(r"^[0-9a-f]{64}\Z")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# What a weights-only load rebuilds without an allow-list (torch adds dtypes, devices, Size, ...).
_PLAIN_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.Tensor, torch.dtype,
                 torch.device, torch.Size)


class CheckpointError(ValueError):
    """A checkpoint cannot be used; the message names the file and the fix."""


class CheckpointCorruptError(CheckpointError):
    pass


class CheckpointMismatchError(CheckpointError):
    """A sound checkpoint that is not the resuming run's (run id, data, model config, seed)."""


class CheckpointOriginError(CheckpointError):
    """A checkpoint this deployment did not write as it is: HMAC, label, lineage, unbound."""


class CheckpointKeyError(CheckpointError):
    """The deployment key cannot be read or created; nothing can be verified or signed."""


@dataclass(frozen=True)
class GoodCheckpoint:
    """The newest checkpoint of a folder that passed every check, and the newer ones skipped."""

    path: Path
    step: int
    sha256: str
    skipped: list[tuple[Path, str]] = field(default_factory=list)  # (file, why), newest first
    run_id: str | None = None  # from its binding


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


# -- the key -------------------------------------------------------------------------------------
def deployment_key(key: bytes | None = None) -> bytes:
    """`key`, else this deployment's checkpoint key, created on first use (the signing key;
    `training._checkpoint_trust.state_key`). CheckpointKeyError naming the key file or variable
    and the fix when it can be neither read nor created."""
    if key is not None:
        return key
    try:
        found = state_key(create=True)
    except StateFileError as error:
        raise CheckpointKeyError(f"{error}; checkpoints can be neither signed nor verified "
                                 "without it") from None
    assert found is not None  # create=True creates it or raises
    return found


def _key_for(manifest: dict[str, Any], key: bytes | None) -> bytes | None:
    """The key that checks `manifest`: `key` when the caller gave one, else the deployment's
    (or one this process held, `verifying_key`); never created by a read."""
    if key is not None:
        return key
    binding = manifest.get("binding")
    try:
        return verifying_key(binding.get("key_id") if isinstance(binding, dict) else None)
    except StateFileError as error:
        raise CheckpointKeyError(f"{error}; checkpoints cannot be verified without it") from None


# -- writing -------------------------------------------------------------------------------------
def _fsync_folder(folder: Path) -> None:
    # fsync the folder so a rename itself survives a machine crash (and in order).
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _write_atomic(path: Path, data: bytes, *, sync_folder: bool = True) -> None:
    """tmp in the same folder, fsync, os.replace, then (by default) fsync of the folder.

    The temp name has a random part and is created O_EXCL|O_NOFOLLOW: a symlink planted under
    the name (to write through it outside the folder) makes the create fail instead. os.replace
    renames over `path` itself, never through a link at `path`."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(8)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
    fd = os.open(tmp, flags, 0o666)  # the umask applies, as for open()
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            tmp.unlink()
    if sync_folder:
        _fsync_folder(path.parent)


# This process's last save per folder: (step, sha256, run_id, lineage), the next one's parent.
_LAST_SAVED: dict[str, tuple[int, str, str | None, str | None]] = {}
_LAST_SAVED_LOCK = threading.Lock()


def _parent_of(path: Path, binding: dict[str, Any], key: bytes) -> tuple[int, str] | None:
    """(step, sha256) of the checkpoint `path` follows: this process's previous save in the
    folder, else the newest older committed checkpoint there of the same run and lineage."""
    match = _STEP_FILE.match(path.name)
    if not match:
        return None
    step, folder = int(match.group(1)), str(path.parent.absolute())
    same_run = (binding["run_id"], binding["lineage"])
    with _LAST_SAVED_LOCK:
        last = _LAST_SAVED.get(folder)
    if last is not None and last[0] < step and (last[2], last[3]) == same_run:
        return last[0], last[1]
    if not path.parent.is_dir():
        return None
    for older, candidate in sorted(_steps_in(path.parent).items(), reverse=True):
        if older >= step:
            continue
        try:
            manifest = read_manifest(candidate)
        except (CheckpointError, OSError):
            continue
        found = manifest.get("binding") or {}
        if signature_problem(manifest, _key_for(manifest, key)) is None \
                and (found.get("run_id"), found.get("lineage")) == same_run:
            return older, manifest["sha256"]
    return None


def save_checkpoint(path: str | Path, state: dict[str, Any], *, key: bytes | None = None) -> str:
    """Writes `state` to `path` atomically, then commits it with its signed, bound manifest
    (module docstring). `key`: the deployment key (default: `deployment_key()`).

    Raises TypeError (before writing anything) if `state` holds an object a weights-only load
    would refuse, ValueError if a `step-NNNNNNN.pt` name disagrees with `state["step"]`.
    Returns the sha256 of the payload (the one in the manifest).
    """
    path = Path(path)
    check_checkpoint_types(state)
    step = state.get("step")
    match = _STEP_FILE.match(path.name)
    if not isinstance(step, int) or isinstance(step, bool):
        step = int(match.group(1)) if match else None
    elif match and int(match.group(1)) != step:
        raise ValueError(f"cannot write the state of step {step} as {path}: a checkpoint's name "
                         f"says its step; write it as {checkpoint_name(step)}")
    key = deployment_key(key)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    checksum = hashlib.sha256(payload).hexdigest()
    binding = binding_from_state(state, key, None)
    parent = _parent_of(path, binding, key)
    binding = binding_from_state(state, key, parent)
    manifest = {
        "format": MANIFEST_FORMAT, "version": FORMAT_VERSION, "payload": path.name,
        "step": step, "sha256": checksum, "bytes": len(payload),
        "torch_version": torch.__version__, "written_unix_s": round(time.time(), 3),
        "binding": binding,
    }
    manifest["hmac"] = sign(manifest, key)
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
    if step is not None:
        with _LAST_SAVED_LOCK:
            _LAST_SAVED[str(path.parent.absolute())] = (step, checksum, binding["run_id"],
                                                         binding["lineage"])
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


def bind_legacy_checkpoint(path: str | Path, *, run_id: str | None = None,
                           key: bytes | None = None) -> str:
    """Signs a checkpoint whose manifest predates the binding (module docstring, "Unbound"),
    after the same integrity check and weights-only load as any load: the operator's explicit
    "this file is mine". `run_id` fills a state without one. Returns the payload sha256."""
    path = Path(path)
    key = deployment_key(key)
    payload, manifest = _verified_payload(path)
    if "hmac" in manifest or "binding" in manifest:
        raise CheckpointOriginError(f"{path} is already bound (its manifest has a binding); "
                                    "nothing to do")
    state = _deserialize(path, payload)
    if run_id is not None and not isinstance(state.get("run_id"), str):
        state = {**state, "run_id": run_id}
    manifest = {**manifest, "binding": binding_from_state(state, key, None)}
    manifest["hmac"] = sign(manifest, key)
    _write_atomic(manifest_path(path),
                  (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
    return manifest["sha256"]


# -- reading -------------------------------------------------------------------------------------
def _fix(path: Path) -> str:
    return (f"resume from an earlier checkpoint (pass the folder {path.parent} to resume from "
            "the newest good one) or start fresh")


def max_payload_bytes() -> int:
    """The largest payload a manifest may commit: half this machine's memory (loading needs the
    bytes and the tensors they become), at most MAX_PAYLOAD_BYTES."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return MAX_PAYLOAD_BYTES
    return min(MAX_PAYLOAD_BYTES, max(memory // 2, 1 << 20))


def _open_checkpoint_file(path: Path) -> int:
    """A read-only fd of a payload that is a regular file, not a link (module docstring)."""
    try:
        return open_regular_file(path)
    except StateFileError as error:
        raise CheckpointCorruptError(
            f"{error}: a checkpoint is read only as a regular file inside its folder (a link can "
            f"point at another run's checkpoint or any file); replace the link by the file or "
            f"remove it; {_fix(path)}") from None


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The commit manifest of checkpoint `path`, validated (fields and types), payload unread,
    origin unchecked (`load_checkpoint` checks it).

    Raises CheckpointCorruptError if it is missing (uncommitted or format-1 file), unreadable,
    a link, over MAX_MANIFEST_BYTES, nested too deep or malformed.
    """
    path = Path(path)
    manifest_file = manifest_path(path)
    if not os.path.lexists(manifest_file):
        fd = _open_checkpoint_file(path)
        with os.fdopen(fd, "rb") as handle:
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
        manifest = loads_bounded(read_small_file(manifest_file, MAX_MANIFEST_BYTES))
        if not isinstance(manifest, dict):
            raise StateFileError(f"a JSON {type(manifest).__name__}, not an object")
    except StateFileError as error:
        raise CheckpointCorruptError(
            f"commit manifest {manifest_file} is unreadable ({error}); {_fix(path)}"
        ) from None
    if manifest.get("format") != MANIFEST_FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"commit manifest {manifest_file} is format {str(manifest.get('format'))[:80]!r} "
            f"version {str(manifest.get('version'))[:20]!r}, this trainwise reads "
            f"{MANIFEST_FORMAT!r} version {FORMAT_VERSION}; resume with the trainwise version "
            "that wrote it or start fresh"
        )
    checksum, size, step = manifest.get("sha256"), manifest.get("bytes"), manifest.get("step")
    if not isinstance(checksum, str) or not _SHA256.match(checksum) \
            or not isinstance(size, int) or isinstance(size, bool) or size < 0 \
            or not (step is None or (isinstance(step, int) and not isinstance(step, bool))):
        raise CheckpointCorruptError(
            f"commit manifest {manifest_file} has an invalid sha256, bytes or step "
            f"({str(checksum)[:70]!r}, {str(size)[:30]}, {str(step)[:30]}); {_fix(path)}"
        )
    problem = _signed_fields_problem(manifest)
    if problem:
        raise CheckpointCorruptError(f"commit manifest {manifest_file} {problem}; {_fix(path)}")
    return manifest


def _signed_fields_problem(manifest: dict[str, Any]) -> str | None:
    """Why the payload name, binding or hmac fields are malformed; None when they are sound
    (absent binding and hmac: an unbound manifest, refused later by `_load_trusted`)."""
    name, binding, tag = manifest.get("payload"), manifest.get("binding"), manifest.get("hmac")
    if name is not None and not isinstance(name, str):
        return f"names its payload with a {type(name).__name__}, not a file name"
    if (binding is None) != (tag is None):
        return "has a binding without an hmac, or an hmac without a binding (half a signature)"
    if tag is not None and (not isinstance(tag, str) or not _SHA256.match(tag)):
        return "has an hmac that is not 64 hex characters"
    if binding is not None:
        return binding_shape_problem(binding)
    return None


def read_checksum(path: str | Path) -> str:
    """The sha256 recorded in a checkpoint's manifest (not verified; `load_checkpoint` verifies)."""
    return read_manifest(path)["sha256"]


def _verified_payload(path: Path) -> tuple[bytes, dict[str, Any]]:
    """The payload bytes, after the manifest's size and sha256 matched; nothing deserialised.

    The size is checked against the file's own (fstat) before a byte is read, so a manifest
    that claims 2**62 bytes costs nothing."""
    if path.is_dir():
        raise FileNotFoundError(
            f"checkpoint {path} is a folder; pass a step-NNNNNNN.pt file, or use "
            "training.checkpoint.latest_good_checkpoint(folder) to pick the newest good one"
        )
    if not os.path.lexists(path):
        raise FileNotFoundError(
            f"checkpoint {path} does not exist; pass an existing checkpoint file"
        )
    manifest = read_manifest(path)
    committed = manifest["bytes"]
    if committed > max_payload_bytes():
        raise CheckpointCorruptError(
            f"commit manifest of {path} commits {committed} bytes, more than this machine can "
            f"load ({max_payload_bytes()}): it was not written here; {_fix(path)}")
    fd = _open_checkpoint_file(path)
    with os.fdopen(fd, "rb") as handle:
        on_disk = os.fstat(handle.fileno()).st_size
        if on_disk > committed:
            raise CheckpointCorruptError(
                f"{path} is longer than the {committed} bytes its manifest commits "
                f"({on_disk} bytes): it was changed after it was committed; {_fix(path)}")
        payload = handle.read(on_disk)
        grew = handle.read(1)
    if len(payload) < committed:
        raise CheckpointCorruptError(
            f"{path} is truncated ({len(payload)} of {committed} payload bytes); {_fix(path)}"
        )
    if grew:
        raise CheckpointCorruptError(
            f"{path} is longer than the {committed} bytes its manifest commits: it was "
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
    """Weights-only load, no extra allow-list: plain data and tensors, never code. Any failure
    of the unpickler (crafted bytes raise IndexError, KeyError, RecursionError, ...) is a
    CheckpointCorruptError; MemoryError is not caught (the payload size is bounded)."""
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
    except MemoryError:
        raise
    except Exception as error:  # noqa: BLE001 - whatever crafted bytes raise: one error type
        raise CheckpointCorruptError(
            f"{path} is not a readable torch file ({type(error).__name__}: "
            f"{str(error)[:200]}); {_fix(path)}"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointCorruptError(
            f"{path} holds a {type(state).__name__}, not a checkpoint state dict; {_fix(path)}"
        )
    return state


def _origin_problem(path: Path, manifest: dict[str, Any], key: bytes | None) -> str | None:
    """Why a bound manifest does not prove this deployment wrote this file under this name."""
    problem = signature_problem(manifest, _key_for(manifest, key))
    if problem:
        return problem
    if manifest.get("payload") != path.name:
        return (f"its manifest commits the payload {manifest.get('payload')!r}, not "
                f"{path.name!r}: a checkpoint re-labelled (renamed) after it was written")
    match = _STEP_FILE.match(path.name)
    if match and manifest["step"] != int(match.group(1)):
        return (f"its manifest says step {manifest['step']}, its name step "
                f"{int(match.group(1))}: a checkpoint re-labelled as another step")
    return None


def _state_problem(manifest: dict[str, Any], state: dict[str, Any]) -> str | None:
    """Why the state inside disagrees with its signed manifest (step, run id)."""
    step, run_id = state.get("step"), state.get("run_id")
    if isinstance(step, int) and manifest["step"] is not None and step != manifest["step"]:
        return f"the state inside is step {step}, its manifest says step {manifest['step']}"
    bound_run = manifest["binding"].get("run_id")
    if isinstance(run_id, str) and run_id != bound_run:
        return f"the state inside is run {run_id!r}, its manifest says run {bound_run!r}"
    return None


def _load_trusted(path: Path, *, key: bytes | None,
                  identity: RunIdentity | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state, manifest) after every check of the module docstring, in its order."""
    payload, manifest = _verified_payload(path)
    bound = "hmac" in manifest
    if bound:
        problem = _origin_problem(path, manifest, key)
        if problem:
            raise CheckpointOriginError(f"checkpoint {path} is refused: {problem}; {_fix(path)}")
        problem = identity_problem(manifest["binding"], identity) if identity else None
        if problem:
            raise CheckpointMismatchError(f"checkpoint {path} is not this run's: {problem}")
    state = _deserialize(path, payload)
    if not bound:
        raise CheckpointOriginError(
            f"checkpoint {path} has an unbound manifest (no run binding, no HMAC): it was "
            "written by a trainwise before checkpoints were bound to their run, or by someone "
            f"who can write {path.parent} without this deployment's key. If it is yours, sign it "
            f"once with training.checkpoint.bind_legacy_checkpoint({str(path)!r}); else "
            f"{_fix(path)}")
    problem = _state_problem(manifest, state)
    if problem:
        raise CheckpointOriginError(f"checkpoint {path} is refused: {problem}; {_fix(path)}")
    return state, manifest


def _model_problem(path: Path, state: dict[str, Any], expected_model_fingerprint: str,
                   expected_model_config: dict[str, Any] | None) -> str | None:
    found = state.get("model_fingerprint")
    if found == expected_model_fingerprint:
        return None
    return (f"checkpoint {path} was written for model {state.get('model_kind')!r} with config "
            f"{state.get('model_config')} (fingerprint {str(found)[:12]}), but this run builds "
            f"config {expected_model_config if expected_model_config is not None else '?'} "
            f"(fingerprint {expected_model_fingerprint[:12]}); start fresh (no resume_from) or "
            "resume with the model config the checkpoint was written with")


def load_checkpoint(
    path: str | Path,
    *,
    expected_model_fingerprint: str | None = None,
    expected_model_config: dict[str, Any] | None = None,
    identity: RunIdentity | None = None,
    key: bytes | None = None,
) -> dict[str, Any]:
    """Verifies a checkpoint (integrity, origin, label; module docstring), then loads it
    weights-only; refuses one written for another model config or, with `identity`, another
    run (run id, data, model, seed).

    Raises FileNotFoundError, CheckpointCorruptError (no manifest, format 1, a link, too big,
    truncated, checksum mismatch, refused by the weights-only load), CheckpointOriginError
    (HMAC, re-labelled, unbound), CheckpointMismatchError (another model config, the message
    shows both; another run) or CheckpointKeyError (the key file is unusable). `key`: the
    deployment key to verify with (default: the deployment's, `_key_for`).
    """
    path = Path(path)
    state, _ = _load_trusted(path, key=key, identity=identity)
    if expected_model_fingerprint is not None:
        problem = _model_problem(path, state, expected_model_fingerprint, expected_model_config)
        if problem:
            raise CheckpointMismatchError(problem)
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


def _fork_problem(path: Path, manifest: dict[str, Any], key: bytes | None) -> str | None:
    """Why `path` is not on the history of the checkpoints beside it: its recorded parent is in
    the folder with another sha256 or lineage (a fork); None when it is, or cannot be told."""
    binding = manifest["binding"]
    parent_step = binding.get("parent_step")
    if parent_step is None or parent_step < 0 or parent_step >= 10**7:
        return None
    parent_path = path.parent / checkpoint_name(parent_step)
    if not os.path.lexists(manifest_path(parent_path)):
        return None  # pruned: nothing to compare with
    try:
        parent = read_manifest(parent_path)
    except (CheckpointError, OSError):
        return None  # the parent is its own skip; it says nothing about this one
    if signature_problem(parent, _key_for(parent, key)) is not None:
        return None
    theirs = parent["binding"]
    if parent["sha256"] != binding.get("parent_sha256") \
            or theirs.get("lineage") != binding.get("lineage"):
        return (f"it follows a step {parent_step} of sha256 "
                f"{str(binding.get('parent_sha256'))[:12]} (lineage "
                f"{str(binding.get('lineage'))[:8]}), but the step {parent_step} beside it is "
                f"{parent['sha256'][:12]} (lineage {str(theirs.get('lineage'))[:8]}): a "
                "checkpoint of another history of the run (abandoned when it was resumed from an "
                "earlier checkpoint) or planted")
    return None


def fork_problem(path: str | Path, *, key: bytes | None = None) -> str | None:
    """Why checkpoint `path` is not on the history of the checkpoints beside it (a fork, see
    `_fork_problem`); None when it is, or when that cannot be told (unbound, unreadable)."""
    path = Path(path)
    try:
        manifest = read_manifest(path)
        if "binding" not in manifest or _origin_problem(path, manifest, key):
            return None
    except (CheckpointError, OSError):
        return None
    return _fork_problem(path, manifest, key)


def latest_good_checkpoint(
    directory: str | Path,
    *,
    identity: RunIdentity | None = None,
    key: bytes | None = None,
) -> GoodCheckpoint | None:
    """`scan_checkpoints(...)[0]`: the newest good checkpoint of `directory`, or None."""
    return scan_checkpoints(directory, identity=identity, key=key)[0]


def scan_checkpoints(
    directory: str | Path,
    *,
    identity: RunIdentity | None = None,
    key: bytes | None = None,
) -> tuple[GoodCheckpoint | None, list[tuple[Path, str]]]:
    """The newest checkpoint of `directory` that passes every check of `load_checkpoint`
    (integrity, origin, label, `identity`, weights-only load) and is not a fork of the
    checkpoints beside it, trying newest first; None if none passes.

    `skipped` lists each newer file that failed and why, so the caller can say it fell back.
    No file stops the search: whatever a candidate raises (but MemoryError, which the size
    bounds prevent) becomes a skip with its reason. Loads each candidate once (a verified
    checkpoint is loaded again by the caller: resumes are rare, and a forged file that passes
    the digest must not stop the fallback). `key`: as for `load_checkpoint`. Returns it (None
    when none passes) and every file skipped with why, also when none passed.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None, []
    skipped: list[tuple[Path, str]] = []
    for step, path in sorted(_steps_in(directory).items(), reverse=True):
        if not os.path.lexists(path):
            skipped.append((path, f"{path} is missing but its manifest exists (deleted after "
                                  "it was committed)"))
            continue
        try:
            state, manifest = _load_trusted(path, key=key, identity=identity)
            if identity is not None and identity.model_fingerprint is not None:
                problem = _model_problem(path, state, identity.model_fingerprint, None)
                if problem:
                    raise CheckpointMismatchError(problem)
            problem = _fork_problem(path, manifest, key)
            if problem:
                raise CheckpointOriginError(f"checkpoint {path} is refused: {problem}")
        except MemoryError:
            raise
        except Exception as error:  # noqa: BLE001 - a hostile file is skipped, never fatal
            reason = str(error) if isinstance(error, CheckpointError | OSError) else (
                f"{path} could not be checked ({type(error).__name__}: {str(error)[:200]})")
            skipped.append((path, reason))
            continue
        found_step = manifest["step"] if manifest["step"] is not None else step
        return GoodCheckpoint(path=path, step=found_step, sha256=manifest["sha256"],
                              skipped=skipped, run_id=manifest["binding"].get("run_id")), skipped
    return None, skipped


def clean_orphaned_temp_files(directory: str | Path) -> list[Path]:
    """Removes the temp files (`.step-NNNNNNN.pt.tmp-PID-RANDOM`,
    `.step-NNNNNNN.pt.manifest.json.tmp-PID-RANDOM`, and the `.tmp-PID` names of older writers)
    that writers killed mid-save left behind; returns what it removed.

    Call it only while holding the run folder's lock (`training.run_lock`): then no live writer
    owns one of these files. A link under such a name is removed itself, never its target.
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
