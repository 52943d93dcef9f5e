"""`hpo_study`: a cost-aware hyperparameter search of the train job, as a Dagster asset.

Optuna searches the train job's config (its launchpad fields under `train`) and the published
schedule's knobs; every trial rung is a real run through the provider (`trainwise/hpo.py` holds
the rules: rungs, ASHA/Hyperband pruning, spot where the schedule allows, the cost constraint).
The result: the trials, their bills and eval losses (also in MLflow, experiment
`<experiment>-hpo`, tagged `trainwise/hpo_study`), the Pareto front of cost against eval loss
(a plot), and the chosen configuration's schedule knobs as a schedule proposal, audited by the
same gate as `schedule_change`: approve its hash with the `schedule_approve` job.
"""

import json
from typing import Literal

import dagster as dg

from assets import forecast
from assets.data import curriculum
from assets.partitions import data_partitions, require_builtin
from assets.resources import (
    MLflowResource,
    ObjectStoreResource,
    StateResource,
    TelemetryStoreResource,
)
from assets.training import TrainRunConfig
from trainwise import approvals, hpo, hpo_report, settings


class HpoSearchConfig(dg.Config):
    """What to search, how long, and what the search may spend."""

    n_trials: int = 8
    """Trials (configurations) to try; >= 1."""
    min_steps: int = 10
    """Steps of the first rung (every trial's first run)."""
    reduction_factor: int = 3
    """Rung k trains min_steps * reduction_factor**k steps; ASHA keeps the best 1/factor."""
    rungs: int = 3
    """Rungs; the last one is the full budget the objective is measured at."""
    pruner: Literal["asha", "hyperband", "none"] = "asha"
    """Optuna pruner: asha (SuccessiveHalvingPruner), hyperband, or none."""
    seed: int = 0
    """Seed of the TPE sampler (same seed, same proposals)."""
    learning_rate_min: float = 3e-4
    """Lowest learning rate (log-uniform search; equal to the max: fixed). Replaces
    train.learning_rate."""
    learning_rate_max: float = 3e-3
    """Highest learning rate."""
    micro_batch_sizes: list[int] = []
    """Micro-batch sizes to choose from; empty: train.micro_batch_size."""
    pruning_rates: list[float] = [0.0, 0.15, 0.3, 0.45]
    """Schedule knob: pruning rates to choose from (within the schedule's bounds; needs the
    partition's difficulty scores); empty: the current curriculum."""
    fast_policies: list[str] = ["heuristic", "noop"]
    """Schedule knob: fast policies to choose from (heuristic, noop, goodput); empty: the
    schedule's."""
    checkpoint_interval_rules: list[str] = ["trainwise", "fixed"]
    """Schedule knob: checkpoint-interval rules to choose from; empty: the schedule's."""
    spot: bool = True
    """Run the trials on spot when the published schedule allows it (its allocation policy is
    not on_demand)."""
    max_run_cost_usd: float | None = None
    """Constraint: a configuration whose run bill exceeds this is infeasible (and stopped at the
    rung that exceeds it); unset: the published schedule's budget_usd."""
    max_study_cost_usd: float | None = None
    """Stop the search after the trial that brings its bill to this; unset: no limit."""
    loss_tolerance: float = 0.01
    """The choice: the cheapest front configuration within this of the best eval loss."""
    study_name: str = ""
    """Names the study (its folder, run ids, MLflow tag); empty: <partition>-<dagster run>. A
    name used before continues that study."""
    reference_run: bool = True
    """Train the chosen hyperparameters on the schedule in force too: the proposal's eval-loss
    evidence (without it the gate refuses a change of the pruning rate or policy)."""
    first_trials: str = ""
    """Configurations to try first, as JSON: a list of objects of searched knobs, e.g.
    [{"learning_rate": 0.001, "fast_policy": "noop"}] (your current best, to start from)."""
    propose: bool = True
    """Write the chosen schedule knobs as a schedule proposal for the gate."""
    reason: str = ""
    """Why (recorded with the proposal)."""
    requested_by: str = "ui"
    """Who proposes (recorded)."""
    train: TrainRunConfig = TrainRunConfig()
    """The train job's config every trial starts from (max_steps is set by the rungs)."""


def _first_trials(text: str) -> tuple[dict, ...]:
    if not text.strip():
        return ()
    try:
        points = json.loads(text)
    except ValueError as error:
        raise hpo.HpoError(f"first_trials is not JSON ({error}); give a list of objects, e.g. "
                           '[{"learning_rate": 0.001}]') from error
    if not isinstance(points, list):
        raise hpo.HpoError(f"first_trials must be a JSON list of objects, not {points!r}")
    return tuple(points)


def spec_of(config: HpoSearchConfig, partition: str, dagster_run_id: str) -> hpo.StudySpec:
    space = hpo.SearchSpace(
        learning_rate_min=config.learning_rate_min, learning_rate_max=config.learning_rate_max,
        micro_batch_sizes=tuple(config.micro_batch_sizes),
        pruning_rates=tuple(config.pruning_rates), fast_policies=tuple(config.fast_policies),
        checkpoint_interval_rules=tuple(config.checkpoint_interval_rules))
    launchpad = config.train.model_dump()
    return hpo.StudySpec(
        name=config.study_name or f"{partition}-{dagster_run_id[:8]}", partition=partition,
        space=space, launchpad=launchpad,
        instance_type=launchpad.get("instance_type") or settings.get("TRAINWISE_INSTANCE_TYPE"),
        region=settings.get("TRAINWISE_REGION"), n_trials=config.n_trials,
        min_steps=config.min_steps, reduction_factor=config.reduction_factor, rungs=config.rungs,
        pruner=config.pruner, seed=config.seed, spot=config.spot,
        max_run_cost_usd=config.max_run_cost_usd, max_study_cost_usd=config.max_study_cost_usd,
        loss_tolerance=config.loss_tolerance, reference_run=config.reference_run,
        first_trials=_first_trials(config.first_trials))


def _proposal(context: dg.AssetExecutionContext, config: HpoSearchConfig, state: StateResource,
              result: dict) -> dict:
    """The chosen schedule knobs through approvals.propose, with the forecast savings computed
    as schedule_change computes them; metadata saying what was (or was not) proposed."""
    folder = state.path(*approvals.FOLDER)
    to, why_not = hpo_report.proposed_schedule(folder, result)
    if to is None or not config.propose:
        why_not = why_not or "propose is off"
        context.log.info(f"no schedule proposal: {why_not}")
        return {"proposal": why_not}
    current = approvals.current_schedule(folder)
    savings_usd, forecast_rows = forecast.schedule_savings(current, to, state)
    earlier = approvals.read_candidate(folder)
    if earlier is not None:
        context.log.warning(f"replacing the pending proposal {earlier['hash']}")
    proposal = hpo_report.propose(
        folder, result, to,
        forecast_savings_usd=savings_usd, forecast_rows=forecast_rows, reason=config.reason,
        requested_by=config.requested_by)
    context.log.info(f"proposal {proposal['hash']}: approve it by materializing approvals with "
                     f"content_hash {proposal['hash']}")
    return {
        "hash": proposal["hash"], "to": dg.MetadataValue.json(proposal["to"]),
        "forecast_savings_usd": proposal["forecast_savings_usd"],
        "eval_loss_change": ("unknown" if proposal["eval_loss_change"] is None
                             else proposal["eval_loss_change"]),
        "how_to_approve": dg.MetadataValue.md(
            "Materialize `approvals` (job `schedule_approve`) with run config:\n\n"
            "```yaml\nops:\n  approvals:\n    config:\n      approver: <your name>\n"
            f"      content_hash: {proposal['hash']}\n      comment: <why>\n```"),
    }


@dg.asset(partitions_def=data_partitions, group_name="tuning", deps=[curriculum],
          kinds={"optuna", "mlflow"})
def hpo_study(context: dg.AssetExecutionContext, config: HpoSearchConfig, state: StateResource,
              mlflow: MLflowResource, object_store: ObjectStoreResource,
              telemetry_store: TelemetryStoreResource) -> dg.MaterializeResult:
    """A cost-aware search of the train job: trials as real runs, the cost/eval-loss front,
    and the chosen schedule knobs as a proposal for the schedule_approved gate."""
    require_builtin(context.partition_key, "hpo_study")
    try:
        spec = spec_of(config, context.partition_key, context.run.run_id)
    except hpo.HpoError as error:
        raise dg.Failure(description=f"{error} (ops.hpo_study.config)") from error
    services = hpo.Services(state_dir=state.path(), tracking_uri=mlflow.uri(),
                            experiment=mlflow.experiment, store=object_store.store(),
                            duckdb_path=telemetry_store.db_path())
    try:
        result = hpo.run_study(spec, services, log=context.log.info)
    except hpo.HpoError as error:
        raise dg.Failure(description=f"{error} (ops.hpo_study.config)") from error
    metadata = {
        "study": result["study"], "trials": len(result["trials"]),
        "pruned": sum(r["pruned"] for r in result["trials"]),
        "runs_trained": result["runs_trained"], "study_bill_usd": result["study_bill_usd"],
        "front": dg.MetadataValue.json(result["front"]),
        "trials_table": dg.MetadataValue.md(hpo_report.markdown(result)),
        "plot": dg.MetadataValue.path(result["plot"]),
        "result": dg.MetadataValue.path(result["result_path"]),
        "mlflow_experiment": result["experiment"],
        "notes": dg.MetadataValue.json(result["notes"]),
    }
    chosen = result["chosen"]
    if chosen is not None:
        metadata.update({"chosen_trial": chosen["number"],
                         "chosen_schedule": dg.MetadataValue.json(chosen["schedule"]),
                         "chosen_training": dg.MetadataValue.json(chosen["training"]),
                         "chosen_eval_loss": chosen["eval_loss"],
                         "chosen_run_bill_usd": chosen["run_bill_usd"]})
    metadata.update(_proposal(context, config, state, result))
    tags = {"trainwise/hpo_study": result["study"]}
    if "hash" in metadata:
        tags["trainwise/schedule_hash"] = metadata["hash"]
    return dg.MaterializeResult(metadata=metadata, tags=tags)
