"""The training run as an asset: a checkpoint, with its cost and eval loss in MLflow."""

from pathlib import Path

import dagster as dg
import pydantic

from assets.data import curriculum
from assets.partitions import data_partitions, require_builtin
from assets.resources import (
    MLflowResource,
    ObjectStoreResource,
    StateResource,
    TelemetryStoreResource,
)
from trainwise import job_forecast, run_request, runs, settings
from trainwise import schedule as schedule_lib

# The launchpad's config is the run schema itself (`trainwise.run_request.TrainRequest`), every
# field but those the job fills in: one schema from the launchpad to the trainer, never copied.
TrainRunConfig = pydantic.create_model(
    "TrainRunConfig", __base__=dg.Config, __module__=__name__,
    __doc__="One training run; defaults size the demo for a 2-core machine.",
    **run_request.config_fields())


def mlflow_link(tracking_uri: str, where: str) -> dg.MetadataValue:
    """A clickable link for an http tracking server; else a text note on how to browse the run
    (a sqlite store has no web address until someone starts `mlflow ui`)."""
    if where.startswith(("http://", "https://")) and tracking_uri.startswith(("http://",
                                                                              "https://")):
        return dg.MetadataValue.url(where)
    return dg.MetadataValue.text(f"no MLflow server (set TRAINWISE_MLFLOW_URI to one for a link);"
                                 f" to browse this run: {where}" if where else
                                 "not recorded in MLflow")


# Run tag recording which training run (run folder, telemetry, checkpoints) a Dagster run drove;
# a re-execution reads its parent's to resume the same training.
TRAINING_RUN_TAG = "trainwise/training_run_id"


def training_run_id(context: dg.AssetExecutionContext, state_dir: Path,
                    store: object | None = None) -> str:
    """The training run this Dagster run drives: the one of its lineage (parent, grandparent,
    ..., root) that is unfinished and has checkpoints (in its local run folder, or committed in
    the object store `store` when this node's state folder is new), so a re-execution of a
    preempted or failed run resumes it; else a new one named after this Dagster run."""
    candidates: list[str] = []
    parent_id = context.run.parent_run_id
    while parent_id:
        parent = context.instance.get_run_by_id(parent_id)
        if parent is None:
            break
        candidates.append(parent.tags.get(TRAINING_RUN_TAG, parent.run_id))
        parent_id = parent.parent_run_id
    if context.run.root_run_id and context.run.root_run_id not in candidates:
        candidates.append(context.run.root_run_id)
    return runs.resumable_run_id(state_dir, candidates, store=store,
                                 partition=context.partition_key) or context.run.run_id


@dg.asset(partitions_def=data_partitions, group_name="training", deps=[curriculum],
          kinds={"pytorch", "mlflow"})
def checkpoint(
    context: dg.AssetExecutionContext,
    config: TrainRunConfig,
    state: StateResource,
    mlflow: MLflowResource,
    object_store: ObjectStoreResource,
    telemetry_store: TelemetryStoreResource,
) -> dg.MaterializeResult:
    """A trained model checkpoint (resumable, checksummed) from the current curriculum.

    A run that does not complete (spot preemption) fails with its checkpoint kept; re-executing
    it resumes from the last good checkpoint under the same training run id."""
    require_builtin(context.partition_key, "checkpoint (the train job)")
    state_dir = state.path()
    store = object_store.store()
    run_id = training_run_id(context, state_dir, store)
    context.instance.add_run_tags(context.run.run_id, {TRAINING_RUN_TAG: run_id})
    if run_id != context.run.run_id:
        context.log.info(f"resuming training run {run_id} from its last good checkpoint")
    # The run config's fields are the request's (a test keeps the two in step); the fields the
    # published schedule sets come from it (trainwise.schedule), a departure only with a reason.
    published = schedule_lib.published(state_dir)
    try:
        request = schedule_lib.request_from_launchpad(
            config.model_dump(), published,
            instance_type=config.instance_type or settings.get("TRAINWISE_INSTANCE_TYPE"),
            partition=context.partition_key, run_id=run_id,
            region=settings.get("TRAINWISE_REGION"))
    except schedule_lib.ScheduleError as error:
        raise dg.Failure(description=str(error)) from error
    context.log.info(f"on the published schedule {published.label()}: fast policy "
                     f"{request.fast_policy}, levers {', '.join(request.fast_levers)}, interval "
                     f"rule {request.checkpoint_interval_rule}")
    context.instance.add_run_tags(context.run.run_id,
                                  {"trainwise/schedule_version": request.schedule_version})
    # -- The budget (issue 28 item 4): a launch whose forecast P90 exceeds the published
    # schedule's budget_usd is refused unless it gives schedule_override_reason (recorded).
    try:
        launch = job_forecast.launch_gate(request, published, state_dir)
    except job_forecast.BudgetExceededError as refused:
        raise dg.Failure(description=str(refused), metadata={
            **{k: v for k, v in refused.record.items() if k != "forecast"},
            "forecast": dg.MetadataValue.json(refused.record["forecast"])}) from refused
    context.log.info(launch.get("summary") or launch.get("skipped", ""))
    if launch.get("override_reason"):
        context.instance.add_run_tags(context.run.run_id, {
            "trainwise/budget_override": launch["override_reason"][:250]})
    # -- end of the budget gate.
    try:
        summary = runs.run_training(
            request,
            state_dir=state_dir,
            tracking_uri=mlflow.uri(),
            experiment=mlflow.experiment,
            store=store,
            duckdb_path=telemetry_store.db_path(),
            progress=True,
        )
    except runs.RunInterruptedError as stopped:
        # Not a success: the partial model is no materialization. Everything needed to resume
        # is in the metadata; allow_retries lets a run-retry policy resume it automatically.
        raise dg.Failure(
            description=str(stopped),
            metadata={**stopped.summary.metadata(), "resume": stopped.resume_hint},
            allow_retries=True,
        ) from stopped
    if summary.pending:
        context.log.warning(f"training completed, but: {summary.pending}")
    context.log.info(summary.one_line())
    metadata = summary.metadata()
    metadata["mlflow_where"] = mlflow_link(mlflow.uri(), summary.mlflow_where)
    metadata["saving"] = summary.saving_line()
    # Where every dollar went (trainwise explain RUN --summary), as the UI's metadata.
    table = state_dir / "runs" / run_id / runs.COST_SUMMARY_NAME
    if table.is_file():
        metadata["where_the_money_went"] = dg.MetadataValue.md(table.read_text("utf-8"))
    return dg.MaterializeResult(metadata=metadata)
