"""Atomic, checksummed publication of a folder of data files (shards, scores).

Layout of a published folder `out_dir`:

    out_dir/<pointer>.json       the manifest; replaced atomically, so it is the commit point
    out_dir/v-<fingerprint16>/   the files the manifest lists (immutable once published)
    out_dir/.staging-<pid>-*/    a build in progress (removed on error, or later if its process died)

A build writes every file into a staging folder, renames the folder to its content-addressed name
and only then swaps in the manifest (write tmp, fsync, os.replace, fsync the folder). A crash at
any point leaves the previous manifest and the files it names untouched and readable.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

STAGING_PREFIX = ".staging-"
VERSION_PREFIX = "v-"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_json(obj: Any) -> str:
    """sha256 of a canonical JSON encoding (sorted keys, no whitespace): stable across runs."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (POSIX: the directory entry lives in the folder)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write tmp file in the same folder, fsync, os.replace, fsync the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    try:
        os.chmod(tmp_name, 0o644)  # mkstemp makes it private; published data is readable by all
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode("utf-8"))


def read_json(path: Path, *, what: str, fix: str) -> dict:
    """Read a manifest; a missing or unreadable one names the file and the fix."""
    if not path.is_file():
        raise FileNotFoundError(f"no {what} at {path}: {fix}")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{what} {path} is corrupt ({exc}): {fix}") from exc
    if not isinstance(obj, dict):
        # ValueError, not TypeError: the file's content is bad, not the caller's argument
        raise ValueError(f"{what} {path} is corrupt (not a JSON object): {fix}")  # noqa: TRY004
    return obj


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_dead_staging(out_dir: Path) -> None:
    """Remove staging folders left by builds whose process died (a crash mid-build).

    Why by pid: two live builds of the same folder (two Dagster runs) must not delete each
    other's staging folder.
    """
    if not out_dir.is_dir():
        return
    for child in out_dir.iterdir():
        if not child.name.startswith(STAGING_PREFIX):
            continue
        pid_text = child.name[len(STAGING_PREFIX):].split("-", 1)[0]
        if pid_text.isdigit() and _pid_alive(int(pid_text)) and int(pid_text) != os.getpid():
            continue
        shutil.rmtree(child, ignore_errors=True)


def publish_folder(
    out_dir: Path,
    pointer_name: str,
    write_files: Callable[[Path], dict],
) -> dict:
    """Build a folder of files and publish it atomically; return its manifest.

    `write_files(staging)` writes the data files into `staging` and returns the manifest, which
    must hold `fingerprint` (content hash) and `files`: [{"file": name, "sha256": ...}, ...].
    The manifest gets `folder` (the published subfolder) and is written to out_dir/pointer_name.
    Publishing identical content twice gives identical files and an identical manifest.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_dead_staging(out_dir)
    pointer = out_dir / pointer_name
    previous_folder = _current_folder(pointer)
    staging = Path(tempfile.mkdtemp(dir=out_dir, prefix=f"{STAGING_PREFIX}{os.getpid()}-"))
    os.chmod(staging, 0o755)  # mkdtemp makes it private; published data is readable by all
    try:
        manifest = write_files(staging)
        for entry in manifest["files"]:
            fsync_file(staging / entry["file"])
        fsync_dir(staging)
        folder = VERSION_PREFIX + manifest["fingerprint"][:16]
        manifest["folder"] = folder
        _move_into_place(staging, out_dir / folder, manifest["files"])
        atomic_write_json(pointer, manifest)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    _remove_old_versions(out_dir, keep={folder, previous_folder})
    return manifest


def _current_folder(pointer: Path) -> str | None:
    try:
        folder = json.loads(pointer.read_text(encoding="utf-8")).get("folder")
    except (OSError, ValueError, AttributeError):
        return None
    return folder if isinstance(folder, str) else None


def _move_into_place(staging: Path, target: Path, files: list[dict]) -> None:
    """Rename staging to its content-addressed name; reuse an identical existing copy.

    An existing copy with wrong checksums (corrupted on disk) is replaced: renamed aside first so
    that the target name never points at a half-deleted folder.
    """
    if target.exists():
        if all(
            (target / e["file"]).is_file() and sha256_file(target / e["file"]) == e["sha256"]
            for e in files
        ):
            return  # same content already published: the caller removes staging
        aside = target.with_name(f"{STAGING_PREFIX}{os.getpid()}-replaced-{target.name}")
        os.replace(target, aside)
        shutil.rmtree(aside, ignore_errors=True)
    os.replace(staging, target)
    fsync_dir(target.parent)


def _remove_old_versions(out_dir: Path, keep: set[str | None]) -> None:
    """Keep the current and the previous version (a reader may still hold the previous manifest)."""
    for child in out_dir.iterdir():
        if child.is_dir() and child.name.startswith(VERSION_PREFIX) and child.name not in keep:
            shutil.rmtree(child, ignore_errors=True)


def read_control_json(path: Path, *, fmt: str, what: str, fix: str) -> dict:
    """Read a control file a running trainer follows (pruning, live control): an unreadable file
    or another format is a ValueError naming the file and the fix, so the trainer can refuse it,
    record why, and change nothing."""
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{what} {path} is unreadable ({error}): {fix}") from error
    if not isinstance(content, dict) or content.get("format") != fmt:
        raise ValueError(f"{what} {path} is not {fmt!r}: {fix}")
    return content


def control_digest(content: dict) -> str:
    """Identity of one written control: its content and its write time (the same content written
    again is a new request, applied once more)."""
    without_time = {k: v for k, v in content.items() if k != "written_at_s"}
    return sha256_json(without_time) + f":{content.get('written_at_s')}"
