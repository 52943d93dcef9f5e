"""The peers trainwise is measured against: node allocation policies, each a pure `act`.

Every policy here reads only the observation (no I/O, no clock, no hidden state that changes its
decisions), so the simulator, the emulated cloud and the tests call the same code. A gang of
`node_count` nodes is "spot-available" in a zone when the zone has at least that many spot nodes
now; `managed_spot` is the one peer that mixes spot and on-demand in one gang.

Names (see `cloud/policy_registry.py`): on_demand, managed_spot, greedy_spot, skypilot_failover,
uniform_progress.
"""

from __future__ import annotations

import math

from cloud.policy_registry import register_policy
from controllers.allocation_types import AllocationAction, AllocationObservation


def on_demand_finish_s(obs: AllocationObservation) -> float:
    """Wall seconds to finish on on-demand launched now: changeover, training, periodic saves."""
    run_s = obs.remaining_run_s
    saves = math.floor(run_s / obs.checkpoint_interval_s) * obs.checkpoint_save_s
    return obs.changeover_s + run_s + saves


def spot_risk_s(obs: AllocationObservation) -> float:
    """Wall seconds a spot gang can lose before the next decision: one tick, plus the notice save
    when it fits the notice, else the work not yet checkpointed."""
    if obs.checkpoint_save_s <= obs.notice_s:
        return obs.tick_s + obs.checkpoint_save_s
    unsaved_s = (obs.work_done_h - obs.work_checkpointed_h) / obs.work_rate_gpu_h_per_h * 3600.0
    return obs.tick_s + unsaved_s


def deadline_forces_on_demand(obs: AllocationObservation) -> bool:
    """True when waiting one more tick off on-demand could make the deadline unreachable."""
    return obs.time_left_s < on_demand_finish_s(obs) + spot_risk_s(obs)


def _run_zone(obs: AllocationObservation) -> str:
    return obs.zone if obs.zone is not None else obs.home_zone


def _keep(obs: AllocationObservation, reason: str) -> AllocationAction:
    return AllocationAction(obs.zone, obs.spot_nodes, obs.on_demand_nodes, None, reason)


class OnDemandPolicy:
    """Configuration 1 of the seed: on-demand nodes in the home zone from start to finish, with a
    fixed checkpoint interval. The baseline every saving is measured from.

    Events: t=0 launch N on-demand -> changeover -> train, saving every `checkpoint_interval_s`
    -> finish. Never preempted; a node fault costs the work since the last checkpoint.
    """

    name = "on_demand"

    def __init__(self, checkpoint_interval_s: float = 3600.0):
        if not checkpoint_interval_s > 0:
            raise ValueError(f"checkpoint_interval_s={checkpoint_interval_s} must be positive")
        self.checkpoint_interval_s = checkpoint_interval_s

    def act(self, obs: AllocationObservation) -> AllocationAction:
        if obs.on_demand_nodes == obs.node_count:
            return AllocationAction(
                obs.zone, 0, obs.node_count, self.checkpoint_interval_s, "on-demand: keep"
            )
        return AllocationAction(
            obs.home_zone,
            0,
            obs.node_count,
            self.checkpoint_interval_s,
            "on-demand: launch the fixed schedule",
        )


class ManagedSpotPolicy:
    """Configuration 2 of the seed: managed spot with restart from the last checkpoint and a
    reactive autoscaler, in the home zone, blind to the deadline (as SkyPilot managed jobs and
    cluster autoscalers are).

    The autoscaler reacts to capacity: at every (re)launch it takes as many spot nodes as the
    zone has, up to N, and fills the rest with on-demand; while it holds on-demand nodes it moves
    them back to spot once `rebalance_s` has passed since the launch and more spot is available.

    Events (1 node): spot -> preempted (notice save) -> spot gone, relaunch on on-demand ->
    1 h later spot is back, relaunch on spot -> ... -> finish (possibly after the deadline).
    """

    name = "managed_spot"

    def __init__(self, rebalance_s: float = 3600.0):
        if rebalance_s < 0:
            raise ValueError(f"rebalance_s={rebalance_s} must be 0 or more")
        self.rebalance_s = rebalance_s

    def act(self, obs: AllocationObservation) -> AllocationAction:
        zone = obs.home_zone
        spot_now = min(obs.spot_available(zone), obs.node_count)
        if not obs.holding:
            return AllocationAction(
                zone,
                spot_now,
                obs.node_count - spot_now,
                None,
                "managed spot: (re)launch from the last checkpoint",
                {"spot_nodes": spot_now},
            )
        if (
            obs.on_demand_nodes
            and obs.since_launch_s >= self.rebalance_s
            and spot_now > obs.spot_nodes
        ):
            return AllocationAction(
                zone,
                spot_now,
                obs.node_count - spot_now,
                None,
                "managed spot: autoscaler moves on-demand nodes back to spot",
                {"spot_nodes": spot_now},
            )
        return _keep(obs, "managed spot: keep")


class GreedySpotPolicy:
    """Greedy: spot whenever the home zone has it, idle otherwise, and on-demand to the end once
    the deadline forces it (the "Greedy" baseline of Can't Be Late, Wu et al., NSDI'24, sec. 3).

    "Forced" means: if the job waited one more tick off on-demand (and lost what a preemption
    costs), on-demand launched then could no longer finish in time.

    Events: spot -> preempted -> idle (no spot, slack left) -> spot back -> spot -> ...
    -> slack runs out -> on-demand until done.
    """

    name = "greedy_spot"

    def act(self, obs: AllocationObservation) -> AllocationAction:
        n = obs.node_count
        if obs.on_demand_nodes == n:
            return _keep(obs, "greedy: on-demand to the end")
        if deadline_forces_on_demand(obs):
            return AllocationAction(
                _run_zone(obs),
                0,
                n,
                None,
                "greedy: the deadline forces on-demand",
                {"time_left_s": obs.time_left_s, "on_demand_finish_s": on_demand_finish_s(obs)},
            )
        if obs.spot_nodes == n:
            return _keep(obs, "greedy: keep spot")
        if obs.spot_available(obs.home_zone) >= n:
            return AllocationAction(obs.home_zone, n, 0, None, "greedy: spot is available")
        return AllocationAction.release("greedy: no spot, slack left: wait")


class SkyPilotFailoverPolicy:
    """SkyPilot managed spot jobs with eager failover (skypilot-org/skypilot,
    `sky/jobs/recovery_strategy.py`, EAGER_NEXT_REGION): spot only; after a preemption, relaunch
    in the next zone of the list that has spot (the preempted zone is tried last); wait when no
    zone has spot. Blind to the deadline, like SkyPilot.

    Events: launch in home zone A -> A preempted -> B has no spot -> C ok, launch in C ->
    C preempted -> A ok, launch in A -> ... -> finish.
    """

    name = "skypilot_failover"

    def act(self, obs: AllocationObservation) -> AllocationAction:
        n = obs.node_count
        if obs.holding:
            return _keep(obs, "failover: keep")
        zones = obs.zones
        if obs.last_zone is None:
            start = obs.zone_index(obs.home_zone)
            order = zones[start:] + zones[:start]
        else:
            after = obs.zone_index(obs.last_zone) + 1
            order = zones[after:] + zones[:after]  # the preempted zone comes last
        for zone in order:
            if obs.spot_available(zone) >= n:
                return AllocationAction(zone, n, 0, None, f"failover: spot available in {zone}")
        return AllocationAction.release("failover: no zone has spot; wait")


class UniformProgressPolicy:
    """Uniform Progress, the Can't Be Late policy (Wu et al., "Can't Be Late: Optimizing Spot
    Instance Savings under Deadlines", NSDI'24), from the paper's four rules, in the home zone:

    1. when idle and behind the uniform-progress line (work_total * t / deadline), launch
       on-demand to catch up;
    2. take spot whenever it is available (and keep it while it lasts);
    3. once on on-demand, stay until progress is ahead of where the line will be two changeover
       delays later (hysteresis against thrashing);
    4. safety net: when the time left is less than the remaining work plus two changeovers, stay
       on on-demand to the end. The simulator decides once per tick and a preemption can cost a
       notice save, so the net is widened to `deadline_forces_on_demand` when that is larger.

    Events: spot -> preempted -> idle (ahead of the line) -> behind the line: on-demand ->
    ahead by 2 changeovers and spot available: spot -> ... -> safety net: on-demand to the end.
    """

    name = "uniform_progress"

    def act(self, obs: AllocationObservation) -> AllocationAction:
        n = obs.node_count
        finish_s = on_demand_finish_s(obs)
        # The paper's 2 changeovers (one is in finish_s), or greedy's one-tick test if larger.
        safety = obs.time_left_s < finish_s + max(obs.changeover_s, spot_risk_s(obs))
        if safety:
            if obs.on_demand_nodes == n:
                return _keep(obs, "uniform progress: safety net, on-demand to the end")
            return AllocationAction(
                _run_zone(obs),
                0,
                n,
                None,
                "uniform progress: safety net, on-demand to the end",
                {"time_left_s": obs.time_left_s, "on_demand_finish_s": finish_s},
            )
        line_h = obs.work_total_h * obs.time_s / obs.deadline_s
        spot_here = obs.spot_available(obs.home_zone) >= n
        if obs.on_demand_nodes == n:
            ahead_h = obs.work_total_h * (obs.time_s + 2 * obs.changeover_s) / obs.deadline_s
            if obs.work_done_h < ahead_h:
                return _keep(obs, "uniform progress: on-demand until ahead by two changeovers")
            if spot_here:
                return AllocationAction(
                    obs.home_zone, n, 0, None, "uniform progress: ahead again, back to spot"
                )
            return AllocationAction.release("uniform progress: ahead again, no spot: wait")
        if obs.spot_nodes == n:
            return _keep(obs, "uniform progress: keep spot")
        if spot_here:
            return AllocationAction(
                obs.home_zone, n, 0, None, "uniform progress: spot is available"
            )
        if obs.work_done_h < line_h:
            return AllocationAction(
                obs.home_zone,
                0,
                n,
                None,
                "uniform progress: behind the line, on-demand to catch up",
                {"work_done_h": obs.work_done_h, "line_h": line_h},
            )
        return AllocationAction.release("uniform progress: ahead of the line, no spot: wait")


register_policy("on_demand", OnDemandPolicy)
register_policy("managed_spot", ManagedSpotPolicy)
register_policy("greedy_spot", GreedySpotPolicy)
register_policy("skypilot_failover", SkyPilotFailoverPolicy)
register_policy("uniform_progress", UniformProgressPolicy)
