"""Where a checkpoint comes from: the per-deployment key, the manifest's HMAC and run binding,
and bounded reads of the small files beside a checkpoint.

`training.checkpoint` uses these; nothing here raises its error types (they live there), so the
functions answer with a problem description (`str`) or `None`, or raise `StateFileError`
(a ValueError the caller converts into an error naming the checkpoint).

The key. One secret per deployment signs every checkpoint manifest (HMAC-SHA256 over the
canonical JSON of the manifest without its `hmac` field). It is, in this order:
- `TRAINWISE_STATE_KEY`: 64 hex characters (32 bytes). A secret, so it is read here from the
  environment like the AWS keys boto3 reads, never through `trainwise.settings` (whose values
  end up in params and metadata). Every machine that shares a checkpoint store (S3, a shared
  disk) must get the same value, e.g. from the secret manager that starts the trainers.
- else `<TRAINWISE_HOME>/state.key`, created once (a random 32 bytes; written to a temp file
  opened with O_EXCL|O_NOFOLLOW and mode 0600, then hard-linked into place so two processes
  that race both end up with the one that won). A key file that is a link, not a regular file,
  readable or writable by group or others, or not 64 hex characters is refused with an error
  naming the file and the fix (it could have been planted).
`key_id` (a hash of the key, never the key) goes into each manifest, so a refusal can say that
a checkpoint was signed by another deployment rather than only "bad signature".
Only a writer creates the key (`state_key(create=True)`); a reader that finds none refuses what
it reads (this deployment wrote nothing yet) and creates nothing. A process verifies with the
key its deployment names now and with any key it resolved before in its life (`_HELD`): its
TRAINWISE_HOME may be changed under it (tests do, per test), and a key it held was this
deployment's. Rotating the key therefore means: new trainers, new key; checkpoints signed with
the old one are refused by them (set the old key again to resume those).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STATE_KEY_ENV = "TRAINWISE_STATE_KEY"
KEY_FILE_NAME = "state.key"
MAX_KEY_FILE_BYTES = 256  # 64 hex characters and a newline; anything bigger is not ours
MAX_JSON_DEPTH = 16  # a manifest nests two levels; a deep document is hostile, not ours
# `\Z`, not `$`: `$` also matches before a final newline (issue 31, class 8).
_HEX_KEY = re.compile(r"^[0-9a-f]{64}\Z")
# JSON strings (skipped whole, escapes included) or one bracket: what the depth scan looks at.
_JSON_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class StateFileError(ValueError):
    """A small state file (manifest, key) that cannot be trusted; the message says why."""


@dataclass(frozen=True)
class RunIdentity:
    """What the run that resumes is: a checkpoint that disagrees is not its own.

    A None field is not checked (a caller that does not know it)."""

    run_id: str | None = None
    data_fingerprint: str | None = None
    model_fingerprint: str | None = None  # the model kind + config ("config fingerprint")
    seed: int | None = None


# -- bounded reads -------------------------------------------------------------------------------
def open_regular_file(path: Path) -> int:
    """A read-only fd of `path`, refusing a symlink at its last component (O_NOFOLLOW) and
    anything but a regular file (a FIFO would block, a device never ends). O_NONBLOCK keeps a
    FIFO from blocking the open itself; it changes nothing for a regular file."""
    flags = os.O_RDONLY | _NOFOLLOW | _CLOEXEC | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise StateFileError(f"{path} is a symbolic link (to {_link_target(path)}): only "
                                 "regular files inside the folder are read") from None
        raise
    kind = stat.S_IFMT(os.fstat(fd).st_mode)
    if kind != stat.S_IFREG:
        os.close(fd)
        raise StateFileError(f"{path} is not a regular file (mode {oct(kind)})")
    return fd


def _link_target(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def read_small_file(path: Path, max_bytes: int) -> bytes:
    """The bytes of a regular, non-link file of at most `max_bytes`; the size is checked before
    anything is read, so a huge (or sparse) file costs no memory."""
    fd = open_regular_file(path)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise StateFileError(f"{path} is {size} bytes, more than the {max_bytes} such a file "
                                 "can be")
        with os.fdopen(os.dup(fd), "rb") as handle:
            data = handle.read(max_bytes + 1)  # one more: a file that grew meanwhile
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise StateFileError(f"{path} grew past {max_bytes} bytes while it was read")
    return data


def json_depth(raw: bytes) -> int:
    """How deep `raw`'s arrays and objects nest (brackets inside strings do not count)."""
    depth = deepest = 0
    for token in _JSON_TOKENS.finditer(raw):
        char = token.group()
        if char in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        elif char in (b"]", b"}"):
            depth -= 1
    return deepest


def loads_bounded(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads of UTF-8 `raw` that refuses a document nested deeper than `max_depth` before
    parsing it (json's recursion would raise RecursionError, or worse, exhaust the C stack), and
    NaN/Infinity (not JSON). Raises StateFileError."""
    depth = json_depth(raw)
    if depth > max_depth:
        raise StateFileError(f"JSON nested {depth} levels deep, more than {max_depth}")

    def no_constants(name: str) -> Any:
        raise StateFileError(f"JSON holds {name}, which is not a JSON number")

    try:
        return json.loads(raw.decode("utf-8"), parse_constant=no_constants)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise StateFileError(f"not UTF-8 JSON ({type(error).__name__}: {str(error)[:120]})") \
            from None


# -- the key -------------------------------------------------------------------------------------
def key_id(key: bytes) -> str:
    """A short public name of `key` (a hash, so the manifest never reveals the key)."""
    return hashlib.sha256(b"trainwise-state-key-id\0" + key).hexdigest()[:16]


# Every key this process resolved (key id -> key). A process verifies with the key its
# deployment names now and with these: its state folder may change under it (tests point
# TRAINWISE_HOME at a folder per test, and undo that), and a key it held was trusted then.
_HELD: dict[str, bytes] = {}


def state_key(home: Path | None = None, *, create: bool = True) -> bytes | None:
    """This deployment's checkpoint key (module docstring). `home`: the state folder (default:
    TRAINWISE_HOME through `trainwise.settings`, read only when the environment holds no key).
    `create=False` (verifying): None when there is no key yet, and nothing is created."""
    raw = os.environ.get(STATE_KEY_ENV, "").strip().lower()
    if raw:
        if not _HEX_KEY.fullmatch(raw):
            raise StateFileError(f"{STATE_KEY_ENV} is not 64 hex characters (32 bytes); set it "
                                 "to e.g. the output of `openssl rand -hex 32`, the same on every "
                                 "machine of the deployment, or unset it to use the key file")
        return _hold(bytes.fromhex(raw))
    if home is None:
        from trainwise import settings  # a leaf module: the import rules allow it

        # home_dir() creates the folder: only a writer needs it to exist.
        home = settings.home_dir() if create else \
            Path(settings.get("TRAINWISE_HOME")).expanduser().resolve()
    path = Path(home) / KEY_FILE_NAME
    try:
        return _hold(_read_key_file(path))
    except FileNotFoundError:
        if not create:
            return None
        _create_key_file(path)
        return _hold(_read_key_file(path))


def _hold(key: bytes) -> bytes:
    _HELD[key_id(key)] = key
    return key


def verifying_key(signer_id: Any) -> bytes | None:
    """The key to check a manifest signed by key id `signer_id` with: the deployment's key now,
    else one this process held with that id, else the deployment's (the check then fails and
    says the signer is another deployment); None when there is no key at all."""
    current = state_key(create=False)
    if current is not None and key_id(current) == signer_id:
        return current
    return _HELD.get(signer_id, current) if isinstance(signer_id, str) else current


def _read_key_file(path: Path) -> bytes:
    fix = (f"remove {path} (a new key is created; checkpoints signed with the old one are then "
           f"refused) or set {STATE_KEY_ENV}")
    try:
        fd = open_regular_file(path)
    except StateFileError as error:
        raise StateFileError(f"checkpoint key {error}; {fix}") from None
    except FileNotFoundError:
        raise
    except OSError as error:
        raise StateFileError(f"cannot read the checkpoint key {path} ({error.strerror or error}); "
                             f"make it readable by this user or set {STATE_KEY_ENV}") from None
    try:
        mode = os.fstat(fd).st_mode
        if mode & 0o077:
            raise StateFileError(f"checkpoint key {path} has mode {oct(mode & 0o777)}: others may "
                                 f"read or change it; chmod 600 {path} (or {fix})")
        with os.fdopen(os.dup(fd), "rb") as handle:
            data = handle.read(MAX_KEY_FILE_BYTES + 1)
    finally:
        os.close(fd)
    text = data.decode("ascii", errors="replace").strip()
    if len(data) > MAX_KEY_FILE_BYTES or not _HEX_KEY.fullmatch(text):
        raise StateFileError(f"checkpoint key {path} is not 64 hex characters; {fix}")
    return bytes.fromhex(text)


def _create_key_file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(8)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o600)
    except OSError as error:
        raise StateFileError(
            f"cannot create the checkpoint key {path} ({error.strerror or error}); make "
            f"{path.parent} writable or set {STATE_KEY_ENV} to 64 hex characters") from None
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(secrets.token_hex(32).encode() + b"\n")
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(tmp, path)  # atomic and never replaces: the first writer's key wins
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)


# -- signing -------------------------------------------------------------------------------------
def _canonical(manifest: dict[str, Any]) -> bytes:
    body = {name: value for name, value in manifest.items() if name != "hmac"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign(manifest: dict[str, Any], key: bytes) -> str:
    """HMAC-SHA256 (hex) over the canonical manifest without its `hmac` field."""
    return hmac.new(key, _canonical(manifest), hashlib.sha256).hexdigest()


def signature_problem(manifest: dict[str, Any], key: bytes | None) -> str | None:
    """Why the manifest's `hmac` does not prove it was written here; None when it does.
    `key` None: this deployment has no key yet (nothing it wrote can be verified)."""
    binding = manifest.get("binding")
    signer = binding.get("key_id") if isinstance(binding, dict) else None
    if key is None:
        return (f"this deployment has no checkpoint key yet (neither {STATE_KEY_ENV} nor "
                f"<TRAINWISE_HOME>/{KEY_FILE_NAME}), so it wrote no checkpoint: this one (key id "
                f"{signer}) was copied from elsewhere; set {STATE_KEY_ENV} to the key of the "
                "deployment that wrote it if it is yours")
    if hmac.compare_digest(sign(manifest, key), str(manifest.get("hmac", ""))):
        return None
    if signer and signer != key_id(key):
        return (f"it was signed with another deployment's key (key id {signer}, this "
                f"deployment's is {key_id(key)}): it was copied from elsewhere")
    return ("its HMAC does not match: the manifest was edited, or written without this "
            "deployment's key")


# -- binding -------------------------------------------------------------------------------------
def binding_from_state(state: dict[str, Any], key: bytes,
                       parent: tuple[int, str] | None) -> dict[str, Any]:
    """What ties a checkpoint to its run, from the state being saved (see
    `training._loop_state.build_state`); `parent`: (step, sha256) of the checkpoint before it."""
    train_config = state.get("train_config")
    seed = train_config.get("seed") if isinstance(train_config, dict) else None
    return {
        "run_id": _str_or_none(state.get("run_id")),
        "lineage": _str_or_none(state.get("lineage")),
        "parent_step": parent[0] if parent else None,
        "parent_sha256": parent[1] if parent else None,
        "data_fingerprint": _str_or_none(state.get("data_fingerprint")),
        "model_fingerprint": _str_or_none(state.get("model_fingerprint")),
        "seed": seed if isinstance(seed, int) and not isinstance(seed, bool) else None,
        "key_id": key_id(key),
    }


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


_BINDING_TYPES = {"run_id": str, "lineage": str, "parent_step": int, "parent_sha256": str,
                  "data_fingerprint": str, "model_fingerprint": str, "seed": int, "key_id": str}


def binding_shape_problem(binding: Any) -> str | None:
    """Why `binding` is not a well-formed binding (types only); None when it is."""
    if not isinstance(binding, dict):
        return f"binding is a JSON {type(binding).__name__}, not an object"
    for name, kind in _BINDING_TYPES.items():
        value = binding.get(name)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            return f"binding field {name} is {type(value).__name__}, not {kind.__name__}"
        if isinstance(value, str) and len(value) > 512:
            return f"binding field {name} is {len(value)} characters long"
    return None


def identity_problem(binding: dict[str, Any], identity: RunIdentity) -> str | None:
    """Why a checkpoint bound to `binding` is not the resuming run's; None when it is."""
    if identity.run_id is not None and binding.get("run_id") != identity.run_id:
        return (f"it belongs to run {binding.get('run_id')!r}, not to this run "
                f"{identity.run_id!r}: a checkpoint of another run (linked or copied in); resume "
                "that run under its own run id, or start fresh")
    if identity.data_fingerprint is not None \
            and binding.get("data_fingerprint") != identity.data_fingerprint:
        return (f"it was trained on data {str(binding.get('data_fingerprint'))[:12]}, this run "
                f"on {identity.data_fingerprint[:12]}; resume with the same shards or start fresh")
    if identity.model_fingerprint is not None \
            and binding.get("model_fingerprint") != identity.model_fingerprint:
        return (f"it was written for model config {str(binding.get('model_fingerprint'))[:12]}, "
                f"this run builds {identity.model_fingerprint[:12]}; start fresh or resume with "
                "the model config the checkpoint was written with")
    if identity.seed is not None and binding.get("seed") is not None \
            and binding["seed"] != identity.seed:
        return (f"it was written by a run with seed {binding['seed']}, this run has seed "
                f"{identity.seed}: not this run's checkpoint; resume with its seed or start fresh")
    return None
