"""The emulated provider's replay speed, paced by the training loop's own steps.

The emulated provider replays a spot trace at a fixed `seconds_per_tick` of wall time, while the
trainer's steps take what this machine takes. At a fixed speed the trace meets a run at a
different step on every machine: the demo's reclaim, 52 ticks into its window, fell at step 305
of 600 on the 2-core machine the demo was set on and would fall after the last step on one twice
as fast, a run in which no decision matters. A request with `replay_steps_per_tick` > 0 paces
the replay by the loop itself (`StepPacer`): the provider's clock holds at the end of the boot
until the loop's second fast tick, the wall seconds per step between its first two fast ticks
(the first steps warm caches up and are left out) set the speed, and the clock then catches up
on every wall second since the loop started at that speed. A trace tick then lasts about that
many steps on any machine, and the provider seconds (the bill) per step are about the same too.

A probe of forward and backward measured before the run was tried first: at 45 ms it was half
of the loop's real 80-90 ms step on this machine (the optimizer step, the sampler, the run's
telemetry and MLflow threads competing for the interpreter), so it paced the demo at half the
steps per tick it asked for. The loop's own steps are the only measure of the loop's speed.
"""

from __future__ import annotations

from dataclasses import dataclass

# Below this a tick would pass between two polls of the provider (a fast tick every ten steps
# of a few ms); above it a 600-step run would not reach its window's first reclaim.
MIN_SECONDS_PER_TICK = 0.02
MAX_SECONDS_PER_TICK = 5.0


@dataclass(frozen=True)
class ReplayPace:
    """The replay speed chosen for a run and what it was chosen from."""

    seconds_per_tick: float
    step_s: float  # the loop's wall seconds per step between two fast ticks
    steps_per_tick: float
    reason: str


def pace(steps_per_tick: float, step_s: float, measured_over: str = "") -> ReplayPace:
    """`steps_per_tick` steps of `step_s` wall seconds per trace tick, within the bounds above;
    `measured_over` says which steps gave `step_s`."""
    if not steps_per_tick > 0:
        raise ValueError(f"replay_steps_per_tick={steps_per_tick} must be > 0 (0 turns pacing "
                         "off: the provider's fixed speed)")
    if not step_s > 0:
        raise ValueError(f"a measured step of {step_s} s cannot pace the replay")
    wanted = steps_per_tick * step_s
    seconds = min(max(wanted, MIN_SECONDS_PER_TICK), MAX_SECONDS_PER_TICK)
    bound = "" if seconds == wanted else (
        f", held to [{MIN_SECONDS_PER_TICK}, {MAX_SECONDS_PER_TICK}] s from {wanted:.3f} s")
    over = f", {measured_over}" if measured_over else ""
    return ReplayPace(seconds, step_s, steps_per_tick,
                      f"replay paced at {seconds:.3f} wall s per trace tick: "
                      f"{steps_per_tick:g} steps x the loop's measured {step_s * 1e3:.1f} ms "
                      f"per step (wall{over}){bound}")


@dataclass
class StepPacer:
    """Chooses the pace from the loop's fast ticks (see the module docstring)."""

    steps_per_tick: float
    origin: tuple[float, int] | None = None  # (monotonic wall s, step) at the first fast tick
    chosen: ReplayPace | None = None

    def __post_init__(self) -> None:
        pace(self.steps_per_tick, 1.0)  # the same refusal as a bad request

    def restart(self) -> None:
        """A new segment (the loop restarted on a replacement) before the pace was chosen: the
        wall since the last fast tick includes the replacement, not steps."""
        if self.chosen is None:
            self.origin = None

    def observe(self, wall_s: float, step: int) -> ReplayPace | None:
        """At a fast tick: the pace once chosen; None while it is not (the first tick only
        sets the origin)."""
        if self.chosen is not None:
            return self.chosen
        if self.origin is None or step <= self.origin[1]:
            if self.origin is None:
                self.origin = (wall_s, step)
            return None
        began_s, first = self.origin
        self.chosen = pace(self.steps_per_tick, max(wall_s - began_s, 1e-9) / (step - first),
                           f"steps {first}..{step}")
        return self.chosen
