"""One training run, end to end, without Dagster: data in, checkpoint + MLflow run out.

The `checkpoint` asset and the tests call `run_training`; it loads the shards and the current
curriculum, prices the emulated instance, trains (the loop writes telemetry files only), then
ingests the telemetry into DuckDB, uploads the checkpoint and logs the run to MLflow.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from controllers.fast_types import FastPolicy, NoOpFastPolicy
from trainwise import settings, tracking
from trainwise.object_store import ObjectStore


@dataclass(frozen=True)
class TrainRequest:
    partition: str
    max_steps: int
    micro_batch_size: int
    grad_accum_steps: int
    learning_rate: float
    eval_every_steps: int
    seed: int
    instance_type: str
    fast_policy: str
    run_id: str
    fast_every_steps: int = 10
    # "static": the curriculum manifest as built; "dynamic": InfoBatch-style pruning per epoch on
    # a running loss table, its rate steered by the slow layer through the run's control file.
    data_selection: str = "static"
    region: str = "us-west-2"


@dataclass(frozen=True)
class RunSummary:
    """The figures a person asks for after a run; also the asset's metadata."""

    run_id: str
    partition: str
    status: str
    steps: int
    tokens_seen: int
    samples_seen: int
    final_eval_loss: float
    final_eval_accuracy: float
    cost_usd: float
    train_wall_s: float
    instance_type: str
    price_usd_per_hour: float
    curriculum_version: str
    fast_policy: str
    checkpoint_uri: str
    checkpoint_sha256: str
    telemetry_dir: str
    events_ingested: int
    mlflow_run_id: str
    mlflow_where: str

    def metadata(self) -> dict[str, Any]:
        # NaN is not valid JSON metadata: an image-free run has no accuracy.
        return {k: (None if isinstance(v, float) and math.isnan(v) else v)
                for k, v in asdict(self).items()}

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> RunSummary:
        values = {k: getattr(v, "value", v) for k, v in metadata.items()}
        kwargs = {}
        for f in fields(cls):
            value = values.get(f.name)
            kwargs[f.name] = float("nan") if value is None and f.type == "float" else value
        return cls(**kwargs)

    def one_line(self) -> str:
        return (f"{self.partition}: {self.steps} steps, {self.tokens_seen:,} tokens, eval loss "
                f"{self.final_eval_loss:.4f}, cost {self.cost_usd:.4f} USD on "
                f"{self.instance_type}")

    def report(self, wall_s: float, dagster_run_id: str) -> str:
        accuracy = ("" if self.final_eval_accuracy is None or math.isnan(self.final_eval_accuracy)
                    else f"\n  eval accuracy   {self.final_eval_accuracy:.4f}")
        return (
            f"\ntrainwise demo: {self.status} in {wall_s:.0f} s\n"
            f"  data set        {self.partition} (curriculum {self.curriculum_version})\n"
            f"  steps           {self.steps}\n"
            f"  tokens seen     {self.tokens_seen:,}  (samples {self.samples_seen:,})\n"
            f"  eval loss       {self.final_eval_loss:.4f}{accuracy}\n"
            f"  cost            {self.cost_usd:.4f} USD  ({self.train_wall_s:.0f} s of "
            f"{self.instance_type} at {self.price_usd_per_hour:.3f} USD/h)\n"
            f"  checkpoint      {self.checkpoint_uri}\n"
            f"  MLflow          {self.mlflow_where}\n"
            f"  Dagster         run {dagster_run_id}: `make ui`, then Runs\n"
            f"  decisions       trainwise explain {self.run_id}\n"
        )


def price_usd_per_hour(instance_type: str, region: str) -> float:
    """On-demand list price of the instance type the emulated node stands for."""
    from cloud import prices

    return prices.on_demand_price(instance_type, region)


def fast_policy(name: str) -> FastPolicy:
    """The fast policy run inside the loop, by name; unknown names list the valid ones."""
    if name == "noop":
        return NoOpFastPolicy()
    if name == "heuristic":
        from controllers.fast_heuristic import HeuristicFastPolicy

        return HeuristicFastPolicy()
    raise ValueError(f"unknown fast policy {name!r}; valid: noop, heuristic")


def step_metrics(events: list[dict[str, Any]]) -> list[tuple[int, dict[str, float]]]:
    """MLflow metrics along the steps, from the run's telemetry records."""
    rows: list[tuple[int, dict[str, float]]] = []
    for event in events:
        if event["type"] == "step":
            rows.append((event["step"], {
                "losses/train": event["train_loss"],
                "charts/tokens": event["tokens_seen"],
                "charts/samples": event["samples_seen"],
                "charts/learning_rate": event["learning_rate"],
                "charts/micro_batch_size": event["micro_batch_size"],
                "cost/usd": event["cost_usd"],
            }))
        elif event["type"] == "eval":
            values = {"losses/eval": event["eval_loss"]}
            if event.get("eval_accuracy") is not None:
                values["eval/accuracy"] = event["eval_accuracy"]
            rows.append((event["step"], values))
    return [(step, {k: float(v) for k, v in values.items() if v is not None})
            for step, values in rows]


def plot_cost_vs_loss(events: list[dict[str, Any]], path: Path) -> Path | None:
    """Eval loss against dollars spent: the picture a user opens first in MLflow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cost_at_step = {e["step"]: e["cost_usd"] for e in events if e["type"] == "step"}
    points = [(cost_at_step.get(e["step"], 0.0), e["eval_loss"])
              for e in events if e["type"] == "eval" and e["eval_loss"] is not None]
    if not points:
        return None
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot([p[0] for p in points], [p[1] for p in points], marker="o")
    axis.set_xlabel("cost so far (USD)")
    axis.set_ylabel("eval loss")
    axis.set_title("eval loss vs cost")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def control_path(state_dir: Path, run_id: str) -> Path:
    """The control file a running trainer reads at fast-tick boundaries (the slow layer writes)."""
    return state_dir / "runs" / run_id / "control.json"


def run_training(
    request: TrainRequest,
    *,
    state_dir: Path,
    tracking_uri: str,
    experiment: str,
    store: ObjectStore,
    duckdb_path: Path,
    progress: bool = False,
) -> RunSummary:
    from telemetry import reader
    from telemetry import store as telemetry_store
    from training import curriculum as curriculum_lib
    from training import loop, shards

    if request.max_steps <= 0:
        raise ValueError(f"max_steps must be positive, got {request.max_steps}")
    price = price_usd_per_hour(request.instance_type, request.region)
    examples = shards.load_shards(state_dir / "shards" / request.partition)
    curriculum = curriculum_lib.load_curriculum(state_dir / "curricula" / request.partition)
    policy = fast_policy(request.fast_policy)
    if request.data_selection not in ("static", "dynamic"):
        raise ValueError(f"data_selection {request.data_selection!r}: use static or dynamic")
    config = loop.TrainConfig(
        max_steps=request.max_steps,
        micro_batch_size=request.micro_batch_size,
        grad_accum_steps=request.grad_accum_steps,
        learning_rate=request.learning_rate,
        eval_every_steps=request.eval_every_steps,
        fast_every_steps=request.fast_every_steps,
        seed=request.seed,
        price_usd_per_hour=price,
        instance_type=request.instance_type,
        run_id=request.run_id,
        num_threads=int(settings.get("TRAINWISE_TORCH_THREADS")),
    )
    run_dir = state_dir / "runs" / request.run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    # Written first: the slow-policy sensor finds a partition's live run by this file.
    request_path = run_dir / "request.json"
    request_path.write_text(json.dumps(asdict(request), indent=2))
    pruning = None
    if request.data_selection == "dynamic":
        from training import scoring
        from training.dynamic_pruning import DynamicPruningConfig

        pruning = DynamicPruningConfig(
            pruning_rate=curriculum.pruning_rate,
            initial_scores=scoring.read_scores(state_dir / "scores" / request.partition),
            control_path=control_path(state_dir, request.run_id))
    result = loop.train(config, examples, curriculum, run_dir, fast_policy=policy,
                        progress=progress, pruning=pruning)

    events = reader.read_run_events(result.telemetry_dir)
    ingested = telemetry_store.ingest(result.telemetry_dir, duckdb_path)
    checkpoint_path = Path(result.checkpoint_path)
    key = f"checkpoints/{request.partition}/{request.run_id}/{checkpoint_path.name}"
    checkpoint_uri = store.put_file(checkpoint_path, key)

    plot = plot_cost_vs_loss(events, run_dir / "eval_loss_vs_cost.png")
    final = {
        "final/eval_loss": result.final_eval_loss,
        "final/cost_usd": result.cost_usd,
        "final/tokens": result.tokens_seen,
        "final/samples": result.samples_seen,
        "final/wall_s": result.elapsed_s,
    }
    if result.final_eval_accuracy is not None:
        final["final/eval_accuracy"] = result.final_eval_accuracy
    mlflow_run_id = tracking.log_run(tracking_uri, tracking.RunRecord(
        experiment=experiment,
        run_name=f"{request.partition}-{request.run_id[:8]}",
        params={
            **{f"train/{k}": v for k, v in asdict(config).items()},
            "data/partition": request.partition,
            "data/fingerprint": examples.fingerprint,
            "curriculum/version": curriculum.version,
            "curriculum/pruning_rate": curriculum.pruning_rate,
            "policy/fast": policy.name,
            "policy/slow": ("slow_policy_sensor" if request.data_selection == "dynamic"
                            else "none"),
            "data/selection": request.data_selection,
            "cloud/instance_type": request.instance_type,
            "cloud/price_usd_per_hour": price,
        },
        step_metrics=step_metrics(events),
        final_metrics=final,
        tags={"dagster_run_id": request.run_id, "partition": request.partition},
        artifacts=[p for p in (plot, request_path) if p is not None],
    ))
    return RunSummary(
        run_id=request.run_id,
        partition=request.partition,
        status=result.status,
        steps=result.steps,
        tokens_seen=result.tokens_seen,
        samples_seen=result.samples_seen,
        final_eval_loss=result.final_eval_loss,
        final_eval_accuracy=(float("nan") if result.final_eval_accuracy is None
                             else result.final_eval_accuracy),
        cost_usd=result.cost_usd,
        train_wall_s=result.elapsed_s,
        instance_type=request.instance_type,
        price_usd_per_hour=price,
        curriculum_version=curriculum.version,
        fast_policy=policy.name,
        checkpoint_uri=checkpoint_uri,
        checkpoint_sha256=result.checkpoint_sha256,
        telemetry_dir=str(result.telemetry_dir),
        events_ingested=ingested,
        mlflow_run_id=mlflow_run_id,
        mlflow_where=tracking.run_url(tracking_uri, mlflow_run_id),
    )
