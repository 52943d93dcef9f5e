"""Faults of the trainer's surroundings: a full disk, and four ingestions at once.

Full disk: a size-limited tmpfs (`mount -t tmpfs -o size=...`, needs root; unmounted in a
`finally`). Where mounting is refused, a per-process file size limit (RLIMIT_FSIZE: writes past
it fail with EFBIG) stands in for the checkpoint case; the results say which was used.
- telemetry_full: the run's telemetry folder is a nearly full tmpfs mounted at
  `<run>/telemetry`, checkpoints are not. The trainer should checkpoint, then stop with an error
  naming the folder; the segment stays readable; after freeing space the run resumes to the end
  and matches the reference.
- checkpoint_full: the whole run folder is on a tmpfs that holds one checkpoint and not two.
  The trainer should stop with an error naming the checkpoint; no committed checkpoint may be
  corrupt and no temp file may be left; a copy of the folder on a disk with space resumes.

Concurrent ingestion: four processes ingest four runs into one DuckDB file at the same moment,
then four processes ingest the same run at once; every line must be stored exactly once.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.faults import harness

CONCURRENT_INGESTS = 4
EVENTS_PER_INGEST_RUN = 3000


def mount_tmpfs(folder: Path, size_bytes: int) -> str | None:
    """Mounts a tmpfs of `size_bytes` at `folder`; None if it worked, else why not."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs",
                               str(folder)], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as error:
        return str(error)
    return None if done.returncode == 0 else (done.stderr.strip() or f"exit {done.returncode}")


def umount(folder: Path) -> None:
    subprocess.run(["umount", str(folder)], capture_output=True, timeout=20, check=False)


def fill(folder: Path, leave_bytes: int) -> None:
    """Writes a filler file so that about `leave_bytes` stay free on `folder`'s file system."""
    stats = os.statvfs(folder)
    free = stats.f_bavail * stats.f_frsize
    with open(folder / "filler", "wb") as handle:
        handle.write(b"\0" * max(0, free - leave_bytes))


def _fsize_limit(limit_bytes: int):
    def apply() -> None:  # runs in the child before exec
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    return apply


def _after_stop(run: harness.Run, code: int) -> dict[str, Any]:
    """What a trainer stopped by a full disk left behind."""
    result = run.result(run.processes - 1)
    try:
        recorded = harness.recorded_steps(run)
        readable, error = True, ""
    except Exception as exc:  # noqa: BLE001 - the finding
        recorded, readable, error = [], False, f"{type(exc).__name__}: {str(exc)[:200]}"
    committed = harness.committed_checkpoints(run.checkpoints)
    return {
        "exit_code": code, "status": result and result["status"],
        "error_tail": run.log_tail(run.processes - 1, 2)[-400:],
        "telemetry_readable": readable, "telemetry_error": error,
        "last_recorded_step": max((s for s, _ in recorded), default=0),
        "newest_checkpoint_step": max((int(p.stem.split("-")[1]) for p in committed), default=0),
        "corrupt_checkpoints": harness.corrupt_checkpoints(run.checkpoints),
        "temp_files": len(harness.temp_files(run.checkpoints)),
    }


def _resume_and_compare(suite, run: harness.Run) -> dict[str, Any]:
    point = harness.resume_point(run.checkpoints)
    code, final = harness.run_to_end(run, point.resume_from)
    ok = code == 0 and final is not None and final["status"] == "completed"
    out: dict[str, Any] = {"resume_step": point.step, "resume_failed": not ok}
    if ok:
        out.update(harness.matches_reference(final, run, suite.reference))
    else:
        out["resume_error"] = run.log_tail(run.processes - 1)
    return out


def disk_full_cases(suite) -> tuple[str, list[dict[str, Any]]]:
    """(method, cases): method is "tmpfs" or "rlimit_fsize (mount refused: ...)"."""
    base = suite.work_dir / "disk"
    probe = base / "probe"
    refused = mount_tmpfs(probe, 1 << 20)
    if refused is None:
        umount(probe)
        return "tmpfs", [_telemetry_full(suite, base), _checkpoint_full(suite, base)]
    run = suite.new_run("disk-fsize-limit")
    process = run.start(None, preexec_fn=_fsize_limit(1 << 20))
    case = {"case": "checkpoint_full (RLIMIT_FSIZE 1 MiB)", **_after_stop(run, harness.wait(process))}
    case.update(_resume_and_compare(suite, run))
    return f"rlimit_fsize (mount refused: {refused})", [case]


def _telemetry_full(suite, base: Path) -> dict[str, Any]:
    # The tmpfs is mounted AT the run's telemetry folder, not linked to it: the trainer refuses
    # a state folder that resolves outside the run folder (issue 31, class 2), a mount point
    # inside it is just a folder on another file system.
    run = suite.new_run("disk-telemetry-full")
    mount = run.run_dir / "telemetry"
    if mount_tmpfs(mount, 1 << 20) is not None:
        return {"case": "telemetry_full", "skipped": "mount failed"}
    try:
        fill(mount, leave_bytes=16 * 1024)
        case = {"case": "telemetry_full", **_after_stop(run, harness.wait(run.start(None)))}
        (mount / "filler").unlink()  # the fix the error should name: free space
        case.update(_resume_and_compare(suite, run))
        return case
    finally:
        umount(mount)


def _checkpoint_full(suite, base: Path) -> dict[str, Any]:
    mount = base / "run-tmpfs"
    if mount_tmpfs(mount, 2 << 20) is not None:
        return {"case": "checkpoint_full", "skipped": "mount failed"}
    try:
        run = suite.new_run("disk-checkpoint-full")
        on_tmpfs = harness.Run(mount / run.run_id, run.shards_dir, run.config)
        case = {"case": "checkpoint_full",
                **_after_stop(on_tmpfs, harness.wait(on_tmpfs.start(None)))}
        # The fix: move the run folder to a disk with space, then resume there.
        shutil.copytree(on_tmpfs.run_dir, run.run_dir, symlinks=True)
        run.processes = on_tmpfs.processes
        case.update(_resume_and_compare(suite, run))
        return case
    finally:
        umount(mount)


# -- concurrent ingestion --------------------------------------------------------------------
_INGEST = ("import sys, time\n"
           "from telemetry.store import ingest\n"
           "time.sleep(max(0.0, float(sys.argv[3]) - time.time()))\n"
           "print(ingest(sys.argv[1], sys.argv[2]))\n")


def _synthetic_run(telemetry_dir: Path, run_id: str, events: int) -> int:
    from telemetry.writer import SegmentWriter

    with SegmentWriter(telemetry_dir, run_id, events_per_segment=500) as writer:
        for step in range(1, events + 1):
            writer.write({"type": "step", "schema_version": 1, "run_id": run_id, "rank": 0,
                          "step": step, "wall_time_s": time.time(), "train_loss": 1.0 / step})
    return events


def _ingest_together(run_dirs: list[Path], db_path: Path) -> list[dict[str, Any]]:
    start_at = time.time() + 3.0  # every process imported and waiting: they hit the lock together
    env = {**os.environ, "PYTHONPATH": str(harness.PROJECT_ROOT)}
    processes = [subprocess.Popen([sys.executable, "-c", _INGEST, str(d), str(db_path),
                                   str(start_at)], cwd=harness.PROJECT_ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for d in run_dirs]
    outcomes = []
    for process in processes:
        out, err = process.communicate(timeout=300)
        outcomes.append({"exit_code": process.returncode, "inserted": out.strip(),
                         "error": err.strip().splitlines()[-1][:300] if process.returncode else ""})
    return outcomes


def _stored(db_path: Path) -> dict[str, int]:
    import duckdb

    with duckdb.connect(str(db_path), read_only=True) as con:
        return dict(con.execute("SELECT run_id, count(*) FROM telemetry_events GROUP BY run_id")
                    .fetchall())


def concurrent_ingestion(suite) -> dict[str, Any]:
    root = suite.work_dir / "ingest" / "telemetry"
    run_ids = [f"ingest-{i}" for i in range(CONCURRENT_INGESTS)]
    lines = {r: _synthetic_run(root, r, EVENTS_PER_INGEST_RUN) for r in run_ids}
    db_many = suite.work_dir / "ingest" / "four-runs.duckdb"
    many = _ingest_together([root / r for r in run_ids], db_many)
    stored = _stored(db_many) if db_many.exists() else {}
    db_same = suite.work_dir / "ingest" / "same-run.duckdb"
    same = _ingest_together([root / run_ids[0]] * CONCURRENT_INGESTS, db_same)
    stored_same = _stored(db_same) if db_same.exists() else {}
    lost = sum(max(0, lines[r] - stored.get(r, 0)) for r in run_ids) \
        + max(0, lines[run_ids[0]] - stored_same.get(run_ids[0], 0))
    duplicated = sum(max(0, stored.get(r, 0) - lines[r]) for r in run_ids) \
        + max(0, stored_same.get(run_ids[0], 0) - lines[run_ids[0]])
    return {"processes": CONCURRENT_INGESTS, "lines_per_run": EVENTS_PER_INGEST_RUN,
            "four_runs": many, "same_run": same,
            "failed_ingests": sum(o["exit_code"] != 0 for o in many + same),
            "rows_lost": lost, "rows_duplicated": duplicated}
