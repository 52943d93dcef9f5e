"""`make demo`: the demo job run in-process against the project's Dagster instance.

The run lands in the same instance the UI reads (DAGSTER_HOME under the state folder), so after
the demo a user finds it in `make ui` too.
"""

from __future__ import annotations

import logging
import os
import time

import dagster as dg

from assets.resources import (
    MLflowResource,
    ObjectStoreResource,
    StateResource,
    TelemetryStoreResource,
)
from pipelines.definitions import defs
from trainwise import preflight, settings
from trainwise.runs import RunFailedError, RunSummary


def default_partition() -> str:
    # Through the setting's own reader, which refuses a path-like name (`../x`, "mnist\n")
    # with a message naming the variable, before it names a folder.
    chosen = settings.demo_partition()
    if chosen:
        return chosen
    corpus = settings.data_dir() / "corpora" / "tinyshakespeare.txt"
    return "tinyshakespeare" if corpus.exists() else "pystdlib"


def check_before_demo() -> None:
    """Paths and services the demo's training needs, checked before the data build (about
    35 s) rather than after it; raises preflight.PreflightError naming each setting."""
    preflight.check_services(
        state_dir=StateResource().path(),
        duckdb_path=TelemetryStoreResource().db_path(),
        tracking_uri=MLflowResource().uri(),
        store=ObjectStoreResource().store(),
    )


def _failure_messages(result: dg.ExecuteInProcessResult) -> str:
    """Each failed step's own error (Dagster wraps the user's exception; its cause is the text
    a person needs)."""
    lines = []
    for event in result.get_step_failure_events():
        error = event.step_failure_data.error
        while error is not None and error.cause is not None and \
                "Error occurred while executing" in error.message:
            error = error.cause
        if error is not None:
            lines.append(f"{event.step_key}: {error.message.strip()}")
    return "\n".join(lines)


# Trainer steps per replayed trace tick (trainwise/replay_pace.py): the replay's speed is set
# from the loop's own wall time per step, so the demo window's reclaim (tick 52) meets the run
# near its middle on any machine, as the demo is meant to show, and the bill per step is about
# the same everywhere. At a fixed 0.5 s per tick a machine twice as fast as the 2-core one the
# demo was set on would finish 600 steps before the reclaim.
DEMO_STEPS_PER_TICK = 6.0


def run_demo(partition: str = "", max_steps: int = 600) -> str:
    partition = partition or default_partition()
    check_before_demo()
    # The summary says where MLflow is; its table-creation notices are noise here.
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    started = time.monotonic()
    instance = dg.DagsterInstance.get()
    result = defs.resolve_job_def("demo").execute_in_process(
        partition_key=partition,
        instance=instance,
        run_config={
            "ops": {"checkpoint": {"config": {"max_steps": max_steps, "market": "spot",
                                                 "replay_steps_per_tick": DEMO_STEPS_PER_TICK}}},
            "loggers": {"console": {"config": {"log_level": "WARNING"}}},
        },
        raise_on_error=False,
    )
    materializations = result.asset_materializations_for_node("checkpoint")
    if not result.success or not materializations:
        raise RunFailedError(
            f"demo run {result.run_id} did not complete (logs: `make ui`, then Runs):\n"
            f"{_failure_messages(result) or 'no step reported an error'}")
    summary = RunSummary.from_metadata(materializations[-1].metadata)
    return summary.report(wall_s=time.monotonic() - started, dagster_run_id=result.run_id)


def run_hpo_search(partition: str, study_config: dict, *, ephemeral: bool = True) -> dict:
    """The `hpo_search` job in-process for `partition` (what `benchmarks.hpo` measures: the
    product's own job, not a copy of it); returns the `hpo_study` materialization's metadata as
    plain values. Raises when the run fails."""
    instance = dg.DagsterInstance.ephemeral() if ephemeral else dg.DagsterInstance.get()
    result = defs.resolve_job_def("hpo_search").execute_in_process(
        partition_key=partition, instance=instance, raise_on_error=True,
        run_config={"ops": {"hpo_study": {"config": study_config}}})
    [materialization] = result.asset_materializations_for_node("hpo_study")
    return {key: getattr(value, "value", value) for key, value in materialization.metadata.items()}
