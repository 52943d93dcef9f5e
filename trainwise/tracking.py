"""MLflow: one run per training run, with cost against eval loss.

mlflow is imported lazily (about 1.2 s) so the CLI and the trainer's hot path never pay for it.
Parameters pass through `scrub_params` first: a key that names a secret is dropped, so secrets can
never land in MLflow even if a caller hands them in by mistake.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_SECRET_KEY = re.compile(r"(secret|password|token|access_key|session_key|credential)", re.I)
_MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value


def scrub_params(params: Mapping[str, Any]) -> dict[str, str]:
    """Params as strings, without anything whose name says it is a secret."""
    clean: dict[str, str] = {}
    for key, value in params.items():
        if _SECRET_KEY.search(key):
            continue
        clean[key] = str(value)[:_MAX_PARAM_CHARS]
    return clean


@dataclass
class RunRecord:
    """Everything one training run sends to MLflow."""

    experiment: str
    run_name: str
    params: Mapping[str, Any]
    # (step, {metric name: value}) along the run; names are namespaced ("losses/eval", "cost/usd").
    step_metrics: Iterable[tuple[int, Mapping[str, float]]] = ()
    final_metrics: Mapping[str, float] = field(default_factory=dict)
    tags: Mapping[str, str] = field(default_factory=dict)
    artifacts: Iterable[Path] = ()


def log_run(tracking_uri: str, record: RunRecord) -> str:
    """Log one run and return its MLflow run id."""
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name(record.experiment)
    experiment_id = (
        experiment.experiment_id if experiment else client.create_experiment(record.experiment)
    )
    run = client.create_run(experiment_id, run_name=record.run_name, tags=dict(record.tags))
    run_id = run.info.run_id
    try:
        now_ms = int(time.time() * 1000)
        params = [Param(k, v) for k, v in scrub_params(record.params).items()]
        metrics = [
            Metric(name, float(value), now_ms, int(step))
            for step, values in record.step_metrics
            for name, value in values.items()
        ]
        final_step = max((m.step for m in metrics), default=0)
        metrics += [
            Metric(name, float(value), now_ms, final_step)
            for name, value in record.final_metrics.items()
        ]
        # log_batch takes at most 1000 metrics and 100 params per call.
        for start in range(0, len(params), 100):
            client.log_batch(run_id, params=params[start : start + 100])
        for start in range(0, len(metrics), 1000):
            client.log_batch(run_id, metrics=metrics[start : start + 1000])
        client.log_batch(run_id, tags=[RunTag("trainwise", "1")])
        for artifact in record.artifacts:
            client.log_artifact(run_id, str(artifact))
        client.set_terminated(run_id, "FINISHED")
    except BaseException:
        client.set_terminated(run_id, "FAILED")
        raise
    return run_id


def run_url(tracking_uri: str, run_id: str) -> str:
    """Where a person finds the run: the server URL when there is one, else how to start the UI."""
    if tracking_uri.startswith("http"):
        return f"{tracking_uri.rstrip('/')}/#/runs/{run_id}"
    return f"mlflow ui --backend-store-uri {tracking_uri}  (then open run {run_id})"
