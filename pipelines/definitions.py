"""The one Definitions object of the trainwise code location."""

import dagster as dg

from assets import data, training
from assets.resources import launchpad_resources
from pipelines.jobs import (
    curriculum_job,
    demo_job,
    live_change_rule_job,
    rollback_job,
    train_job,
)
from sensors.slow_policy import slow_policy_sensor

defs = dg.Definitions(
    assets=[data.data_shards, data.difficulty_scores, data.curriculum, training.checkpoint],
    asset_checks=[data.curriculum_coverage],
    jobs=[demo_job, train_job, curriculum_job, rollback_job, live_change_rule_job],
    sensors=[slow_policy_sensor],
    resources=launchpad_resources(),
)
