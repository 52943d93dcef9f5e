"""`make demo`: the demo job run in-process against the project's Dagster instance.

The run lands in the same instance the UI reads (DAGSTER_HOME under the state folder), so after
the demo a user finds it in `make ui` too.
"""

from __future__ import annotations

import logging
import os
import time

import dagster as dg

from pipelines.definitions import defs
from trainwise import settings
from trainwise.runs import RunSummary


def default_partition() -> str:
    chosen = settings.get("TRAINWISE_DEMO_PARTITION")
    if chosen:
        return chosen
    corpus = settings.data_dir() / "corpora" / "tinyshakespeare.txt"
    return "tinyshakespeare" if corpus.exists() else "pystdlib"


def run_demo(partition: str = "", max_steps: int = 300) -> str:
    partition = partition or default_partition()
    # The summary says where MLflow is; its table-creation notices are noise here.
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    started = time.monotonic()
    instance = dg.DagsterInstance.get()
    result = defs.resolve_job_def("demo").execute_in_process(
        partition_key=partition,
        instance=instance,
        run_config={
            "ops": {"checkpoint": {"config": {"max_steps": max_steps}}},
            "loggers": {"console": {"config": {"log_level": "WARNING"}}},
        },
    )
    materializations = result.asset_materializations_for_node("checkpoint")
    if not result.success or not materializations:
        raise RuntimeError(f"demo run {result.run_id} failed: see `make ui` for its logs")
    summary = RunSummary.from_metadata(materializations[-1].metadata)
    return summary.report(wall_s=time.monotonic() - started, dagster_run_id=result.run_id)
