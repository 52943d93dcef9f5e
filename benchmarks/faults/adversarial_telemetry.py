"""Adversarial telemetry (issue 31, classes `planted_bill` and `full_telemetry_disk`): generated
cases against the real trainer (`training.loop.train`, in this process, on a tiny GPT over
synthetic data: no shards needed, so `suite` is not used).

planted_bill. A base run is made (stopped with a checkpoint, or killed -9 by its own fast policy
at a random fast tick past a checkpoint, in a forked child), copied per case, tampered with,
then resumed. The truth is what the trainer itself committed before the tampering: the
checkpoint it resumes from and the newest clock and step its genuine telemetry recorded.
`bill_changed`: the resumed run's `lost_s` or replay range differs from that truth. Tampering:
- telemetry: a sealed segment with a self-consistent marker (a huge clock and step, or a
  plausible few minutes more), an open segment, a run_end record, a segment in another rank's
  folder, a real line edited and its segment resealed; expected "warned" (the cross-check
  records it, the bill ignores it);
- a marker rewritten to declare real lines torn; expected "refused" by the reader and by
  ingestion, naming the marker (`rows_lost`: real lines that vanished silently);
- forged ledger lines: without any key (the trainer's ledger unkeyed: the forger's best case)
  a huge clock, a step jump, a future wall time, a forged process, another run's line; with the
  deployment's key a plausible line made without it or with a guessed key, an edited earlier
  line, a re-labelled copy of a real line; expected "warned".

full_telemetry_disk. The telemetry disk fills at a random write (the writer's `_write_fd`
fault-injected, as the tests do) or for real (a small tmpfs mounted at the run's `telemetry`
folder and filled, where mounting is allowed); the trainer must stop naming the folder
(expected "refused"), then, space freed, resume to the end. `rows_lost`: step and eval rows of
1..max_steps missing from DuckDB after ingesting twice, plus rows stored twice.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import signal
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.faults.adversarial import Case
from controllers.fast_types import NoOpFastPolicy
from telemetry.events import RunEndEvent, StepEvent, to_record
from telemetry.reader import (
    TelemetryFormatError,
    latest_recorded,
    list_segments,
    read_run_events,
    read_segment_lines,
)
from telemetry.writer import seal_segment
from training import ledger as ledger_module
from training.checkpoint import latest_good_checkpoint, load_checkpoint
from training.data_types import ExampleSet
from training.ledger import LEDGER_KEY_ENV, ledger_path, line_mac
from training.loop import TrainConfig, TrainingStoppedError, train
from training.model import GPTConfig

RUN_ID = "adv"
MAX_STEPS = 24
STOP_STEP = 8
VOCAB = tuple("abcdefgh")
HUGE_S = 10_000_000.0
HUGE_STEP = 10_000_000
SEED = 31


def _examples() -> ExampleSet:
    starts = np.random.default_rng(0).integers(0, len(VOCAB), 256)
    inputs = (starts[:, None] + np.arange(17)[None, :]) % len(VOCAB)
    is_eval = np.zeros(256, dtype=bool)
    is_eval[::8] = True
    return ExampleSet(
        partition="cycle", kind="text", example_ids=np.arange(256, dtype=np.int64) * 3 + 1,
        is_eval=is_eval, inputs=inputs.astype(np.int64), labels=None, vocab=VOCAB,
        shard_index=np.zeros(256, dtype=np.int32), fingerprint="a" * 64)


EXAMPLES = _examples()


def _config() -> TrainConfig:
    return TrainConfig(
        max_steps=MAX_STEPS, micro_batch_size=8, grad_accum_steps=2, learning_rate=3e-3,
        min_learning_rate=3e-4, warmup_steps=3, eval_every_steps=8, eval_batches=2,
        eval_batch_size=16, checkpoint_every_steps=8, keep_checkpoints=10, fast_every_steps=4,
        seed=7, price_usd_per_hour=3.06, instance_type="p3.2xlarge", run_id=RUN_ID,
        num_threads=1,
        model=GPTConfig(vocab_size=len(VOCAB), block_size=16, n_layer=1, n_head=2, n_embd=32))


class _KilledAt(NoOpFastPolicy):
    """SIGKILLs its own process at a fast tick (after that step's record): a lost node."""

    def __init__(self, step: int) -> None:
        self.step = step

    def act(self, observation):  # noqa: ANN001, ANN201 - the FastPolicy protocol
        if observation.step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().act(observation)


@contextlib.contextmanager
def _ledger_keyed(mode: str) -> Iterator[None]:
    """"default": the key derived from the deployment's; "explicit": TRAINWISE_LEDGER_KEY;
    "unkeyed": no key at all (what a deployment without one would write)."""
    before = os.environ.get(LEDGER_KEY_ENV)
    derived = ledger_module._derived_key
    os.environ.pop(LEDGER_KEY_ENV, None)
    if mode == "explicit":
        os.environ[LEDGER_KEY_ENV] = "adversarial-" + hashlib.sha256(b"k").hexdigest()[:16]
    elif mode == "unkeyed":
        ledger_module._derived_key = lambda: b""  # type: ignore[assignment]
    try:
        yield
    finally:
        ledger_module._derived_key = derived  # type: ignore[assignment]
        if before is None:
            os.environ.pop(LEDGER_KEY_ENV, None)
        else:
            os.environ[LEDGER_KEY_ENV] = before


def _quiet(call: Callable[[], Any]) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        return call(), [str(w.message) for w in caught]


# -- base runs and their truth -------------------------------------------------------------------
def _stopped(folder: Path) -> None:
    _quiet(lambda: train(_config(), EXAMPLES, None, folder, stop_after_steps=STOP_STEP))


def _killed(folder: Path, step: int) -> None:
    pid = os.fork()
    if pid == 0:  # the child never returns into the caller
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                train(_config(), EXAMPLES, None, folder, fast_policy=_KilledAt(step))
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
        raise RuntimeError(f"the base run killed at step {step} ended otherwise ({status})")


@dataclass(frozen=True)
class _Truth:
    checkpoint_step: int
    lost_s: float
    replay_to_step: int | None


def _truth(folder: Path) -> _Truth:
    """What the trainer committed: the checkpoint a resume takes and its genuine telemetry."""
    good = latest_good_checkpoint(folder / "checkpoints")
    assert good is not None, f"no checkpoint in {folder}"
    state = load_checkpoint(good.path)
    recorded = latest_recorded(folder / "telemetry" / RUN_ID)
    assert recorded is not None
    step, elapsed_s = recorded
    return _Truth(int(state["step"]), max(0.0, elapsed_s - float(state["elapsed_s"])),
                  step if step > int(state["step"]) else None)


def _resume(folder: Path) -> tuple[dict[str, Any] | None, list[str], str]:
    """(the resumed run's run_start record, warnings, error) of a resume to the end."""
    try:
        _, said = _quiet(lambda: train(_config(), EXAMPLES, None, folder,
                                       resume_from=folder / "checkpoints"))
    except Exception as error:  # noqa: BLE001 - the finding
        return None, [], f"{type(error).__name__}: {error}"
    return _last_run_start(folder), said, ""


def _last_run_start(folder: Path) -> dict[str, Any] | None:
    """The newest run_start record; segments a case made unreadable are skipped (the newest
    process wrote its own segment)."""
    found = None
    for segment in list_segments(folder / "telemetry" / RUN_ID):
        try:
            lines = read_segment_lines(segment)
        except ValueError:
            continue
        for _, record in lines:
            if record["type"] == "run_start" and segment.rank == 0:
                found = record
    return found


def _bill_case(name: str, folder: Path, truth: _Truth, expected: str = "warned") -> Case:
    start, said, error = _resume(folder)
    if start is None:
        return Case("planted_bill", name, expected, "crashed", detail=error or "no run_start")
    lost_s = start["lost_s"]
    changed = (lost_s is None or abs(lost_s - truth.lost_s) > 1e-9
               or start["replay_to_step"] != truth.replay_to_step
               or (truth.replay_to_step is not None
                   and start["replay_from_step"] != truth.checkpoint_step))
    noted = start.get("billing_warnings") or [s for s in said if "resume bill" in s]
    return Case("planted_bill", name, expected, "warned" if noted else "accepted",
                bill_changed=changed,
                detail=(f"lost_s {lost_s} vs {truth.lost_s:.6f}, replay_to "
                        f"{start['replay_to_step']} vs {truth.replay_to_step}; "
                        + ("; ".join(noted)[:200] if noted else "no warning")))


# -- tampering with telemetry ------------------------------------------------------------------------
def _rank_dir(folder: Path, rank: int = 0) -> Path:
    path = folder / "telemetry" / RUN_ID / f"rank{rank}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _step_record(step: int, elapsed_s: float, rank: int = 0) -> dict[str, Any]:
    return to_record(StepEvent(
        run_id=RUN_ID, rank=rank, step=step, train_loss=1.0, learning_rate=1e-3, grad_norm=1.0,
        grad_noise_scale=1.0, micro_batch_size=8, grad_accum_steps=2, step_time_ms=1.0,
        samples_seen=step * 16, tokens_seen=step * 256, elapsed_s=elapsed_s,
        cost_usd=elapsed_s * 3.06 / 3600))


def _plant(folder: Path, records: list[dict[str, Any]], *, rank: int = 0, sealed: bool = True,
           index: int = 90) -> None:
    path = _rank_dir(folder, rank) / f"segment-{index:05d}.jsonl"
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))
    if sealed:
        seal_segment(path)  # a marker that matches: the forger's best effort


def _newest_step_segment(folder: Path) -> Path:
    rank0 = _rank_dir(folder)
    for path in sorted(rank0.glob("segment-*.jsonl"), reverse=True):
        if b'"type":"step"' in path.read_bytes():
            return path
    raise RuntimeError(f"no step record in {rank0}")


def _edit_real_line(folder: Path, rng: np.random.Generator) -> None:
    segment = _newest_step_segment(folder)
    lines = segment.read_bytes().splitlines(keepends=True)
    at = max(i for i, raw in enumerate(lines) if b'"type":"step"' in raw)
    record = json.loads(lines[at])
    record["elapsed_s"] = float(rng.uniform(1e5, HUGE_S))
    lines[at] = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    segment.write_bytes(b"".join(lines))
    if segment.with_suffix(".complete").exists():
        seal_segment(segment)


def telemetry_plants(truth_s: float, newest_step: int, rng: np.random.Generator
                     ) -> dict[str, Callable[[Path], None]]:
    """name -> a function planting it into a copied run folder."""
    modest_s = truth_s + float(rng.uniform(30, 600))
    modest_step = newest_step + int(rng.integers(1, 6))
    end = to_record(RunEndEvent(
        run_id=RUN_ID, step=newest_step, status="completed", elapsed_s=HUGE_S,
        cost_usd=HUGE_S * 3.06 / 3600, samples_seen=0, tokens_seen=0, final_eval_loss=None,
        final_eval_accuracy=None, checkpoint_path=None, checkpoint_sha256=None))
    return {
        "sealed_segment_huge_clock_and_step": lambda f: _plant(
            f, [_step_record(HUGE_STEP, HUGE_S)]),
        "sealed_segment_plausible_clock": lambda f: _plant(
            f, [_step_record(modest_step, modest_s)]),
        "open_segment_huge_clock": lambda f: _plant(f, [_step_record(HUGE_STEP, HUGE_S)],
                                                    sealed=False),
        "sealed_run_end_huge_clock": lambda f: _plant(f, [end]),
        "other_rank_folder_huge_clock": lambda f: _plant(
            f, [_step_record(HUGE_STEP, HUGE_S, rank=1)], rank=1),
        "real_line_edited_and_resealed": lambda f: _edit_real_line(f, rng),
    }


def _torn_marker_case(name: str, folder: Path, truth: _Truth) -> Case:
    """A marker declaring every line but the first torn: the reader and ingestion must refuse,
    naming the marker; the resume bills as before."""
    segment = _newest_step_segment(folder)
    data = segment.read_bytes()
    keep = data[: data.index(b"\n") + 1]
    marker = segment.with_suffix(".complete")
    marker.write_text(json.dumps({"lines": 1, "bytes": len(keep), "recovered": True,
                                  "sha256": hashlib.sha256(keep).hexdigest(),
                                  "torn_bytes": len(data) - len(keep)}))
    real_lines = data.count(b"\n")
    telemetry_dir = folder / "telemetry" / RUN_ID
    refusals = []
    try:
        kept = [s for s in list_segments(telemetry_dir) if s.path == segment]
        read = read_segment_lines(kept[0])
        refusals.append(False)
        silently_lost = real_lines - len(read)  # real lines the reader dropped without a word
    except TelemetryFormatError as error:
        refusals.append(str(marker) in str(error))
        silently_lost = 0
    try:
        from telemetry.store import ingest

        ingest(telemetry_dir, folder / "t.duckdb")
        refusals.append(False)
    except TelemetryFormatError as error:
        refusals.append(str(marker) in str(error))
    bill = _bill_case(name, folder, truth, expected="refused")
    outcome = "refused" if all(refusals) else ("crashed" if bill.outcome == "crashed"
                                               else "accepted")
    return Case("planted_bill", name, "refused", outcome, bill_changed=bill.bill_changed,
                rows_lost=silently_lost, detail=f"read/ingest refused naming the marker: "
                f"{refusals}; {bill.detail}")


# -- forging ledger lines --------------------------------------------------------------------------
def _ledger_lines(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in ledger_path(folder, RUN_ID).read_bytes().splitlines()]


def _append(folder: Path, fields: dict[str, Any], key: bytes, keep_mac: bool = False) -> None:
    fields = dict(fields)
    if not keep_mac:
        fields.pop("mac", None)
        fields["mac"] = line_mac(key, fields)
    with open(ledger_path(folder, RUN_ID), "a") as handle:
        handle.write(json.dumps(fields) + "\n")


def _chained(folder: Path, **changes: Any) -> dict[str, Any]:
    last = _ledger_lines(folder)[-1]
    return {**last, "n": last["n"] + 1, "prev": last["mac"], "wall_time_s": time.time(),
            **changes}


def _forge_process(folder: Path, key: bytes, step: int) -> None:
    start = _chained(folder, kind="start", proc="forged-1", step=step, elapsed_s=HUGE_S)
    _append(folder, start, key)
    _append(folder, _chained(folder, kind="step", proc="forged-1", step=step + 1,
                             elapsed_s=HUGE_S + 1.0), key)


def _edit_earlier_line(folder: Path) -> None:
    path = ledger_path(folder, RUN_ID)
    lines = path.read_bytes().splitlines()
    edited = json.loads(lines[2])
    edited["elapsed_s"] = edited["elapsed_s"] + 0.25
    lines[2] = json.dumps(edited).encode()
    path.write_bytes(b"\n".join(lines) + b"\n")


def ledger_forgeries(mode: str, checkpoint_step: int, rng: np.random.Generator
                     ) -> dict[str, Callable[[Path], None]]:
    if mode == "unkeyed":
        # The forger computes the (keyless) mac: only the clock and step checks stand.
        return {
            "unkeyed_ledger_huge_clock": lambda f: _append(f, _chained(f, elapsed_s=HUGE_S), b""),
            "unkeyed_ledger_step_jump": lambda f: _append(
                f, _chained(f, kind="step", step=HUGE_STEP), b""),
            "unkeyed_ledger_future_wall_time": lambda f: _append(f, _chained(
                f, wall_time_s=time.time() + 86_400 * float(rng.uniform(1, 30)),
                elapsed_s=float(rng.uniform(1e3, 1e6))), b""),
            "unkeyed_ledger_forged_process": lambda f: _forge_process(f, b"", checkpoint_step),
            "unkeyed_ledger_line_of_another_run": lambda f: _append(
                f, _chained(f, run_id="other-run", elapsed_s=HUGE_S), b""),
        }
    plausible_s = float(rng.uniform(5, 60))
    return {
        "keyed_ledger_plausible_line_without_key": lambda f: _append(f, _chained(
            f, elapsed_s=_ledger_lines(f)[-1]["elapsed_s"] + plausible_s), b""),
        "keyed_ledger_plausible_line_guessed_key": lambda f: _append(f, _chained(
            f, kind="step", step=_ledger_lines(f)[-1]["step"] + 1,
            elapsed_s=_ledger_lines(f)[-1]["elapsed_s"] + plausible_s), b"trainwise"),
        "keyed_ledger_earlier_line_edited": _edit_earlier_line,
        "keyed_ledger_real_line_relabelled": lambda f: _append(f, _chained(
            f, elapsed_s=_ledger_lines(f)[-1]["elapsed_s"] + plausible_s,
            mac=_ledger_lines(f)[-1]["mac"]), b"", keep_mac=True),
    }


# -- the planted_bill cases ------------------------------------------------------------------------
def _planted_bill_cases(work_dir: Path, rng: np.random.Generator) -> list[Case]:
    found: list[Case] = []
    kill_steps = sorted(rng.choice([12, 16, 20], size=2, replace=False).tolist())
    plans = [("default", "stopped", None)] + [("default", f"killed{k}", k) for k in kill_steps]
    plans += [(mode, name, step) for mode in ("unkeyed", "explicit")
              for name, step in (("stopped", None), (f"killed{kill_steps[-1]}", kill_steps[-1]))]
    for mode, scenario, kill_step in plans:
        with _ledger_keyed(mode):
            base = work_dir / "bases" / f"{mode}-{scenario}"
            if kill_step is None:
                _stopped(base)
            else:
                _killed(base, kill_step)
            truth = _truth(base)
            recorded = latest_recorded(base / "telemetry" / RUN_ID)
            assert recorded is not None
            newest_step, newest_s = recorded
            if mode == "default":
                tampering = telemetry_plants(newest_s, newest_step, rng)
            else:
                tampering = ledger_forgeries(mode, truth.checkpoint_step, rng)
            for name, tamper in tampering.items():
                folder = work_dir / "cases" / f"{mode}-{scenario}-{name}"
                shutil.copytree(base, folder, symlinks=True)
                try:
                    tamper(folder)
                except (OSError, ValueError, IndexError) as error:  # e.g. no ledger to forge
                    found.append(Case("planted_bill", f"{scenario}/{name}", "warned", "crashed",
                                      detail=f"could not tamper: {type(error).__name__}: "
                                             f"{error}"))
                    continue
                found.append(_bill_case(f"{scenario}/{name}", folder, truth))
            if mode == "default":
                folder = work_dir / "cases" / f"{mode}-{scenario}-torn_marker"
                shutil.copytree(base, folder, symlinks=True)
                found.append(_torn_marker_case(f"{scenario}/marker_declares_real_lines_torn",
                                               folder, truth))
    return found


# -- full telemetry disk ---------------------------------------------------------------------------
class _RefusingDisk:
    """An `os.write` failing with ENOSPC for files under `root` after `budget` writes there."""

    def __init__(self, root: Path, budget: int) -> None:
        self.root, self.budget, self.full = str(root), budget, True
        self.real_write = os.write

    def __call__(self, fd: int, data: bytes) -> int:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if self.full and target.startswith(self.root):
            if self.budget <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.budget -= 1
        return self.real_write(fd, data)


def _expected_rows() -> Counter:
    steps = Counter(("step", s) for s in range(1, MAX_STEPS + 1))
    evals = Counter(("eval", s) for s in range(8, MAX_STEPS + 1, 8))
    return steps + evals


def _rows_lost(folder: Path) -> tuple[int, str]:
    """Step and eval rows missing from the store (non-replay), plus rows stored twice."""
    import duckdb

    from telemetry.store import ingest

    telemetry_dir = folder / "telemetry" / RUN_ID
    db = folder / "t.duckdb"
    ingest(telemetry_dir, db)
    again = ingest(telemetry_dir, db)
    with duckdb.connect(str(db), read_only=True) as con:
        rows = con.execute(
            "SELECT event_type, step, is_replay, payload ->> 'wall_time_s' FROM telemetry_events "
            "WHERE event_type IN ('step', 'eval')").fetchall()
    fresh = Counter((kind, step) for kind, step, replay, _ in rows if not replay)
    expected = _expected_rows()
    missing = sum((expected - fresh).values())
    twice = sum((fresh - expected).values()) + again + sum(
        n - 1 for n in Counter((k, s, w) for k, s, _, w in rows).values() if n > 1)
    return missing + twice, f"missing {missing}, stored twice {twice}"


def _stop_outcome(call: Callable[[], Any], telemetry_dir: Path) -> tuple[str, str]:
    try:
        _quiet(call)
    except TrainingStoppedError as error:
        named = str(telemetry_dir) in str(error)
        return ("refused" if named else "accepted"), str(error)[:160]
    except Exception as error:  # noqa: BLE001 - the finding
        return "crashed", f"{type(error).__name__}: {error}"
    return "accepted", "the run did not stop"


def _full_disk_case(name: str, folder: Path, budget: int, full_resumes: int) -> Case:
    import telemetry.writer as writer_module

    telemetry_dir = folder / "telemetry" / RUN_ID
    disk = _RefusingDisk(folder / "telemetry", budget)
    real = writer_module._write_fd
    writer_module._write_fd = disk  # type: ignore[assignment]
    try:
        outcome, detail = _stop_outcome(lambda: train(_config(), EXAMPLES, None, folder),
                                        telemetry_dir)
        for _ in range(full_resumes):  # resumed with the disk still full: stops again at once
            disk.budget = 1
            again, _ = _stop_outcome(lambda: train(_config(), EXAMPLES, None, folder,
                                                   resume_from=folder / "checkpoints"),
                                     telemetry_dir)
            outcome = outcome if again == "refused" else again
        disk.full = False
        return _finish_full_disk(name, folder, outcome, detail)
    finally:
        writer_module._write_fd = real  # type: ignore[assignment]


def _finish_full_disk(name: str, folder: Path, outcome: str, detail: str) -> Case:
    start, _, error = _resume(folder)
    if start is None:
        return Case("full_telemetry_disk", name, "refused", "crashed", detail=error)
    lost, how = _rows_lost(folder)
    return Case("full_telemetry_disk", name, "refused", outcome, rows_lost=lost,
                detail=f"{how}; {detail}")


def _mount_tmpfs(folder: Path, size_bytes: int) -> str | None:
    from benchmarks.faults.environment import mount_tmpfs

    return mount_tmpfs(folder, size_bytes)


def _tmpfs_case(name: str, folder: Path, leave_bytes: int) -> Case | None:
    """A real ENOSPC: a tmpfs at the run's telemetry folder (inside the run folder, so the
    trainer's inside-the-folder check holds), filled to `leave_bytes`. None: mount refused."""
    from benchmarks.faults.environment import fill, umount

    mount = folder / "telemetry"
    if _mount_tmpfs(mount, 256 * 1024) is not None:
        return None
    try:
        fill(mount, leave_bytes=leave_bytes)
        outcome, detail = _stop_outcome(lambda: train(_config(), EXAMPLES, None, folder),
                                        mount / RUN_ID)
        (mount / "filler").unlink()  # the fix the error names: free space
        return _finish_full_disk(name, folder, outcome, detail)
    finally:
        umount(mount)


def _full_disk_cases(work_dir: Path, rng: np.random.Generator) -> list[Case]:
    reference = work_dir / "reference"
    _quiet(lambda: train(_config(), EXAMPLES, None, reference))
    lines = len(read_run_events(reference / "telemetry" / RUN_ID))
    budgets = sorted({2, lines - 3, lines - 1, *rng.integers(3, lines - 3, size=3).tolist()})
    found = [_full_disk_case(f"injected_enospc_after_{b}_writes",
                             work_dir / f"injected-{b}", int(b), 0) for b in budgets]
    found.append(_full_disk_case("injected_enospc_resumed_twice_while_full",
                                 work_dir / "injected-twice", int(rng.integers(5, lines - 5)), 2))
    for leave in (4096, 12288):
        case = _tmpfs_case(f"tmpfs_full_leaving_{leave}_bytes", work_dir / f"tmpfs-{leave}", leave)
        if case is not None:
            found.append(case)
    return found


def cases(work_dir: Path, suite: Any = None) -> list[Case]:
    """Every case of the two classes, each in its own folder under `work_dir`."""
    work_dir = Path(work_dir)
    rng = np.random.default_rng(SEED)
    with _ledger_keyed("default"):
        found = _planted_bill_cases(work_dir / "planted", rng)
        found += _full_disk_cases(work_dir / "full_disk", rng)
    return found


if __name__ == "__main__":  # python -m benchmarks.faults.adversarial_telemetry WORK_DIR
    import sys
    import tempfile

    began = time.monotonic()
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    results = cases(target)
    for case in results:
        print(f"{'ok ' if case.passed else 'BAD'} {case.defect_class:20s} {case.case:60s} "
              f"{case.outcome:8s} {case.detail[:120]}")
    print(f"{sum(c.passed for c in results)}/{len(results)} passed in "
          f"{time.monotonic() - began:.0f} s")
