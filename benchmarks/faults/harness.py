"""Trainer subprocesses for the fault suite: the data, the job, watching a run, and the checks
made after each fault (checkpoints load, resume matches the reference, telemetry adds up).

A trainer is `python -m trainwise.emulated_worker JOB.json` (the emulated cloud's worker): one
process trains or resumes a run with `training.loop.train` and writes a result file when it
ends normally. Everything here uses the public functions of `training.checkpoint` and
`telemetry`, and works with the format-1 checkpoints (embedded checksum) as with the format-2
ones (payload + detached commit manifest): where the two differ, the format in the tree decides.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.results_io import PROJECT_ROOT

WORKER_MODULE = "trainwise.emulated_worker"
PARTITION = "tinyshakespeare"
FALLBACK_PARTITION = "pystdlib"  # needs no data folder
TRAINER_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class RunShape:
    """The small GPT run every trial trains (about 0.1 s a step on one thread)."""

    max_steps: int = 48
    checkpoint_every_steps: int = 6
    events_per_segment: int = 7  # small: many segment seals to kill inside
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    micro_batch_size: int = 8
    eval_every_steps: int = 16
    seed: int = 1234


def checkpoint_module():
    from training import checkpoint

    return checkpoint


def has_manifests() -> bool:
    """Format 2 (a detached commit manifest per checkpoint) is in the tree."""
    return hasattr(checkpoint_module(), "manifest_path")


def prepare_shards(work_dir: Path, data_dir: Path | None = None) -> Path:
    """The partition's shards under `work_dir/shards/<partition>` (built once, reused)."""
    from training import shards
    from trainwise import settings

    data_dir = Path(data_dir) if data_dir is not None else settings.data_dir()
    partition = PARTITION if (data_dir / "corpora" / "tinyshakespeare.txt").is_file() \
        else FALLBACK_PARTITION
    out = Path(work_dir) / "shards" / partition
    if not (out / "manifest.json").exists():
        shards.build_shards(partition, data_dir, out)
    return out


def train_config(run_id: str, vocab_size: int, block_size: int, shape: RunShape) -> dict[str, Any]:
    """The `TrainConfig` fields of a trial's run, JSON-ready (`model` as a dict)."""
    return {
        "max_steps": shape.max_steps, "micro_batch_size": shape.micro_batch_size,
        "learning_rate": 3e-3, "min_learning_rate": 3e-4, "warmup_steps": 4,
        "eval_every_steps": shape.eval_every_steps, "eval_batches": 2, "eval_batch_size": 16,
        "checkpoint_every_steps": shape.checkpoint_every_steps, "keep_checkpoints": 2,
        "fast_every_steps": 8, "seed": shape.seed, "price_usd_per_hour": 3.06,
        "instance_type": "p3.2xlarge", "num_threads": 1, "run_id": run_id,
        "telemetry_events_per_segment": shape.events_per_segment,
        "model": {"vocab_size": vocab_size, "block_size": block_size, "n_layer": shape.n_layer,
                  "n_head": shape.n_head, "n_embd": shape.n_embd},
    }


@dataclass
class Run:
    """One run folder worked on by one or more trainer processes."""

    run_dir: Path
    shards_dir: Path
    config: dict[str, Any]
    processes: int = 0

    @property
    def run_id(self) -> str:
        return self.config["run_id"]

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def telemetry(self) -> Path:
        return self.run_dir / "telemetry" / self.run_id

    @property
    def rank0(self) -> Path:
        return self.telemetry / "rank0"

    def result_path(self, index: int) -> Path:
        return self.run_dir / "jobs" / f"result-{index:03d}.json"

    def log_path(self, index: int) -> Path:
        return self.run_dir / "jobs" / f"worker-{index:03d}.log"

    def start(self, resume_from: str | None, preexec_fn=None) -> subprocess.Popen:
        """Starts the next trainer process of this run (its own session: signals reach only it)."""
        index = self.processes
        self.processes += 1
        folder = self.run_dir / "jobs"
        folder.mkdir(parents=True, exist_ok=True)
        job = {"shards_dir": str(self.shards_dir), "run_dir": str(self.run_dir),
               "result_path": str(self.result_path(index)), "resume_from": resume_from,
               "train_config": self.config}
        job_path = folder / f"job-{index:03d}.json"
        job_path.write_text(json.dumps(job, indent=1))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINWISE_TORCH_THREADS": "1",
               "PYTHONPATH": str(PROJECT_ROOT)}
        with open(self.log_path(index), "w") as log:
            return subprocess.Popen([sys.executable, "-m", WORKER_MODULE, str(job_path)],
                                    cwd=PROJECT_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, env=env, preexec_fn=preexec_fn)

    def result(self, index: int) -> dict[str, Any] | None:
        path = self.result_path(index)
        return json.loads(path.read_text()) if path.exists() else None

    def log_tail(self, index: int, lines: int = 3) -> str:
        path = self.log_path(index)
        text = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
        return " | ".join(text[-lines:])


def wait(process: subprocess.Popen, timeout_s: float = TRAINER_TIMEOUT_S) -> int:
    """The exit code; a trainer past `timeout_s` is SIGKILLed (code -9) rather than hanging."""
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.kill(process.pid, signal.SIGKILL)
        return process.wait()


def run_to_end(run: Run, resume_from: str | None) -> tuple[int, dict[str, Any] | None]:
    process = run.start(resume_from)
    code = wait(process)
    return code, run.result(run.processes - 1)


# -- watching a running trainer (cheap enough to poll every few ms) --------------------------------
def newest_step(rank0: Path) -> int:
    """The step of the newest step event in the newest non-empty segment (0 before any)."""
    try:
        names = sorted(n for n in os.listdir(rank0) if n.startswith("segment-")
                       and n.endswith(".jsonl"))
    except FileNotFoundError:
        return 0
    for name in reversed(names):
        try:
            data = (rank0 / name).read_bytes()
        except FileNotFoundError:
            continue
        for raw in reversed(data[: data.rfind(b"\n") + 1].splitlines()):
            if b'"type":"step"' in raw:
                try:
                    return int(json.loads(raw)["step"])
                except (ValueError, KeyError):
                    continue
    return 0


def temp_files(folder: Path) -> list[str]:
    """Temp files of atomic writes in `folder` (`.name.tmp`, `.name.tmp-PID`)."""
    try:
        return [n for n in os.listdir(folder) if n.startswith(".") and ".tmp" in n]
    except FileNotFoundError:
        return []


def uncommitted_payloads(folder: Path) -> list[str]:
    """`step-*.pt` files without their commit manifest (format 2 only)."""
    if not has_manifests():
        return []
    try:
        names = set(os.listdir(folder))
    except FileNotFoundError:
        return []
    return [n for n in names if n.startswith("step-") and n.endswith(".pt")
            and f"{n}.manifest.json" not in names]


def full_open_segment(rank0: Path, events_per_segment: int) -> bool:
    """A segment holds its last line but has no completion marker yet: its seal is under way."""
    try:
        names = set(os.listdir(rank0))
    except FileNotFoundError:
        return False
    if any(n.startswith(".") and "complete" in n for n in names):
        return True  # the marker's own temp file
    for name in names:
        if name.endswith(".jsonl") and name.replace(".jsonl", ".complete") not in names:
            try:
                if (rank0 / name).read_bytes().count(b"\n") >= events_per_segment:
                    return True
            except FileNotFoundError:
                continue
    return False


# -- checks after a fault ---------------------------------------------------------------------
def committed_checkpoints(folder: Path) -> list[Path]:
    """The checkpoints a resume may use: with manifests, those whose manifest exists."""
    if not folder.is_dir():
        return []
    paths = sorted(p for p in folder.iterdir()
                   if p.name.startswith("step-") and p.name.endswith(".pt"))
    if has_manifests():
        manifest = checkpoint_module().manifest_path
        paths = [p for p in paths if manifest(p).is_file()]
    return paths


def commit_marker(path: Path) -> Path:
    """The file whose appearance makes a checkpoint durable: its manifest, or the file itself."""
    return checkpoint_module().manifest_path(path) if has_manifests() else Path(path)


def corrupt_checkpoints(folder: Path) -> list[tuple[str, str]]:
    """(file, error) for every committed checkpoint that does not load."""
    load = checkpoint_module().load_checkpoint
    bad = []
    for path in committed_checkpoints(folder):
        try:
            load(path)
        except Exception as error:  # noqa: BLE001 - any failure is a corrupt checkpoint here
            bad.append((path.name, f"{type(error).__name__}: {str(error)[:200]}"))
    return bad


@dataclass
class ResumePoint:
    resume_from: str | None  # what the trainer is given (a folder with format 2, else a file)
    step: int  # 0: nothing to resume from, a fresh start
    skipped: list[str] = field(default_factory=list)


def resume_point(folder: Path) -> ResumePoint:
    """Where a restarted trainer resumes: the newest good checkpoint (`latest_good_checkpoint`
    when the tree has it; else the newest file). With format 2 the trainer gets the folder and
    picks it itself, as a re-executed run does."""
    module = checkpoint_module()
    if hasattr(module, "latest_good_checkpoint"):
        good = module.latest_good_checkpoint(folder)
        if good is None:
            return ResumePoint(None, 0)
        return ResumePoint(str(folder), int(good.step), [f"{p.name}: {why[:160]}"
                                                         for p, why in good.skipped])
    newest = module.latest_checkpoint(folder)
    if newest is None:
        return ResumePoint(None, 0)
    return ResumePoint(str(newest), int(newest.stem.split("-")[1]))


def recorded_steps(run: Run) -> list[tuple[int, float]]:
    """(step, train_loss) of every step event of the run's rank 0, in the order written."""
    from telemetry.reader import read_run_events

    if not run.telemetry.is_dir():
        return []
    return [(int(r["step"]), r["train_loss"]) for r in read_run_events(run.telemetry, rank=0)
            if r["type"] == "step"]


@dataclass(frozen=True)
class Reference:
    """The uninterrupted run every trial is compared with (same config, one thread)."""

    steps: int
    final_eval_loss: float
    losses: dict[int, float]
    params: dict[str, Any]
    step_s: float  # mean wall seconds per step (elapsed / steps)

    @classmethod
    def train(cls, work_dir: Path, shards_dir: Path, config: dict[str, Any]) -> Reference:
        run = Run(work_dir / "reference", shards_dir, {**config, "run_id": "reference"})
        code, result = run_to_end(run, None)
        if code != 0 or result is None or result["status"] != "completed":
            raise RuntimeError(f"the reference run failed (exit {code}): {run.log_tail(0, 20)}")
        state = checkpoint_module().load_checkpoint(result["checkpoint_path"])
        return cls(result["steps"], result["final_eval_loss"], dict(recorded_steps(run)),
                   state["model"], result["elapsed_s"] / max(1, result["steps"]))


def matches_reference(result: dict[str, Any], run: Run, reference: Reference) -> dict[str, Any]:
    """Bit-for-bit: final parameters, final eval loss, and every recorded step loss (replayed
    steps included) against the uninterrupted run."""
    import torch

    state = checkpoint_module().load_checkpoint(result["checkpoint_path"])
    params = state["model"]
    same_params = params.keys() == reference.params.keys() and all(
        torch.equal(params[k], reference.params[k]) for k in params)
    losses = recorded_steps(run)
    differing = [s for s, loss in losses if reference.losses.get(s) != loss]
    return {"params_identical": bool(same_params),
            "eval_loss_identical": result["final_eval_loss"] == reference.final_eval_loss,
            "step_losses_differing": len(differing)}


def audit_telemetry(run: Run, db_path: Path, max_steps: int) -> dict[str, Any]:
    """Ingest the run twice and count what the store lost or holds twice.

    rows_lost / rows_duplicated: complete lines in the files vs rows in the store. For the step
    events the store marks as not replayed: steps of 1..max_steps missing (lost) or present more
    than once (duplicated). Replayed steps (`is_replay`) are not duplicates; without that column
    every repeat counts as a duplicate.
    """
    import duckdb

    from telemetry.reader import read_run_events
    from telemetry.store import ingest

    lines = len(read_run_events(run.telemetry))
    first = ingest(run.telemetry, db_path)
    second = ingest(run.telemetry, db_path)
    with duckdb.connect(str(db_path), read_only=True) as con:
        names = {row[0] for row in con.execute("DESCRIBE telemetry_events").fetchall()}
        replay = "is_replay" if "is_replay" in names else "false"
        rows = con.execute("SELECT count(*) FROM telemetry_events WHERE run_id = ?",
                           [run.run_id]).fetchone()[0]
        steps = con.execute(
            f"SELECT step, {replay} FROM telemetry_events WHERE run_id = ? "
            "AND event_type = 'step'", [run.run_id]).fetchall()
    fresh = [int(s) for s, is_replay in steps if not is_replay]
    missing = sorted(set(range(1, max_steps + 1)) - set(fresh))
    return {
        "file_lines": lines, "store_rows": int(rows), "first_ingest": first,
        "second_ingest": second, "rows_lost": max(0, lines - rows) + len(missing),
        "rows_duplicated": max(0, rows - lines) + len(fresh) - len(set(fresh)) + second,
        "replay_rows": sum(1 for _, r in steps if r), "replay_column": replay == "is_replay",
    }


def record(obj: Any) -> dict[str, Any]:
    return asdict(obj)


def wait_for(predicate, timeout_s: float, poll_s: float = 0.0003) -> bool:
    """Polls `predicate` until true (True) or the timeout (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll_s)
    return False
