"""Jobs: the whole chain (demo), the training run alone (train), the curriculum refresh the
slow-policy sensor asks for, gated rollbacks (curriculum, policy), and the switch of the
live-change rule."""

import json

import dagster as dg

from assets.resources import StateResource
from trainwise import orphan_nodes, settings, slow_tick

demo_job = dg.define_asset_job(
    "demo",
    selection=dg.AssetSelection.groups("data", "training"),
    description="Shards -> difficulty scores -> curriculum (gated) -> training run with MLflow.",
)

train_job = dg.define_asset_job(
    "train",
    selection=dg.AssetSelection.assets("checkpoint"),
    description="Train from the current (published) curriculum and record cost vs eval loss.",
)

# Named apart from its asset (Dagster refuses a job and an asset of one name): what a launch
# would cost, before it is launched, and the budget check that blocks an over-budget one.
forecast_job = dg.define_asset_job(
    "forecast",
    selection=dg.AssetSelection.assets("cost_forecast"),
    description="Forecast P50/P90 cost and hours of each partition's job from its measured "
                "throughput (and the schedule's policies) before a launch; p90_within_budget "
                "blocks when a P90 exceeds the published schedule's budget.",
)

curriculum_job = dg.define_asset_job(
    "curriculum_refresh",
    selection=dg.AssetSelection.assets("difficulty_scores", "curriculum"),
    description="Re-score the data and propose a curriculum; published only if its gate passes "
                "(what the slow-policy sensor asks).",
)

# The asset selection includes the blocking check, so a rollback passes the same gate as a new
# curriculum: the restored version is proposed, checked against today's shards, then published.
rollback_job = dg.define_asset_job(
    "curriculum_rollback",
    selection=dg.AssetSelection.assets("curriculum"),
    description="Make a stored curriculum version current again (run config: ops.curriculum."
                "config.restore_version, reason, requested_by), gated by curriculum_coverage "
                "and recorded in the curriculum history.",
)

# The same shape for a learned policy: the proposal asset's blocking check verifies the restored
# file and its promotion record, then moves the registry alias and champion.npz (rl.gate).
# The job's name differs from its asset's: Dagster refuses a job and an asset of the same name
# when the code location loads (the definitions object itself builds fine).
policy_rollback_job = dg.define_asset_job(
    "champion_rollback",
    selection=dg.AssetSelection.assets("policy_rollback"),
    description="Make a stored slow or fast policy version the region's champion again (run "
                "config: ops.policy_rollback.config.kind, restore_version, reason, requested_by), "
                "gated by policy_rollback_gate and recorded in the policy history and registry.",
)


class LiveChangeRuleConfig(dg.Config):
    """The automatic-approval rule for the slow layer's live changes of running jobs."""

    auto_approve: bool
    """On: a live change goes live once its curriculum gate passed. Off: it waits for a person."""
    set_by: str
    """Who switches the rule (recorded)."""
    why: str
    """Why (recorded)."""
    max_rate_change: float = slow_tick.DEFAULT_MAX_AUTO_RATE_CHANGE
    """Largest pruning-rate move approved automatically; a bigger one waits."""


@dg.op
def set_live_change_rule(context: dg.OpExecutionContext, config: LiveChangeRuleConfig,
                         state: StateResource) -> None:
    """Record the new rule (who, why, when) under the state folder."""
    rule = slow_tick.set_live_change_rule(
        state.path(), auto_approve=config.auto_approve, set_by=config.set_by,
        why=config.why, max_rate_change=config.max_rate_change)
    context.log.info(f"live-change rule now {rule}")


@dg.job(name="live_change_rule",
        description="Turn the automatic approval of the slow layer's live changes on or off.")
def live_change_rule_job():
    set_live_change_rule()


class RunDecisionConfig(dg.Config):
    decision_json: str
    """The slow layer's decision for one live run (`trainwise.slow_tick.run_decision`, JSON)."""


@dg.op
def hand_decision_to_run(context: dg.OpExecutionContext, config: RunDecisionConfig,
                       state: StateResource) -> None:
    """Hand the decision to the live run (live-control file, allocation) and record it with
    this Dagster run's id, so the UI shows who changed the running job, what and when."""
    decision = json.loads(config.decision_json)
    record = slow_tick.apply_run_decision(state.path(), decision,
                                          applied_by=f"dagster run {context.run_id}")
    context.log.info(f"applied to run {decision['run_id']}: {record}")


@dg.job(name="apply_run_decision",
        description="Apply the slow layer's decision to a live run (the slow-policy sensor asks "
                    "for it; the run folder's slow_decisions.jsonl names this Dagster run).")
def run_decision_job():
    hand_decision_to_run()


class OrphanNodesConfig(dg.Config):
    """Which tagged nodes to terminate; each is checked again here, so a run that came back to
    life since the sensor looked keeps its nodes."""

    instance_ids: list[str] = []
    """Only these (the sensor's list); empty: every orphan found now."""
    terminate_unknown: bool = False
    """Also terminate tagged nodes no run of this deployment names (another deployment's, or
    this one's after its state folder was lost)."""


@dg.op
def terminate_orphans_op(context: dg.OpExecutionContext, config: OrphanNodesConfig,
                         state: StateResource) -> None:
    """Terminate the aws nodes or kubernetes pods no live run of this deployment holds
    (trainwise.orphan_nodes),
    and log each with whose it was and why."""
    wanted = set(config.instance_ids)
    terminated_total = 0
    for region, (provider, orphans) in orphan_nodes.find_orphans_on_provider(
            settings.get("TRAINWISE_PROVIDER"), state.path(),
            settings.get("TRAINWISE_REGION")).items():
        chosen = [o for o in orphans if not wanted or o.instance_id in wanted]
        done, left = orphan_nodes.terminate_orphans(
            provider, chosen, terminate_unknown=config.terminate_unknown)
        for line in orphan_nodes.describe(done):
            context.log.info(f"terminated in {region}: {line}")
        for line in orphan_nodes.describe(left):
            context.log.warning(f"left running in {region} (unknown to this deployment; "
                                f"terminate_unknown: true to terminate): {line}")
        terminated_total += len(done)
    context.log.info(f"{terminated_total} orphan node(s) terminated")


@dg.job(name="terminate_orphan_nodes",
        description="Terminate aws nodes (tag trainwise:node) or kubernetes pods (label "
                    "trainwise/run) that no live run of this "
                    "deployment holds: left by a run that ended or a process that died. The "
                    "orphan_nodes sensor asks for it.")
def orphan_nodes_job():
    terminate_orphans_op()


# ---- schedule changes: propose (the gate blocks until approved), approve (the gate re-runs) ----

schedule_propose_job = dg.define_asset_job(
    "schedule_propose",
    selection=dg.AssetSelection.assets("schedule_change"),
    description="Propose a schedule change (run config: ops.schedule_change.config); its gate "
                "schedule_approved blocks it until an approval of its hash exists.",
)

# The approval and the gate in one run: the check depends on `approvals` (additional_deps), so
# it runs after the approval is recorded and publishes the proposal when it passes.
schedule_approve_job = dg.define_asset_job(
    "schedule_approve",
    selection=dg.AssetSelection.assets("approvals")
    | dg.AssetSelection.checks(dg.AssetCheckKey(dg.AssetKey("schedule_change"),
                                                "schedule_approved")),
    description="Approve the current proposal (run config: ops.approvals.config.approver, "
                "content_hash, comment); the gate then runs and publishes it if it passes.",
)

# ---- cost-aware hyperparameter search (assets/hpo.py); its proposal waits for schedule_approve ----

hpo_job = dg.define_asset_job(
    "hpo_search",
    selection=dg.AssetSelection.assets("hpo_study"),
    description="Search the train job's hyperparameters and schedule knobs with Optuna (trials "
                "are real runs, pruned by ASHA); the chosen schedule becomes a proposal that "
                "schedule_approve gates.",
)
