"""The allocation policy's market view of a live run, for the slow tick (no Dagster here).

`market_view(events, request, gang_record)` builds the `controllers.allocation_types.
AllocationObservation` that the slow tick hands the allocation policy in `SlowObservation.market`,
or says why there is none (then the tick keeps the nodes, as before). It reads:

- the provider's market now. For `aws`, EC2's spot prices per zone of the run's region, with a
  zone held back after the run was reclaimed or refused spot there (`trainwise.market_view_aws`).
  For `emulated`, at the run's current trace clock: the same replayed real trace the run's
  provider session
  replays (`trainwise.gang.provider_for_run`: every zone of the default trace folder from window
  tick 0, at its replay speed), its spot availability and spot/on-demand prices per zone of the
  run's region. The clock is the one `gang.json` last recorded (`history[-1]`: provider seconds
  at a wall time) moved on by the wall seconds since at the replay speed, as the session's own
  `check()` moves it (an over-estimate while the trainer is stopped for a restore). A trace that
  is the labelled synthetic stand-in (no shared data) gives no view: its "market" is invented.
- what the provider holds for the run (`gang.json`): market, zone, nodes, launch time, reclaims.
- the run's progress from its telemetry: steps done of `max_steps`, the mean step time and the
  checkpoint saves, all put on the provider's clock (wall seconds x replay speed), because the
  trace, changeover, notice and deadline are in that frame.
- the deadline: the request's `deadline_s` (provider seconds since the job started) when set,
  else `DEFAULT_DEADLINE_FACTOR` x the on-demand time to finish from the start (one changeover
  plus `max_steps` at the measured step time); the reason says which.

Work is in node-hours on the provider's clock: the full gang of `nodes` gains `nodes` node-hours
per hour (the reference throughput, as the emulated benchmark's one node gains 1.0).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controllers.allocation_types import AllocationObservation
from trainwise.market_types import Markets, held_zone_and_region
from trainwise.market_view_aws import aws_markets

EMULATED = "emulated"
AWS = "aws"
# Without a deadline in the request: this many times the on-demand time to finish.
DEFAULT_DEADLINE_FACTOR = 1.5


@dataclass(frozen=True)
class MarketView:
    """The observation for the allocation policy, or None and why not; `reason` either way."""

    observation: AllocationObservation | None
    reason: str


def wall_now_s() -> float:
    """Wall time now (the scale of gang.json's `wall_time_s`); tests pin it."""
    return time.time()


def emulated_markets(instance_type: str, region: str, replay: dict[str, Any] | None = None
                     ) -> tuple[tuple[Any, ...], float]:
    """The markets the run's emulated provider replays and its speed (provider seconds per wall
    second), built as the run built them (`trainwise.gang.provider_for_run`): the trace window
    gang.json records under "replay", else the provider's defaults (what runs.py uses)."""
    from trainwise import gang

    provider = gang.provider_for_run(instance_type, region, name=EMULATED, **(replay or {}))
    return tuple(provider.markets), float(provider.clock.emulated_per_wall_s)


def provider_clock_s(gang_record: dict[str, Any], emulated_per_wall_s: float,
                     now_wall_s: float) -> float | None:
    """The provider's clock now: the last recorded (provider seconds, wall time) moved on by the
    wall seconds since at the replay speed; `provider_now_s` alone when no history has a wall
    time; None when gang.json records no clock."""
    for entry in reversed(gang_record.get("history") or []):
        at_s, wall_s = entry.get("provider_time_s"), entry.get("wall_time_s")
        if at_s is not None and wall_s is not None:
            return float(at_s) + max(0.0, now_wall_s - float(wall_s)) * emulated_per_wall_s
    now = gang_record.get("provider_now_s")
    return float(now) if now is not None else None


def market_view(events: list[dict[str, Any]], request: dict[str, Any],
                gang_record: dict[str, Any] | None, *,
                now_wall_s: float | None = None, aws_provider: Any = None) -> MarketView:
    """See the module docstring. Never raises on a run's own files: a view that cannot be
    built is None with the reason (the tick then keeps the nodes). `aws_provider`: the EC2
    provider to ask (tests pass one at moto_server; None builds the run's own)."""
    if not gang_record:
        return MarketView(None, "no gang.json: the provider holds no nodes on record for the run")
    provider = str(gang_record.get("provider") or "")
    now_wall = wall_now_s() if now_wall_s is None else now_wall_s
    if provider == EMULATED:
        markets = _emulated(request, gang_record, now_wall)
    elif provider == AWS:
        markets = aws_markets(request, gang_record, now_wall, provider=aws_provider)
    else:
        return MarketView(None, f"provider {provider or '(none)'!r} has no market view here "
                                f"(only {EMULATED!r}, a replayed trace, and {AWS!r}, EC2's spot "
                                "prices, are read)")
    if isinstance(markets, str):
        return MarketView(None, markets)
    return _view(events, request, gang_record, markets)


def _emulated(request: dict[str, Any], gang_record: dict[str, Any],
              now_wall: float) -> Markets | str:
    """The emulated provider's replayed trace at the run's clock, or why there is none."""
    _, region = held_zone_and_region(request, gang_record)
    instance_type = str(gang_record.get("instance_type") or request.get("instance_type") or "")
    try:
        replay_args = gang_record.get("replay")
        markets, speed = (emulated_markets(instance_type, region, replay_args) if replay_args
                          else emulated_markets(instance_type, region))
    except (OSError, ValueError) as error:
        return f"the emulated trace could not be read ({error})"
    markets = tuple(m for m in markets if m.region == region)
    if not markets:
        return f"the emulated trace has no zone in region {region!r}"
    if all(m.synthetic for m in markets):
        return ("no trace: the emulated provider replays a labelled synthetic stand-in (shared "
                "spot data missing), not a market")
    now_s = provider_clock_s(gang_record, speed, now_wall)
    if now_s is None:
        return "gang.json records no provider clock (no history, no provider_now_s)"
    window_ticks = min(len(m.available) for m in markets)
    tick_s = float(markets[0].tick_s)
    tick = int(now_s // tick_s)
    if tick >= window_ticks:
        # A stale gang.json (the trainer stopped without a run_end) or a run longer than the
        # replayed window: the trace says nothing there (it would read as spot down everywhere).
        return (f"the run's trace clock ({now_s:.0f} provider-s, tick {tick}) is past the "
                f"replayed window ({window_ticks} ticks): no market data")
    return Markets(
        zones=tuple(m.zone for m in markets),
        spot_available=tuple(m.available_at(tick) for m in markets),
        spot_usd_per_hour=tuple(float(m.spot_usd_per_hour) for m in markets),
        on_demand_usd_per_hour=tuple(float(m.on_demand_usd_per_hour) for m in markets),
        now_s=now_s, origin_s=0.0, provider_per_wall_s=speed,
        # The trace's tick, as the emulated benchmark; the sensor's own interval is longer.
        tick_s=tick_s, trace_time_s=float(markets[0].window_start_tick * tick_s + now_s),
        source=(f"emulated trace {Path(markets[0].source).parent.name} tick "
                f"{markets[0].window_start_tick + tick} (provider clock {now_s:.0f} s)"))


def _view(events: list[dict[str, Any]], request: dict[str, Any], gang_record: dict[str, Any],
          markets: Markets) -> MarketView:
    """The observation from a provider's markets and the run's own files."""
    from cloud import emulated as replay

    held_zone, _ = held_zone_and_region(request, gang_record)
    speed = markets.provider_per_wall_s
    now_s = markets.now_s - markets.origin_s  # job time
    steps = [e for e in events if e["type"] == "step"]
    if not steps or steps[-1]["step"] <= 0 or steps[-1]["elapsed_s"] <= 0:
        return MarketView(None, "no step trained yet: no work rate to plan with")
    rules = replay.default_rules()
    step, max_steps = int(steps[-1]["step"]), int(request["max_steps"])
    step_s = float(steps[-1]["elapsed_s"]) / step * speed  # provider seconds per step
    nodes = max(1, int(gang_record.get("nodes") or request.get("nodes") or 1))
    market_kind = str(gang_record.get("market") or "")
    holding = bool(held_zone) and int(gang_record.get("nodes") or 0) > 0
    saves = [e for e in events if e["type"] == "checkpoint" and e["step"] <= step]
    checkpoint_step = max((int(e["step"]) for e in saves), default=0)
    save_s = (sum(e["save_ms"] for e in saves) / len(saves) / 1000.0 * speed if saves
              else rules.checkpoint_save_s)
    # The trainer's interval as checkpointed: the mean spacing of distinct checkpoint steps.
    ckpt_steps = sorted({int(e["step"]) for e in saves})
    interval_s = ((ckpt_steps[-1] - ckpt_steps[0]) / (len(ckpt_steps) - 1) * step_s
                  if len(ckpt_steps) > 1 else rules.checkpoint_interval_s)
    history = gang_record.get("history") or []
    launches = [float(h["provider_time_s"]) - markets.origin_s for h in history
                if h.get("event") == "launch" and h.get("provider_time_s") is not None]
    launch_s = launches[-1] if launches and holding else None
    changeover_left = (max(0.0, launch_s + rules.changeover_s - now_s)
                       if launch_s is not None else 0.0)
    reclaims = tuple(float(h["provider_time_s"]) - markets.origin_s for h in history
                     if h.get("event") == "notice" and str(h.get("reason", "")).startswith(
                         "reclaim") and h.get("provider_time_s") is not None)
    on_demand_to_finish_s = rules.changeover_s + max_steps * step_s
    if request.get("deadline_s") is not None:
        deadline_s = float(request["deadline_s"])
        deadline_why = f"deadline {deadline_s / 3600:.2f} h from the request"
    else:
        deadline_s = DEFAULT_DEADLINE_FACTOR * on_demand_to_finish_s
        deadline_why = (f"deadline {deadline_s / 3600:.2f} h: default {DEFAULT_DEADLINE_FACTOR}x "
                        f"the on-demand time to finish (the request sets none)")
    node_h = nodes / 3600.0
    observation = AllocationObservation(
        time_s=now_s,
        tick_s=markets.tick_s,
        trace_time_s=markets.trace_time_s,
        work_done_h=step * step_s * node_h,
        work_checkpointed_h=checkpoint_step * step_s * node_h,
        work_total_h=max_steps * step_s * node_h,
        work_rate_gpu_h_per_h=float(nodes),
        deadline_s=deadline_s,
        changeover_s=rules.changeover_s,
        checkpoint_save_s=save_s,
        checkpoint_interval_s=interval_s,
        notice_s=rules.notice_s,
        node_count=nodes,
        zones=markets.zones,
        home_zone=held_zone or markets.zones[0],
        zone=held_zone if holding else None,
        spot_nodes=nodes if holding and market_kind == "spot" else 0,
        on_demand_nodes=nodes if holding and market_kind != "spot" else 0,
        in_changeover=changeover_left > 0,
        changeover_left_s=changeover_left,
        last_zone=held_zone or None,
        spot_available_by_zone=markets.spot_available,
        spot_price_usd_per_hour_by_zone=markets.spot_usd_per_hour,
        on_demand_price_usd_per_hour_by_zone=markets.on_demand_usd_per_hour,
        since_checkpoint_s=max(0, step - checkpoint_step) * step_s,
        since_launch_s=max(0.0, now_s - launch_s) if launch_s is not None else 0.0,
        preemption_times_s=reclaims,
        launch_failed=bool(history) and history[-1].get("event") == "launch_failed",
    )
    spots = ", ".join(f"{z} {a}" for z, a in zip(
        markets.zones, markets.spot_available, strict=True))
    return MarketView(observation, (
        f"{markets.source}, spot available: {spots}; step {step}/{max_steps} at "
        f"{step_s:.1f} provider-s a step; {deadline_why}"))
