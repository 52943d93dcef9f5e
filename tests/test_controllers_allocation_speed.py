"""trainwise_heuristic's fast paths decide exactly as the slow ones: the plan solver (all held
modes at once, sliced shifts) gives bit-identical tables to a mode-by-mode loop with gathers,
the per-tick shortcuts (fast validation, cached curve lookups, bisect in the plan table) change
no action, on real trace windows with the suite's fit protocol. No wall-clock assertions here:
the replay time is measured by `benchmarks/cost/suite.py` (`time_full_trace`)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import controllers.allocation_heuristic as heuristic
from cloud.faults import FaultSampler, load_fault_trace
from cloud.scenarios import (
    MULTI_NODE,
    SINGLE_NODE,
    build_scenarios,
    policy_for,
    risk_model_for,
    rules_for,
)
from cloud.simulator import simulate
from cloud.traces import default_spot_dir
from controllers.allocation_planner import (
    IDLE,
    ON_DEMAND,
    SPOT,
    PlanInputs,
    SlackPlan,
    _transitions,
    miss_penalty_usd,
    solve_plan,
)
from controllers.allocation_types import AllocationObservation
from controllers.preemption_risk import POOLED_ZONE, UP, PreemptionRiskModel

needs_data = pytest.mark.skipif(not default_spot_dir().is_dir(),
                                reason="shared spot data missing")


# The deliberately slow reference: the planner's backward induction as first written, one held
# mode at a time, shifts by index gathers, per-state floor arrays.

def _reference_shift(n: int, by_units: float):
    pos = np.arange(n) - by_units
    lo = np.floor(pos).astype(int)
    w = pos - lo
    outside = lo < 0
    lo_c, hi_c = np.clip(lo, 0, n - 1), np.clip(lo + 1, 0, n - 1)

    def shift(values: np.ndarray, floor_values: np.ndarray) -> np.ndarray:
        out = values[..., lo_c] * (1 - w) + values[..., hi_c] * w
        if outside.any():
            out[..., outside] = floor_values[..., outside]
        return out

    return shift


def reference_solve_plan(model: PreemptionRiskModel, zone: str, spot_nodes: int,
                         inputs: PlanInputs) -> SlackPlan:
    age_edges = tuple(model.curve(zone, spot_nodes, UP).age_edges_s)
    bins = len(age_edges)
    p, end = _transitions(model, zone, spot_nodes, inputs.dt_s, age_edges,
                          inputs.hop_probability, inputs.zones)
    up_mask = np.zeros(2 * bins, dtype=bool)
    up_mask[:bins] = True
    p_stay_up = p * up_mask[None, :]
    p_stay_up[np.arange(bins), 0] -= end[:bins] * inputs.hop_probability
    q_hop, unit = inputs.hop_probability, inputs.slack_unit_s
    n_slack = int(math.ceil(inputs.max_slack_s / unit)) + 2
    slack = np.arange(n_slack) * unit
    dt, c, save = inputs.dt_s, inputs.changeover_s, inputs.save_s
    step_od = inputs.on_demand_usd_per_h * dt / 3600.0
    step_spot = inputs.spot_usd_per_h * dt / 3600.0
    release = np.array([0.0, inputs.on_demand_usd_per_h, inputs.spot_usd_per_h]) * save / 3600.0
    shift_dt, shift_c, shift_save = (_reference_shift(n_slack, x / unit) for x in (dt, c, save))
    steps = inputs.steps
    decisions = np.zeros((steps + 1, 3, 2 * bins, n_slack), dtype=np.int8)
    values = np.zeros((steps + 1, 3, 2 * bins, n_slack), dtype=np.float32)
    v = np.zeros((3, 2 * bins, n_slack))
    down_up = ~up_mask
    for k in range(1, steps + 1):
        time_left = k * dt
        done = slack >= time_left
        miss = np.full((2 * bins, n_slack),
                       miss_penalty_usd(inputs)
                       + inputs.on_demand_usd_per_h * (time_left + c) / 3600.0)
        ev_idle, ev_od = p @ v[IDLE], p @ v[ON_DEMAND]
        after = q_hop * v[IDLE][0:1] + (1 - q_hop) * v[IDLE][bins:bins + 1]
        ev_spot = p_stay_up @ v[SPOT] + end[:, None] * shift_save(after, miss[:1])
        q_idle = shift_dt(ev_idle, miss)
        q_od_keep, q_od_launch = step_od + ev_od, step_od + shift_c(ev_od, miss)
        q_spot_keep, q_spot_launch = step_spot + ev_spot, step_spot + shift_c(ev_spot, miss)
        q_spot_keep[down_up] = 1e18
        q_spot_launch[down_up] = 1e18
        new_v = np.empty_like(v)
        for mode in (IDLE, ON_DEMAND, SPOT):
            options = (q_idle + release[mode],
                       q_od_keep if mode == ON_DEMAND else q_od_launch + release[mode],
                       q_spot_keep if mode == SPOT else q_spot_launch + release[mode])
            best = np.where(options[1] < options[0], ON_DEMAND, IDLE)
            best_v = np.minimum(options[0], options[1])
            spot_better = options[2] < best_v
            best[spot_better] = SPOT
            new_v[mode] = np.where(spot_better, options[2], best_v)
            decisions[k, mode] = best
        new_v[:, :, done] = 0.0
        decisions[k, ON_DEMAND][:, done] = ON_DEMAND
        decisions[k, SPOT][:, done] = SPOT
        decisions[k, IDLE][:, done] = np.where(up_mask, SPOT, ON_DEMAND)[:, None]
        new_v[SPOT][down_up] = new_v[IDLE][down_up]
        v = new_v
        values[k] = v
    return SlackPlan(inputs, age_edges, decisions, values)


def _reference_index(self, steps_left, slack_s, mode, up, age_s):
    """SlackPlan._index as first written (numpy searchsorted on the age edges)."""
    k = int(min(max(round(steps_left), 0), self.decisions.shape[0] - 1))
    bins = len(self.age_edges_s)
    age_bin = max(0, min(bins - 1, int(np.searchsorted(self.age_edges_s, age_s,
                                                        side="right")) - 1))
    s = int(min(max(math.floor(slack_s / self.inputs.slack_unit_s), 0),
                self.decisions.shape[3] - 1))
    return k, mode, age_bin if up else bins + age_bin, s


class _NoMemo(dict):
    """A dict that forgets everything: turns the model's curve lookup cache off."""

    def get(self, key, default=None):
        return default

    def __setitem__(self, key, value) -> None:
        pass


@pytest.fixture(scope="module")
def scenarios():
    """Real windows cut as in the suite: a single-zone 1-node window (the plan decides), a
    multi-zone 1-node window and a multi-zone 16-node gang (node sets scored, composite plan)."""
    single = build_scenarios(SINGLE_NODE, rules_for(SINGLE_NODE), 1, max_zones=2,
                             folders=("availability-1node-aws-2023-02",))
    gang = build_scenarios(MULTI_NODE, rules_for(MULTI_NODE), 1, max_zones=2,
                           kinds=("multi_zone",))
    return {
        "single_zone_1_node": next(s for s in single if s.kind == "single_zone"),
        "multi_zone_1_node": next(s for s in single if s.kind == "multi_zone"),
        "multi_zone_16_node_gang": gang[0],
    }


def _replay(scenario) -> tuple[list[tuple], float]:
    """Every action (time, zone, spot, on-demand, checkpoint interval, reason) and the cost."""
    policy = policy_for("trainwise_heuristic", scenario)
    actions: list[tuple] = []

    class Recorder:
        name = policy.name

        def act(self, obs: AllocationObservation):
            action = policy.act(obs)
            actions.append((obs.time_s, action.zone, action.spot_nodes, action.on_demand_nodes,
                            action.checkpoint_interval_s, action.reason))
            return action

    sampler = None
    if scenario.setting.faults:
        sampler = FaultSampler(load_fault_trace(), seed=scenario.seed)
    result = simulate(Recorder(), scenario.job, scenario.rules, scenario.market,
                      home_zone=scenario.home_zone, fault_sampler=sampler)
    return actions, result.cost_usd


@needs_data
@pytest.mark.parametrize("name", ["single_zone_1_node", "multi_zone_1_node",
                                  "multi_zone_16_node_gang"])
def test_fast_paths_take_the_same_actions_as_the_slow_reference(scenarios, name, monkeypatch):
    scenario = scenarios[name]
    fast_actions, fast_cost = _replay(scenario)
    model = risk_model_for(scenario)
    with monkeypatch.context() as patch:
        patch.setattr(heuristic, "solve_plan", reference_solve_plan)
        patch.setattr(heuristic, "_plainly_usable", lambda obs: False)
        patch.setattr(SlackPlan, "_index", _reference_index)
        patch.setattr(model, "_found", _NoMemo())
        slow_actions, slow_cost = _replay(scenario)
    assert len(fast_actions) >= 300
    # Not a trivial window: the policy changes its holding more than once.
    assert len({a[1:4] for a in fast_actions}) >= 2
    assert fast_actions == slow_actions
    assert fast_cost == slow_cost


@needs_data
@pytest.mark.parametrize("zone_kind, hop, zones", [("own", 0.0, 1), ("pooled", 0.4, 3)])
@pytest.mark.parametrize("changeover_s, save_s", [(360.0, 60.0), (0.0, 0.0), (500.0, 700.0)])
def test_plan_tables_are_bit_identical_to_the_reference_loop(scenarios, zone_kind, hop, zones,
                                                             changeover_s, save_s):
    scenario = scenarios["multi_zone_1_node"]
    model = risk_model_for(scenario)
    zone = scenario.home_zone if zone_kind == "own" else POOLED_ZONE
    inputs = PlanInputs(dt_s=390.0, steps=120, max_slack_s=4 * 3600.0 + 750.0,
                        changeover_s=changeover_s, save_s=save_s, spot_usd_per_h=0.9731,
                        on_demand_usd_per_h=3.06, slack_unit_s=120.0, hop_probability=hop,
                        zones=zones)
    fast = solve_plan(model, zone, 1, inputs)
    slow = reference_solve_plan(model, zone, 1, inputs)
    assert fast.decisions.shape == slow.decisions.shape
    assert np.array_equal(fast.decisions, slow.decisions)
    assert fast.values.tobytes() == slow.values.tobytes()
    # The table is not degenerate: every action is chosen somewhere.
    assert set(np.unique(fast.decisions)) == {IDLE, ON_DEMAND, SPOT}


def _observation(**overrides) -> AllocationObservation:
    fields = {
        "time_s": 3600.0, "tick_s": 195.0, "trace_time_s": 3600.0, "work_done_h": 1.0,
        "work_checkpointed_h": 1.0, "work_total_h": 48.0, "work_rate_gpu_h_per_h": 1.0,
        "deadline_s": 52 * 3600.0, "changeover_s": 360.0, "checkpoint_save_s": 60.0,
        "checkpoint_interval_s": 3600.0, "notice_s": 120.0, "node_count": 1,
        "zones": ("a", "b"), "home_zone": "a", "zone": "a", "spot_nodes": 1,
        "on_demand_nodes": 0, "in_changeover": False, "changeover_left_s": 0.0,
        "last_zone": "a", "spot_available_by_zone": (1, 0),
        "spot_price_usd_per_hour_by_zone": (0.97, 0.97),
        "on_demand_price_usd_per_hour_by_zone": (3.06, 3.06), "since_checkpoint_s": 0.0,
        "since_launch_s": 600.0, "preemption_times_s": (), "launch_failed": False,
    }
    fields.update(overrides)
    return AllocationObservation(**fields)


@pytest.mark.parametrize("overrides", [
    {"time_s": math.nan}, {"tick_s": 0.0}, {"deadline_s": -1.0}, {"work_done_h": math.inf},
    {"notice_s": True}, {"checkpoint_save_s": "60"}, {"since_launch_s": -0.5},
    {"spot_available_by_zone": (1,)}, {"spot_price_usd_per_hour_by_zone": (0.97, math.nan)},
    {"on_demand_price_usd_per_hour_by_zone": (3.06, -1.0)}, {"home_zone": "c"},
    {"zone": "c"}, {"zones": (), "spot_available_by_zone": (),
                    "spot_price_usd_per_hour_by_zone": (),
                    "on_demand_price_usd_per_hour_by_zone": ()},
    {"work_rate_gpu_h_per_h": 0},
])
def test_fast_validation_never_passes_what_the_detailed_check_refuses(overrides):
    obs = _observation(**overrides)
    assert heuristic.bad_allocation_fields(obs) != []
    assert not heuristic._plainly_usable(obs)


@pytest.mark.parametrize("overrides", [
    {}, {"zone": None, "spot_nodes": 0}, {"time_s": 0, "since_launch_s": 0},
    {"spot_available_by_zone": (0, 3)}, {"changeover_left_s": 120.0},
])
def test_fast_validation_passes_plain_usable_observations(overrides):
    obs = _observation(**overrides)
    assert heuristic.bad_allocation_fields(obs) == []
    assert heuristic._plainly_usable(obs)
    # A numpy float64 (a float subclass) is usable too: the fast check defers it to the
    # detailed one.
    odd = dataclasses.replace(obs, time_s=np.float64(obs.time_s))
    assert not heuristic._plainly_usable(odd)
    assert heuristic.bad_allocation_fields(odd) == []
    policy = heuristic.TrainwiseAllocationPolicy()
    assert not policy.act(odd).reason.startswith("fallback:")
