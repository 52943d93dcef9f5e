"""The simulator's rules for `benchmarks.fidelity`, measured on this machine's emulated runs.

Calibration runs use the `on_demand` policy (never preempted, so the trace's spot availability
plays no part) for the scored runs' step count, on windows in zones the fidelity benchmark does
not score. From their own results and telemetry:

- the emulated seconds a step takes (evals and periodic saves included; the clock runs at
  tick_s / seconds_per_tick emulated seconds per wall second while the trainer trains): the
  completion less the changeover and the tail, over the steps;
- the changeover: the emulated clock is frozen while a trainer boots and restores, then jumps by
  the provider's configured changeover, and every step from the trainer's `run_start` on runs on
  the clock (`trainwise.emulated._Emulation.boot_jump_s`), the first one too. A fresh process's
  first step takes longer than the others (warm-up: allocator, first kernels): that excess is a
  per-launch cost on the node, not progress, so the simulator's changeover is the configured one
  plus the measured warm-up (`warmup_s`: the first step's gap after `run_start` less the median
  step gap, median over the calibration runs' trainers);
- the tail: from the last trainer's `run_end` to the provider seeing its process exit (the
  process's shutdown on this machine), on the emulated clock and billed once per run; measured
  from each run's telemetry (wall times) and taken off its completion before the fit;
- the checkpoint save cost is the median `save_ms` of the trainers' interval checkpoints
  (telemetry), at the replay speed.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.driver_run import run_job, workspace
from cloud import emulated as replay
from telemetry.reader import read_run_events
from trainwise.emulated import EmulatedResult, ReplaySpec

CALIBRATION_POLICY = "on_demand"


@dataclass(frozen=True)
class Calibration:
    method: str
    steps: int  # steps of a scored run
    checkpoint_every_steps: int  # pinned in every run (calibration and scored)
    emulated_per_wall_s: float
    step_s: float  # emulated seconds a step takes, evals and periodic saves included
    save_s: float  # emulated seconds an interval checkpoint blocks training
    changeover_s: float  # effective, per launch (line intercept)
    tail_s: float  # the last trainer's exit after its final checkpoint (once a run)
    emulated_changeover_s: float  # what the emulated provider is configured with
    emulated_save_s: float  # what the emulated observation tells the policy
    emulated_interval_s: float
    runs: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    # The runs froze the clock from the last step to the trainer's exit
    # (`run_emulated(freeze_after_last_step=True)`): no tail on the clock (tail_s 0), and the
    # final set is billed as a shutdown, the notice at most.
    tail_frozen: bool = False
    # A launch's first-step warm-up (emulated s), part of `changeover_s` (`warmup_s` below).
    warmup_s: float = 0.0

    @property
    def saves_per_run(self) -> int:
        """Interval checkpoints in a scored run (the final one is not an interval save)."""
        return max(0, math.ceil(self.steps / self.checkpoint_every_steps) - 1)

    @property
    def run_s(self) -> float:
        """Emulated seconds a scored run trains, saves included."""
        return self.steps * self.step_s

    @property
    def pure_step_s(self) -> float:
        return (self.run_s - self.saves_per_run * self.save_s) / self.steps

    @property
    def checkpoint_interval_s(self) -> float:
        """Seconds of training between the trainer's interval checkpoints."""
        return self.checkpoint_every_steps * self.pure_step_s

    @property
    def step_wall_s(self) -> float:
        """The emulated run's `step_wall_s_estimate`: makes its work (what its policy sees) the
        simulator's pure training time, so both policies see the same job."""
        return self.pure_step_s / self.emulated_per_wall_s

    @property
    def train_overrides(self) -> dict[str, Any]:
        every = self.checkpoint_every_steps
        return {"checkpoint_every_steps": every, "eval_every_steps": every}

    def at_rate(self, emulated_per_wall_s: float) -> Calibration:
        """The same machine at another replay speed (a trace with another tick length): step,
        save and tail were measured in wall seconds, so they scale with emulated seconds per
        wall second; the changeover is the provider's configured one and does not."""
        k = emulated_per_wall_s / self.emulated_per_wall_s
        return replace(self, emulated_per_wall_s=emulated_per_wall_s, step_s=self.step_s * k,
                       save_s=self.save_s * k, tail_s=self.tail_s * k,
                       warmup_s=self.warmup_s * k,
                       changeover_s=self.changeover_s + self.warmup_s * (k - 1.0))

    def record(self) -> dict[str, Any]:
        return {"method": self.method, "steps": self.steps,
                "checkpoint_every_steps": self.checkpoint_every_steps,
                "emulated_per_wall_s": self.emulated_per_wall_s, "step_s": self.step_s,
                "pure_step_s": self.pure_step_s, "step_wall_s": self.step_wall_s,
                "save_s": self.save_s, "tail_s": self.tail_s, "changeover_s": self.changeover_s,
                "emulated_changeover_s": self.emulated_changeover_s,
                "checkpoint_interval_s": self.checkpoint_interval_s, "run_s": self.run_s,
                "saves_per_run": self.saves_per_run, "runs": list(self.runs),
                "tail_frozen": self.tail_frozen, "warmup_s": self.warmup_s}


def every_steps(steps: int) -> int:
    return max(5, steps // 4)


def interval_save_s(result: EmulatedResult, emulated_per_wall_s: float) -> list[float]:
    """Emulated seconds each interval checkpoint blocked training (telemetry `save_ms`)."""
    events = read_run_events(result.run_dir / "telemetry" / result.run_id, rank=0)
    return [e["save_ms"] / 1000.0 * emulated_per_wall_s for e in events
            if e["type"] == "checkpoint" and e.get("reason") == "interval"]


def tail_s(result: EmulatedResult, emulated_per_wall_s: float) -> float:
    """Emulated seconds from the trainer's last `run_end` (training, final eval and checkpoint
    done) to the provider seeing its process exit: billed, on the clock, once per run."""
    events = read_run_events(result.run_dir / "telemetry" / result.run_id)
    ends = [e["wall_time_s"] for e in events if e["type"] == "run_end" and e["rank"] == 0]
    done = [e["wall_time_s"] for e in events if e["type"] == "decision"
            and e["rank"] != 0 and e["action"].get("event") == "completed"]
    if not ends or not done:
        return 0.0
    return max(0.0, (done[-1] - ends[-1]) * emulated_per_wall_s)


def step_gaps_s(result: EmulatedResult, emulated_per_wall_s: float) -> list[float]:
    """Emulated seconds between consecutive steps of one trainer process (evals and saves
    between them included): wall-time gaps of rank-0 step events whose step numbers follow on,
    never across a `run_start` (a resumed trainer's first step follows its predecessor's last,
    with a boot in between)."""
    gaps, last = [], None
    for event in read_run_events(result.run_dir / "telemetry" / result.run_id, rank=0):
        if event["type"] == "run_start":
            last = None
        elif event["type"] == "step":
            if last is not None and int(event["step"]) == int(last["step"]) + 1:
                gaps.append((event["wall_time_s"] - last["wall_time_s"]) * emulated_per_wall_s)
            last = event
    return gaps


def first_step_gaps_s(result: EmulatedResult, emulated_per_wall_s: float) -> list[float]:
    """Emulated seconds from each trainer process's `run_start` (restored) to its first step."""
    gaps, start = [], None
    for event in read_run_events(result.run_dir / "telemetry" / result.run_id, rank=0):
        if event["type"] == "run_start":
            start = event["wall_time_s"]
        elif event["type"] == "step" and start is not None:
            gaps.append((event["wall_time_s"] - start) * emulated_per_wall_s)
            start = None
    return gaps


def warmup_s(results: Sequence[EmulatedResult], emulated_per_wall_s: float) -> float:
    """A launch's warm-up: the first step's gap after `run_start` less the median step gap
    (median over every trainer of `results`), emulated seconds, never below 0."""
    firsts = [g for r in results for g in first_step_gaps_s(r, emulated_per_wall_s)]
    steps = [g for r in results for g in step_gaps_s(r, emulated_per_wall_s)]
    if not firsts or not steps:
        return 0.0
    return max(0.0, statistics.median(firsts) - statistics.median(steps))


def same_run(cal: Calibration, result: EmulatedResult) -> Calibration:
    """The machine's speed during the scored run itself: its mean step gap, its interval saves
    and its own tail (trainer telemetry wall times). Only speeds are read, never the run's cost,
    completion or preemptions, which the simulator must still predict; this takes the machine's
    run-to-run drift (a shared, loaded machine) out of the comparison."""
    rate = cal.emulated_per_wall_s
    gaps, saves = step_gaps_s(result, rate), interval_save_s(result, rate)
    warmup = warmup_s([result], rate) if first_step_gaps_s(result, rate) else cal.warmup_s
    return replace(cal, method="same run: step gap, save, tail and first-step warm-up from the "
                   "scored run's own trainer telemetry", warmup_s=warmup,
                   changeover_s=cal.emulated_changeover_s + warmup,
                   step_s=statistics.fmean(gaps) if gaps else cal.step_s,
                   save_s=statistics.median(saves) if saves else cal.save_s,
                   tail_s=(tail_s(result, rate) if result.finish_s is not None
                           and not cal.tail_frozen else cal.tail_s),
                   runs=())


def calibrate(windows: Sequence[tuple[str, str, int]], partition: str, steps: int,
              seconds_per_tick: float, work: Path, max_wall_s: float,
              freeze_after_last_step: bool = False) -> Calibration:
    """Run `on_demand` for `steps` steps on each calibration window and measure
    (`freeze_after_last_step`: as the scored runs will; then there is no tail on the clock)."""
    rules = replay.default_rules()
    every = every_steps(steps)
    overrides = {"checkpoint_every_steps": every, "eval_every_steps": every}
    points, saves, tails, runs, rate, results = [], [], [], [], 0.0, []
    for i, (folder, zone_file, start) in enumerate(windows):
        n = steps
        result = run_job(workspace(work, partition), partition, max_steps=n,
                         policy_name=CALIBRATION_POLICY, run_id=f"calibration-{i:02d}",
                         train_overrides=overrides,
                         replay=ReplaySpec(trace_folder=folder, zone_files=(zone_file,),
                                           window_start_tick=start,
                                           seconds_per_tick=seconds_per_tick,
                                           max_wall_s=max_wall_s,
                                           freeze_after_last_step=freeze_after_last_step))
        if result.finish_s is None or result.preemptions:
            raise RuntimeError(f"calibration run {i} on {folder}/{zone_file}@{start} did not "
                               f"finish unpreempted ({result.status}); rerun on a quieter machine")
        probe = replay.load_replay_market(folder, zone_file, start, 1, _spot_dir())
        rate = probe.tick_s / seconds_per_tick
        launch_s = result.holdings[0]["launch_s"]
        tail = 0.0 if freeze_after_last_step else tail_s(result, rate)
        tails.append(tail)
        points.append((n, float(result.finish_s) - launch_s - tail))
        saves += interval_save_s(result, rate)
        results.append(result)
        runs.append({"window": f"{folder}/{zone_file}@{start}", "policy": CALIBRATION_POLICY,
                     "steps": n, "finish_s": result.finish_s, "tail_s": tail,
                     "wall_s": round(result.wall_s, 2)})
    # The emulated clock is frozen while a trainer boots, then jumps by the provider's configured
    # changeover; from its `run_start` every step is on the clock, the first one's warm-up too:
    # the changeover a launch costs is both.
    warmup = warmup_s(results, rate)
    changeover = rules.changeover_s + warmup
    step = statistics.fmean((y - changeover) / n for n, y in points)
    method = ("on_demand runs on unscored windows: emulated seconds a step from each run's "
              "completion less the changeover and its measured tail; save cost, tail and "
              f"first-step warm-up ({warmup:.0f} s, in the changeover) from their telemetry")
    if freeze_after_last_step:
        method = ("on_demand runs on unscored windows, clock frozen after the last step: "
                  "emulated seconds a step from each run's completion less the changeover; save "
                  f"cost and first-step warm-up ({warmup:.0f} s, in the changeover) from their "
                  "telemetry")
    return Calibration(
        method=method, steps=steps, checkpoint_every_steps=every, emulated_per_wall_s=rate,
        step_s=step, save_s=statistics.median(saves) if saves else 0.0,
        tail_s=statistics.median(tails), changeover_s=max(0.0, changeover),
        emulated_changeover_s=rules.changeover_s,
        emulated_save_s=rules.checkpoint_save_s, emulated_interval_s=rules.checkpoint_interval_s,
        runs=tuple(runs), tail_frozen=freeze_after_last_step, warmup_s=warmup)


def _spot_dir() -> Path:
    from trainwise import settings

    return settings.data_dir() / "spot"
