"""Schedule changes as proposals approved from the UI (`trainwise/approvals.py` holds the rules).

- `schedule_change` writes a proposal (any field of `trainwise.schedule`: both layers'
  policies, the levers, the checkpoint-interval rule, the pruning rate and its bounds, the
  budget; or a rollback to an earlier version) with its content hash, forecast savings
  (Monte Carlo over the traces, current vs proposed) and the eval-loss change seen in recent
  MLflow runs (telemetry when MLflow has none).
- `approvals` records a person's approval (run config: approver, content_hash, comment; the
  time is recorded, and who approved comes from the run's `user` tag when it has one:
  `approvals.approver_identity`) of the proposal with that hash.
- `schedule_approved`, a blocking check of `schedule_change` that runs after `approvals` when
  both are in a run, publishes the proposal only when an approval matches its current hash and
  the thresholds hold. Candidate -> check -> publish, as the curriculum does.
"""


import typing
from typing import Literal

import dagster as dg

from assets import forecast
from assets.resources import MLflowResource, StateResource
from cloud.policy_registry import policy_names
from trainwise import approvals, settings
from trainwise import schedule as schedule_lib
from trainwise.run_request import FastPolicyName

UNCHANGED = "unchanged"
# The registered allocation policies, as a choice the Launchpad checks (not a free string);
# Dagster's config has no optional choice, hence the explicit "unchanged".
PolicyChoice = Literal[(UNCHANGED, *policy_names())]  # type: ignore[valid-type]
FastChoice = Literal[(UNCHANGED, *typing.get_args(FastPolicyName))]  # type: ignore[valid-type]
# Fields of the config that set the schedule field of the same name when given.
_SET_FIELDS = ("pruning_rate", "pruning_rate_min", "pruning_rate_max", "allocation_policy",
               "fast_policy", "fast_levers", "checkpoint_interval_rule", "budget_usd",
               "allocation_rule")


class ScheduleChangeConfig(dg.Config):
    """What to change; unset fields keep the current schedule's value."""

    pruning_rate: float | None = None
    """New share of easy examples pruned, in [0, 1)."""
    allocation_policy: PolicyChoice = UNCHANGED
    """New node allocation policy ("unchanged" keeps the current one)."""
    allocation_rule: str | None = None
    """New allocation rule (free text recorded with the schedule, e.g. 'spot only in us-west-2')."""
    pruning_rate_min: float | None = None
    """Lowest pruning rate the slow layer may steer a live run to."""
    pruning_rate_max: float | None = None
    """Highest pruning rate the slow layer may steer a live run to (< 1)."""
    fast_policy: FastChoice = UNCHANGED
    """New fast policy inside the loop ("unchanged" keeps the current one)."""
    fast_levers: list[str] | None = None
    """Levers of the fast heuristic that may act (batch_scaling, straggler_shares, preemption;
    preemption cannot be left out)."""
    checkpoint_interval_rule: str | None = None
    """Rule of the checkpoint-interval chooser (trainwise, fixed, or one registered)."""
    budget_usd: float | None = None
    """Most a run may spend, USD (the forecast's blocking check)."""
    rollback_to: str = ""
    """Roll back instead of changing: "previous" or a schedule version that was in force (the
    other fields must then stay unset)."""
    reason: str = ""
    """Why (recorded)."""
    requested_by: str = "ui"
    """Who proposes (recorded)."""


class ApprovalConfig(dg.Config):
    """A person's approval of the schedule_change proposal with this content hash."""

    approver: str = ""
    """Your name (recorded). When the run carries a `user` tag (Dagster+, or the authenticating
    proxy deployment) that is who approves, and a different name here is refused."""
    content_hash: str
    """The `hash` shown on the latest schedule_change materialization."""
    comment: str = ""
    """Why you approve (recorded)."""


def _evidence(mlflow: MLflowResource, state: StateResource, from_rate: float, to_rate: float
              ) -> tuple[float | None, dict]:
    runs, note = approvals.mlflow_runs(mlflow.uri(), mlflow.experiment)
    change, detail = approvals.eval_loss_change(runs, from_rate, to_rate)
    source = "mlflow"
    if change is None:  # MLflow has nothing at both rates: the run folders' telemetry may
        tele_runs, tele_note = approvals.telemetry_runs(state.path())
        change, detail = approvals.eval_loss_change(tele_runs, from_rate, to_rate)
        note, source = f"{note}; {tele_note}", "telemetry"
    return change, {"source": source, "runs": note, "detail": detail}


@dg.asset(group_name="governance", kinds={"json"})
def schedule_change(context: dg.AssetExecutionContext, config: ScheduleChangeConfig,
                    state: StateResource, mlflow: MLflowResource) -> dg.MaterializeResult:
    """A proposed schedule change with its content hash, forecast savings and eval-loss change;
    it goes live only when `schedule_approved` passes."""
    folder = state.path(*approvals.FOLDER)
    current = approvals.current_schedule(folder)
    given = {f: getattr(config, f) for f in _SET_FIELDS
             if getattr(config, f) not in (None, UNCHANGED)}
    rollback_of = ""
    try:
        if config.rollback_to:
            if given:
                raise approvals.ApprovalError(
                    f"a rollback sets no field, but {sorted(given)} are set; propose the "
                    "rollback alone, then change from there")
            target = approvals.rollback_target(folder, config.rollback_to)
            to, rollback_of = dict(target["schedule"]), target["version"]
        else:
            to = schedule_lib.validate({**current, **given})
    except (approvals.ApprovalError, schedule_lib.ScheduleError) as error:
        raise dg.Failure(description=f"{error} (ops.schedule_change.config)") from error
    if to == current:
        raise dg.Failure(f"the proposal changes nothing (current schedule {current}); set a "
                         f"field ({', '.join(_SET_FIELDS)}) or rollback_to in the run config")
    savings, forecast_rows = forecast.schedule_savings(current, to, state)
    change, evidence = _evidence(mlflow, state, current["pruning_rate"], to["pruning_rate"])
    evidence["forecast"] = forecast_rows
    proposal = approvals.propose(folder, to, forecast_savings_usd=savings,
                                 eval_loss_change=change, evidence=evidence,
                                 reason=config.reason, requested_by=config.requested_by,
                                 rollback_of=rollback_of)
    context.log.info(f"proposal {proposal['hash']}: approve it by materializing approvals with "
                     f"content_hash {proposal['hash']}")
    return dg.MaterializeResult(
        metadata={
            "hash": proposal["hash"],
            "kind": f"rollback to {rollback_of}" if rollback_of else "change",
            "version_now": schedule_lib.version_of(current),
            "version_proposed": schedule_lib.version_of(to),
            "from": dg.MetadataValue.json(current),
            "to": dg.MetadataValue.json(to),
            "forecast_savings_usd": proposal["forecast_savings_usd"],
            "eval_loss_change": ("unknown" if proposal["eval_loss_change"] is None
                                 else proposal["eval_loss_change"]),
            "evidence": dg.MetadataValue.json(evidence),
            "how_to_approve": dg.MetadataValue.md(
                "Materialize `approvals` (job `schedule_approve`) with run config:\n\n"
                "```yaml\nops:\n  approvals:\n    config:\n      approver: <your name>\n"
                f"      content_hash: {proposal['hash']}\n      comment: <why>\n```"),
        },
        tags={"trainwise/schedule_hash": proposal["hash"]})


# Named `approvals` in Dagster; the Python name keeps clear of the trainwise.approvals module.
# No dep on schedule_change: its blocking check depends on approvals (it must run after the
# approval in one run), and a blocking check comes before its asset's downstream: a cycle.
@dg.asset(name="approvals", group_name="governance", kinds={"json"})
def approvals_asset(context: dg.AssetExecutionContext, config: ApprovalConfig,
                    state: StateResource) -> dg.MaterializeResult:
    """A person's approval of the current proposal's content hash (refused for any other)."""
    try:
        record = approvals.record_approval(state.path(*approvals.FOLDER), config.approver,
                                           config.content_hash, config.comment,
                                           run_tags=dict(context.run.tags))
    except approvals.ApprovalError as error:
        raise dg.Failure(description=str(error)) from error
    context.log.info(f"{record['approver']} approved {record['hash']}")
    return dg.MaterializeResult(metadata={
        "approver": record["approver"], "identity_source": record["identity_source"],
        "hash": record["hash"], "comment": record["comment"],
        "approved_at": dg.MetadataValue.timestamp(record["time"])})


@dg.asset_check(asset=schedule_change, name="schedule_approved", blocking=True,
                additional_deps=[dg.AssetKey("approvals")])
def schedule_approved(context: dg.AssetCheckExecutionContext,
                      state: StateResource) -> dg.AssetCheckResult:
    """Gate: an approval of the proposal's current hash, savings >= the minimum and eval-loss
    change <= the maximum; passing publishes the proposal as the current schedule."""
    report = approvals.audit_and_publish(
        state.path(*approvals.FOLDER), settings.min_forecast_savings_usd(),
        settings.max_eval_loss_regression(),
        checked_by=f"schedule_approved (dagster run {context.run.run_id[:8]})")
    metadata = {k: (dg.MetadataValue.json(v) if isinstance(v, (dict, list)) else v)
                for k, v in report.items() if v is not None}
    return dg.AssetCheckResult(passed=report["passed"], severity=dg.AssetCheckSeverity.ERROR,
                               metadata=metadata, description=report["status"])
