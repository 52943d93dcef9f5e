"""The cost suite: every policy and the hindsight oracle on the same real-trace windows.

The settings (job shapes) and scenarios (windows) are the product's, in `cloud/scenarios.py`
(the learned policies train and are gated on them too); this module runs policies on them, checks
no policy beats its oracle, and times the whole-trace replay.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from cloud.faults import FaultSampler, load_fault_trace
from cloud.oracle import hindsight_optimum
from cloud.policy_registry import make_policy, policy_names
from cloud.prices import (
    CANT_BE_LATE_ON_DEMAND_USD_PER_HOUR,
    CANT_BE_LATE_SPOT_USD_PER_HOUR,
)
from cloud.scenarios import SINGLE_NODE, Scenario, all_collections, policy_for, rules_for
from cloud.simulator import JobSpec, market_from_traces, simulate
from cloud.traces import load_folder

# The whole-trace replay timed for every policy (`time_full_trace`).
TIMING_FOLDER = "availability-1node-aws-2023-02"


@dataclass
class ScenarioOutcome:
    scenario: Scenario
    oracle_met_usd: float
    oracle_any_usd: float
    results: dict[str, dict[str, Any]] = field(default_factory=dict)


def _result_row(result: Any) -> dict[str, Any]:
    return {
        "cost_usd": result.cost_usd,
        "completion_usd": result.completion_usd,
        "deadline_met": result.deadline_met,
        "finish_h": None if result.finish_s is None else result.finish_s / 3600.0,
        "spot_share": result.spot_share,
        "waste_share": result.waste_share,
        "utilization": result.utilization,
        "preemptions": result.preemptions,
        "changeovers": result.changeovers,
        "faults": result.faults,
    }


def progress_bar(enabled: bool, label: str) -> Callable[[Iterable], Iterable] | None:
    """A tqdm bar over scenarios on stderr (None when disabled or tqdm is missing)."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return lambda items: tqdm(items, desc=label, file=sys.stderr, leave=False)


def run_scenarios(
    scenarios: list[Scenario],
    policies: tuple[str, ...],
    progress: Callable[[Iterable], Iterable] | None = None,
    factories: dict[str, Callable[[Scenario], Any]] | None = None,
) -> list[ScenarioOutcome]:
    """Run every policy and the oracle (once per oracle key) on every scenario. `factories`:
    policies built per scenario outside the registry (name -> scenario -> policy), e.g. the
    learned policy of the scenario's held-out fold (`learned.py`)."""
    oracle_cache: dict[tuple, tuple[float, float]] = {}
    fault_trace = None
    outcomes: list[ScenarioOutcome] = []
    iterator = progress(scenarios) if progress else scenarios
    for scenario in iterator:
        if scenario.oracle_key not in oracle_cache:
            bound = hindsight_optimum(scenario.job, scenario.rules, scenario.market)
            oracle_cache[scenario.oracle_key] = (bound.cost_deadline_met_usd, bound.cost_any_usd)
        met, any_ = oracle_cache[scenario.oracle_key]
        outcome = ScenarioOutcome(scenario, met, any_)
        for name in policies:
            sampler = None
            if scenario.setting.faults:
                fault_trace = fault_trace or load_fault_trace()
                sampler = FaultSampler(fault_trace, seed=scenario.seed)
            build = (factories or {}).get(name)
            result = simulate(
                build(scenario) if build else policy_for(name, scenario),
                scenario.job,
                scenario.rules,
                scenario.market,
                home_zone=scenario.home_zone,
                fault_sampler=sampler,
            )
            outcome.results[name] = _result_row(result)
        outcomes.append(outcome)
    return outcomes



def oracle_violations(outcomes: list[ScenarioOutcome], tolerance_usd: float = 1e-6) -> list[dict]:
    """Scenario/policy pairs where a policy beat its bound: the deadline-met oracle for runs that
    met the deadline, the any-finish oracle for runs that did not. Must be empty."""
    found = []
    for outcome in outcomes:
        for name, row in outcome.results.items():
            bound = outcome.oracle_met_usd if row["deadline_met"] else outcome.oracle_any_usd
            if row["cost_usd"] < bound - tolerance_usd:
                found.append(
                    {
                        "policy": name,
                        "kind": outcome.scenario.kind,
                        "folder": outcome.scenario.folder,
                        "zone": outcome.scenario.home_zone,
                        "start_tick": outcome.scenario.start_tick,
                        "cost_usd": row["cost_usd"],
                        "bound_usd": bound,
                    }
                )
    return found


def time_full_trace(policies: tuple[str, ...], repeats: int = 3) -> dict[str, float]:
    """Best-of-`repeats` seconds to replay the whole 45-day 2023-02 trace (20,158 ticks) in one
    zone for one policy: a 900 GPU-h job with the trace's full length as its deadline. {} when
    that collection is not in the spot data folder."""
    if TIMING_FOLDER not in all_collections():
        return {}
    trace = next(t for t in load_folder(TIMING_FOLDER) if t.zone == "us-west-2a")
    market = market_from_traces(
        [trace], (CANT_BE_LATE_SPOT_USD_PER_HOUR,), (CANT_BE_LATE_ON_DEMAND_USD_PER_HOUR,)
    )
    job = JobSpec(work_gpu_h=900.0, deadline_s=market.n_ticks * market.tick_s)
    rules = rules_for(SINGLE_NODE)
    seconds: dict[str, float] = {}
    for name in policies:
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            simulate(make_policy(name), job, rules, market)
            best = min(best, time.perf_counter() - start)
        seconds[name] = best
    return seconds


def default_policies() -> tuple[str, ...]:
    return policy_names()
