"""The slow layer's learned-policy contract: observation vector, action menu, safety net.

Observation: `slow_features(obs, heuristic_action)` turns the controller's
`AllocationObservation` (plus what the heuristic would do now, so the policy can learn a residual
on it) into a float32 vector whose layout is `SLOW_OBS_LAYOUT` (names, in order). The layout is
fixed whatever the number of zones: per-zone facts are summarised as "home zone" and "best other
zone" (the cheapest other zone with spot for the whole gang now), so a policy trained on a
9-zone market runs on a 2-zone one. The layout's name list is hashed into every policy file, and a
file with another layout is refused.

Action: `(choice, checkpoint)`, a `MultiDiscrete([len(SLOW_CHOICES), len(CHECKPOINT_CHOICES_S)])`:
choice 0 is "do what the heuristic does" (the residual's zero), the others override it;
checkpoint 0 keeps the heuristic's interval. Node count is not a choice: the simulator runs a
synchronous gang of exactly `node_count` nodes (0 or all), so the only count choice is
"wait" (0 nodes).

Deadline misses are a hard constraint, enforced by a masked safety net, not a price:
`apply_slow_choice` overrides every choice with Uniform Progress's published safety rules
(`cloud.policies.at_safety_point`): once the remaining run plus two changeovers no longer fits
the time left, anything not riding a running spot gang goes to on-demand to the end. The
environments additionally charge `DEADLINE_MISS_PENALTY` (in units of the job's on-demand cost)
for a miss that still happens (a preemption in the last ticks), so the learner never prefers one.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from cloud.policies import at_safety_point, on_demand_finish_s
from controllers.allocation_types import AllocationAction, AllocationObservation

SLOW_CHOICES = ("heuristic", "spot_home", "spot_best_other", "on_demand_here", "wait")
# 0: the heuristic's interval (None keeps the current one).
CHECKPOINT_CHOICES_S = (None, 1800.0, 7200.0)
DEADLINE_MISS_PENALTY = 1.0

SLOW_OBS_LAYOUT = (
    "time_frac", "work_done_frac", "work_checkpointed_frac", "slack_frac",
    "holding", "on_spot", "on_demand", "in_changeover", "changeover_left_ticks", "launch_failed",
    "since_checkpoint_h", "since_launch_h", "preemptions_per_day", "since_preemption_h",
    "checkpoint_interval_h", "safety_point_1", "safety_point_2",
    "home_spot_ok", "home_spot_price_ratio", "other_spot_ok_share", "best_other_price_ratio",
    "in_home_zone", "zones_log2",
    "heur_wait", "heur_spot", "heur_on_demand", "heur_home_zone", "heur_moves",
)
SLOW_OBS_SIZE = len(SLOW_OBS_LAYOUT)


def layout_sha256(layout: tuple[str, ...]) -> str:
    """Identity of an observation layout (what a policy file must match)."""
    return hashlib.sha256("\n".join(layout).encode()).hexdigest()


def best_other_zone(obs: AllocationObservation) -> int:
    """Index of the cheapest other zone with spot for the whole gang now; -1 when none."""
    best, best_price = -1, math.inf
    home = obs.zone_index(obs.home_zone)
    for i, avail in enumerate(obs.spot_available_by_zone):
        if i != home and avail >= obs.node_count:
            price = obs.spot_price_usd_per_hour_by_zone[i]
            if price < best_price:
                best, best_price = i, price
    return best


def slow_features(obs: AllocationObservation, heuristic: AllocationAction) -> np.ndarray:
    """The observation vector (layout `SLOW_OBS_LAYOUT`). NaN in any field propagates and is
    refused by the policy (`rl.fast_path`), which then falls back to the heuristic."""
    n = obs.node_count
    deadline = obs.deadline_s
    work_total = obs.work_total_h
    home = obs.zone_index(obs.home_zone)
    od_min = min(obs.on_demand_price_usd_per_hour_by_zone)
    other = best_other_zone(obs)
    zones = len(obs.zones)
    others_ok = sum(1 for i, a in enumerate(obs.spot_available_by_zone) if i != home and a >= n)
    preempt = obs.preemption_times_s
    want = heuristic.spot_nodes + heuristic.on_demand_nodes
    features = (
        obs.time_s / deadline,
        obs.work_done_h / work_total,
        obs.work_checkpointed_h / work_total,
        (obs.time_left_s - on_demand_finish_s(obs)) / deadline,
        float(obs.holding),
        float(obs.spot_nodes == n),
        float(obs.on_demand_nodes == n),
        float(obs.in_changeover),
        obs.changeover_left_s / obs.tick_s,
        float(obs.launch_failed),
        min(obs.since_checkpoint_s / 3600.0, 24.0),
        min(obs.since_launch_s / 3600.0, 24.0),
        len(preempt) / max(obs.time_s / 86400.0, 1.0),
        min((obs.time_s - preempt[-1]) / 3600.0, 24.0) if preempt else 24.0,
        obs.checkpoint_interval_s / 3600.0,
        float(at_safety_point(obs, changeovers=1)),
        float(at_safety_point(obs, changeovers=2)),
        float(obs.spot_available_by_zone[home] >= n),
        obs.spot_price_usd_per_hour_by_zone[home] / od_min,
        others_ok / max(zones - 1, 1),
        obs.spot_price_usd_per_hour_by_zone[other] / od_min if other >= 0 else 1.0,
        float(obs.zone == obs.home_zone),
        math.log2(zones),
        float(want == 0),
        float(want > 0 and heuristic.spot_nodes == n),
        float(want > 0 and heuristic.on_demand_nodes == n),
        float(want > 0 and heuristic.zone == obs.home_zone),
        float(want > 0 and heuristic.zone != obs.zone),
    )
    return np.asarray(features, dtype=np.float32)


def _keep(obs: AllocationObservation, reason: str) -> AllocationAction:
    return AllocationAction(obs.zone, obs.spot_nodes, obs.on_demand_nodes, None, reason)


def _spot_in(obs: AllocationObservation, zone: str, reason: str) -> AllocationAction:
    if obs.zone == zone and obs.spot_nodes == obs.node_count:
        return _keep(obs, reason)
    return AllocationAction(zone, obs.node_count, 0, None, reason)


def _on_demand_here(obs: AllocationObservation, reason: str) -> AllocationAction:
    if obs.on_demand_nodes == obs.node_count:
        return _keep(obs, reason)
    zone = obs.zone if obs.zone is not None else obs.home_zone
    return AllocationAction(zone, 0, obs.node_count, None, reason)


def safety_net(obs: AllocationObservation) -> AllocationAction | None:
    """Uniform Progress's safety rules (4 and 5 of `cloud.policies.UniformProgressPolicy`), or
    None when the deadline leaves room for any choice."""
    n = obs.node_count
    on_spot = obs.spot_nodes == n
    if at_safety_point(obs, changeovers=1):
        if on_spot and not obs.in_changeover:
            return _keep(obs, "rl safety net: ride running spot until preempted")
        return _on_demand_here(obs, "rl safety net: on-demand to the end")
    if not on_spot and at_safety_point(obs, changeovers=2):
        return _on_demand_here(obs, "rl safety net: on-demand to the end")
    return None


def apply_slow_choice(
    obs: AllocationObservation, heuristic: AllocationAction, choice: int, checkpoint: int
) -> AllocationAction:
    """The action the runner gets: the chosen override (or the heuristic's), behind the safety
    net; a choice that cannot be carried out now (no spot for the gang) falls back to the
    heuristic's action, so a learned policy can never ask for capacity that is not there."""
    if not 0 <= choice < len(SLOW_CHOICES) or not 0 <= checkpoint < len(CHECKPOINT_CHOICES_S):
        raise ValueError(
            f"slow action ({choice}, {checkpoint}) is out of range; choice must be in "
            f"0..{len(SLOW_CHOICES) - 1} {SLOW_CHOICES}, checkpoint in "
            f"0..{len(CHECKPOINT_CHOICES_S) - 1} {CHECKPOINT_CHOICES_S}"
        )
    n = obs.node_count
    action = safety_net(obs)
    if action is None:
        name = SLOW_CHOICES[choice]
        action = heuristic
        if name == "spot_home" and obs.spot_available(obs.home_zone) >= n:
            action = _spot_in(obs, obs.home_zone, "rl: spot in the home zone")
        elif name == "spot_best_other":
            other = best_other_zone(obs)
            if other >= 0:
                action = _spot_in(obs, obs.zones[other], "rl: spot in the cheapest other zone")
        elif name == "on_demand_here":
            action = _on_demand_here(obs, "rl: on-demand")
        elif name == "wait":
            action = AllocationAction.release("rl: wait")
    interval = CHECKPOINT_CHOICES_S[checkpoint]
    if interval is None:
        interval = heuristic.checkpoint_interval_s
    if interval == action.checkpoint_interval_s:
        return action
    return AllocationAction(
        action.zone, action.spot_nodes, action.on_demand_nodes, interval, action.reason,
        action.numbers,
    )
