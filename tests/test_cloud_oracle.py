"""The hindsight oracle: exact on tiny markets (against brute force) and never beaten."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cloud.oracle import hindsight_optimum, multi_zone_optimum, single_zone_optimum
from cloud.policy_registry import make_policy, policy_names
from cloud.simulator import ClusterRules, JobSpec, Market, simulate
from controllers.allocation_types import AllocationAction

ZONES = ("us-west-2a", "us-west-2b", "us-west-2c")


class Script:
    name = "script"

    def __init__(self, actions):
        self.actions = actions

    def act(self, obs):
        return self.actions[round(obs.time_s / obs.tick_s)]


class RandomPolicy:
    """Random but valid actions: explores schedules no peer would try."""

    name = "random"

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def act(self, obs):
        n = obs.node_count
        choice = self.rng.integers(0, 4)
        if choice == 0:
            return AllocationAction.release("random wait")
        zone = obs.zones[self.rng.integers(len(obs.zones))]
        spot = int(self.rng.integers(0, n + 1)) if choice == 1 else (n if choice == 2 else 0)
        return AllocationAction(zone, spot, n - spot, None, "random")


def brute_force(
    job: JobSpec, rules: ClusterRules, market: Market, ticks: int
) -> tuple[float, float]:
    """Cheapest (deadline met, any) cost over every per-tick action sequence in the simulator."""
    n = job.node_count
    options = [AllocationAction.release("idle")] + [
        AllocationAction(zone, s, n - s) for zone in market.zones for s in range(n + 1)
    ]
    best_met = best_any = np.inf
    for sequence in itertools.product(options, repeat=ticks):
        result = simulate(Script(sequence), job, rules, market)
        best_any = min(best_any, result.cost_usd)
        if result.deadline_met:
            best_met = min(best_met, result.cost_usd)
    return best_met, best_any


# No checkpoints and a 150 s changeover on 100 s ticks: the oracle's 50 s unit is exact, so the
# oracle must equal the best schedule the simulator can play, not just stay below it.
EXACT_RULES = ClusterRules(changeover_s=150, checkpoint_save_s=0, checkpoint_interval_s=1e9)


@pytest.mark.parametrize(
    "available, node_count, work_s",
    [
        ([[0, 1, 0, 0, 1, 1, 1]], 1, 350),
        ([[0, 1, 0, 1, 1, 0], [1, 1, 0, 0, 1, 0]], 1, 250),
        ([[1, 2, 2, 0, 2, 1]], 2, 300),
    ],
)
def test_oracle_equals_the_best_schedule_on_tiny_markets(available, node_count, work_s):
    available = np.array(available)
    zones = len(available)
    market = Market(ZONES[:zones], 100, available, (0.9, 1.3, 0.7)[:zones], (3.0,) * zones)
    ticks = available.shape[1]
    job = JobSpec(
        work_gpu_h=work_s * node_count / 3600, deadline_s=ticks * 100, node_count=node_count
    )
    bound = hindsight_optimum(job, EXACT_RULES, market)
    best_met, best_any = brute_force(job, EXACT_RULES, market, ticks)
    assert bound.cost_deadline_met_usd == pytest.approx(best_met, abs=1e-9)
    assert bound.cost_any_usd <= best_any + 1e-9
    assert bound.work_unit_s == 50 and bound.changeover_rounded_s == 150


def _random_market(rng: np.random.Generator, zones: int, nodes: int, ticks: int) -> Market:
    runs = rng.integers(1, 8, size=(zones, ticks))
    values = rng.integers(0, nodes + 1, size=(zones, ticks))
    available = np.stack([np.repeat(values[z], runs[z])[:ticks] for z in range(zones)])
    return Market(
        ZONES[:zones], 195, available, tuple(rng.uniform(0.8, 1.2, zones)), (3.06,) * zones
    )


@pytest.mark.parametrize("seed", range(8))
def test_no_policy_beats_the_oracle_on_random_markets(seed):
    rng = np.random.default_rng(seed)
    zones, nodes = (1 + seed % 3, 1 + (seed // 3) % 2 * 3)
    ticks = 150
    market = _random_market(rng, zones, nodes, ticks)
    rules = ClusterRules(changeover_s=360.0, checkpoint_save_s=60.0, checkpoint_interval_s=3600.0)
    job = JobSpec(
        work_gpu_h=float(rng.uniform(4.0, 6.5)) * nodes, deadline_s=ticks * 195.0, node_count=nodes
    )
    bound = multi_zone_optimum(job, rules, market)
    policies = [make_policy(name) for name in policy_names()] + [
        RandomPolicy(seed + k) for k in range(4)
    ]
    for zone in market.zones:
        single = single_zone_optimum(job, rules, market, zone)
        assert bound.cost_deadline_met_usd <= single.cost_deadline_met_usd + 1e-9
        for policy in policies:
            for scope, oracle, home in (("single", single, zone), ("multi", bound, zone)):
                result = simulate(
                    policy,
                    job,
                    rules,
                    market.zone_market(zone) if scope == "single" else market,
                    home_zone=home,
                )
                limit = oracle.cost_deadline_met_usd if result.deadline_met else oracle.cost_any_usd
                assert result.cost_usd >= limit - 1e-9, (
                    policy.name,
                    scope,
                    zone,
                    result.cost_usd,
                    limit,
                )


def test_oracle_prices_the_extremes_exactly():
    rules = ClusterRules(changeover_s=390.0, checkpoint_save_s=60.0)
    # 185 ticks of training: a whole number of the oracle's 195 s work units, so no rounding.
    job = JobSpec(work_gpu_h=185 * 195 / 3600, deadline_s=200 * 195.0)
    always = Market(ZONES[:1], 195, np.ones((1, 200), dtype=int), (1.0,), (3.0,))
    never = Market(ZONES[:1], 195, np.zeros((1, 200), dtype=int), (1.0,), (3.0,))
    # One launch, a 390 s changeover, then the training, at 1 or 3 USD/h.
    hours = (185 * 195 + 390) / 3600
    assert hindsight_optimum(job, rules, always).cost_deadline_met_usd == pytest.approx(hours)
    assert hindsight_optimum(job, rules, never).cost_deadline_met_usd == pytest.approx(3 * hours)


def test_oracle_refuses_a_deadline_shorter_than_the_work():
    market = Market(ZONES[:1], 195, np.ones((1, 100), dtype=int), (1.0,), (3.0,))
    with pytest.raises(ValueError, match="is shorter than the work"):
        hindsight_optimum(JobSpec(work_gpu_h=6.0, deadline_s=6 * 3600.0), ClusterRules(), market)
    with pytest.raises(ValueError, match="longer than the market window"):
        hindsight_optimum(JobSpec(work_gpu_h=1.0, deadline_s=30 * 3600.0), ClusterRules(), market)


WHOLE_TICK_RULES = ClusterRules(
    changeover_s=150, checkpoint_save_s=0, checkpoint_interval_s=1e9,
    bill_finishing_tick_whole=True,
)


@pytest.mark.parametrize(
    "available, work_s",
    [([[0, 1, 0, 0, 1, 1, 1]], 330), ([[0, 1, 0, 1, 1, 0], [1, 1, 0, 0, 1, 0]], 230)],
)
def test_oracle_is_exact_when_the_finishing_tick_is_billed_whole(available, work_s):
    """The Can't Be Late convention: the finishing tick bills whole, so the bound is the best
    schedule exactly (per-second billing of that tick would put it below)."""
    available = np.array(available)
    zones = len(available)
    market = Market(ZONES[:zones], 100, available, (0.9, 1.3)[:zones], (3.0,) * zones)
    ticks = available.shape[1]
    job = JobSpec(work_gpu_h=work_s / 3600, deadline_s=ticks * 100)
    best_met, _ = brute_force(job, WHOLE_TICK_RULES, market, ticks)
    whole = hindsight_optimum(job, WHOLE_TICK_RULES, market, max_work_levels=100_000)
    assert whole.cost_deadline_met_usd == pytest.approx(best_met, abs=1e-9)
    assert whole.work_unit_s == 10  # gcd(100, 150, ...) grid kept exact: 330 s is 33 units
    per_second = hindsight_optimum(job, EXACT_RULES, market, max_work_levels=100_000)
    assert per_second.cost_deadline_met_usd < best_met - 1e-6


def test_a_larger_work_grid_tightens_the_bound():
    """With MAX_WORK_LEVELS binding the grid is coarser (a looser lower bound); the cap is a
    parameter so a benchmark can ask for the exact gcd grid."""
    market = Market(("us-west-2a",), 195, np.ones((1, 960), dtype=np.int64), (0.9731,), (3.06,))
    job = JobSpec(work_gpu_h=48.0, deadline_s=52 * 3600.0)
    coarse = hindsight_optimum(job, WHOLE_TICK_RULES, market)
    exact = hindsight_optimum(job, WHOLE_TICK_RULES, market, max_work_levels=100_000)
    assert exact.work_unit_s == 15 and coarse.work_unit_s > 15
    # Spot always up: 150 s changeover + 172,800 s of work = 887 ticks (886.9 rounded up).
    assert exact.cost_deadline_met_usd == pytest.approx(887 * 195 * 0.9731 / 3600)
    assert coarse.cost_deadline_met_usd <= exact.cost_deadline_met_usd + 1e-9
