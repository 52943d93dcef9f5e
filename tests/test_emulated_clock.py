"""When the emulated clock runs: every training step is on the clock, as in the simulator.

- The clock waits for a booting trainer's first step (its SIGTERM handler is in place by then),
  then jumps the changeover plus the wall time since the trainer's `run_start` (restored) at
  replay speed, so its first step is on the clock like every later one (the simulator trains
  from the end of the changeover). Without that, the step was free: about one step a launch
  (the single-zone bias of benchmarks/fidelity.md).
- A trainer told to stop (reclaim notice, release, move) finishes its step in flight on the
  clock, until it leaves its step loop (its `preemption` event); only its save and exit are
  frozen (this machine's seconds, billed as a shutdown). Frozen at once, that step was free.
Fast: no trainer process, the trainer's telemetry is written by the test."""

import subprocess
import sys
import time

import pytest

from controllers.allocation_types import AllocationAction
from telemetry.events import PreemptionEvent, RunStartEvent, StepEvent
from telemetry.writer import SegmentWriter
from tests.test_emulated_multizone import Scripted, emulation, market
from trainwise import emulated as emu


def run_start(run_id: str, step: int = 0, **kw) -> RunStartEvent:
    return RunStartEvent(run_id=run_id, rank=0, step=step, model_kind="test", model_config={},
                         model_fingerprint="f", train_config={}, data_fingerprint="d",
                         curriculum_version=None, instance_type="p3.2xlarge",
                         price_usd_per_hour=3.06, **kw)


def trainer(tmp_path, spawn_wall_s: float) -> emu._Trainer:
    # A finished child stands for the trainer process: read_progress only reads telemetry.
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return emu._Trainer(process, spawn_wall_s, tmp_path / "result.json", None)


def step(run_id: str, n: int, wall_time_s: float) -> StepEvent:
    return StepEvent(run_id=run_id, rank=0, step=n, wall_time_s=wall_time_s, train_loss=1.0,
                     learning_rate=0.1, grad_norm=1.0, grad_noise_scale=0.0, micro_batch_size=16,
                     grad_accum_steps=1, step_time_ms=50.0, samples_seen=16, tokens_seen=0,
                     elapsed_s=0.1, cost_usd=0.0)


def test_a_trainers_first_step_runs_on_the_clock(tmp_path):
    wait = AllocationAction("us-east-1a", 0, 0, reason="wait")
    job, writer = emulation(tmp_path, [market("us-east-1a", [1] * 20, spot=0.9)], Scripted([wait]))
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        now = time.time()
        job.trainer = emu._Trainer(live, now - 1.0, tmp_path / "result.json", None)
        with writer, SegmentWriter(tmp_path / "telemetry", "t", rank=0) as trainer_writer:
            # Restored at now - 0.2 s (wall), first step at now: 0.2 s of its loop at 975x.
            trainer_writer.write(run_start("t", wall_time_s=now - 0.2))
            trainer_writer.write(step("t", 1, wall_time_s=now))
            job.poll_trainer()
    finally:
        live.kill()
        live.wait()
    assert job.trainer.ready
    # Old rule: the clock jumped the changeover only (360 s), that first step free.
    assert job.clock.now_s >= 360.0 + 0.2 * 975.0 - 1.0, (
        f"clock at {job.clock.now_s} s: the first step (0.2 wall s = 195 s) must be on it")


def test_a_predecessors_run_start_does_not_count_for_a_new_trainer(tmp_path):
    job, writer = emulation(tmp_path, [market("us-east-1a", [1] * 5, spot=0.9)], Scripted([]))
    with writer, SegmentWriter(tmp_path / "telemetry", "t", rank=0) as trainer_writer:
        trainer_writer.write(run_start("t"))
    job.trainer = trainer(tmp_path, spawn_wall_s=time.time() + 60.0)  # spawned after it
    job.read_progress()
    assert job.trainer.loop_start_wall_s is None and not job.trainer.ready and job.frozen
    assert job.boot_jump_s(job.trainer, time.time() + 90.0) == job.rules.changeover_s


def test_a_stopping_trainer_finishes_its_step_in_flight_on_the_clock(tmp_path):
    job, writer = emulation(tmp_path, [market("us-east-1a", [1] * 5, spot=0.9)], Scripted([]))
    list(job.clock.advance_to(195.0))  # at the tick-1 boundary, where a notice comes
    job.trainer = trainer(tmp_path, spawn_wall_s=time.time() - 1.0)
    job.trainer.ready = True
    job.stop_trainer("preemption")
    # Old rule: frozen at the notice, the step in flight free.
    assert not job.frozen, "the step in flight after a notice is training: the clock runs"
    job.advance(195.0 + 1000.0)
    # It runs at most the notice past it (120 s) and never across the next tick boundary.
    assert job.clock.now_s == pytest.approx(195.0 + 120.0, abs=1e-3)
    assert job.clock.next_tick == 2
    with writer, SegmentWriter(tmp_path / "telemetry", "t", rank=0) as trainer_writer:
        trainer_writer.write(PreemptionEvent(run_id="t", rank=0, step=3, signal_name="SIGTERM",
                                             notice_s=120.0, received_wall_time_s=time.time(),
                                             response="checkpoint_and_exit"))
    job.read_progress()
    # Left its step loop: the save and exit are this machine's seconds, the clock frozen.
    assert job.frozen and not job.finishing_step


def test_a_trainer_stopped_while_booting_keeps_the_clock_frozen(tmp_path):
    job, writer = emulation(tmp_path, [market("us-east-1a", [1] * 5, spot=0.9)], Scripted([]))
    job.trainer = trainer(tmp_path, spawn_wall_s=time.time())
    job.stop_trainer("preemption")  # not booted: no step in flight
    with writer:
        assert job.frozen
