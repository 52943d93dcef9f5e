"""Adversarial cases of the run folder itself (issue 31): links planted at the names the trainer
writes, the lock's file deleted or its folder replaced while held, the work a kill loses with a
background save in flight, and names, settings and SIGTERM at the edges of a run.

Classes and what each generated case does (every one calls the real function):

- `write_outside_folder`: each predictable name the trainer writes (the lock record, the
  telemetry marker and its old temp name, a segment, the consumption record, the worker's result
  file and its old temp name) planted as a symlink to a file outside the run folder, a symlink
  to a file inside it, a dangling symlink outside (an open with O_CREAT would create it there),
  a hard link to each, or a FIFO for the files read or appended; and each state folder
  (`checkpoints`, `telemetry`, `telemetry/<run_id>`, `.../rank0`) as a link to a folder outside.
  Expected: "fell_back" for files rewritten whole (the planted entry is replaced by a rename,
  its target untouched), "refused" for files appended to or read and for folders.
- `deleted_lock`: `.run.lock` deleted (or swapped for a link) while held, then a second lock, a
  second `train()`, or with `suite` a second real trainer process; the run folder removed or
  replaced while held, then the holder's check, checkpoint and telemetry write. Expected:
  "refused", with a message that names what happened (not "free disk space").
- `lost_work_bound`: `train()` with one background save held in flight (an event, no clock) and
  a kill at the worst moment and mid-interval; the steps lost against
  `training._loop_persist.max_lost_steps`. Expected: "fell_back" (the resume point is the newest
  durable checkpoint, within the stated bound); "accepted" would mean more lost than stated.
- `small`: run ids with a newline, `..`, slashes; TRAINWISE_DEMO_PARTITION with `..`; SIGTERM
  while the worker starts, inside `train()` before the loop's handler, and after `train()`.

Every case writes a sentinel file in a folder beside its run folder; `write_outside` is True when
anything there changed or appeared. Only `deleted_lock/second_trainer_process` needs `suite`
(its shards and run shape; about 15 s); with `suite=None` it is left out and the rest run in
about 20 s on one core.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.faults.adversarial import Case

SENTINEL = b"a file outside the run folder that no trainer may change\n"
INSIDE_NAME = "keep.txt"  # a file inside the run folder that a link may point at
RUN_ID = "adv"
NEEDS_SUITE = ("second_trainer_process",)
Outcome = tuple[str, str]  # (outcome, detail)
Action = Callable[[Path, Path], Outcome]  # (run folder, outside folder) -> outcome


# -- running one case ------------------------------------------------------------------------
def _snapshot(folder: Path) -> dict[str, tuple]:
    """Every entry under `folder` (links not followed): kind, size, content digest or target."""
    seen: dict[str, tuple] = {}
    for path in sorted(folder.rglob("*")):
        name = str(path.relative_to(folder))
        if path.is_symlink():
            seen[name] = ("link", os.readlink(path))
        elif path.is_file():
            seen[name] = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
        else:
            seen[name] = ("other", path.lstat().st_mode)
    return seen


def _refusal_types() -> tuple[type[BaseException], ...]:
    from telemetry.writer import TelemetryFolderError
    from training.run_lock import RunFolderLockedError, RunFolderReplacedError
    from training.safe_files import UnsafeStatePathError
    from trainwise.settings import SettingError

    return (UnsafeStatePathError, TelemetryFolderError, RunFolderLockedError,
            RunFolderReplacedError, SettingError)


def _run_case(work_dir: Path, defect_class: str, name: str, expected: str,
              action: Action) -> Case:
    root = work_dir / defect_class / name.replace("/", "__")
    shutil.rmtree(root, ignore_errors=True)
    run, outside = root / "run", root / "outside"
    run.mkdir(parents=True)
    outside.mkdir()
    (outside / "sentinel.txt").write_bytes(SENTINEL)
    (run / INSIDE_NAME).write_bytes(SENTINEL)
    before = _snapshot(outside)
    try:
        outcome, detail = action(run, outside)
    except _refusal_types() as error:
        outcome, detail = "refused", f"{type(error).__name__}: {error}"
    except Exception as error:  # noqa: BLE001 - any other error is the finding "crashed"
        outcome, detail = "crashed", f"{type(error).__name__}: {error}"
    if outcome != "crashed" and (run / INSIDE_NAME).exists() \
            and (run / INSIDE_NAME).read_bytes() != SENTINEL:
        outcome, detail = "accepted", f"wrote through a link into {INSIDE_NAME}; {detail}"
    return Case(defect_class=defect_class, case=name, expected=expected, outcome=outcome,
                write_outside=_snapshot(outside) != before, detail=detail)


# -- write_outside_folder ----------------------------------------------------------------------
def _write_lock(run: Path) -> None:
    from training.run_lock import RunFolderLock

    with RunFolderLock(run):
        pass


def _write_telemetry(run: Path) -> None:
    from telemetry.writer import SegmentWriter

    with SegmentWriter(run / "telemetry", RUN_ID, events_per_segment=1) as writer:
        writer.write({"type": "step", "run_id": RUN_ID, "rank": 0, "step": 1})  # seals seg. 0


def _write_consumption(run: Path) -> None:
    from training.consumption import ConsumptionWriter, consumption_path

    ConsumptionWriter(consumption_path(run / "telemetry", RUN_ID), start_step=0).close()


def _write_result(run: Path) -> None:
    from trainwise.emulated_worker import write_json_atomic

    write_json_atomic(run / "jobs" / "result-000.json", {"status": "completed"})


RANK0 = f"telemetry/{RUN_ID}/rank0"
# name -> (path in the run folder, the real write, expected outcome, link kinds to plant)
WHOLE_FILE_KINDS = ("symlink_outside", "symlink_inside", "dangling_outside", "hardlink_outside",
                    "hardlink_inside")
PLANTED_FILES: dict[str, tuple[str, Callable[[Path], None], str, tuple[str, ...]]] = {
    "lock_record": (".run.lock", _write_lock, "fell_back", WHOLE_FILE_KINDS),
    "marker_old_temp": (f"{RANK0}/.segment-00000.complete.tmp", _write_telemetry, "fell_back",
                        WHOLE_FILE_KINDS),
    "marker": (f"{RANK0}/segment-00000.complete", _write_telemetry, "fell_back",
               WHOLE_FILE_KINDS),
    "segment": (f"{RANK0}/segment-00000.jsonl", _write_telemetry, "refused",
                ("symlink_outside", "symlink_inside", "dangling_outside", "fifo")),
    "consumption": (f"telemetry/{RUN_ID}/consumption.jsonl", _write_consumption, "refused",
                    (*WHOLE_FILE_KINDS, "fifo")),
    "result_old_temp": ("jobs/.result-000.json.tmp", _write_result, "fell_back",
                        WHOLE_FILE_KINDS),
    "result": ("jobs/result-000.json", _write_result, "fell_back", WHOLE_FILE_KINDS),
}
PLANTED_FOLDERS: dict[str, tuple[str, Callable[[Path], None]]] = {
    "checkpoints_folder": ("checkpoints", _write_lock),
    "telemetry_folder": ("telemetry", _write_lock),
    "run_telemetry_folder": (f"telemetry/{RUN_ID}", _write_telemetry),
    "rank_folder": (RANK0, _write_telemetry),
}


def _plant(path: Path, kind: str, run: Path, outside: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
        return
    where, how = kind.split("_")
    if where == "dangling":
        os.symlink(outside / "created-through-link.txt", path)
        return
    target = outside / "sentinel.txt" if how == "outside" else run / INSIDE_NAME
    os.symlink(target, path) if where == "symlink" else os.link(target, path)


def _planted_file_action(relative: str, write: Callable[[Path], None], kind: str) -> Action:
    """A planted name the trainer writes (it must replace the entry) or used to write as a temp
    name (it must leave it alone); either way the link's target stays as it was, which
    `_run_case` checks (the sentinel outside, `keep.txt` inside)."""
    def action(run: Path, outside: Path) -> Outcome:
        path = run / relative
        _plant(path, kind, run, outside)
        write(run)
        if relative.endswith(".tmp"):
            return "fell_back", (f"{relative}: an old fixed temp name, no longer used; the "
                                 f"planted {kind} is left alone, its target untouched")
        if path.is_symlink() or (path.exists() and path.stat().st_nlink > 1):
            return "accepted", f"{relative} is still the planted {kind}: written through it"
        return "fell_back", f"{relative}: the planted {kind} was replaced, its target untouched"
    return action


def _planted_folder_action(relative: str, write: Callable[[Path], None]) -> Action:
    def action(run: Path, outside: Path) -> Outcome:
        (run / relative).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(outside, run / relative, target_is_directory=True)
        write(run)
        return "accepted", f"wrote into {relative}, a link to a folder outside the run folder"
    return action


def _write_outside_cases(work_dir: Path) -> list[Case]:
    cases = []
    for name, (relative, write, expected, kinds) in PLANTED_FILES.items():
        for kind in kinds:
            cases.append(_run_case(work_dir, "write_outside_folder", f"{name}/{kind}", expected,
                                   _planted_file_action(relative, write, kind)))
    for name, (relative, write) in PLANTED_FOLDERS.items():
        cases.append(_run_case(work_dir, "write_outside_folder", f"{name}/symlink_outside",
                               "refused", _planted_folder_action(relative, write)))
    return cases


# -- deleted_lock ------------------------------------------------------------------------------
def _second_lock_after(change: Callable[[Path, Path], None]) -> Action:
    def action(run: Path, outside: Path) -> Outcome:
        from training.run_lock import LOCK_NAME, RunFolderLock

        with RunFolderLock(run):
            change(run / LOCK_NAME, outside)
            with RunFolderLock(run):
                return "accepted", "a second lock was granted while the first was held"
    return action


def _swap_for_link(record: Path, outside: Path) -> None:
    record.unlink()
    os.symlink(outside / "sentinel.txt", record)


def _holder_check_after(change: str) -> Action:
    def action(run: Path, outside: Path) -> Outcome:
        from training.run_lock import RunFolderLock

        with RunFolderLock(run) as lock:
            _remove_or_replace(run, change)
            lock.check()
        return "accepted", f"the holder did not notice its folder was {change}"
    return action


def _remove_or_replace(run: Path, change: str) -> None:
    if change == "removed":
        shutil.rmtree(run)
    else:
        run.rename(run.with_name("run-moved-away"))
        run.mkdir()


def _checkpoint_after_removal(run: Path, outside: Path) -> Outcome:
    from training._loop_persist import CheckpointPersister
    from training.run_lock import RunFolderLock

    persister = CheckpointPersister(run / "checkpoints", keep=2)
    with RunFolderLock(run):
        shutil.rmtree(run)
        try:
            persister.persist_now({"step": 3}, step=3, reason="interval", elapsed_s=1.0,
                                  blocking_s=0.0, snapshot_s=0.0)
        except OSError as error:
            if "disk space" in str(error).lower() and "not a full disk" not in str(error):
                return "crashed", f"misleading message: {error}"
            raise
    return "accepted", f"the checkpoint was written into a recreated {run} under no lock"


def _telemetry_after_removal(run: Path, outside: Path) -> Outcome:
    from telemetry.writer import SegmentWriter, TelemetryWriteError

    writer = SegmentWriter(run / "telemetry", RUN_ID, events_per_segment=1)
    shutil.rmtree(run / "telemetry")
    try:
        writer.write({"type": "step", "run_id": RUN_ID, "rank": 0, "step": 1})
    except TelemetryWriteError as error:
        said = str(error)
        if "was removed" in said and "not a full disk" in said:
            return "refused", said
        return "crashed", f"misleading message: {said}"
    finally:
        writer.close()
    return "accepted", "the write into a removed folder reported nothing"


HOLDER_SCRIPT = ("import sys\nfrom training.run_lock import RunFolderLock\n"
                 "lock = RunFolderLock(sys.argv[1]); lock.acquire()\n"
                 "print('held', flush=True); sys.stdin.read()\n")


def _project_env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}


def _train_after_record_deleted(run: Path, outside: Path) -> Outcome:
    """Another process holds the folder; its `.run.lock` record is deleted; `train()` here."""
    from training.loop import train
    from training.run_lock import LOCK_NAME

    holder = subprocess.Popen([sys.executable, "-c", HOLDER_SCRIPT, str(run)], env=_project_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if holder.stdout.readline().strip() != "held":
            return "crashed", "the holder process did not take the lock"
        (run / LOCK_NAME).unlink()
        result = train(_tiny_config(max_steps=2), _tiny_examples(), None, run)
        return "accepted", f"a second trainer ran {result.steps} steps on a held folder"
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def _second_trainer_process(suite: Any) -> Action:
    """Two real trainer processes (`trainwise.emulated_worker`) on one folder, the first's
    `.run.lock` deleted while it trains: the second must refuse while the first still runs;
    the first is then stopped by SIGTERM (a long run, so it cannot finish first)."""
    def action(run: Path, outside: Path) -> Outcome:
        from benchmarks.faults import harness
        from training.run_lock import LOCK_NAME

        shutil.rmtree(run)
        config = {**suite.base_config, "run_id": "deleted-lock", "max_steps": 100_000}
        trial = harness.Run(run, suite.shards_dir, config)
        first = trial.start(None)
        try:
            started = harness.wait_for(lambda: harness.newest_step(trial.rank0) >= 2
                                       or first.poll() is not None, harness.TRAINER_TIMEOUT_S,
                                       0.01)
            if not started or first.poll() is not None:
                return "crashed", f"the first trainer ended early: {trial.log_tail(0)}"
            (run / LOCK_NAME).unlink(missing_ok=True)
            second_code = harness.wait(trial.start(None))
            first_alive = first.poll() is None
        finally:
            if first.poll() is None:
                os.kill(first.pid, signal.SIGTERM)  # a preemption: checkpoint and stop
            first_code = harness.wait(first)
        second, first_result = trial.result(1), trial.result(0)
        if second is not None:
            return "accepted", f"the second trainer ran to {second['status']} (steps trained twice)"
        log = trial.log_tail(1, lines=5)
        if not first_alive or second_code == 0 or "in use by another trainer" not in log:
            return "crashed", f"second trainer exit {second_code} (first alive: {first_alive}): {log}"
        if first_code != 0 or not first_result or first_result["status"] != "preempted":
            return "crashed", f"the first trainer did not stop cleanly: {trial.log_tail(0)}"
        return "refused", log
    return action


def _deleted_lock_cases(work_dir: Path, suite: Any) -> list[Case]:
    plan: list[tuple[str, Action]] = [
        ("record_deleted/second_lock", _second_lock_after(lambda p, o: p.unlink())),
        ("record_swapped_for_link/second_lock", _second_lock_after(_swap_for_link)),
        ("folder_removed/holder_check", _holder_check_after("removed")),
        ("folder_replaced/holder_check", _holder_check_after("replaced")),
        ("folder_removed/checkpoint_write", _checkpoint_after_removal),
        ("folder_removed/telemetry_write", _telemetry_after_removal),
        ("record_deleted/second_train_call", _train_after_record_deleted),
    ]
    if suite is not None:
        plan.append(("record_deleted/second_trainer_process", _second_trainer_process(suite)))
    return [_run_case(work_dir, "deleted_lock", name, "refused", action) for name, action in plan]


# -- lost_work_bound ---------------------------------------------------------------------------
def _tiny_examples(n: int = 256, block: int = 16):
    """Windows of a cycle of 8 symbols (tests.test_training_loop's data, rebuilt here)."""
    from training.data_types import ExampleSet

    vocab = tuple("abcdefgh")
    starts = np.random.default_rng(0).integers(0, len(vocab), n)
    inputs = (starts[:, None] + np.arange(block + 1)[None, :]) % len(vocab)
    is_eval = np.zeros(n, dtype=bool)
    is_eval[::8] = True
    return ExampleSet(partition="cycle", kind="text", example_ids=np.arange(n, dtype=np.int64),
                      is_eval=is_eval, inputs=inputs.astype(np.int64), labels=None, vocab=vocab,
                      shard_index=np.zeros(n, dtype=np.int32), fingerprint="c" * 64)


def _tiny_config(**changes: Any):
    from training.loop import TrainConfig
    from training.model import GPTConfig

    fields = dict(max_steps=24, micro_batch_size=8, grad_accum_steps=1, learning_rate=3e-3,
                  min_learning_rate=3e-4, warmup_steps=2, eval_every_steps=1000, eval_batches=1,
                  eval_batch_size=8, checkpoint_every_steps=0, keep_checkpoints=10,
                  fast_every_steps=1, seed=7, price_usd_per_hour=3.06, run_id=RUN_ID,
                  num_threads=1, model=GPTConfig(vocab_size=8, block_size=16, n_layer=1,
                                                 n_head=2, n_embd=16))
    fields.update(changes)
    return TrainConfig(**fields)


class _Killed(Exception):
    """Stands for kill -9 at a chosen point."""


class _Observer:
    """A fast policy that keeps everything and remembers the newest step it saw; it can kill
    the run at a step (mid-interval kills)."""

    name = "observer"

    def __init__(self, kill_at_step: int | None, on_kill: Callable[[], None]) -> None:
        self.kill_at_step = kill_at_step
        self.on_kill = on_kill  # lets a held save end: a killed process holds nothing either
        self.step = 0

    def act(self, observation):
        from controllers.fast_types import FastAction

        self.step = observation.step
        if observation.step == self.kill_at_step:
            self.on_kill()
            raise _Killed
        return FastAction(micro_batch_size=observation.micro_batch_size,
                          grad_accum_steps=observation.grad_accum_steps,
                          learning_rate=observation.learning_rate, rank_work_shares=(1.0,),
                          reason="observe", numbers={})


def _lost_steps_action(interval: int, *, asynchronous: bool, kill: str) -> Action:
    """Holds the save of step 2k in flight (background) until the kill; kill "at_wait": when the
    loop waits for it at step 3k (the worst moment); "mid": at step 2k + k // 2 + 1."""
    def action(run: Path, outside: Path) -> Outcome:
        from training import _loop_persist
        from training.loop import train

        held_step = 2 * interval
        release = threading.Event()
        real_save, real_wait = _loop_persist.save_checkpoint, _loop_persist.CheckpointPersister.wait
        kill_at = held_step + interval // 2 + 1 if kill == "mid" else None
        if not asynchronous:  # no save in flight to hold: kill mid-interval after step k
            kill_at = interval + interval - 1
        policy = _Observer(kill_at, release.set)

        def save(path, state):
            if asynchronous and state["step"] == held_step:
                release.wait(120)
                raise OSError(errno.EIO, "killed before this save was durable", str(path))
            return real_save(path, state)

        def wait(self):
            if kill == "at_wait" and self.in_flight_step == held_step:
                release.set()
                raise _Killed
            return real_wait(self)

        _loop_persist.save_checkpoint = save
        _loop_persist.CheckpointPersister.wait = wait
        try:
            train(_tiny_config(max_steps=4 * interval, checkpoint_every_steps=interval,
                               async_checkpoints=asynchronous), _tiny_examples(), None, run,
                  fast_policy=policy)
            return "crashed", "the kill never came"
        except _Killed:
            pass
        finally:
            release.set()
            _loop_persist.save_checkpoint = real_save
            _loop_persist.CheckpointPersister.wait = real_wait
        durable = [int(p.stem.split("-")[1]) for p in (run / "checkpoints").glob("step-*.pt")]
        lost = policy.step - max(durable, default=0)
        bound = _loop_persist.max_lost_steps(interval, asynchronous=asynchronous)
        detail = (f"trained to step {policy.step}, newest durable checkpoint step "
                  f"{max(durable, default=0)}: {lost} steps lost, stated bound {bound}")
        return ("fell_back" if lost <= bound else "accepted"), detail
    return action


def _lost_work_cases(work_dir: Path) -> list[Case]:
    plan = [(f"interval_{k}/async/kill_{kill}", _lost_steps_action(k, asynchronous=True,
                                                                    kill=kill))
            for k in (3, 5) for kill in ("at_wait", "mid")]
    plan.append(("interval_5/sync/kill_mid", _lost_steps_action(5, asynchronous=False,
                                                                 kill="mid")))
    return [_run_case(work_dir, "lost_work_bound", name, "fell_back", action)
            for name, action in plan]


# -- small -------------------------------------------------------------------------------------
BAD_RUN_IDS = {"newline": "run\n", "dotdot": "..", "parent": "../run", "slash": "a/b",
               "hidden": ".run", "nul": "run\x00", "empty": ""}
BAD_PARTITIONS = {"dotdot_etc": "../../etc", "dotdot": "..", "slash": "a/b",
                  "newline": "mnist\n", "hidden": ".mnist", "unknown": "imagenet"}


def _run_id_action(run_id: str, through_train: bool) -> Action:
    def action(run: Path, outside: Path) -> Outcome:
        from telemetry.writer import rank_dir

        try:
            if through_train:
                from training.loop import train

                train(_tiny_config(max_steps=1, run_id=run_id), _tiny_examples(), None, run)
            else:
                rank_dir(run / "telemetry", run_id, 0)
        except ValueError as error:
            if "run_id" in str(error):
                return "refused", str(error)
            raise
        return "accepted", f"run id {run_id!r} accepted"
    return action


def _partition_action(value: str) -> Action:
    def action(run: Path, outside: Path) -> Outcome:
        from argparse import Namespace

        from trainwise import cli

        previous = os.environ.get("TRAINWISE_DEMO_PARTITION")
        os.environ["TRAINWISE_DEMO_PARTITION"] = value
        try:
            cli._check_demo_args(Namespace(partition="", steps=10))  # what `trainwise demo` runs
        finally:
            if previous is None:
                os.environ.pop("TRAINWISE_DEMO_PARTITION", None)
            else:
                os.environ["TRAINWISE_DEMO_PARTITION"] = previous
        return "accepted", f"TRAINWISE_DEMO_PARTITION={value!r} accepted before the demo"
    return action


# The worker's main() three times in one interpreter, each SIGTERM raised at a fixed point
# (raise_signal: no timing): while starting, inside train() before the loop's handler, after
# train() returned. `train` is replaced by a stand-in so the case needs no data.
SIGTERM_SCRIPT = r"""
import json, signal, sys, time
from pathlib import Path
from trainwise import emulated_worker as worker
from training import loop, shards

class Result:
    def __init__(self, status, on_status=None):
        self._status, self._on_status = status, on_status
        self.run_id, self.steps, self.final_eval_loss = "adv", 4, 1.0
        self.checkpoint_path, self.checkpoint_sha256, self.elapsed_s = "ck", "0", 1.0
        self.final_eval_accuracy, self.tokens_seen, self.samples_seen = None, 0, 0
        self.cost_usd, self.telemetry_dir = 0.0, "tel"
    @property
    def status(self):
        if self._on_status:
            self._on_status(); self._on_status = None
        return self._status

def during_setup(*args, **kwargs):
    from training._loop_fast import PreemptionSignal
    signal.raise_signal(signal.SIGTERM)
    with PreemptionSignal() as notice:
        for _ in range(2000):
            if notice.pending:
                return Result("preempted")
            time.sleep(0.005)
    return Result("completed")

folder = Path(sys.argv[1])
job = {"shards_dir": "unused", "run_dir": str(folder / "run"), "resume_from": None,
       "train_config": {"max_steps": 4, "run_id": "adv"}}
plan = {"starting": (lambda p: signal.raise_signal(signal.SIGTERM), None),
        "during_setup": (lambda p: None, during_setup),
        "after_train": (lambda p: None, lambda *a, **k: Result(
            "completed", lambda: signal.raise_signal(signal.SIGTERM)))}
for name, (load, fake_train) in plan.items():
    shards.load_shards = load
    if fake_train is not None:
        loop.train = fake_train
    path = folder / f"job-{name}.json"
    path.write_text(json.dumps({**job, "result_path": str(folder / f"result-{name}.json")}))
    code = worker.main([str(path)])
    print(json.dumps({"scenario": name, "code": code}), flush=True)
    print(f"--- end of {name}", file=sys.stderr, flush=True)
"""
SIGTERM_EXPECTED = {  # scenario -> (expected outcome, what the line on stderr must say)
    "starting": ("refused", "SIGTERM received while starting"),
    "during_setup": ("fell_back", "stopped by SIGTERM"),
    "after_train": ("warned", "after the training loop had ended"),
}


def _sigterm_cases(work_dir: Path) -> list[Case]:
    folder = work_dir / "small" / "sigterm"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    script = folder / "sigterm.py"
    script.write_text(SIGTERM_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(folder)], capture_output=True,
                          text=True, timeout=180, env=_project_env())
    codes = {}
    for line in done.stdout.splitlines():
        try:
            record = json.loads(line)
            codes[record["scenario"]] = record["code"]
        except (ValueError, KeyError, TypeError):
            continue
    said = dict(zip(SIGTERM_EXPECTED, done.stderr.split("--- end of ")))
    cases = []
    for scenario, (expected, line) in SIGTERM_EXPECTED.items():
        text = said.get(scenario, "")
        if scenario not in codes:
            outcome, detail = "crashed", (f"process ended with {done.returncode} before this "
                                          f"scenario finished: {done.stderr[-200:]}")
        elif line in text:
            outcome, detail = expected, text.strip()[-300:]
        else:
            outcome, detail = "crashed", f"exit {codes[scenario]} without the line {line!r}"
        cases.append(Case(defect_class="small", case=f"sigterm/{scenario}", expected=expected,
                          outcome=outcome, detail=detail))
    return cases


def _small_cases(work_dir: Path) -> list[Case]:
    plan: list[tuple[str, str, Action]] = []
    for label, run_id in BAD_RUN_IDS.items():
        plan.append((f"run_id/{label}", "refused", _run_id_action(run_id, through_train=False)))
    plan.append(("run_id/newline/train", "refused", _run_id_action("run\n", through_train=True)))
    plan.append(("run_id/plain/control", "accepted", _run_id_action("run-1.a", False)))
    for label, value in BAD_PARTITIONS.items():
        plan.append((f"demo_partition/{label}", "refused", _partition_action(value)))
    plan.append(("demo_partition/plain/control", "accepted", _partition_action("pystdlib")))
    cases = [_run_case(work_dir, "small", name, expected, action)
             for name, expected, action in plan]
    return cases + _sigterm_cases(work_dir)


def cases(work_dir: Path, suite: Any) -> list[Case]:
    """Every case of this module under `work_dir` (see the module docstring; `suite` may be
    None, which leaves out the case that needs real trainer processes)."""
    import torch

    work_dir = Path(work_dir)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        found = (_write_outside_cases(work_dir) + _deleted_lock_cases(work_dir, suite)
                 + _lost_work_cases(work_dir) + _small_cases(work_dir))
    finally:
        torch.set_num_threads(previous_threads)
    for case in found:
        case.detail = case.detail[:300]
    return found
