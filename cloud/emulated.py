"""The emulated cloud's pure parts: a real spot trace replayed in accelerated time, the billing
rule, and the `AllocationObservation` an allocation policy sees at each replayed tick.

No processes and no I/O beyond reading the trace: the orchestration that starts real trainer
processes and signals them lives in `trainwise/emulated.py` (it needs `training` and `telemetry`,
which `cloud/` may not import). Keeping the replay and the bill here lets the simulator's figures
and the emulated ones be compared rule for rule.

The replay (one zone's view; several zones share the clock, one `ReplayMarket` each, and a
gang's N nodes are N holdings):

- Trace tick i (`tick_s` emulated seconds, 195 s in the 2023-02 availability traces) lasts
  `seconds_per_tick` of wall time. The emulated clock runs only while the cloud is "live"
  (a trainer trains, or nothing is held): it is frozen while a trainer process boots or shuts
  down, because those wall seconds are this machine's, not the emulated node's. A launch then
  jumps the clock by `changeover_s` (launch + restore, as in `cloud/simulator.py`) plus the
  trainer's steps since it entered its step loop, and a trainer told to stop finishes its step
  in flight on the clock: every training step is time, as in the simulator
  (`trainwise/emulated.py`, "When the clock runs").
- Spot availability at tick i is `available[i]` of the window; after the window, spot is treated
  as unavailable (no market data), so a policy falls back to on-demand.

Billing rule (per emulated second): every holding (a launched node, spot or on-demand) is billed
from its launch until the node is down, at its price per hour. A node is down when training ends
on it, or, once it was told to stop (spot reclaim notice, release, switch), when its trainer
process exits or the notice runs out (the provider reclaims or kills it), whichever comes first:
`node_down_s`. The clock is frozen while a trainer shuts down (this machine's seconds), so the
shutdown's wall seconds are converted at replay speed, at most `notice_s`. Every second a node
was up is billed, including the work a killed trainer did after its last checkpoint. The first
`changeover_s` of each holding is the changeover delay, billed like the rest. So
`cost_usd = sum((end_s - launch_s) * price_usd_per_hour / 3600)`. Unlike the simulator (whose
notice falls inside the tick before the reclaim), a notice here arrives at the tick boundary, so
a stopped node costs up to `notice_s` more here than there.

Preemption waste: steps a resumed trainer runs again because the killed one had recorded them
after its last checkpoint (`replayed_steps`), at the emulated seconds a step stands for
(`work_total_s / max_steps`) and the price of the node that re-runs them. They are billed (the
node was up) but are not training progress: `ReplayWaste` keeps them apart from useful work.

References: Wu et al., "Can't Be Late", NSDI'24 (the traces and the 0.1 h changeover);
skypilot-org/spot-traces (the trace files); AWS's two-minute spot interruption notice.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cloud import prices
from cloud.simulator import ClusterRules
from cloud.traces import FOLDER_MEANING, TraceMeaning, load_trace, region_of_zone
from controllers.allocation_types import AllocationObservation

SPOT = "spot"
ON_DEMAND = "on_demand"
SYNTHETIC_SOURCE = "SYNTHETIC availability (shared spot data missing; not a real trace)"


@dataclass(frozen=True)
class ReplayMarket:
    """One zone's spot availability over the replayed window, and the prices that bill it."""

    zone: str
    instance_type: str
    tick_s: int
    # available[i]: spot nodes available during window tick i (trace tick window_start_tick + i).
    available: np.ndarray
    window_start_tick: int
    source: str
    spot_usd_per_hour: float
    on_demand_usd_per_hour: float
    spot_price_source: str

    @property
    def region(self) -> str:
        return region_of_zone(self.zone)

    @property
    def synthetic(self) -> bool:
        return self.source == SYNTHETIC_SOURCE

    def available_at(self, tick: int) -> int:
        """Spot nodes available at window tick `tick`; 0 after the window (no market data)."""
        if tick < 0:
            raise ValueError(f"tick={tick} must be >= 0")
        return int(self.available[tick]) if tick < self.available.shape[0] else 0

    def price_usd_per_hour(self, kind: str) -> float:
        if kind == SPOT:
            return self.spot_usd_per_hour
        if kind == ON_DEMAND:
            return self.on_demand_usd_per_hour
        raise ValueError(f"node kind {kind!r}: use {SPOT!r} or {ON_DEMAND!r}")


def synthetic_availability(n_ticks: int, up_ticks: int = 4, down_ticks: int = 3) -> np.ndarray:
    """A labelled stand-in for a trace, ONLY for when the shared data is missing (tests on a bare
    clone): `up_ticks` up, then `down_ticks` down, repeated."""
    if n_ticks < 1 or up_ticks < 1 or down_ticks < 1:
        raise ValueError("n_ticks, up_ticks and down_ticks must be >= 1")
    pattern = np.array([1] * up_ticks + [0] * down_ticks, dtype=np.int64)
    return np.resize(pattern, n_ticks).astype(np.int64)


def spot_price(instance_type: str, region: str) -> tuple[float, str]:
    """Spot USD/h from the Spot Advisor feed, else the Can't Be Late discount; and its source
    (the providers' billing price, `cloud.providers.base.spot_price_usd_per_hour`)."""
    from cloud.providers.base import spot_price_usd_per_hour

    return spot_price_usd_per_hour(instance_type, region)


def load_replay_market(
    trace_folder: str,
    zone_file: str,
    window_start_tick: int,
    n_ticks: int,
    spot_dir: str | Path,
) -> ReplayMarket:
    """The replayed window of a real trace; a labelled synthetic array when the file is missing.

    `n_ticks` is cut to what the trace holds after `window_start_tick` (later ticks read as
    unavailable, see `ReplayMarket.available_at`).
    """
    if window_start_tick < 0 or n_ticks < 1:
        raise ValueError(f"window_start_tick={window_start_tick} must be >= 0 and n_ticks="
                         f"{n_ticks} >= 1")
    instance = prices.instance_for_trace(trace_folder, zone_file)
    zone = Path(zone_file).name.split("_", 1)[0]
    on_demand = prices.on_demand_price(instance, region_of_zone(zone))
    spot_usd, spot_source = spot_price(instance, region_of_zone(zone))
    path = Path(spot_dir) / trace_folder / zone_file
    if path.is_file():
        meaning = FOLDER_MEANING.get(trace_folder, TraceMeaning.AVAILABLE)
        trace = load_trace(path, meaning)
        if window_start_tick >= trace.n_ticks:
            raise ValueError(f"window_start_tick={window_start_tick} is past the end of {path} "
                             f"({trace.n_ticks} ticks); pick 0..{trace.n_ticks - 1}")
        available = trace.available[window_start_tick: window_start_tick + n_ticks]
        if trace.spot_price_stated:  # collection.toml's, or the prices the trace file records
            spot_usd, spot_source = trace.spot_usd_per_hour, trace.spot_price_source
        return ReplayMarket(zone, instance, trace.tick_s, available.copy(), window_start_tick,
                            str(path), spot_usd, on_demand, spot_source)
    return ReplayMarket(zone, instance, 195, synthetic_availability(n_ticks), 0,
                        SYNTHETIC_SOURCE, spot_usd, on_demand, spot_source)


def find_drop_window(
    available: np.ndarray, up_ticks: int, max_down_ticks: int, min_start: int = 0
) -> int:
    """First start tick s >= `min_start` where spot was down at s - 1, is up for exactly
    `up_ticks` ticks from s, then drops, and comes back within `max_down_ticks`: a window where a
    job that takes spot at once is preempted quickly and can ride spot again."""
    values = np.asarray(available)
    for s in range(max(1, min_start), values.shape[0] - up_ticks - max_down_ticks):
        drop = s + up_ticks
        if (values[s - 1] == 0 and values[s:drop].min() >= 1 and values[drop] == 0
                and values[drop: drop + max_down_ticks + 1].max() >= 1):
            return s
    raise ValueError(f"no window with {up_ticks} up ticks then a drop of at most "
                     f"{max_down_ticks} ticks after tick {min_start}; relax the search")


@dataclass
class Holding:
    """One launched node, billed from `launch_s` to `end_s` (emulated seconds since job start).

    `end_s` is first set when the node stops being the job's (notice, release, end of training);
    for a node told to stop (`notice_at_s`) it moves to the moment the node went down once its
    trainer exits (`node_down_s`). `trainer_exit_s` is that exit (None: no trainer ran on it or it
    ended with the job)."""

    kind: str
    launch_s: float
    price_usd_per_hour: float
    end_s: float | None = None
    end_reason: str = ""
    notice_at_s: float | None = None
    trainer_exit_s: float | None = None
    zone: str = ""  # the zone it was launched in ("" when built without one)

    def billed_s(self, now_s: float | None = None) -> float:
        end = self.end_s if self.end_s is not None else now_s
        if end is None:
            raise ValueError("holding is still open: pass now_s to bill it so far")
        return max(0.0, end - self.launch_s)


def node_down_s(notice_at_s: float, shutdown_wall_s: float, emulated_per_wall_s: float,
                notice_s: float) -> float:
    """When a node told to stop at `notice_at_s` goes down: its trainer's exit, `shutdown_wall_s`
    wall seconds after the notice at replay speed, or the end of the notice (reclaimed, or killed
    by the provider), whichever comes first. Emulated seconds since job start."""
    if shutdown_wall_s < 0 or emulated_per_wall_s <= 0 or notice_s < 0:
        raise ValueError(f"shutdown_wall_s={shutdown_wall_s} and notice_s={notice_s} must be >= 0, "
                         f"emulated_per_wall_s={emulated_per_wall_s} > 0")
    return notice_at_s + min(notice_s, shutdown_wall_s * emulated_per_wall_s)


def replayed(recorded_steps: Iterable[int]) -> list[bool]:
    """For each step event of a run, in the order the trainers wrote them, whether it re-ran a
    step already recorded (a trainer resumed from a checkpoint older than its killed
    predecessor's last step, or started over without one)."""
    done, flags = 0, []
    for step in recorded_steps:
        flags.append(int(step) <= done)
        done = max(done, int(step))
    return flags


@dataclass(frozen=True)
class ReplayWaste:
    """Steps re-run after resumes: billed (the node was up) but not training progress."""

    replayed_steps: int
    waste_s: float  # emulated seconds the replayed steps took
    waste_usd: float  # at the price of the node that re-ran each of them


def replay_waste(replayed_steps: int, step_s: float, price_usd_per_hour: float) -> ReplayWaste:
    """What `replayed_steps` re-run steps cost on one node: `step_s` emulated seconds a step."""
    if replayed_steps < 0 or step_s < 0 or price_usd_per_hour < 0:
        raise ValueError(f"replayed_steps={replayed_steps}, step_s={step_s} and "
                         f"price_usd_per_hour={price_usd_per_hour} must be >= 0")
    waste_s = replayed_steps * step_s
    return ReplayWaste(replayed_steps, waste_s, waste_s * price_usd_per_hour / 3600.0)


def bill_usd(holdings: list[Holding], now_s: float | None = None) -> float:
    """The billing rule of the module docstring: emulated seconds held x price."""
    return sum(h.billed_s(now_s) * h.price_usd_per_hour / 3600.0 for h in holdings)


def spot_share(holdings: list[Holding], now_s: float | None = None) -> float:
    """Share of billed node-seconds that were spot."""
    total = sum(h.billed_s(now_s) for h in holdings)
    spot = sum(h.billed_s(now_s) for h in holdings if h.kind == SPOT)
    return spot / total if total else 0.0


@dataclass
class ReplayClock:
    """Emulated seconds since job start, advanced by wall seconds at `tick_s / seconds_per_tick`.

    `advance_to(target_s)` yields each tick boundary crossed (window tick index), so the caller
    handles ticks in order and may stop early (the clock stays frozen at that boundary).
    """

    tick_s: float
    seconds_per_tick: float
    now_s: float = 0.0
    next_tick: int = 0

    def __post_init__(self) -> None:
        if not (self.tick_s > 0 and self.seconds_per_tick > 0):
            raise ValueError(f"tick_s={self.tick_s} and seconds_per_tick={self.seconds_per_tick} "
                             "must be positive")

    @property
    def emulated_per_wall_s(self) -> float:
        return self.tick_s / self.seconds_per_tick

    def wall_s(self, emulated_s: float) -> float:
        return emulated_s / self.emulated_per_wall_s

    def advance_to(self, target_s: float) -> Iterator[int]:
        """Moves the clock to `target_s`, yielding each tick boundary on the way with the clock
        on it. A caller that stops iterating leaves the clock frozen at that boundary."""
        while self.next_tick * self.tick_s <= target_s + 1e-9:
            self.now_s = max(self.now_s, self.next_tick * self.tick_s)
            self.next_tick += 1
            yield self.next_tick - 1
        self.now_s = max(self.now_s, target_s)

    @property
    def tick(self) -> int:
        """The tick the clock is in."""
        return max(0, self.next_tick - 1)


def default_rules() -> ClusterRules:
    """The simulator's rules (changeover 360 s, notice 120 s, save 60 s), so figures compare."""
    return ClusterRules()


@dataclass(frozen=True)
class HeldSet:
    """The node set a job holds: `spot_nodes` + `on_demand_nodes` nodes in `zone`, launched
    (its changeover started) at `launch_s` emulated seconds."""

    zone: str
    spot_nodes: int
    on_demand_nodes: int
    launch_s: float


def build_observation(
    *,
    market: ReplayMarket,
    rules: ClusterRules,
    clock: ReplayClock,
    work_done_h: float,
    work_checkpointed_h: float,
    work_total_h: float,
    deadline_s: float,
    holding: Holding | None,
    last_kind_zone: str | None,
    since_checkpoint_s: float,
    preemption_times_s: tuple[float, ...],
    launch_failed: bool,
) -> AllocationObservation:
    """What the allocation policy sees at the start of the clock's current tick (one node, one
    zone); `build_gang_observation` is the general form."""
    held = None
    if holding is not None:
        held = HeldSet(market.zone, int(holding.kind == SPOT), int(holding.kind == ON_DEMAND),
                       holding.launch_s)
    return build_gang_observation(
        markets=(market,), node_count=1, rules=rules, clock=clock, work_done_h=work_done_h,
        work_checkpointed_h=work_checkpointed_h, work_total_h=work_total_h,
        deadline_s=deadline_s, held=held, last_zone=last_kind_zone,
        since_checkpoint_s=since_checkpoint_s, preemption_times_s=preemption_times_s,
        launch_failed=launch_failed)


def build_gang_observation(
    *,
    markets: Sequence[ReplayMarket],
    node_count: int,
    rules: ClusterRules,
    clock: ReplayClock,
    work_done_h: float,
    work_checkpointed_h: float,
    work_total_h: float,
    deadline_s: float,
    held: HeldSet | None,
    last_zone: str | None,
    since_checkpoint_s: float,
    preemption_times_s: tuple[float, ...],
    launch_failed: bool,
) -> AllocationObservation:
    """What the allocation policy sees at the start of the clock's current tick, built as
    `cloud.simulator.simulate` builds it: every zone's spot availability and prices (the first
    market is the home zone), the held set's zone and spot/on-demand counts, and the gang's work
    rate (`node_count` nodes of one reference GPU each: work is in GPU-hours)."""
    now = clock.now_s
    changeover_left = 0.0
    if held is not None:
        changeover_left = max(0.0, held.launch_s + rules.changeover_s - now)
    home = markets[0]
    return AllocationObservation(
        time_s=now,
        tick_s=float(home.tick_s),
        trace_time_s=float(home.window_start_tick * home.tick_s + now),
        work_done_h=work_done_h,
        work_checkpointed_h=work_checkpointed_h,
        work_total_h=work_total_h,
        work_rate_gpu_h_per_h=float(node_count),  # nodes of the trace's shape, reference speed
        deadline_s=deadline_s,
        changeover_s=rules.changeover_s,
        checkpoint_save_s=rules.checkpoint_save_s,
        checkpoint_interval_s=rules.checkpoint_interval_s,
        notice_s=rules.notice_s,
        node_count=node_count,
        zones=tuple(m.zone for m in markets),
        home_zone=home.zone,
        zone=held.zone if held is not None else None,
        spot_nodes=held.spot_nodes if held is not None else 0,
        on_demand_nodes=held.on_demand_nodes if held is not None else 0,
        in_changeover=changeover_left > 0,
        changeover_left_s=changeover_left,
        last_zone=last_zone,
        spot_available_by_zone=tuple(m.available_at(clock.tick) for m in markets),
        spot_price_usd_per_hour_by_zone=tuple(m.spot_usd_per_hour for m in markets),
        on_demand_price_usd_per_hour_by_zone=tuple(m.on_demand_usd_per_hour for m in markets),
        since_checkpoint_s=since_checkpoint_s,
        since_launch_s=now - held.launch_s if held is not None else 0.0,
        preemption_times_s=preemption_times_s,
        launch_failed=launch_failed,
    )


def window_ticks(deadline_s: float, tick_s: float) -> int:
    """Ticks to replay: the deadline plus as much again (runs may finish late)."""
    return max(1, math.ceil(2.0 * deadline_s / tick_s) + 1)
