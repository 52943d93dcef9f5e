"""Several ranks under the SDK (`examples/ddp_loop/`, two CPU ranks over gloo, run by torchrun as
a user runs it): the ranks stop at one step on a notice that reached one of them, leave with exit
code 143, and resume from the newest step that every rank committed, bit for bit; a resume with
another rank count is refused by name.

The example's epoch is 6 global batches (96 rows, 8 per rank); a run is 12 steps with a
checkpoint every 4, so the reference commits steps 4, 8 and 12 on each rank.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from trainwise.sdk import Run
from trainwise.sdk.ranks import agree_on_step
from trainwise.sdk.spec import RunSpec, RunSpecError, with_fields

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "ddp_loop" / "train.py"
MAX_STEPS = 12
TIMEOUT_S = 120


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("TRAINWISE_RUN_SPEC", None)
    return env


def _command(base: Path, nproc: int = 2, sleep_s: float = 0.0, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nproc), str(SCRIPT), "--run-id", "ddp", "--run-dir", str(base / "run"),
            "--store-root", str(base / "store"), "--notice-file", str(base / "notice"),
            "--max-steps", str(MAX_STEPS), "--checkpoint-every-steps", "4",
            "--step-sleep-s", str(sleep_s), *extra]


def _run(base: Path, nproc: int = 2, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(_command(base, nproc, 0.0, *extra), env=_env(), capture_output=True,
                          text=True, timeout=TIMEOUT_S)


def _run_to_end(base: Path) -> list[str]:
    done = _run(base)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout.splitlines()


def _starts(lines: list[str]) -> dict[int, str]:
    """rank -> its start line's "resumed <bool> at step <n>"."""
    found = {}
    for line in lines:
        match = re.match(r"^rank (\d+) pid \d+ (resumed \w+ at step \d+)$", line)
        if match:
            found[int(match.group(1))] = match.group(2)
    return found


def _interrupt(base: Path, after_step: int, how: str) -> tuple[int, str]:
    """Starts the run, waits for rank 0's line of `after_step`, then SIGTERMs rank 1's process
    alone (`sigterm_rank1`) or writes the node agent's notice file; returns torchrun's exit code
    and all it printed."""
    process = subprocess.Popen(_command(base, sleep_s=0.2), env=_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines, pids = [], {}
    deadline = time.monotonic() + TIMEOUT_S
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line.rstrip("\n"))
        match = re.match(r"^rank (\d+) pid (\d+) ", line)
        if match:
            pids[int(match.group(1))] = int(match.group(2))
        if line.strip() == f"step {after_step}" or time.monotonic() > deadline:
            break
    else:
        pytest.fail("the run ended before the step to interrupt at:\n" + "\n".join(lines))
    if how == "sigterm_rank1":
        os.kill(pids[1], signal.SIGTERM)
    else:
        (base / "notice").write_text("reclaim\n")
    rest, _ = process.communicate(timeout=TIMEOUT_S)
    (base / "notice").unlink(missing_ok=True)  # the node agent's file is gone on the next node
    return process.returncode, "\n".join(lines) + "\n" + rest


def _outcome(base: Path, rank: int) -> dict:
    return json.loads((base / "run" / f"outcome-rank{rank}.json").read_text())


def _committed(base: Path, rank: int) -> list[int]:
    folder = base / "store" / "runs" / "ddp" / "checkpoints" / f"rank{rank}"
    return sorted(int(p.name[5:12]) for p in folder.glob("step-*.pt.commit"))


def _final(base: Path, rank: int) -> dict:
    path = base / "run" / "checkpoints" / f"rank{rank}" / f"step-{MAX_STEPS:07d}.pt"
    return torch.load(path, map_location="cpu", weights_only=True)


def _assert_same_as_reference(base: Path, reference: Path) -> None:
    for rank in (0, 1):
        mine, theirs = _final(base, rank), _final(reference, rank)
        assert mine["step"] == theirs["step"] == MAX_STEPS
        for name, tensor in theirs["model"].items():
            assert torch.equal(mine["model"][name], tensor), f"rank {rank}: {name} differs"
        for index, group in theirs["optimizer"]["state"].items():
            for key, value in group.items():
                assert torch.equal(torch.as_tensor(mine["optimizer"]["state"][index][key]),
                                   torch.as_tensor(value)), f"rank {rank}: optimizer {key}"
        assert mine["scheduler"] == theirs["scheduler"]
        assert mine["sampler"] == theirs["sampler"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted two-rank run (not to be changed: tests copy it)."""
    base = tmp_path_factory.mktemp("ddp_reference")
    lines = _run_to_end(base)
    assert _starts(lines) == {0: "resumed False at step 0", 1: "resumed False at step 0"}
    assert lines[-1].startswith(f"finished at step {MAX_STEPS}")
    assert _committed(base, 0) == _committed(base, 1) == [4, 8, 12]
    return base


def _copy(reference: Path, tmp_path: Path) -> Path:
    base = tmp_path / "copy"
    shutil.copytree(reference, base)
    return base


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["sigterm_rank1", "notice_file"])
def test_a_notice_stops_both_ranks_at_one_step_and_the_resume_is_bit_identical(
        tmp_path, reference, how):
    code, printed = _interrupt(tmp_path, after_step=5, how=how)
    assert code != 0, printed  # torchrun reports ranks that exit non-zero as failed
    # Both ranks left with 143: torchrun's failure report names each rank and its exit code.
    report = re.findall(r"rank\s*: (\d+) \(local_rank: \d+\)\s*exitcode\s*: (-?\d+)", printed)
    assert sorted(report) == [("0", "143"), ("1", "143")], printed
    outcomes = [_outcome(tmp_path, rank) for rank in (0, 1)]
    assert [o["status"] for o in outcomes] == ["preempted", "preempted"], printed
    stopped_at = outcomes[0]["step"]
    assert outcomes[1]["step"] == stopped_at and 5 <= stopped_at < MAX_STEPS
    assert stopped_at in _committed(tmp_path, 0) and stopped_at in _committed(tmp_path, 1)
    if how == "notice_file":
        shutil.rmtree(tmp_path / "run" / "checkpoints")  # a new node: only the store is left
    lines = _run_to_end(tmp_path)
    assert _starts(lines) == {0: f"resumed True at step {stopped_at}",
                              1: f"resumed True at step {stopped_at}"}
    _assert_same_as_reference(tmp_path, reference)


@pytest.mark.timeout(120)
def test_a_step_only_rank_0_committed_is_not_a_resume_point(tmp_path, reference):
    """A crash between the two ranks' commits of step 12: rank 0's marker is there, rank 1's
    is not. Both ranks resume from step 8 (which both committed) and end as the reference."""
    base = _copy(reference, tmp_path)
    shutil.rmtree(base / "run" / "checkpoints")  # a new node: only the store is left
    (base / "store" / "runs" / "ddp" / "checkpoints" / "rank1"
     / f"step-{MAX_STEPS:07d}.pt.commit").unlink()
    assert _committed(base, 0) == [4, 8, 12] and _committed(base, 1) == [4, 8]
    lines = _run_to_end(base)
    assert _starts(lines) == {0: "resumed True at step 8", 1: "resumed True at step 8"}
    assert _committed(base, 1) == [4, 8, 12]
    _assert_same_as_reference(base, reference)
    # The checkpoint holds DistributedDataParallel's inner module: a plain model loads it.
    plain = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(32, 3))
    plain.load_state_dict(_final(base, 0)["model"])


@pytest.mark.timeout(120)
def test_a_resume_with_another_rank_count_is_refused(tmp_path, reference):
    base = _copy(reference, tmp_path)
    done = _run(base, nproc=1)
    assert done.returncode != 0
    assert ("was written by a run of 2 rank(s), and this run has world_size 1" in done.stderr
            and "resume with 2 rank(s)" in done.stderr), done.stderr[-3000:]
    assert _committed(base, 0) == [4, 8, 12]
    assert _outcome(base, 0)["status"] == "completed"  # the refused start wrote nothing


@pytest.mark.timeout(60)
def test_a_batch_size_that_leaves_a_rank_without_a_batch_is_refused(tmp_path):
    """96 rows in global batches of 9 x 2: the epoch's last 6 rows are all rank 0's, and rank
    1 would take one step fewer each epoch."""
    done = _run(tmp_path, 2, "--batch-size", "9")
    assert done.returncode != 0
    assert "leave the epoch's last global batch (6 examples) without a batch for 1 rank(s)" \
        in done.stderr and "pass drop_last=True" in done.stderr, done.stderr[-3000:]


def test_several_ranks_without_torchrun_or_with_an_unknown_backend_are_refused(
        tmp_path, monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    spec = RunSpec(run_id="ranks", run_dir=str(tmp_path), rank=1, world_size=2)
    with pytest.raises(RunSpecError, match="MASTER_ADDR.*launch them with torchrun"):
        Run(spec, install_signal_handler=False)
    with pytest.raises(RunSpecError, match="dist_backend 'mpi' is not one of auto, gloo, nccl"):
        with_fields(spec, dist_backend="mpi")


class _Exchange:
    """Ranks as threads of this process: each collective waits for every rank's value."""

    def __init__(self, world_size: int) -> None:
        self.barrier = threading.Barrier(world_size, timeout=10)
        self.values: list = [None] * world_size


class _ThreadRanks:
    def __init__(self, exchange: _Exchange, rank: int) -> None:
        self.exchange, self.rank = exchange, rank

    def _gather(self, value):
        self.exchange.values[self.rank] = value
        self.exchange.barrier.wait()
        values = list(self.exchange.values)
        self.exchange.barrier.wait()  # every rank has read before the next write
        return values

    def min_int(self, value: int) -> int:
        return min(self._gather(value))

    def all_true(self, flag: bool) -> bool:
        return all(self._gather(bool(flag)))

    def same_everywhere(self, value: int) -> bool:
        return len(set(self._gather(value))) == 1


def _agree(held: list[dict[int, int | None]]) -> list:
    """agree_on_step on one thread per rank; `held[r]`: step -> the start that wrote it (None:
    the rank lists the step but its checkpoint does not load)."""
    exchange, results = _Exchange(len(held)), [None] * len(held)

    def rank_main(rank: int) -> None:
        mine = held[rank]
        results[rank] = agree_on_step(_ThreadRanks(exchange, rank), mine, mine.get,
                                      tag=lambda start: start)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(len(held))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    return results


def test_ranks_agree_on_the_newest_step_every_rank_holds_from_one_start():
    # Rank 1 holds no step 12: both take 8.
    assert _agree([{4: 1, 8: 1, 12: 1}, {4: 1, 8: 1}]) == [(8, 1), (8, 1)]
    # Rank 1's 12 and 16 come from a start that resumed from 8 and was lost (start 2), rank
    # 0's 12 from the start before it: 12 is two histories, so both take 8.
    assert _agree([{4: 1, 8: 1, 12: 1}, {4: 1, 8: 1, 12: 2, 16: 2}]) == [(8, 1), (8, 1)]
    # Rank 0's 8 does not load: both take 4.
    assert _agree([{4: 1, 8: None}, {4: 1, 8: 1}]) == [(4, 1), (4, 1)]
    # No step every rank holds: a fresh start on both.
    assert _agree([{4: 1}, {}]) == [None, None]
