"""Interrupt a trainer (kill -9 at a random step, inside a checkpoint write, inside a telemetry
seal; SIGTERM at a random step), then check, resume to the end and compare: one trial.

Fault points are chosen by watching the run: a random target step from the telemetry, then a
random delay inside that step; for the "inside" kinds, the trainer's folders are polled every
0.3 ms and the kill lands the moment a checkpoint temp file (or, with commit manifests, a payload
not yet committed) or a segment seal in progress is seen. A trial whose fault point never came
(the run ended first) is recorded with `hit = False` and still checked.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.faults import harness

KILL_RANDOM = "kill9_random"
KILL_CHECKPOINT = "kill9_checkpoint_write"
KILL_SEAL = "kill9_telemetry_seal"
SIGTERM_RANDOM = "sigterm_random"
KINDS = (KILL_RANDOM, KILL_CHECKPOINT, KILL_SEAL, SIGTERM_RANDOM)


@dataclass
class Suite:
    """What every trial shares: the folders, the data, the run shape and the reference."""

    work_dir: Path
    shards_dir: Path
    shape: harness.RunShape
    base_config: dict[str, Any]
    reference: harness.Reference

    @classmethod
    def prepare(cls, work_dir: Path, shape: harness.RunShape | None = None) -> Suite:
        from training import shards

        shape = shape or harness.RunShape()
        work_dir = Path(work_dir)
        shards_dir = harness.prepare_shards(work_dir)
        examples = shards.load_shards(shards_dir)
        config = harness.train_config("run", len(examples.vocab), examples.inputs.shape[1] - 1,
                                      shape)
        return cls(work_dir, shards_dir, shape, config,
                   harness.Reference.train(work_dir, shards_dir, config))

    def new_run(self, name: str) -> harness.Run:
        folder = self.work_dir / "trials" / name
        return harness.Run(folder, self.shards_dir, {**self.base_config, "run_id": name})


def _inject(kind: str, run: harness.Run, process, rng: np.random.Generator,
            shape: harness.RunShape, variant: int) -> dict[str, Any]:
    """Waits for the fault point and signals the trainer; says what it hit."""
    alive = lambda: process.poll() is None  # noqa: E731
    info: dict[str, Any] = {"hit": False, "target_step": None, "at": None}
    if kind in (KILL_RANDOM, SIGTERM_RANDOM):
        target = int(rng.integers(1, shape.max_steps))
        info["target_step"] = target
        reached = harness.wait_for(lambda: harness.newest_step(run.rank0) >= target or not alive(),
                                   harness.TRAINER_TIMEOUT_S, poll_s=0.002)
        if reached and alive():
            time.sleep(float(rng.uniform(0.0, 0.08)))  # somewhere inside the next step
    elif kind == KILL_CHECKPOINT:
        # Random which checkpoint: wait for a random step first, then for the next write.
        target = int(rng.integers(1, max(2, shape.max_steps - shape.checkpoint_every_steps)))
        info["target_step"] = target
        harness.wait_for(lambda: harness.newest_step(run.rank0) >= target or not alive(),
                         harness.TRAINER_TIMEOUT_S, poll_s=0.002)
        uncommitted = harness.has_manifests() and variant % 2 == 1
        info["at"] = "payload_not_committed" if uncommitted else "temp_file"
        probe = ((lambda: harness.uncommitted_payloads(run.checkpoints)) if uncommitted
                 else (lambda: harness.temp_files(run.checkpoints)))
        reached = harness.wait_for(lambda: bool(probe()) or not alive(), harness.TRAINER_TIMEOUT_S)
    elif kind == KILL_SEAL:
        target = int(rng.integers(1, shape.max_steps))
        info["target_step"] = target
        harness.wait_for(lambda: harness.newest_step(run.rank0) >= target or not alive(),
                         harness.TRAINER_TIMEOUT_S, poll_s=0.002)
        info["at"] = "segment_full_unsealed"
        reached = harness.wait_for(
            lambda: harness.full_open_segment(run.rank0, shape.events_per_segment)
            or not alive(), harness.TRAINER_TIMEOUT_S)
    else:
        raise ValueError(f"fault kind {kind!r}: use one of {KINDS}")
    if not (reached and alive()):
        return info  # the run ended first
    sent_wall_s = time.time()
    os.kill(process.pid, signal.SIGTERM if kind == SIGTERM_RANDOM else signal.SIGKILL)
    info.update(hit=True, sent_wall_s=sent_wall_s, step_at_signal=harness.newest_step(run.rank0))
    return info


def _notice_to_durable_s(result: dict[str, Any] | None, sent_wall_s: float) -> float | None:
    """SIGTERM to the preemption checkpoint's commit on disk (0 when the notice landed on a
    boundary already saved); None when the trainer did not end preempted."""
    if result is None or result.get("status") != "preempted":
        return None
    marker = harness.commit_marker(Path(result["checkpoint_path"]))
    if not marker.exists():
        return None
    return max(0.0, marker.stat().st_mtime - sent_wall_s)


def run_trial(suite: Suite, kind: str, index: int, rng: np.random.Generator) -> dict[str, Any]:
    """One fault, then the checks, the resume and the comparison; a JSON-ready record."""
    run = suite.new_run(f"{kind.replace('_', '-')}-{index:03d}")
    began = time.monotonic()
    process = run.start(None)
    info = _inject(kind, run, process, rng, suite.shape, index)
    exit_code = harness.wait(process)
    exit_s = time.time() - info["sent_wall_s"] if info["hit"] else None
    first = run.result(0)
    trial: dict[str, Any] = {"kind": kind, "index": index, "run_id": run.run_id, **info,
                             "exit_code": exit_code, "first_status": first and first["status"],
                             "signal_to_exit_s": exit_s}
    trial.pop("sent_wall_s", None)
    if kind == SIGTERM_RANDOM and info["hit"]:
        trial["notice_to_durable_s"] = _notice_to_durable_s(first, info["sent_wall_s"])
        trial["answered"] = first is not None and first.get("status") == "preempted"
    # After the fault: every committed checkpoint must load; killed writers leave temp files.
    trial["corrupt_checkpoints"] = harness.corrupt_checkpoints(run.checkpoints)
    trial["temp_files_after_fault"] = len(harness.temp_files(run.checkpoints))
    try:
        recorded = harness.recorded_steps(run)
        trial["telemetry_read_error"] = None
    except Exception as error:  # noqa: BLE001 - recorded as a finding
        recorded = []
        trial["telemetry_read_error"] = f"{type(error).__name__}: {str(error)[:200]}"
    last_step = max((s for s, _ in recorded), default=0)
    point = harness.resume_point(run.checkpoints)
    trial.update(last_recorded_step=last_step, resume_step=point.step,
                 skipped_checkpoints=point.skipped)
    if first is not None and first.get("status") == "completed":
        trial.update(lost_steps=0, resumed=False)
        final = first
        resume_code = 0
    else:
        trial["lost_steps"] = max(0, last_step - point.step)  # steps the resume runs again
        resume_code, final = harness.run_to_end(run, point.resume_from)
        trial["resumed"] = True
        trial["temp_files_after_resume"] = len(harness.temp_files(run.checkpoints))
    ok = resume_code == 0 and final is not None and final.get("status") == "completed" \
        and final.get("steps") == suite.shape.max_steps
    trial["resume_failed"] = not ok
    if not ok:
        trial["resume_error"] = f"exit {resume_code}: {run.log_tail(run.processes - 1)}"
    else:
        trial.update(harness.matches_reference(final, run, suite.reference))
        try:
            trial.update(harness.audit_telemetry(run, run.run_dir / "telemetry.duckdb",
                                                 suite.shape.max_steps))
        except Exception as error:  # noqa: BLE001 - recorded as a finding
            trial["telemetry_error"] = f"{type(error).__name__}: {str(error)[:300]}"
    trial["wall_s"] = round(time.monotonic() - began, 2)
    return trial


def plan(quick: bool) -> list[str]:
    """The trials of a suite run, in order (kinds interleaved so a partial run is balanced)."""
    counts = ({KILL_RANDOM: 2, KILL_CHECKPOINT: 2, KILL_SEAL: 1, SIGTERM_RANDOM: 2} if quick
              else {KILL_RANDOM: 12, KILL_CHECKPOINT: 8, KILL_SEAL: 4, SIGTERM_RANDOM: 12})
    order: list[str] = []
    while any(counts.values()):
        for kind in KINDS:
            if counts[kind]:
                order.append(kind)
                counts[kind] -= 1
    return order
