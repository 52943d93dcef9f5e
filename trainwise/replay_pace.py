"""The emulated provider's replay speed, paced by the trainer's measured step time.

The emulated provider replays a spot trace at a fixed `seconds_per_tick` of wall time, while the
trainer's steps take what this machine takes. At a fixed speed the trace meets a run at a
different step on every machine: the demo's reclaim, 52 ticks into its window, fell at step 305
of 600 on the 2-core machine the demo was set on and would fall after the last step on one twice
as fast, a run in which no decision matters. A request with `replay_steps_per_tick` > 0 sets the
speed from the step time measured here before the run (`profile_samples_per_s`: forward and
backward of the run's own model at its batch, thread CPU seconds, so other load on the machine
does not skew it), so a trace tick lasts about that many steps on any machine, and the provider
seconds (the bill) per step are about the same too. The loop's real step also evaluates,
checkpoints and records, so the pace is approximate; the record says what was measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Below this a tick would pass between two polls of the provider (a fast tick every ten steps
# of a few ms); above it a 600-step run would not reach its window's first reclaim.
MIN_SECONDS_PER_TICK = 0.02
MAX_SECONDS_PER_TICK = 5.0


@dataclass(frozen=True)
class ReplayPace:
    """The replay speed chosen for a run and what it was chosen from."""

    seconds_per_tick: float
    step_s: float  # the measured step (thread CPU seconds of forward + backward)
    steps_per_tick: float
    reason: str


def measured_step_s(config: Any, examples: Any) -> float:
    """Thread CPU seconds of one forward + backward of the run's model at its batch, measured
    on a separate model from the run's seed (the run's own model and RNG are untouched)."""
    import torch

    from training._loop_step import profile_samples_per_s
    from training.loop import default_model_config
    from training.model import MODEL_KIND_FOR_DATA, build_model

    batch = int(config.micro_batch_size) * int(config.grad_accum_steps)
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(config.seed)
        probe = build_model(MODEL_KIND_FOR_DATA[examples.kind],
                            config.model or default_model_config(examples))
    finally:
        torch.random.set_rng_state(generator_state)
    rates = profile_samples_per_s(probe, examples, [batch], repeats=2, seed=config.seed)
    return batch / rates[batch]


def pace(steps_per_tick: float, step_s: float) -> ReplayPace:
    """`steps_per_tick` steps of `step_s` seconds per trace tick, within the bounds above."""
    if not steps_per_tick > 0:
        raise ValueError(f"replay_steps_per_tick={steps_per_tick} must be > 0 (0 turns pacing "
                         "off: the provider's fixed speed)")
    if not step_s > 0:
        raise ValueError(f"a measured step of {step_s} s cannot pace the replay")
    wanted = steps_per_tick * step_s
    seconds = min(max(wanted, MIN_SECONDS_PER_TICK), MAX_SECONDS_PER_TICK)
    bound = "" if seconds == wanted else (
        f", held to [{MIN_SECONDS_PER_TICK}, {MAX_SECONDS_PER_TICK}] s from {wanted:.3f} s")
    return ReplayPace(seconds, step_s, steps_per_tick,
                      f"replay paced at {seconds:.3f} wall s per trace tick: "
                      f"{steps_per_tick:g} steps x a measured step of {step_s * 1e3:.1f} ms "
                      f"(forward + backward, thread CPU){bound}")


def paced_provider(request: Any, config: Any, examples: Any) -> tuple[Any, ReplayPace | None]:
    """The run's provider (`trainwise.gang.provider_for_run`); an emulated one replays at the
    request's pace when `replay_steps_per_tick` > 0. A pace asked of another provider is refused:
    only a replay has a speed to set."""
    from cloud.providers import provider_name
    from cloud.providers.emulated import NAME as EMULATED
    from trainwise import gang

    steps_per_tick = float(getattr(request, "replay_steps_per_tick", 0.0) or 0.0)
    if steps_per_tick <= 0:
        return gang.provider_for_run(request.instance_type, request.region), None
    name = provider_name(None)
    if name != EMULATED:
        raise ValueError(f"replay_steps_per_tick={steps_per_tick:g} paces a replayed trace; the "
                         f"provider is {name!r}, which replays nothing: set it to 0")
    chosen = pace(steps_per_tick, measured_step_s(config, examples))
    provider = gang.provider_for_run(request.instance_type, request.region,
                                     seconds_per_tick=chosen.seconds_per_tick)
    return provider, chosen
