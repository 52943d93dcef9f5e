"""The training run as an asset: a checkpoint, with its cost and eval loss in MLflow."""


import dagster as dg

from assets.data import curriculum
from assets.partitions import data_partitions
from assets.resources import (
    MLflowResource,
    ObjectStoreResource,
    StateResource,
    TelemetryStoreResource,
)
from trainwise import runs, settings


class TrainRunConfig(dg.Config):
    """One training run; defaults size the demo for a 2-core machine."""

    max_steps: int = 300
    """Optimizer steps."""
    micro_batch_size: int = 32
    """Examples per micro-batch at start (the fast policy may change it)."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step at start."""
    learning_rate: float = 1e-3
    """Peak learning rate (warm-up then cosine decay)."""
    eval_every_steps: int = 50
    """Steps between evaluations on the held-out split."""
    seed: int = 0
    """Seed of model init, sampler and RNG streams."""
    instance_type: str = ""
    """Instance type the emulated node stands for; empty = TRAINWISE_INSTANCE_TYPE."""
    fast_policy: str = "heuristic"
    """Fast policy run inside the loop (noop | heuristic)."""
    fast_every_steps: int = 10
    """Steps between fast-policy decisions."""
    data_selection: str = "static"
    """static (the curriculum as built) | dynamic (InfoBatch per epoch, rate steered live by the
    slow-policy sensor through the run's control file)."""


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
    """A trained model checkpoint (resumable, checksummed) from the current curriculum."""
    # The run config's fields are the request's (a test keeps the two in step).
    request = runs.TrainRequest(**{
        **config.model_dump(),
        "instance_type": config.instance_type or settings.get("TRAINWISE_INSTANCE_TYPE"),
        "partition": context.partition_key,
        "run_id": context.run.run_id,
        "region": settings.get("TRAINWISE_REGION"),
    })
    summary = runs.run_training(
        request,
        state_dir=state.path(),
        tracking_uri=mlflow.uri(),
        experiment=mlflow.experiment,
        store=object_store.store(),
        duckdb_path=telemetry_store.db_path(),
        progress=True,
    )
    context.log.info(summary.one_line())
    return dg.MaterializeResult(metadata=summary.metadata())
