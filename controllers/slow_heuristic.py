"""The cold-start slow policy: pruning rate and checkpoint interval; allocation is pluggable.

- Pruning rate: `controllers.pruning.decide_pruning_rate` (InfoBatch with a quality guard).
- Checkpoint interval: the one chooser (`controllers/checkpoint_interval.py`, which the
  allocation heuristic and the trainer's autotune ask too), fed by its `CheckpointIntervalTuner`
  (running save-cost and interruption estimates, re-tuned as they change, CheckFreq-style). The
  risk model's P(preemption within the horizon), when given, sets the reclaim MTBF prior; when a
  save fits in the notice (`ClusterSummary.notice_s`) reclaims lose nothing and only node faults
  count. Interruptions saved by an on-notice checkpoint
  (`ClusterSummary.preemptions_saved_by_notice`) are not losses: they cost no rework.
- Allocation: delegated to the `AllocationPolicy` given to the constructor (None: the action
  carries `allocation=None`, i.e. keep the nodes as they are).

Safe fallback on a bad observation (NaN, negative, inconsistent fields): pruning rate 0 (full
data), the checkpoint interval in force (the minimum interval before the first one), allocation
None; the reason starts with "fallback:" and names the bad fields. An empty eval-loss history is
not bad input: pruning stays at 0 until the first eval (see `controllers.pruning`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from controllers.checkpoint_interval import (
    CheckpointIntervalTuner,
    CheckpointTunerConfig,
    fallback_choice,
)
from controllers.checkpointing import expected_overhead_fraction, mtbf_from_risk_s
from controllers.pruning import PruningConfig, check_pruning_inputs, decide_pruning_rate
from controllers.slow_types import SlowAction, SlowObservation
from controllers.validation import number_problem


class AllocationPolicy(Protocol):
    """Chooses the node allocation from the slow observation (pure, no I/O)."""

    name: str

    def act(self, observation: SlowObservation) -> object: ...


@dataclass(frozen=True)
class SlowHeuristicConfig:
    pruning: PruningConfig = field(default_factory=PruningConfig)
    checkpoint: CheckpointTunerConfig = field(default_factory=CheckpointTunerConfig)


def bad_slow_fields(obs: SlowObservation) -> list[str]:
    """One description per unusable field of a slow observation; empty when all are usable."""
    c = obs.cluster
    problems = [
        number_problem("time_s", obs.time_s),
        number_problem("step", obs.step),
        number_problem("cluster.nodes", c.nodes),
        number_problem("cluster.spot_nodes", c.spot_nodes),
        number_problem("cluster.on_demand_nodes", c.on_demand_nodes),
        number_problem("cluster.preemptions_observed", c.preemptions_observed),
        number_problem("cluster.preemptions_saved_by_notice", c.preemptions_saved_by_notice,
                       maximum=c.preemptions_observed if isinstance(
                           c.preemptions_observed, int) else None),
        number_problem("cluster.observed_for_s", c.observed_for_s),
        number_problem("cluster.risk_horizon_s", c.risk_horizon_s, strictly_positive=True),
    ]
    # nan checkpoint cost means "not measured yet" (documented in ClusterSummary).
    if not (isinstance(c.checkpoint_cost_s, float) and math.isnan(c.checkpoint_cost_s)):
        problems.append(number_problem("cluster.checkpoint_cost_s", c.checkpoint_cost_s))
    if c.preemption_risk is not None:
        problems.append(number_problem("cluster.preemption_risk", c.preemption_risk, maximum=1.0))
    counts = (c.nodes, c.spot_nodes, c.on_demand_nodes)
    if all(isinstance(n, int) for n in counts) and c.spot_nodes + c.on_demand_nodes != c.nodes:
        problems.append(f"cluster.spot_nodes {c.spot_nodes} + on_demand_nodes "
                        f"{c.on_demand_nodes} != nodes {c.nodes}")
    problems = [p for p in problems if p is not None]
    try:
        problems += check_pruning_inputs(obs.data, obs.loss_curve, obs.progress)
    except (TypeError, AttributeError) as error:  # a None where a number or part belongs
        problems.append(f"data/loss_curve/progress: {error}")
    return problems


class HeuristicSlowPolicy:
    """Pruning rate + Young/Daly checkpoint interval (+ allocation from a pluggable policy).

    Stateful (running MTBF and cost estimates, the last cumulative counters): one per run.
    """

    name = "heuristic_slow"

    def __init__(self, config: SlowHeuristicConfig | None = None,
                 allocation_policy: AllocationPolicy | None = None) -> None:
        self.config = config or SlowHeuristicConfig()
        self.allocation_policy = allocation_policy
        self._tuner = CheckpointIntervalTuner(self.config.checkpoint)
        self._last_observed_for_s = 0.0
        self._last_preemptions = 0

    @property
    def tuner(self) -> CheckpointIntervalTuner:
        return self._tuner

    def _fallback(self, bad: list[str]) -> SlowAction:
        interval = self._tuner.interval_s or fallback_choice(
            self.config.checkpoint.min_interval_s).interval_s
        return SlowAction(
            pruning_rate=0.0, pruning_upweight=1.0, checkpoint_interval_s=interval,
            allocation=None,
            reason=f"fallback: bad {', '.join(bad)}: full data, checkpoint interval kept at "
                   f"{interval:.0f}s, allocation kept",
            numbers={"bad_fields": float(len(bad)), "checkpoint_interval_s": interval},
        )

    def _update_tuner(self, obs: SlowObservation) -> None:
        c = obs.cluster
        # Only interruptions that lost work count: a preemption whose notice let the on-notice
        # checkpoint finish is not what periodic checkpoints guard against.
        lossy = c.preemptions_observed - c.preemptions_saved_by_notice
        if c.observed_for_s < self._last_observed_for_s or lossy < self._last_preemptions:
            # Counters went back: a new run (or a restarted recorder); count from zero again.
            self._last_observed_for_s, self._last_preemptions = 0.0, 0
        self._tuner.observe_exposure(c.observed_for_s - self._last_observed_for_s,
                                     lossy - self._last_preemptions)
        self._last_observed_for_s = c.observed_for_s
        self._last_preemptions = lossy
        self._tuner.set_situation(node_count=c.nodes, notice_s=c.notice_s)
        if c.preemption_risk is not None:
            self._tuner.set_prior_mtbf(mtbf_from_risk_s(c.preemption_risk, c.risk_horizon_s))
        if c.checkpoint_cost_s == c.checkpoint_cost_s and c.checkpoint_cost_s > 0:
            self._tuner.observe_checkpoint_cost(c.checkpoint_cost_s)

    def act(self, observation: SlowObservation) -> SlowAction:
        bad = bad_slow_fields(observation)
        if bad:
            return self._fallback(bad)
        self._update_tuner(observation)
        interval_s, changed = self._tuner.retune()
        choice = self._tuner.last_choice
        cost = self._tuner.checkpoint_cost_s
        mtbf = choice.mtbf_s
        if cost is None:
            checkpoint_reason = (f"checkpoint every {interval_s:.0f}s (minimum) until a "
                                 f"checkpoint cost is measured (rule {choice.rule})")
        else:
            verb = "re-tuned to" if changed else "kept at"
            checkpoint_reason = (f"checkpoint interval {verb} {interval_s:.0f}s "
                                 f"(cost {cost:.1f}s, MTBF {mtbf:.0f}s; rule {choice.rule}: "
                                 f"{choice.reason})")
        pruning = decide_pruning_rate(observation.data, observation.loss_curve,
                                      observation.progress, self.config.pruning)
        allocation = None
        allocation_reason = "allocation kept (no allocation policy)"
        if self.allocation_policy is not None:
            allocation = self.allocation_policy.act(observation)
            allocation_reason = f"allocation by {self.allocation_policy.name}"
        numbers = dict(pruning.numbers)
        cluster = observation.cluster
        numbers.update(checkpoint_interval_s=interval_s, mtbf_s=mtbf,
                       preemptions_observed=float(cluster.preemptions_observed),
                       preemptions_saved_by_notice=float(cluster.preemptions_saved_by_notice))
        if cost is not None:
            numbers["checkpoint_cost_s"] = cost
            if math.isfinite(mtbf) and math.isfinite(interval_s):
                numbers["checkpoint_overhead_fraction"] = expected_overhead_fraction(
                    interval_s, cost, mtbf)
        return SlowAction(
            pruning_rate=pruning.rate, pruning_upweight=pruning.upweight,
            checkpoint_interval_s=interval_s, allocation=allocation,
            reason=f"pruning {pruning.rate:.2f}: {pruning.reason}; {checkpoint_reason}; "
                   f"{allocation_reason}",
            numbers=numbers,
        )
