"""Learned policies as assets: `slow_policy` and `fast_policy`, one partition per region.

Each materialization trains a candidate (behaviour clone of the heuristic, then PPO; `rl.train`),
saves it as a plain npz policy file with its header, and evaluates it against the incumbent
(the region's champion, else the heuristic) on held-out cells (`rl.gate`). The blocking checks
`slow_policy_gate` / `fast_policy_gate` then act on that decision: promoted candidates become the
champion, refused ones leave the incumbent in charge and fail the check (ERROR), so nothing
downstream runs on a policy the gate did not accept.

Schedules: `weekly_slow_policy_retraining` (Mondays 03:00 UTC) and `daily_fast_policy_retraining`
(04:00 UTC) request one run per region partition, so retraining fans out on whatever executor
the deployment has. Registered by the lead from `POLICY_DEFS`.
"""

import warnings
from dataclasses import replace
from typing import Literal

import dagster as dg

from rl.cells import PARTITION_REGIONS
from rl.retrain import DAILY_FAST, TINY, WEEKLY_SLOW, Budget, apply_gate, retrain_fast, retrain_slow

REGIONS = PARTITION_REGIONS
region_partitions = dg.StaticPartitionsDefinition(list(REGIONS))


class PolicyTrainConfig(dg.Config):
    budget: Literal["full", "tiny"] = "full"
    """full: the scheduled budget (slow 200k PPO steps, fast 100k); tiny: seconds (tests, demos)."""
    ppo_timesteps: int = -1
    """PPO timesteps after the behaviour clone; -1 keeps the budget's."""
    seed: int = 0


def _budget(config: PolicyTrainConfig, full: Budget) -> Budget:
    budget = full if config.budget == "full" else TINY
    budget = replace(budget, seed=config.seed)
    if config.ppo_timesteps >= 0:
        budget = replace(budget, ppo_timesteps=config.ppo_timesteps)
    return budget


def _metadata(out: dict) -> dict:
    d = out["decision"]
    return {
        "version": out["version"], "path": out["path"], "incumbent": out["incumbent"],
        "gate_decision": d["reason"], "cost_ratio": d["cost_ratio"],
        "cost_ratio_ci95": str(d["cost_ratio_ci95"]), "held_out": d["cells"],
        "candidate_misses": d["candidate_misses"], "incumbent_misses": d["incumbent_misses"],
        "bc_agreement": out["bc_agreement"], "train_seconds": out["train_seconds"],
        "ppo_timesteps": out["ppo_timesteps"], "train_window": out["header"]["train_window"],
    }


@dg.asset(partitions_def=region_partitions, group_name="policies",
          description="Learned slow (allocation + checkpoint interval) policy of the region.")
def slow_policy(context: dg.AssetExecutionContext, config: PolicyTrainConfig) -> dg.MaterializeResult:
    out = retrain_slow(context.partition_key, _budget(config, WEEKLY_SLOW))
    return dg.MaterializeResult(metadata=_metadata(out))


@dg.asset(partitions_def=region_partitions, group_name="policies",
          description="Learned fast (shares, batch, notice answer) policy of the region.")
def fast_policy(context: dg.AssetExecutionContext, config: PolicyTrainConfig) -> dg.MaterializeResult:
    out = retrain_fast(context.partition_key, _budget(config, DAILY_FAST))
    return dg.MaterializeResult(metadata=_metadata(out))


def _gate(kind: str, context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
    decision = apply_gate(kind, context.partition_key)
    return dg.AssetCheckResult(
        passed=bool(decision["promote"]), severity=dg.AssetCheckSeverity.ERROR,
        description=decision["reason"],
        metadata={"cost_ratio": decision["cost_ratio"], "margin": decision["margin"],
                  "candidate_version": decision["candidate_version"],
                  "champion_version": str(decision["champion_version"]),
                  "candidate_misses": decision["candidate_misses"],
                  "incumbent_misses": decision["incumbent_misses"]})


# Partitioned checks are a Dagster 1.13 preview (as in assets/data.py): silenced here only.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=dg.PreviewWarning,
                            message=".*partitions_def on an AssetCheckSpec")

    @dg.asset_check(asset=slow_policy, name="slow_policy_gate", blocking=True,
                    partitions_def=region_partitions)
    def slow_policy_gate(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        """Promote only if cheaper by the margin on held-out cells with no more deadline misses."""
        return _gate("slow", context)

    @dg.asset_check(asset=fast_policy, name="fast_policy_gate", blocking=True,
                    partitions_def=region_partitions)
    def fast_policy_gate(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        """Promote only if faster by the margin on held-out seeds."""
        return _gate("fast", context)


slow_policy_job = dg.define_asset_job("slow_policy_retraining", selection=[slow_policy])
fast_policy_job = dg.define_asset_job("fast_policy_retraining", selection=[fast_policy])


def _per_region(context: dg.ScheduleEvaluationContext):
    when = context.scheduled_execution_time.isoformat() if context.scheduled_execution_time else "now"
    for region in REGIONS:
        yield dg.RunRequest(run_key=f"{when}-{region}", partition_key=region)


@dg.schedule(job=slow_policy_job, cron_schedule="0 3 * * 1", execution_timezone="UTC",
             name="weekly_slow_policy_retraining")
def weekly_slow_policy_retraining(context: dg.ScheduleEvaluationContext):
    yield from _per_region(context)


@dg.schedule(job=fast_policy_job, cron_schedule="0 4 * * *", execution_timezone="UTC",
             name="daily_fast_policy_retraining")
def daily_fast_policy_retraining(context: dg.ScheduleEvaluationContext):
    yield from _per_region(context)


POLICY_DEFS = {
    "assets": [slow_policy, fast_policy],
    "asset_checks": [slow_policy_gate, fast_policy_gate],
    "schedules": [weekly_slow_policy_retraining, daily_fast_policy_retraining],
    "jobs": [slow_policy_job, fast_policy_job],
}
