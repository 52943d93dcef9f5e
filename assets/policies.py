"""Learned policies as assets: `slow_policy` and `fast_policy`, one partition per region.

Each materialization trains a candidate (behaviour clone of the heuristic, then PPO; `rl.train`),
saves it as a plain npz policy file with its header, and evaluates it against the incumbent
(the region's champion, else the heuristic) on held-out cells (`rl.gate`). The blocking checks
`slow_policy_gate` / `fast_policy_gate` then act on that decision: promoted candidates become the
champion, refused ones leave the incumbent in charge and fail the check (ERROR), so nothing
downstream runs on a policy the gate did not accept. Each candidate is registered in the MLflow
Model Registry (`rl.registry`: alias `challenger`, training window and figures as tags); the
check moves `champion` to a promoted one and records a refusal on the version.

Rollback: `policy_rollback` (job of the same name in pipelines/jobs.py) proposes a stored version
of a region's slow or fast policy again (run config: kind, restore_version, reason,
requested_by); its blocking check `policy_rollback_gate` publishes it (registry alias, then
champion.npz) only when the file loads and the version was promoted before (`rl.gate`), and
records from, to, who and why in the policy history. A candidate that was rolled back from is
not promoted again by re-executing its gate.

Schedules: `weekly_slow_policy_retraining` (Mondays 03:00 UTC) and `daily_fast_policy_retraining`
(04:00 UTC) request one run per region partition, so retraining fans out on whatever executor
the deployment has. Registered by the lead from `POLICY_DEFS`.
"""

import warnings
from dataclasses import replace
from typing import Literal

import dagster as dg

from rl import gate as rl_gate
from rl.cells import PARTITION_REGIONS
from rl.policy_file import PolicyFileError, load_policy
from rl.registry import (
    record_gate_outcome,
    register_retrained,
    train_data_tags,
    verify_champion_file,
)
from rl.retrain import (
    DAILY_FAST,
    TINY,
    WEEKLY_SLOW,
    Budget,
    apply_gate,
    policy_dir,
    retrain_fast,
    retrain_slow,
)

REGIONS = PARTITION_REGIONS
region_partitions = dg.StaticPartitionsDefinition(list(REGIONS))


class PolicyTrainConfig(dg.Config):
    budget: Literal["full", "tiny"] = "full"
    """full: the scheduled budget (slow 200k PPO steps, fast 100k); tiny: seconds (tests, demos)."""
    ppo_timesteps: int = -1
    """PPO timesteps after the behaviour clone; -1 keeps the budget's."""
    seed: int = 0
    """Added to the training data's fingerprint (rl.training_data.derived_seed): the same data
    and seed give the same policy."""
    train_days: float = -1.0
    """Days of the region's newest market data to train on; -1 keeps the budget's (slow 14,
    fast 7)."""


def _budget(config: PolicyTrainConfig, full: Budget) -> Budget:
    budget = full if config.budget == "full" else TINY
    # Tiny shrinks the work, not the data: it trains on the full budget's window.
    budget = replace(budget, seed=config.seed, train_days=full.train_days)
    if config.ppo_timesteps >= 0:
        budget = replace(budget, ppo_timesteps=config.ppo_timesteps)
    if config.train_days > 0:
        budget = replace(budget, train_days=config.train_days)
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
        # What the candidate trained on: data sha256, time range, collections, seed.
        **train_data_tags(out["header"].get("train_data")),
    }


@dg.asset(partitions_def=region_partitions, group_name="policies",
          description="Learned slow (allocation + checkpoint interval) policy of the region.")
def slow_policy(context: dg.AssetExecutionContext, config: PolicyTrainConfig) -> dg.MaterializeResult:
    out = retrain_slow(context.partition_key, _budget(config, WEEKLY_SLOW))
    registry = register_retrained("slow", context.partition_key, out)
    return dg.MaterializeResult(metadata={**_metadata(out), **registry})


@dg.asset(partitions_def=region_partitions, group_name="policies",
          description="Learned fast (shares, batch, notice answer) policy of the region.")
def fast_policy(context: dg.AssetExecutionContext, config: PolicyTrainConfig) -> dg.MaterializeResult:
    out = retrain_fast(context.partition_key, _budget(config, DAILY_FAST))
    registry = register_retrained("fast", context.partition_key, out)
    return dg.MaterializeResult(metadata={**_metadata(out), **registry})


def _rolled_back_from(kind: str, region: str) -> dict | None:
    """The rollback record that took the latest candidate out of charge (and no later one
    restored it), if any: executing its gate again must not undo the rollback."""
    stored = rl_gate.stored_versions(kind, region)
    latest = f"v{stored[-1]}" if stored else None
    last = next((r for r in reversed(rl_gate.read_history(kind, region))
                 if r.get("event") == "rollback" and latest in (r.get("from"), r.get("to"))), None)
    return last if last is not None and last["from"] == latest != last["to"] else None


def _gate(kind: str, context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
    rolled_back = _rolled_back_from(kind, context.partition_key)
    if rolled_back is not None:
        return dg.AssetCheckResult(
            passed=False, severity=dg.AssetCheckSeverity.ERROR,
            description=(f"{rolled_back['from']} was rolled back to {rolled_back['to']} at "
                         f"{rolled_back['at_utc']} by {rolled_back['requested_by']} "
                         f"({rolled_back['why']}); not promoted again: retrain, or restore it "
                         "with the policy_rollback job"),
            metadata={"rolled_back_at": rolled_back["at_utc"], "champion": rolled_back["to"]})
    decision = apply_gate(kind, context.partition_key)
    # The registry records the decision (aliases champion/challenger); a promotion it could not
    # record fails the check, since the loader would refuse that champion file later.
    candidate = policy_dir(kind, context.partition_key) / f"v{decision['candidate_version']}.npz"
    recorded, registry = record_gate_outcome(kind, context.partition_key, decision, candidate)
    return dg.AssetCheckResult(
        passed=bool(decision["promote"]) and recorded, severity=dg.AssetCheckSeverity.ERROR,
        description=f"{decision['reason']}; {registry}",
        metadata={"registry": registry, "cost_ratio": decision["cost_ratio"], "margin": decision["margin"],
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


class PolicyRollbackConfig(dg.Config):
    """Which stored policy version to make current again, and why (both recorded)."""

    kind: Literal["slow", "fast"]
    """slow: allocation + checkpoint interval; fast: shares, batch, notice answer."""
    restore_version: int
    """The stored version to restore (v<N>.npz under the region's policy folder)."""
    reason: str
    """Why (recorded in the policy history and on the registry version; required)."""
    requested_by: str = ""
    """Who asks (recorded); empty: the run's user tag, else 'ui'."""
    allow_unpromoted: bool = False
    """Restore a version the gate never promoted (recorded as such); off: refused."""


@dg.asset(partitions_def=region_partitions, group_name="policies",
          description="A rollback proposal for the region's slow or fast policy; it becomes the "
                      "champion only when policy_rollback_gate passes.")
def policy_rollback(context: dg.AssetExecutionContext,
                    config: PolicyRollbackConfig) -> dg.MaterializeResult:
    requested_by = config.requested_by or context.run.tags.get("dagster/user", "") or "ui"
    current = rl_gate.champion_label(config.kind, context.partition_key)
    proposal = rl_gate.propose_rollback(
        config.kind, context.partition_key, config.restore_version, reason=config.reason,
        requested_by=requested_by, allow_unpromoted=config.allow_unpromoted)
    return dg.MaterializeResult(metadata={
        "kind": config.kind, "restore_version": config.restore_version, "current": current,
        "status": "proposal: published when policy_rollback_gate passes",
        "why": config.reason, "requested_by": requested_by,
        "proposed_utc": proposal["proposed_utc"]})


def _checked_regions(context: dg.AssetCheckExecutionContext) -> list[str]:
    if context.has_partition_key:
        return [context.partition_key]
    if context.has_partition_key_range:
        return list(context.partition_keys)
    return list(REGIONS)


def _champions_valid(region: str) -> tuple[bool, str]:
    """No proposal pending: the check says whether the champions in charge are still valid."""
    notes, ok = [], True
    for kind in ("slow", "fast"):
        path = policy_dir(kind, region) / "champion.npz"
        if not path.is_file():
            notes.append(f"{kind}: heuristic in charge")
            continue
        try:
            load_policy(path, kind, rl_gate._layout(kind), region)
            accepted, note = verify_champion_file(kind, region, path)
        except (PolicyFileError, KeyError, TypeError) as error:
            accepted, note = False, str(error)
        ok = ok and accepted
        notes.append(f"{kind}: {note}" if accepted else f"{kind}: refused ({note}); roll back")
    return ok, "; ".join(notes)


def _rollback_gate(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
    results, passed = [], True
    for region in _checked_regions(context):
        out = rl_gate.publish_rollback(region, approved_by="policy_rollback_gate")
        if out is None:
            ok, note = _champions_valid(region)
            out = {"passed": ok, "reason": f"{region}: no rollback pending; {note}"}
        passed = passed and out["passed"]
        results.append(out["reason"])
    return dg.AssetCheckResult(passed=passed, severity=dg.AssetCheckSeverity.ERROR,
                               description="\n".join(results))


with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=dg.PreviewWarning,
                            message=".*partitions_def on an AssetCheckSpec")

    @dg.asset_check(asset=policy_rollback, name="policy_rollback_gate", blocking=True,
                    partitions_def=region_partitions)
    def policy_rollback_gate(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        """Publish the pending rollback only if the file loads and was promoted before; with none
        pending, say whether the champions in charge are still valid."""
        return _rollback_gate(context)


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
    "assets": [slow_policy, fast_policy, policy_rollback],
    "asset_checks": [slow_policy_gate, fast_policy_gate, policy_rollback_gate],
    "schedules": [weekly_slow_policy_retraining, daily_fast_policy_retraining],
    "jobs": [slow_policy_job, fast_policy_job],
}
