"""Write benchmark results: JSON and markdown side by side, atomically, with their provenance.

Every result file says how it was made: the command, the git commit (when the tree is a git
checkout), the machine (platform, CPU count, memory) and the date. Writes go to a temporary file
in the same folder, are fsynced and then renamed over the target, so a reader never sees half a
file and an interrupted run leaves the previous results intact.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def _git(args: list[str], cwd: Path) -> str | None:
    """stdout of `git <args>`, or None when git or the repository is missing."""
    try:
        done = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def git_commit(cwd: Path = PROJECT_ROOT) -> str | None:
    """`git rev-parse HEAD`, or None when git or the repository is missing."""
    commit = (_git(["rev-parse", "HEAD"], cwd) or "").strip()
    return commit or None


# Results folders hold what a run writes (its plot lands before its tables); a changed result file
# does not change the code that produced it, so it does not make the tree dirty.
RESULTS_PATHSPEC = ":(exclude,glob)**/benchmarks/results/**"


def git_tree_dirty(cwd: Path = PROJECT_ROOT) -> bool | None:
    """Whether tracked files outside `benchmarks/results/` differ from HEAD (`git status
    --porcelain -uno`), or None without git. A figure measured on a dirty tree cannot be tied to
    one commit, so results say so."""
    status = _git(["status", "--porcelain", "--untracked-files=no", "--", ".", RESULTS_PATHSPEC],
                  cwd)
    return None if status is None else bool(status.strip())


def memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "memory_gib": memory_gib(),
    }


def provenance(command: list[str] | None = None) -> dict[str, Any]:
    """Command, commit, machine and UTC date of this run."""
    argv = command if command is not None else [Path(sys.executable).name, *sys.argv]
    return {
        "command": " ".join(argv),
        "commit": git_commit(),
        "tree_dirty": git_tree_dirty(),
        "machine": machine(),
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a temporary file in the same folder, fsync, then rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp creates the file 0600; results are meant to be read: the usual umask-ed 0666.
        os.fchmod(handle, 0o666 & ~current_umask())
        with os.fdopen(handle, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_results(
    out_dir: str | Path,
    stem: str,
    payload: dict[str, Any],
    markdown: str,
    meta: dict[str, Any] | None = None,
) -> tuple[Path, Path]:
    """Write `<stem>.json` (payload plus `meta`) and `<stem>.md` (a provenance line, then the
    markdown). `meta` defaults to `provenance()`; returns both paths."""
    out_dir = Path(out_dir)
    meta = meta if meta is not None else provenance()
    document = {"meta": meta, **payload}
    json_path = out_dir / f"{stem}.json"
    md_path = out_dir / f"{stem}.md"
    write_atomic(json_path, (json.dumps(document, indent=1, default=_json_default) + "\n").encode())
    header = (
        f"<!-- written by `{meta.get('command')}` at commit {meta.get('commit')}"
        f"{_dirty_note(meta.get('tree_dirty'))} on {meta.get('date_utc')} -->\n\n"
    )
    write_atomic(md_path, (header + markdown.rstrip() + "\n").encode())
    return json_path, md_path


def _dirty_note(tree_dirty: bool | None) -> str:
    if tree_dirty is None:
        return " (tree state unknown)"
    return " with uncommitted changes" if tree_dirty else " (clean tree)"


def _json_default(value: Any) -> Any:
    """numpy scalars and paths in payloads; anything else is a bug worth failing on."""
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON: {value!r}")


def write_suite_results(out_dir: str | Path | None, quick: bool, default_out: str | Path,
                        stem: str, module: str, argv: list[str] | None, payload: dict[str, Any],
                        markdown: str) -> tuple[Path, Path] | None:
    """A suite's results where asked: `out_dir`, else `default_out` unless `quick` (a smoke run
    writes nothing unless told where), its command line (`python -m module argv`) as the
    provenance; None when nothing is written."""
    target = out_dir if out_dir is not None else (None if quick else default_out)
    if target is None:
        return None
    command = ["python", "-m", module, *(argv if argv is not None else sys.argv[1:])]
    return write_results(target, stem, payload, markdown, provenance(command))
