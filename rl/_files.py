"""Writing the policy folders without following links (issue 31, class 2), in rl's own few lines:
the import rules keep rl from `training.safe_files`, whose rules these follow.

A policy folder (`<TRAINWISE_HOME>/policies/<kind>/<region>`) holds the champion the trainer
loads, so a name written there by a predictable path (`champion.npz`, a fixed
`.champion.npz.<pid>.tmp`, `history.jsonl`) may be a planted link: writing it plainly would
overwrite whatever it points to. Whole files go to an unpredictable temp name in the same
folder and are renamed over the name (the rename replaces a link itself, never its target);
appends refuse a link, a FIFO or a file with another hard link.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def write_atomic(path: str | Path, data: bytes) -> None:
    """`data` at `path`, all or nothing: mkstemp (O_EXCL) in the folder, fsync, rename."""
    path = Path(path)
    handle, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            os.fchmod(handle, 0o644)  # mkstemp makes it private; policy files are readable
            view = memoryview(data)
            while view:
                view = view[os.write(handle, view):]
            os.fsync(handle)
        finally:
            os.close(handle)
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise


def append_line(path: str | Path, line: str) -> None:
    """Appends `line` to `path` (created if missing); ValueError naming the path and the fix if
    it is a link, not a regular file, or has another hard link."""
    path = Path(path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        handle = os.open(path, flags, 0o644)
    except OSError as error:  # ELOOP: a link; ENXIO: a FIFO nobody reads
        if path.is_symlink() or (path.exists() and not path.is_file()):
            raise ValueError(f"{path} is a link or not a regular file; trainwise writes neither "
                             "there. Remove it; the history starts again") from error
        raise
    try:
        info = os.fstat(handle)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            raise ValueError(f"{path} is not a regular file of its own ({info.st_nlink} hard "
                             "links); remove it (or move it out of the policy folder); the "
                             "history starts again")
        data = memoryview(line.encode("utf-8"))
        while data:
            data = data[os.write(handle, data):]
    finally:
        os.close(handle)
