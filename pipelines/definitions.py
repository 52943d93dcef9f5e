"""The one Definitions object of the trainwise code location."""

import dagster as dg

from assets import (
    analytics,
    data,
    forecast,
    governance,
    hpo,
    partitions,
    policies,
    training,
    user_jobs,
)
from assets.resources import launchpad_resources
from pipelines.jobs import (
    curriculum_job,
    demo_job,
    forecast_job,
    hpo_job,
    live_change_rule_job,
    orphan_nodes_job,
    policy_rollback_job,
    rollback_job,
    run_decision_job,
    schedule_approve_job,
    schedule_propose_job,
    train_job,
)
from sensors.orphan_nodes import orphan_nodes_sensor
from sensors.slow_policy import slow_policy_sensor

# The team's registered jobs (TRAINWISE_PROJECT_FILE): none, no asset and no job.
USER_JOBS = user_jobs.user_job_defs(partitions.PROJECT, data.data_shards)

defs = dg.Definitions(
    assets=[data.data_shards, data.difficulty_scores, data.curriculum, training.checkpoint,
            governance.schedule_change, governance.approvals_asset, forecast.cost_forecast,
            analytics.telemetry, analytics.dbt_models, hpo.hpo_study,
            *policies.POLICY_DEFS["assets"], *USER_JOBS["assets"]],
    asset_checks=[data.curriculum_coverage, governance.schedule_approved,
                  forecast.p90_within_budget, *policies.POLICY_DEFS["asset_checks"]],
    jobs=[demo_job, train_job, forecast_job, curriculum_job, rollback_job, policy_rollback_job,
          live_change_rule_job, run_decision_job, schedule_propose_job, schedule_approve_job,
          hpo_job, orphan_nodes_job, *policies.POLICY_DEFS["jobs"], *USER_JOBS["jobs"]],
    schedules=policies.POLICY_DEFS["schedules"],
    sensors=[slow_policy_sensor, orphan_nodes_sensor],
    resources=launchpad_resources(),
    # Every job here is a chain (shards -> scores -> curriculum -> training) or one asset, so
    # a process per step buys no parallelism; it cost each launched run one import of this code
    # location per step (5-7 s each on 2 cores): a 12-step demo launched through the daemon took
    # 52.6 s with a process per step and 20.4 s in one (tests/test_integration_dagster_ui.py,
    # idle 2-core machine). Runs still get a process each (the daemon's run launcher); the steps
    # of one run share it, as they do in execute_in_process.
    executor=dg.in_process_executor,
)
