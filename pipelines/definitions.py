"""The one Definitions object of the trainwise code location."""

import dagster as dg

from assets import data, training
from assets.resources import (
    MLflowResource,
    ObjectStoreResource,
    StateResource,
    TelemetryStoreResource,
)
from pipelines.jobs import curriculum_job, demo_job, train_job
from sensors.slow_policy import slow_policy_sensor

defs = dg.Definitions(
    assets=[data.data_shards, data.difficulty_scores, data.curriculum, training.checkpoint],
    asset_checks=[data.curriculum_coverage],
    jobs=[demo_job, train_job, curriculum_job],
    sensors=[slow_policy_sensor],
    resources={
        "state": StateResource(),
        "mlflow": MLflowResource(),
        "object_store": ObjectStoreResource(),
        "telemetry_store": TelemetryStoreResource(),
    },
)
