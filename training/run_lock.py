"""One trainer per run folder: an exclusive `flock` on the run folder's own directory handle.

Two trainers on one folder corrupt each other (the lagging one prunes the checkpoint the other
has just written, then crashes), so `training.loop.train` holds this lock for its whole call.
`flock` is released by the kernel when the holder dies, even by SIGKILL, so nothing stale ever
blocks a resume.

Why the folder and not a lock file (issue 31, class 6): a lock on `<out_dir>/.run.lock` was a
file anyone could delete; a clean-up that removed it let a second trainer lock a new file of
that name, train and bill the same steps again and delete the first's temp files. A clean-up
that deletes files cannot delete the folder's own lock, so the lock is `flock` on an
`O_DIRECTORY` descriptor of `out_dir`. If the folder is removed or replaced anyway (`rm -rf`, a
restored backup moved into place), the holder finds out at its next check (`check`, called
before every checkpoint write by `training._loop_persist`): the inode behind the path is no
longer the one it holds, and it stops with `RunFolderReplacedError` saying so.

`.run.lock` stays as the holder's record only: `{"pid", "host", "started"}`, written atomically
(unpredictable temp name, rename), so a refused second launch can say whom it collided with.
Deleting it changes nothing but that message, which then names the holder's pid from Linux's
`/proc/locks` (the kernel's own table of flocks, by the folder's inode). Before taking the
folder, the state paths the trainer writes into (`checkpoints`, `telemetry`, `ledger`) must
resolve inside it (`training.safe_files.ensure_inside`, issue 31 class 2).

`flock` on a directory works on local file systems (ext4, xfs, btrfs, tmpfs). NFS emulates
flock with byte-range locks, which a directory descriptor cannot take; there the lock falls back
to `flock` on `.run.flock` (opened `O_NOFOLLOW`, never written), and `check` also compares that
path's inode with the held descriptor's: a clean-up that deletes it is found at the holder's
next checkpoint, which stops with `RunFolderReplacedError` (a second trainer may have started
in between: on such a file system keep clean-ups away from live run folders).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Self

from training.safe_files import ensure_inside, read_small, write_atomic

LOCK_NAME = ".run.lock"  # the holder's record, not the lock
FALLBACK_LOCK_NAME = ".run.flock"  # locked where a directory cannot be (NFS); never written
# errno of a file system that cannot flock a directory descriptor
_NO_DIRECTORY_FLOCK = {errno.EBADF, errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP}
# The folders of a run folder the trainer writes into; each must resolve inside it. `ledger`
# holds the run ledger (`training.ledger.LEDGER_FOLDER`), which a resume bills from.
STATE_FOLDERS = ("checkpoints", "telemetry", "ledger")
_RECORD_LIMIT_BYTES = 4096

# The locks this process holds (id -> lock), so a writer deep in the loop can ask whether the
# folder it writes into is still the one held (`check_folder_of`). The persist thread reads it.
_HELD: dict[int, RunFolderLock] = {}
_HELD_GUARD = threading.Lock()


class RunFolderLockedError(RuntimeError):
    """Another live process holds the run folder; the message names it and the fix."""

    def __init__(self, out_dir: Path, holder: dict[str, Any]) -> None:
        self.out_dir = out_dir
        self.holder = holder
        if holder:
            started = holder.get("started")
            when = (time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))
                    if isinstance(started, (int, float)) else "an unknown time")
            who = f"pid {holder.get('pid')} on host {holder.get('host')!r}, started {when}"
        else:
            who = f"a process whose record {LOCK_NAME} is missing or unreadable"
        super().__init__(
            f"run folder {out_dir} is in use by another trainer ({who}); two trainers on one "
            f"folder overwrite each other's checkpoints. Wait for it to finish, stop it "
            f"(`kill {holder.get('pid', '<pid>')}` sends SIGTERM: it checkpoints and exits) and "
            "resume, or train into another out_dir"
        )


class RunFolderReplacedError(OSError):
    """The run folder was removed or replaced while this trainer held it. An OSError (ENOENT),
    so the loop's checkpoint-failure handling treats it as a failed write, with this message."""

    def __init__(self, out_dir: Path, how: str) -> None:
        self.out_dir = out_dir
        super().__init__(
            errno.ENOENT,
            f"run folder {out_dir} was {how} while this trainer (pid {os.getpid()}) held it, so "
            "it stops before its checkpoints land in the wrong folder or a second trainer "
            "overwrites them. This is not a full disk: something removed or moved files of the "
            "run (a clean-up job, `rm -rf`, a restore). Stop whatever did it; then resume from "
            "the folder that holds this run's checkpoints (resume_from=<that folder>/"
            "checkpoints), or start the run again",
        )


def _read_holder(path: Path) -> dict[str, Any]:
    try:
        raw = read_small(path, _RECORD_LIMIT_BYTES)
        holder = json.loads(raw.decode("utf-8")) if raw.strip() else {}
    except (OSError, ValueError):  # missing, a link, not JSON: the holder stays unknown
        return {}
    return holder if isinstance(holder, dict) else {}


def lock_holder(out_dir: str | Path) -> dict[str, Any]:
    """Who holds the run folder's lock now ({"pid", "host"}), read from the kernel's table
    without taking or touching anything; {} when nobody on this host holds it (or unknown)."""
    return _holder_from_kernel(Path(out_dir))


def _holder_from_kernel(out_dir: Path) -> dict[str, Any]:
    """The pid holding the flock on `out_dir`, from Linux's /proc/locks (the record may have
    been deleted with the clean-up); {} where unknown. Lines read
    `1: FLOCK  ADVISORY  WRITE <pid> <major hex>:<minor hex>:<inode> 0 EOF`."""
    try:
        folder = os.stat(out_dir)
        with open("/proc/locks", encoding="ascii", errors="replace") as locks:
            lines = locks.read().splitlines()
    except OSError:
        return {}
    wanted = (os.major(folder.st_dev), os.minor(folder.st_dev), folder.st_ino)
    for line in lines:
        parts = line.split()
        if len(parts) < 6 or parts[1] != "FLOCK" or parts[3] != "WRITE":
            continue
        try:
            major, minor, inode = parts[5].split(":")
            if (int(major, 16), int(minor, 16), int(inode)) == wanted:
                return {"pid": int(parts[4]), "host": socket.gethostname()}
        except ValueError:
            continue
    return {}


def check_state_folders(out_dir: str | Path) -> None:
    """UnsafeStatePathError when a state folder of `out_dir` resolves outside it (a link): every
    write into it would land elsewhere."""
    for name in STATE_FOLDERS:
        ensure_inside(out_dir, Path(out_dir) / name)


class RunFolderLock:
    """`with RunFolderLock(out_dir):` holds the folder; a second holder gets
    `RunFolderLockedError` at once (no waiting: a trainer that waits would resume from a
    checkpoint the other is about to replace)."""

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / LOCK_NAME
        self._handle: int | None = None
        self._identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the held folder
        self._fallback: tuple[int, int] | None = None  # the same of .run.flock, when locked
        self._absolute = os.path.abspath(self.out_dir)

    @property
    def held(self) -> bool:
        return self._handle is not None

    def acquire(self) -> None:
        if self._handle is not None:
            raise RuntimeError(f"{self.out_dir} is already held by this RunFolderLock")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        try:
            handle, on_file = self._take()
        except BlockingIOError:
            holder = _read_holder(self.path) or _holder_from_kernel(self.out_dir)
            raise RunFolderLockedError(self.out_dir, holder) from None
        try:
            check_state_folders(self.out_dir)
            info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
            write_atomic(self.path, (json.dumps(info) + "\n").encode("utf-8"))
        except BaseException:
            os.close(handle)  # closing the descriptor releases the flock
            raise
        folder, held = os.stat(self.out_dir), os.fstat(handle)
        self._handle, self._identity = handle, (folder.st_dev, folder.st_ino)
        self._fallback = (held.st_dev, held.st_ino) if on_file else None
        with _HELD_GUARD:
            _HELD[id(self)] = self

    def _take(self) -> tuple[int, bool]:
        """(a descriptor holding the flock, whether it is `.run.lock`'s fallback file); raises
        BlockingIOError when another holder has it."""
        handle = os.open(self.out_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle, False
        except BlockingIOError:
            os.close(handle)
            raise
        except OSError as error:
            os.close(handle)
            if error.errno not in _NO_DIRECTORY_FLOCK:
                raise
        except BaseException:
            os.close(handle)
            raise
        # O_NOFOLLOW: a planted link is refused (ELOOP); the file is never written, so a hard
        # link to a file elsewhere only gets locked, never changed.
        handle = os.open(self.out_dir / FALLBACK_LOCK_NAME,
                         os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(handle)
            raise
        return handle, True

    def check(self) -> None:
        """Raises RunFolderReplacedError when `out_dir` no longer names the folder held (it was
        removed, or another folder was moved to its path). A no-op when not held."""
        if self._handle is None or self._identity is None:
            return
        try:
            now = os.stat(self.out_dir)
        except FileNotFoundError:
            raise RunFolderReplacedError(self.out_dir, "removed") from None
        if (now.st_dev, now.st_ino) != self._identity:
            raise RunFolderReplacedError(self.out_dir, "replaced by another folder")
        if self._fallback is not None:
            try:
                lock_file = os.stat(self.out_dir / FALLBACK_LOCK_NAME, follow_symlinks=False)
                same = (lock_file.st_dev, lock_file.st_ino) == self._fallback
            except FileNotFoundError:
                same = False
            if not same:
                raise RunFolderReplacedError(
                    self.out_dir, f"left without its lock file {FALLBACK_LOCK_NAME} (deleted or "
                    "replaced; this file system cannot lock the folder itself)")

    def covers(self, path: str | Path) -> bool:
        """`path` is the held folder or lies under it (by its absolute path, so a folder that
        is gone still matches)."""
        target = os.path.abspath(path)
        return os.path.commonpath([target, self._absolute]) == self._absolute

    def release(self) -> None:
        if self._handle is None:
            return
        handle, self._handle, self._identity, self._fallback = self._handle, None, None, None
        with _HELD_GUARD:
            _HELD.pop(id(self), None)
        try:
            fcntl.flock(handle, fcntl.LOCK_UN)
        finally:
            os.close(handle)

    def __enter__(self) -> Self:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def check_folder_of(path: str | Path) -> None:
    """RunFolderReplacedError when a run folder this process holds, and that `path` lies in, was
    removed or replaced. Writers call it before writing and when a write fails, so the error
    names what happened instead of a full disk. A no-op for paths no held lock covers."""
    with _HELD_GUARD:
        locks = [lock for lock in _HELD.values() if lock.covers(path)]
    for lock in locks:
        lock.check()
