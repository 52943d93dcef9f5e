"""One trainer per run folder: an exclusive `flock` on `<out_dir>/.run.lock`.

Two trainers on one folder corrupt each other (the lagging one prunes the checkpoint the other
has just written, then crashes), so `training.loop.train` holds this lock for its whole call.
`flock` is released by the kernel when the holder dies, even by SIGKILL, so a stale lock file
never blocks a resume; the file itself stays and only says who held it last.

The holder writes `{"pid", "host", "started"}` into the file so a refused second launch can say
whom it collided with. A reader may catch the holder between truncate and write and see nothing;
it then reports the holder as unknown rather than guessing.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Self

LOCK_NAME = ".run.lock"


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
            who = "a process that has not written its details yet"
        super().__init__(
            f"run folder {out_dir} is in use by another trainer ({who}); two trainers on one "
            f"folder overwrite each other's checkpoints. Wait for it to finish, stop it "
            f"(`kill {holder.get('pid', '<pid>')}` sends SIGTERM: it checkpoints and exits) and "
            "resume, or train into another out_dir"
        )


def _read_holder(handle: int) -> dict[str, Any]:
    try:
        raw = os.pread(handle, 4096, 0)
        holder = json.loads(raw.decode("utf-8")) if raw.strip() else {}
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


class RunFolderLock:
    """`with RunFolderLock(out_dir):` holds the folder; a second holder gets
    `RunFolderLockedError` at once (no waiting: a trainer that waits would resume from a
    checkpoint the other is about to replace)."""

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / LOCK_NAME
        self._handle: int | None = None

    @property
    def held(self) -> bool:
        return self._handle is not None

    def acquire(self) -> None:
        if self._handle is not None:
            raise RuntimeError(f"{self.path} is already held by this RunFolderLock")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        handle = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(handle)
            os.close(handle)
            raise RunFolderLockedError(self.out_dir, holder) from None
        except BaseException:
            os.close(handle)
            raise
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        os.ftruncate(handle, 0)
        os.pwrite(handle, (json.dumps(info) + "\n").encode("utf-8"), 0)
        self._handle = handle

    def release(self) -> None:
        if self._handle is None:
            return
        handle, self._handle = self._handle, None
        try:
            fcntl.flock(handle, fcntl.LOCK_UN)
        finally:
            os.close(handle)

    def __enter__(self) -> Self:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
