"""Trace-driven cluster simulator: one training job, one allocation policy, one market window.

The world, tick by tick (a tick is the trace's `gap_seconds`):

1. Preemption at the tick boundary: if the zone now has fewer spot nodes available than the job
   holds, the job loses its spot nodes. The notice came `notice_s` earlier: when the checkpoint
   save fits in the notice (`checkpoint_on_notice`), the job spent its last `checkpoint_save_s` of
   the previous tick saving and loses nothing else; otherwise it loses the work since its last
   checkpoint. A synchronous gang cannot run short of a rank, so the whole gang is released (as
   SkyPilot tears down and relaunches a managed cluster).
2. Optional node faults (sampled from a real cluster's fault log, `cloud/faults.py`): no notice,
   the work since the last checkpoint is lost and the gang restarts on a replacement node.
3. The policy sees an `AllocationObservation` and returns an `AllocationAction`.
4. The action is applied: asking for the set already held keeps it; any other set is launched
   (spot only if the zone has that many spot nodes available now, else the launch fails and the
   current set is kept). Leaving a set that has unsaved work first saves a checkpoint, billed on
   the old set. A new set trains only after `changeover_s` (launch + restore), billed.
5. Training: the full gang progresses at `node_count * gpus_per_node / step_slowdown` GPU-hours
   per hour (the slowest rank sets the step time, `cloud/stragglers.py`), pausing
   `checkpoint_save_s` every `checkpoint_interval_s` of training (the rules' interval until the
   policy asks for another, `controllers.checkpoint_interval.interval_in_force_s`; the trainwise
   heuristic's comes from the one checkpoint-interval chooser). Billing is per second held;
   every tick held is billed whole (the tick before a preemption too, and its work counts), and
   the tick in which the work finishes is billed up to the finish, or whole with
   `ClusterRules.bill_finishing_tick_whole` (the Can't Be Late convention).

A job is its work (GPU-hours at the reference throughput), its deadline and its node count.
Work left at the deadline is finished afterwards on on-demand nodes (one changeover plus the
remaining work at the cheapest zone's on-demand price): that charge is part of the cost, and the
deadline counts as missed. `cloud/oracle.py` solves the same rules with hindsight; every rule
here is at least as costly as the oracle's, which is what makes the oracle a lower bound.

Deterministic: the only randomness is the fault sampler, seeded. Replaying a 45-day trace
(20,158 ticks) for one policy takes a fraction of a second (see tests and the suite's report).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from cloud.faults import FaultSampler
from cloud.traces import SpotTrace, window_of
from controllers.allocation_types import AllocationObservation, AllocationPolicy
from controllers.checkpoint_interval import interval_in_force_s


@dataclass(frozen=True)
class JobSpec:
    """A training job: `work_gpu_h` GPU-hours at the reference throughput, due `deadline_s` after
    it starts, run as one synchronous gang of `node_count` nodes."""

    work_gpu_h: float
    deadline_s: float
    node_count: int = 1
    gpus_per_node: int = 1

    def __post_init__(self) -> None:
        if not self.work_gpu_h > 0:
            raise ValueError(f"work_gpu_h={self.work_gpu_h} must be positive")
        if not self.deadline_s > 0:
            raise ValueError(f"deadline_s={self.deadline_s} must be positive")
        if self.node_count < 1 or self.gpus_per_node < 1:
            raise ValueError(
                f"node_count={self.node_count} and gpus_per_node={self.gpus_per_node} "
                "must be at least 1"
            )


@dataclass(frozen=True)
class ClusterRules:
    """How the cluster behaves; the same rules bind every policy and the oracle."""

    # Launch + restore from the last checkpoint; training pauses this long after any change.
    changeover_s: float = 360.0
    checkpoint_save_s: float = 60.0
    # Default interval between checkpoints, in seconds of training; a policy may change it.
    checkpoint_interval_s: float = 3600.0
    # AWS gives a spot node two minutes' notice before it reclaims it.
    notice_s: float = 120.0
    checkpoint_on_notice: bool = True
    # Mean slowest-rank inflation of a step (1.0 = no stragglers); see StragglerSampler.
    step_slowdown: float = 1.0
    # Bill the tick in which the work finishes whole (the published Can't Be Late simulator)
    # instead of only its seconds up to the finish (per-second billing, the default).
    bill_finishing_tick_whole: bool = False
    # 0: work is continuous and a reclaim's save is cut from the last tick's training (the
    # notice fell inside it). > 0: the job trains in steps of this many seconds, as a real
    # trainer does (issue 10, the emulated run of trainwise/emulated.py): the policy sees the
    # work of the steps completed, and a reclaim's notice comes at the tick boundary, the
    # trainer finishes its step in flight inside it, then saves (about half a step a reclaim
    # that the continuous rule lost).
    train_step_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("changeover_s", "checkpoint_save_s", "notice_s", "train_step_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be 0 or more")
        if not self.checkpoint_interval_s > 0:
            raise ValueError(f"checkpoint_interval_s={self.checkpoint_interval_s} must be positive")
        if not self.step_slowdown >= 1.0:
            raise ValueError(
                f"step_slowdown={self.step_slowdown} must be at least 1.0 (the slowest "
                "rank is never faster than the median)"
            )


@dataclass(frozen=True)
class Market:
    """Spot availability and prices of the zones a job may use, over its window.

    `spot_available[z, i]` spot nodes can be held in zone z during tick i. Prices are per node-hour.
    """

    zones: tuple[str, ...]
    tick_s: int
    spot_available: np.ndarray
    spot_usd_per_hour: tuple[float, ...]
    on_demand_usd_per_hour: tuple[float, ...]
    # Seconds from the trace's first tick to this window's first tick.
    trace_start_s: float = 0.0

    def __post_init__(self) -> None:
        zones = len(self.zones)
        if zones == 0:
            raise ValueError("a market needs at least one zone")
        if len(set(self.zones)) != zones:
            raise ValueError(f"zones must be distinct, got {self.zones}")
        if self.spot_available.ndim != 2 or self.spot_available.shape[0] != zones:
            raise ValueError(
                f"spot_available must have shape (zones={zones}, ticks), got "
                f"{self.spot_available.shape}"
            )
        if len(self.spot_usd_per_hour) != zones or len(self.on_demand_usd_per_hour) != zones:
            raise ValueError("one spot and one on-demand price per zone are required")
        if min(self.spot_usd_per_hour) < 0 or min(self.on_demand_usd_per_hour) <= 0:
            raise ValueError("prices must be positive (spot may be 0)")
        if self.tick_s <= 0:
            raise ValueError(f"tick_s={self.tick_s} must be positive")
        if self.spot_available.size and self.spot_available.min() < 0:
            raise ValueError("spot_available must not be negative")

    @property
    def n_ticks(self) -> int:
        return int(self.spot_available.shape[1])

    def zone_market(self, zone: str) -> Market:
        """The single-zone market of one of these zones."""
        if zone not in self.zones:
            raise ValueError(f"zone {zone!r} is not in this market; valid: {', '.join(self.zones)}")
        z = self.zones.index(zone)
        return Market(
            (zone,),
            self.tick_s,
            self.spot_available[z : z + 1],
            (self.spot_usd_per_hour[z],),
            (self.on_demand_usd_per_hour[z],),
            self.trace_start_s,
        )

    def window(self, start_tick: int, n_ticks: int) -> Market:
        """A sub-window; errors name the valid starts."""
        values = window_of(self.spot_available, start_tick, n_ticks, what="market")
        return Market(
            self.zones,
            self.tick_s,
            values,
            self.spot_usd_per_hour,
            self.on_demand_usd_per_hour,
            self.trace_start_s + start_tick * self.tick_s,
        )


def market_from_traces(
    traces: list[SpotTrace],
    spot_usd_per_hour: tuple[float, ...],
    on_demand_usd_per_hour: tuple[float, ...],
    availability: list[np.ndarray] | None = None,
) -> Market:
    """A market over the common length of the traces (collected side by side from one start).

    `availability` replaces the traces' own values (e.g. scaled copies for a larger cluster).
    """
    if not traces:
        raise ValueError("market_from_traces needs at least one trace")
    ticks = {t.tick_s for t in traces}
    if len(ticks) != 1:
        raise ValueError(f"traces of one market must share a tick, got {sorted(ticks)} seconds")
    zones = [t.zone for t in traces]
    repeated = sorted({z for z in zones if zones.count(z) > 1})
    if repeated:
        files = [t.source_path for t in traces if t.zone in repeated]
        raise ValueError(f"zones must be distinct: {', '.join(files)} all record zone "
                         f"{repeated[0]!r}; give each file its own zone in its collection.toml")
    values = availability if availability is not None else [t.available for t in traces]
    length = min(len(v) for v in values)
    return Market(
        zones=tuple(t.zone for t in traces),
        tick_s=traces[0].tick_s,
        spot_available=np.stack([np.asarray(v[:length], dtype=np.int64) for v in values]),
        spot_usd_per_hour=tuple(spot_usd_per_hour),
        on_demand_usd_per_hour=tuple(on_demand_usd_per_hour),
    )


@dataclass(frozen=True)
class Horizon:
    """The job's numbers in simulator units, shared by the simulator and the oracle."""

    ticks: int
    run_s: float  # seconds of full-gang training the work needs (stragglers included)
    work_rate_gpu_h_per_h: float


def job_horizon(job: JobSpec, rules: ClusterRules, market: Market) -> Horizon:
    """Deadline in whole ticks (rounded down) and the training time the work needs.

    Errors: a deadline too short for the work even on on-demand from the first second, and a
    deadline longer than the market window.
    """
    rate = job.node_count * job.gpus_per_node / rules.step_slowdown
    run_s = job.work_gpu_h / rate * 3600.0
    ticks = math.floor(job.deadline_s / market.tick_s + 1e-9)
    horizon_s = ticks * market.tick_s
    if horizon_s < run_s + rules.changeover_s:
        raise ValueError(
            f"deadline_s={job.deadline_s:.0f} (rounded down to {ticks} ticks of {market.tick_s} "
            f"s = {horizon_s} s) is shorter than the work: {run_s:.0f} s of training "
            f"({job.work_gpu_h} GPU-h at {rate:.3f} GPU-h/h) plus one changeover of "
            f"{rules.changeover_s:.0f} s; give a deadline of at least "
            f"{run_s + rules.changeover_s:.0f} s"
        )
    if ticks > market.n_ticks:
        raise ValueError(
            f"deadline of {ticks} ticks is longer than the market window ({market.n_ticks} ticks "
            f"of {market.tick_s} s); use a shorter deadline or a longer trace window"
        )
    return Horizon(ticks=ticks, run_s=run_s, work_rate_gpu_h_per_h=rate)


def completion_charge_usd(
    job: JobSpec, rules: ClusterRules, market: Market, remaining_run_s: float
) -> float:
    """What finishing after the deadline costs: one changeover plus the remaining training, on
    on-demand nodes of the cheapest zone."""
    if remaining_run_s <= 0:
        return 0.0
    price = job.node_count * min(market.on_demand_usd_per_hour)
    return price * (remaining_run_s + rules.changeover_s) / 3600.0


@dataclass
class SimResult:
    policy: str
    cost_usd: float  # window cost plus the completion charge
    window_cost_usd: float
    completion_usd: float
    deadline_met: bool
    finish_s: float | None
    spot_node_s: float
    on_demand_node_s: float
    changeover_node_s: float
    checkpoint_node_s: float
    lost_node_s: float
    useful_gpu_h: float  # work kept at the end of the window
    gpus_per_node: int
    preemptions: int
    changeovers: int
    launch_failures: int
    faults: int
    events: list[tuple[float, str, str]] = field(default_factory=list)

    @property
    def billed_node_s(self) -> float:
        return self.spot_node_s + self.on_demand_node_s

    @property
    def spot_share(self) -> float:
        """Share of billed node-hours that were spot."""
        return self.spot_node_s / self.billed_node_s if self.billed_node_s else 0.0

    @property
    def waste_share(self) -> float:
        """Share of billed node-hours spent on lost work, changeovers and checkpoints."""
        wasted = self.lost_node_s + self.changeover_node_s + self.checkpoint_node_s
        return wasted / self.billed_node_s if self.billed_node_s else 0.0

    @property
    def utilization(self) -> float:
        """Reference GPU-hours of work kept per billed GPU-hour (stragglers lower it too)."""
        billed_gpu_h = self.billed_node_s * self.gpus_per_node / 3600.0
        return self.useful_gpu_h / billed_gpu_h if billed_gpu_h else 0.0


def simulate(
    policy: AllocationPolicy,
    job: JobSpec,
    rules: ClusterRules,
    market: Market,
    home_zone: str | None = None,
    fault_sampler: FaultSampler | None = None,
    record_events: bool = False,
) -> SimResult:
    """Run `policy` on `job` over `market` from its first tick to the deadline.

    `home_zone` (default: the market's first zone) is the zone the user asked for. With a
    `fault_sampler`, node faults of a `node_count` group arrive at its sampled instants.
    """
    horizon = job_horizon(job, rules, market)
    zones = market.zones
    if home_zone is None:
        home_zone = zones[0]
    if home_zone not in zones:
        raise ValueError(f"home_zone {home_zone!r} is not in the market; valid: {', '.join(zones)}")
    zone_index = {z: i for i, z in enumerate(zones)}
    n_nodes = job.node_count
    tick = float(market.tick_s)
    run_total = horizon.run_s
    rate = horizon.work_rate_gpu_h_per_h
    work_total_h = job.work_gpu_h
    changeover = float(rules.changeover_s)
    save = float(rules.checkpoint_save_s)
    notice_save = rules.checkpoint_on_notice and save <= rules.notice_s
    interval = float(rules.checkpoint_interval_s)
    step_s = float(rules.train_step_s)
    spot_prices = market.spot_usd_per_hour
    od_prices = market.on_demand_usd_per_hour
    # Plain Python lists: indexing them in the loop is several times faster than numpy scalars.
    avail = [list(map(int, row)) for row in market.spot_available[:, : horizon.ticks]]
    avail_by_tick = list(zip(*avail))
    faults = fault_sampler.fault_times_s(horizon.ticks * tick, n_nodes) if fault_sampler else []
    fault_next = 0

    zone_i = -1  # -1: nothing held
    last_zone: str | None = None
    spot = od = 0
    price_per_s = 0.0
    changeover_left = 0.0
    save_left = 0.0
    work = 0.0  # training seconds done (full gang)
    committed = 0.0  # training seconds covered by a checkpoint
    last_checkpoint_time = 0.0
    launch_time = 0.0
    last_prod = 0.0
    launch_failed = False
    notice_credit = 0.0  # training seconds the reclaimed trainer finishes in its notice
    preemption_times: tuple[float, ...] = ()
    cost = spot_node_s = od_node_s = changeover_node_s = checkpoint_node_s = lost_node_s = 0.0
    preemptions = changeovers = launch_failures = fault_count = 0
    finish_s: float | None = None
    events: list[tuple[float, str, str]] = []
    to_h = work_total_h / run_total  # training seconds -> GPU-hours of work
    deadline_s = horizon.ticks * tick  # the deadline as the simulator applies it (whole ticks)

    for t in range(horizon.ticks):
        now = t * tick
        # 1. Preemption at the boundary (the notice fell inside the previous tick).
        if spot and avail[zone_i][t] < spot:
            if notice_save and step_s > 0 and work > committed:
                # The step in flight finishes inside the notice (when it and the save fit),
                # after this tick's decision: the policy sees the work done at the boundary.
                in_flight = step_s * math.ceil(work / step_s - 1e-9) - work
                if in_flight + save <= rules.notice_s:
                    notice_credit = min(run_total - work, in_flight)
                else:  # no time to finish it: the save holds the last completed step
                    done = step_s * math.floor(work / step_s + 1e-9)
                    lost_node_s += (work - max(done, committed)) * n_nodes
                    work = max(done, committed)
            elif notice_save and work > committed:
                # The save ran in the last seconds of the previous tick instead of training.
                cut = min(save, last_prod, work - committed)
                work -= cut
                checkpoint_node_s += cut * n_nodes
            elif work > committed:
                lost_node_s += (work - committed) * n_nodes
                work = committed
            committed = work
            last_checkpoint_time = now
            preemptions += 1
            preemption_times = preemption_times + (now,)
            if record_events:
                events.append(
                    (
                        now,
                        "preempted",
                        f"{zones[zone_i]}: {avail[zone_i][t]} spot left, held {spot}",
                    )
                )
            zone_i, spot, od, price_per_s = -1, 0, 0, 0.0
            changeover_left = save_left = 0.0
        # 2. Node faults: no notice; the gang restarts on a replacement node.
        while fault_next < len(faults) and faults[fault_next] <= now:
            if zone_i >= 0:
                fault_count += 1
                lost_node_s += (work - committed) * n_nodes
                work = committed
                changeover_left, save_left = changeover, 0.0
                launch_time = now
                if record_events:
                    events.append((now, "fault", f"{zones[zone_i]}: node replaced"))
            fault_next += 1

        # 3. Decide.
        holding = zone_i >= 0
        observation = AllocationObservation(
            time_s=now,
            tick_s=tick,
            trace_time_s=market.trace_start_s + now,
            # A stepped trainer reports completed steps (the step in flight is not done yet).
            work_done_h=(step_s * math.floor(work / step_s + 1e-9) if step_s > 0 else work) * to_h,
            work_checkpointed_h=committed * to_h,
            work_total_h=work_total_h,
            work_rate_gpu_h_per_h=rate,
            deadline_s=deadline_s,
            changeover_s=changeover,
            checkpoint_save_s=save,
            checkpoint_interval_s=interval,
            notice_s=rules.notice_s,
            node_count=n_nodes,
            zones=zones,
            home_zone=home_zone,
            zone=zones[zone_i] if holding else None,
            spot_nodes=spot,
            on_demand_nodes=od,
            in_changeover=changeover_left > 0,
            changeover_left_s=changeover_left,
            last_zone=last_zone,
            spot_available_by_zone=avail_by_tick[t],
            spot_price_usd_per_hour_by_zone=spot_prices,
            on_demand_price_usd_per_hour_by_zone=od_prices,
            since_checkpoint_s=now - last_checkpoint_time,
            since_launch_s=now - launch_time if holding else 0.0,
            preemption_times_s=preemption_times,
            launch_failed=launch_failed,
        )
        action = policy.act(observation)

        if notice_credit > 0:  # the reclaimed trainer's step in flight, saved in the notice
            work += notice_credit
            committed, notice_credit = work, 0.0
        # 4. Apply.
        want_spot, want_od = action.spot_nodes, action.on_demand_nodes
        want_total = want_spot + want_od
        if want_spot < 0 or want_od < 0 or (want_total and want_total != n_nodes):
            raise ValueError(
                f"policy {policy.name!r} asked for {want_spot} spot + {want_od} on-demand nodes at "
                f"t={now:.0f} s; a gang job needs 0 or exactly node_count={n_nodes} nodes"
            )
        # The policy's interval (trainwise_heuristic's comes from the checkpoint-interval
        # chooser that the slow layer and the trainer ask too) goes in force as the chooser's
        # module defines it: None keeps it.
        interval = interval_in_force_s(interval, action.checkpoint_interval_s,
                                       asked_by=policy.name)
        launch_failed = False
        if want_total == 0:
            if holding:
                if work > committed and changeover_left == 0:
                    cost += price_per_s * save
                    checkpoint_node_s += save * n_nodes
                    spot_node_s += save * spot
                    od_node_s += save * od
                    committed = work
                    last_checkpoint_time = now
                if record_events:
                    events.append((now, "release", action.reason))
                zone_i, spot, od, price_per_s = -1, 0, 0, 0.0
                changeover_left = save_left = 0.0
        else:
            want_zone = zone_index.get(action.zone, -1) if action.zone is not None else -1
            if want_zone < 0:
                raise ValueError(
                    f"policy {policy.name!r} asked for zone {action.zone!r}; valid: "
                    f"{', '.join(zones)}"
                )
            if not (holding and want_zone == zone_i and want_spot == spot):
                if want_spot > avail[want_zone][t]:
                    launch_failed = True
                    launch_failures += 1
                    if record_events:
                        events.append(
                            (
                                now,
                                "launch_failed",
                                (
                                    f"{zones[want_zone]}: {want_spot} spot "
                                    f"asked, {avail[want_zone][t]} available"
                                ),
                            )
                        )
                else:
                    if holding and work > committed and changeover_left == 0:
                        cost += price_per_s * save
                        checkpoint_node_s += save * n_nodes
                        spot_node_s += save * spot
                        od_node_s += save * od
                        committed = work
                        last_checkpoint_time = now
                    zone_i, spot, od = want_zone, want_spot, want_od
                    last_zone = zones[zone_i]
                    price_per_s = (spot * spot_prices[zone_i] + od * od_prices[zone_i]) / 3600.0
                    changeover_left, save_left = changeover, 0.0
                    launch_time = now
                    changeovers += 1
                    if record_events:
                        events.append(
                            (
                                now,
                                "launch",
                                (f"{zones[zone_i]}: {spot} spot + {od} on-demand; {action.reason}"),
                            )
                        )

        # 5. Train and bill.
        if zone_i < 0:
            last_prod = 0.0
            continue
        left = tick
        if changeover_left > 0:
            used = min(left, changeover_left)
            changeover_left -= used
            left -= used
            changeover_node_s += used * n_nodes
        if save_left > 0 and left > 0:
            used = min(left, save_left)
            save_left -= used
            left -= used
            checkpoint_node_s += used * n_nodes
        prod = 0.0
        while left > 0:
            step = min(left, interval - (work - committed), run_total - work)
            if step < 0:
                step = 0.0
            work += step
            left -= step
            prod += step
            if work >= run_total - 1e-9:
                finish_s = now + tick - left
                break
            if work - committed >= interval - 1e-9:
                committed = work
                last_checkpoint_time = now + tick - left
                used = min(left, save)
                save_left = save - used
                left -= used
                checkpoint_node_s += used * n_nodes
        last_prod = prod
        partial = finish_s is not None and not rules.bill_finishing_tick_whole
        billed = tick - left if partial else tick
        cost += price_per_s * billed
        spot_node_s += billed * spot
        od_node_s += billed * od
        if finish_s is not None:
            if record_events:
                events.append((finish_s, "finish", f"{zones[zone_i]}: work done"))
            break

    completion = 0.0
    if finish_s is None:
        completion = completion_charge_usd(job, rules, market, run_total - work)
        if record_events:
            events.append(
                (
                    horizon.ticks * tick,
                    "deadline",
                    f"{(run_total - work) * to_h:.2f} GPU-h left, finished on on-demand",
                )
            )
    return SimResult(
        policy=policy.name,
        cost_usd=cost + completion,
        window_cost_usd=cost,
        completion_usd=completion,
        deadline_met=finish_s is not None,
        finish_s=finish_s,
        spot_node_s=spot_node_s,
        on_demand_node_s=od_node_s,
        changeover_node_s=changeover_node_s,
        checkpoint_node_s=checkpoint_node_s,
        lost_node_s=lost_node_s,
        useful_gpu_h=(run_total if finish_s is not None else work) * to_h,
        gpus_per_node=job.gpus_per_node,
        preemptions=preemptions,
        changeovers=changeovers,
        launch_failures=launch_failures,
        faults=fault_count,
        events=events,
    )
