"""The trainer under torchrun: 2 ranks (gloo, CPU, one thread each) train the same global batch
as one process, uneven straggler shares give the same training, every rank writes its own
telemetry, a preemption notice (SIGTERM) to one rank stops the whole gang at one step boundary
with one checkpoint, and that checkpoint resumes bit for bit at the same world size (refused at
another).

Tolerance for one process vs two ranks: the two ranks sum the same per-example gradients in
another order (two partial sums, then an all-reduce), so float32 rounding differs by ~1e-7
relative per step; over 6 AdamW steps the losses stay within 1e-4 (measured: ~1e-6).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from telemetry.reader import read_run_events
from tests.test_training_loop import TINY_GPT, text_examples, tiny_config
from training.checkpoint import load_checkpoint
from training.ddp_worker import model_spec
from training.distributed import micro_counts
from training.loop import train

REPO = Path(__file__).resolve().parents[1]
LOSS_TOLERANCE = 1e-4


def ddp_config(**changes: Any):
    # grad_accum_steps is the global micro-batch count under torchrun: 4 lets shares be 3:1.
    return tiny_config(max_steps=6, grad_accum_steps=4, fast_every_steps=2, eval_every_steps=3,
                       price_usd_per_hour=0.0, run_id="ddp", **changes)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun(tmp: Path, name: str, *, policy: dict | None = None, nproc: int = 2,
             resume_from: str | None = None, stop_after_steps: int | None = None,
             out_dir: Path | None = None, micro_batch_ms: float = 0.0) -> subprocess.Popen:
    """Starts training.ddp_worker under torchrun; `results` waits for it."""
    config = {k: v for k, v in dataclasses.asdict(ddp_config()).items() if k != "model"}
    config["model"] = model_spec(TINY_GPT)
    spec = {
        "examples": "tests.test_training_loop:text_examples", "config": config,
        "out_dir": str(out_dir or tmp / name), "policy": policy or {"kind": "noop"},
        "resume_from": resume_from, "stop_after_steps": stop_after_steps,
        "result_dir": str(tmp / f"{name}-results"),
        "micro_batch_ms": micro_batch_ms,  # emulated device time: sleeps, same numerics
    }
    spec_path = tmp / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               # Static rendezvous on one machine (c10d's store start-up costs ~2 s a job).
               "--master_addr=127.0.0.1", f"--master_port={free_port()}",
               "-m", "training.ddp_worker", str(spec_path)]
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    process.result_dir = tmp / f"{name}-results"  # type: ignore[attr-defined]
    process.nproc = nproc  # type: ignore[attr-defined]
    return process


def results(process: subprocess.Popen) -> list[dict[str, Any]]:
    """Each rank's result record of a `torchrun` job."""
    try:
        _, stderr = process.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        process.kill()
        _, stderr = process.communicate()
    found = []
    for rank in range(process.nproc):  # type: ignore[attr-defined]
        path = process.result_dir / f"rank{rank}.json"  # type: ignore[attr-defined]
        assert path.exists(), f"rank {rank} left no result; torchrun said:\n{stderr[-3000:]}"
        found.append(json.loads(path.read_text()))
    return found


def preempt_rank_after_its_first_step(process: subprocess.Popen, out_dir: Path, rank: int
                                      ) -> None:
    """SIGTERM to one worker (a spot reclaim notice reaching one node) once it has trained a
    step: its handler is installed by then, and the gang still has steps to go."""
    pid_file = process.result_dir / f"rank{rank}.pid"  # type: ignore[attr-defined]
    segment = out_dir / "telemetry" / "ddp" / f"rank{rank}" / "segment-00000.jsonl"
    deadline = time.monotonic() + 240  # generous: 2 shared cores under load
    while time.monotonic() < deadline and process.poll() is None:
        if pid_file.exists() and segment.exists() and '"type":"step"' in segment.read_text():
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
            return
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} trained no step within 240 s; poll={process.poll()}")


def step_records(out_dir: Path, rank: int) -> list[dict[str, Any]]:
    return [r for r in read_run_events(out_dir / "telemetry" / "ddp", rank=rank)
            if r["type"] == "step"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    """The torchrun jobs (about 8 s each), run once for the module, and the same training in
    one process. The shares are 1:1 for steps 1-2 and 3:1 from the fast tick at step 2 on, so
    one job covers even and uneven shares. The first job is preempted through rank 1 (its
    150 ms of emulated device time per micro batch leave time to send the notice), the second
    resumes from its checkpoint."""
    tmp = tmp_path_factory.mktemp("ddp")
    uneven = {"kind": "fixed_shares", "shares": [0.75, 0.25]}
    found: dict[str, Any] = {"tmp": tmp}
    first = torchrun(tmp, "first", policy=uneven, out_dir=tmp / "resumed", micro_batch_ms=150)
    whole = torchrun(tmp, "uneven", policy=uneven)  # alongside: a job on its own ports and folder
    preempt_rank_after_its_first_step(first, tmp / "resumed", rank=1)
    found["single"] = train(ddp_config(), text_examples(), None, tmp / "single")
    found["first"] = results(first)
    second = torchrun(tmp, "second", policy=uneven, out_dir=tmp / "resumed",
                      resume_from=str(tmp / "resumed" / "checkpoints"))
    found["uneven"], found["second"] = results(whole), results(second)
    return found


def test_micro_counts_follow_shares_and_give_every_rank_one() -> None:
    assert micro_counts(4, [0.5, 0.5]) == (2, 2)
    assert micro_counts(4, [0.75, 0.25]) == (3, 1)
    assert micro_counts(4, [0.99, 0.01]) == (3, 1)  # never 0: every rank joins the all-reduce
    assert micro_counts(16, [0.6, 0.4]) == (10, 6)
    assert sum(micro_counts(7, [0.2, 0.3, 0.5])) == 7
    with pytest.raises(ValueError, match="grad_accum_steps >= 2"):
        micro_counts(1, [0.5, 0.5])


def test_two_ranks_even_and_uneven_train_like_one_process(runs) -> None:
    assert all("error" not in r for r in runs["uneven"]), runs["uneven"]
    single = step_records(runs["tmp"] / "single", 0)
    out = runs["tmp"] / "uneven"
    rank0, rank1 = step_records(out, 0), step_records(out, 1)
    assert len(rank0) == len(single) == 6
    assert [r["train_loss"] for r in rank0] == [r["train_loss"] for r in rank1]  # global loss
    # Steps 1-2 at shares 1:1, 3-6 at 3:1: the same loss and gradient (norm) as one process.
    assert [r["micro_batches"] for r in rank0] == [2, 2, 3, 3, 3, 3]
    for one, two in zip(single, rank0):
        assert abs(one["train_loss"] - two["train_loss"]) < LOSS_TOLERANCE
        assert abs(one["grad_norm"] - two["grad_norm"]) < LOSS_TOLERANCE * max(1.0,
                                                                               one["grad_norm"])
    weights = [load_checkpoint(Path(path))["model"] for path in
               (runs["single"].checkpoint_path, runs["uneven"][0]["checkpoint_path"])]
    for key, value in weights[0].items():
        torch.testing.assert_close(weights[1][key], value, atol=1e-4, rtol=1e-4)
    assert runs["uneven"][0]["samples_seen"] == runs["single"].samples_seen


def test_every_rank_writes_its_share_and_wait(runs) -> None:
    out = runs["tmp"] / "uneven"
    late0, late1 = step_records(out, 0)[-1], step_records(out, 1)[-1]
    assert (late0["micro_batches"], late1["micro_batches"]) == (3, 1)
    assert (late0["share"], late1["share"]) == (0.75, 0.25)
    for rank, record in enumerate((late0, late1)):
        assert record["rank"] == rank and record["world_size"] == 2
        # Measured, each: the figures are time spent, so an unmeasured (0.0) one is a bug.
        assert record["allreduce_wait_ms"] > 0 and record["compute_ms"] > 0
        assert record["allreduce_ms"] > 0
    decisions = [r for r in read_run_events(out / "telemetry" / "ddp") if r["type"] == "decision"]
    assert decisions and {r["rank"] for r in decisions} == {0}  # rank 0 decides for the gang
    assert len(decisions[0]["observation"]["rank_step_time_ms"]) == 2


def test_notice_to_one_rank_stops_the_gang_at_one_boundary_with_one_checkpoint(runs) -> None:
    assert [r["status"] for r in runs["first"]] == ["preempted", "preempted"], runs["first"]
    stopped_at = runs["first"][0]["steps"]
    assert runs["first"][1]["steps"] == stopped_at and 1 <= stopped_at < 6
    out = runs["tmp"] / "resumed"
    notices = [[r for r in read_run_events(out / "telemetry" / "ddp", rank=rank)
                if r["type"] == "preemption"] for rank in (0, 1)]
    assert [len(n) for n in notices] == [1, 1]
    assert [n[0]["step"] for n in notices] == [stopped_at, stopped_at]
    assert notices[1][0]["signal_name"] == "SIGTERM"  # the rank that got it
    assert notices[0][0]["signal_name"] == "SIGTERM to rank 1 (gang notice)"
    # One checkpoint, written by rank 0 (the resumed job adds later ones to the folder).
    checkpoints = sorted(p.name for p in (out / "checkpoints").glob("step-*.pt"))
    assert [c for c in checkpoints if c <= f"step-{stopped_at:07d}.pt"] == [
        f"step-{stopped_at:07d}.pt"]
    assert runs["first"][1]["checkpoint_path"] == runs["first"][0]["checkpoint_path"]
    written = [r for r in read_run_events(out / "telemetry" / "ddp")
               if r["type"] == "checkpoint" and r["step"] == stopped_at]
    assert [(r["rank"], r["reason"]) for r in written] == [(0, "preemption")]


def test_gang_resume_is_bit_identical(runs) -> None:
    assert all("error" not in r for r in runs["second"]), runs["second"]
    state = load_checkpoint(Path(runs["first"][0]["checkpoint_path"]))
    assert state["world_size"] == 2 and len(state["ranks"]) == 2
    assert state["rank_work_shares"] == [0.75, 0.25]
    resumed = [r["train_loss"] for r in step_records(runs["tmp"] / "resumed", 0)]
    uninterrupted = [r["train_loss"] for r in step_records(runs["tmp"] / "uneven", 0)]
    assert resumed == uninterrupted  # bit for bit
    assert runs["second"][0]["checkpoint_sha256"] is not None


def test_resume_at_another_world_size_is_refused(runs, tmp_path) -> None:
    checkpoint = runs["first"][0]["checkpoint_path"]
    with pytest.raises(ValueError, match=r"2 rank\(s\) but this run has 1.*nproc_per_node=2"):
        train(ddp_config(), text_examples(), None, tmp_path / "one", resume_from=checkpoint)
