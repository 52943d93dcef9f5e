"""Creating files in a run folder without following links out of it (issue 31, class 2).

A run folder is shared with clean-up jobs, restored backups and other users' processes, so a
name the trainer writes by a predictable path (`.run.lock`, `consumption.jsonl`, a fixed
`.name.tmp`) may already be a symbolic link, a hard link or a FIFO when the trainer comes to
write it. Opening such a path plainly truncates or appends to whatever it points to. The rules
here close that class:

- a file rewritten as a whole is written to a temp file with an unpredictable name (`mkstemp`
  in the same folder: `O_CREAT | O_EXCL`, so it is always a fresh inode) and renamed over the
  name (`write_atomic`); the rename replaces a planted link itself, never its target;
- a file created once is opened `O_CREAT | O_EXCL | O_NOFOLLOW` (`create_new`);
- a file appended to is opened `O_NOFOLLOW | O_NONBLOCK` and refused unless it is a regular
  file with one link (`open_for_append`, `append_bytes`): a hard link would make the append
  change the other name's file too, and a FIFO would block the trainer;
- a log a child process writes from the start is unlinked and created anew
  (`replace_with_new`), never truncated through whatever the name is;
- a folder the trainer writes into must resolve inside the run folder (`ensure_inside`).

Refusals raise `UnsafeStatePathError` (a ValueError: the path is bad input, not a full disk),
whose message names the path, what it is and the fix.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


class UnsafeStatePathError(ValueError):
    """A state path the trainer must write is a link, a non-regular file, or resolves outside
    the run folder; the message names the path and the fix."""


def _refusal(path: Path, what: str, fix: str) -> UnsafeStatePathError:
    return UnsafeStatePathError(
        f"{path} {what}; the trainer refuses to write through it because the write would land "
        f"outside the run folder or in another file. {fix}")


def ensure_inside(folder: str | Path, path: str | Path) -> Path:
    """`path` resolved (links followed); UnsafeStatePathError unless it is `folder` (resolved)
    or lies under it. Parts of `path` that do not exist yet resolve lexically, as they will be
    created."""
    root = Path(os.path.realpath(folder))
    resolved = Path(os.path.realpath(path))
    if resolved != root and root not in resolved.parents:
        raise _refusal(Path(path), f"resolves to {resolved}, outside the run folder {root}",
                       f"Remove the link (or move the real folder inside {root}) and start "
                       "again; to keep state on another disk, point the run folder itself "
                       "there")
    return resolved


def _check_regular_single(path: Path, handle: int) -> None:
    info = os.fstat(handle)
    if not stat.S_ISREG(info.st_mode):
        raise _refusal(path, "is not a regular file", "Remove it; the trainer recreates it")
    if info.st_nlink != 1:
        raise _refusal(path, f"has {info.st_nlink} hard links (another name shares its data)",
                       "Remove it (or move it out of the run folder); the trainer recreates it")


def open_for_append(path: str | Path, mode: int = 0o644) -> int:
    """A read-write fd appending to `path` (created if missing; readable, so a caller can look
    at its last byte); refuses a link, a FIFO, a device or a file with more than one hard link
    (UnsafeStatePathError)."""
    path = Path(path)
    flags = (os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
             | os.O_CLOEXEC)
    try:
        handle = os.open(path, flags, mode)
    except OSError as error:
        # ELOOP: a symbolic link; ENXIO: a FIFO without a reader (O_NONBLOCK kept us from
        # blocking on it).
        if path.is_symlink():
            raise _refusal(path, f"is a symbolic link (to {os.readlink(path)!r})",
                           "Remove the link; the trainer recreates the file") from error
        if path.exists() and not path.is_file():
            raise _refusal(path, "is not a regular file",
                           "Remove it; the trainer recreates it") from error
        raise
    try:
        _check_regular_single(path, handle)
        os.set_blocking(handle, True)  # a regular file: O_NONBLOCK only guarded the open
    except BaseException:
        os.close(handle)
        raise
    return handle


def append_bytes(path: str | Path, data: bytes) -> None:
    """Appends `data` to `path` through `open_for_append` (so a planted link, hard link or FIFO
    is refused, never written through). A line goes in one write(2) (a regular file takes it
    whole), so whole lines of concurrent appenders do not interleave."""
    handle = open_for_append(path)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(handle, view):]
    finally:
        os.close(handle)


def replace_with_new(path: str | Path, mode: int = 0o644) -> int:
    """A write fd of a fresh, empty file at `path` (a log a child process writes): whatever entry
    is there (a planted link or hard link too) is unlinked first, never opened, then the file is
    created `O_EXCL | O_NOFOLLOW`; FileExistsError if someone plants one in between."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return create_new(path, mode)


def create_new(path: str | Path, mode: int = 0o644) -> int:
    """A write fd of a file created now at `path`; FileExistsError if anything (a link
    included) is there already."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                   mode)


def fsync_folder(folder: str | Path) -> None:
    """Makes a rename in `folder` durable (the folder's own entry list)."""
    handle = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def write_atomic(path: str | Path, data: bytes, *, mode: int = 0o644,
                 sync_folder: bool = True) -> None:
    """Writes `data` to `path` so a reader sees the old file or the new one, never half of one:
    a temp file with an unpredictable name in the same folder, fsync, rename over `path`.

    The rename replaces whatever entry `path` is (a planted link too) and never writes through
    it. A failure (full disk) removes the temp file and re-raises."""
    path = Path(path)
    handle, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            os.fchmod(handle, mode)  # mkstemp makes it private; state files are readable
            view = memoryview(data)
            while view:
                view = view[os.write(handle, view):]
            os.fsync(handle)
        finally:
            os.close(handle)
        os.replace(temp_name, path)
    except BaseException:
        try:
            os.unlink(temp_name)
        except FileNotFoundError:
            pass
        raise
    if sync_folder:
        fsync_folder(path.parent)


def read_small(path: str | Path, limit_bytes: int) -> bytes:
    """At most `limit_bytes` of a regular file, not following a final link and not blocking on
    a FIFO; OSError (ELOOP, ENXIO, ...) or UnsafeStatePathError otherwise."""
    path = Path(path)
    handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(handle).st_mode):
            raise _refusal(path, "is not a regular file", "Remove it")
        return os.pread(handle, limit_bytes, 0)
    finally:
        os.close(handle)


def save_figure_atomic(figure, path: str | Path, dpi: int = 100) -> Path:
    """A matplotlib figure as PNG, rendered into memory and renamed into place: savefig(path)
    would open the predictable name plainly, following a link planted there (issue 31, class 2).
    The figure is closed."""
    import io

    import matplotlib.pyplot as plt

    image = io.BytesIO()
    figure.savefig(image, format="png", dpi=dpi)
    plt.close(figure)
    write_atomic(path, image.getvalue())
    return Path(path)
