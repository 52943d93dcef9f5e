"""Schedule changes as proposals approved from the UI (`trainwise/approvals.py` holds the rules).

- `schedule_change` writes a proposal (new pruning rate / allocation policy / allocation rule)
  with its content hash, forecast savings (Monte Carlo over the traces, current vs proposed)
  and the eval-loss change seen in recent MLflow runs (telemetry when MLflow has none).
- `approvals` records a person's approval (run config: approver, content_hash, comment; the
  time is recorded) of the proposal with that hash.
- `schedule_approved`, a blocking check of `schedule_change` that runs after `approvals` when
  both are in a run, publishes the proposal only when an approval matches its current hash and
  the thresholds hold. Candidate -> check -> publish, as the curriculum does.
"""


from typing import Literal

import dagster as dg

from assets import forecast
from assets.resources import MLflowResource, StateResource
from cloud import forecast as forecast_lib
from cloud.policy_registry import policy_names
from trainwise import approvals, settings

UNCHANGED = "unchanged"
# The registered allocation policies, as a choice the Launchpad checks (not a free string);
# Dagster's config has no optional choice, hence the explicit "unchanged".
PolicyChoice = Literal[(UNCHANGED, *policy_names())]  # type: ignore[valid-type]


class ScheduleChangeConfig(dg.Config):
    """What to change; unset fields keep the current schedule's value."""

    pruning_rate: float | None = None
    """New share of easy examples pruned, in [0, 1)."""
    allocation_policy: PolicyChoice = UNCHANGED
    """New node allocation policy ("unchanged" keeps the current one)."""
    allocation_rule: str | None = None
    """New allocation rule (free text recorded with the schedule, e.g. 'spot only in us-west-2')."""
    reason: str = ""
    """Why (recorded)."""
    requested_by: str = "ui"
    """Who proposes (recorded)."""


class ApprovalConfig(dg.Config):
    """A person's approval of the schedule_change proposal with this content hash."""

    approver: str
    """Your name (recorded)."""
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
    to = dict(current)
    for field in ("pruning_rate", "allocation_policy", "allocation_rule"):
        if getattr(config, field) not in (None, UNCHANGED):
            to[field] = getattr(config, field)
    if not 0.0 <= to["pruning_rate"] < 1.0:
        raise dg.Failure(f"pruning_rate={to['pruning_rate']} is not in [0, 1); set "
                         "ops.schedule_change.config.pruning_rate to a share in [0, 1)")
    if to == current:
        raise dg.Failure(f"the proposal changes nothing (current schedule {current}); set "
                         "pruning_rate, allocation_policy or allocation_rule in the run config")
    work, deadline_s, samples = forecast.next_run()
    results = forecast_lib.forecast(
        {"current": forecast.scenario(current, work), "proposed": forecast.scenario(to, work)},
        deadline_s, forecast.market(state), samples=samples)
    savings = results["current"].p50_usd - results["proposed"].p50_usd
    change, evidence = _evidence(mlflow, state, current["pruning_rate"], to["pruning_rate"])
    evidence["forecast"] = {k: v.row() for k, v in results.items()}
    proposal = approvals.propose(folder, to, forecast_savings_usd=savings,
                                 eval_loss_change=change, evidence=evidence,
                                 reason=config.reason, requested_by=config.requested_by)
    context.log.info(f"proposal {proposal['hash']}: approve it by materializing approvals with "
                     f"content_hash {proposal['hash']}")
    return dg.MaterializeResult(
        metadata={
            "hash": proposal["hash"],
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
                                           config.content_hash, config.comment)
    except approvals.ApprovalError as error:
        raise dg.Failure(description=str(error)) from error
    context.log.info(f"{record['approver']} approved {record['hash']}")
    return dg.MaterializeResult(metadata={
        "approver": record["approver"], "hash": record["hash"], "comment": record["comment"],
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
