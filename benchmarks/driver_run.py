"""The emulated benchmarks run the product's driver: `trainwise.runs.run_training`, the function
the Dagster `train` job calls, with the request's `allocation_policy` set (the supervised engine,
`trainwise/supervised_run.py`).

`run_job` takes the arguments the benchmarks used to give `trainwise.emulated.run_emulated` and
returns the same `EmulatedResult`, read from the run folder's `supervised.json` (the figures the
driver wrote), so every figure a benchmark publishes comes from a run a user can start from the
launchpad with the same fields. Each benchmark's work folder is a trainwise state folder
(`Workspace`): the partition's shards and a keep-everything curriculum (every strategy trains
the same data), an MLflow sqlite store, a DuckDB telemetry store and a local object store, as
`make demo` lays them out. What the driver adds to the old path, and what it costs: preflight
of the services, MLflow live logging, telemetry ingestion, checkpoint uploads (every trainer
uploads and a replacement restores from the store: the new node's disk is empty).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainwise import settings
from trainwise.emulated import EmulatedResult, ReplaySpec
from trainwise.object_store import LocalObjectStore
from trainwise.run_request import TrainRequest

EXPERIMENT = "benchmarks"
# The trainer settings the emulated benchmarks have always used (the old `run_emulated` ones).
MICRO_BATCH_SIZE = 16
EVAL_BATCHES = 2
EVAL_BATCH_SIZE = 32


@dataclass(frozen=True)
class Workspace:
    """A state folder the driver can run in (the `make demo` layout)."""

    state_dir: Path

    @property
    def tracking_uri(self) -> str:
        return f"sqlite:///{self.state_dir / 'mlflow.db'}"

    @property
    def store(self) -> LocalObjectStore:
        return LocalObjectStore(self.state_dir / "objects")

    @property
    def duckdb_path(self) -> Path:
        return self.state_dir / "trainwise.duckdb"


def workspace(root: Path, partition: str, data_dir: Path | None = None) -> Workspace:
    """`root` as a state folder with `partition`'s shards and a keep-everything curriculum
    (built once; a second call reuses them)."""
    from training import shards
    from training.curriculum import keep_everything, write_curriculum

    root = Path(root)
    shards_dir = root / "shards" / partition
    if not (shards_dir / "manifest.json").exists():
        shards.build_shards(partition, Path(data_dir) if data_dir else settings.data_dir(),
                            shards_dir)
    curricula = root / "curricula" / partition
    if not (curricula / "LATEST").exists():
        write_curriculum(keep_everything(partition, shards.load_shards(shards_dir)), curricula)
    return Workspace(root)


def every_steps(max_steps: int) -> int:
    """The old emulated runs' eval and checkpoint period: four a run, at least every 10 steps."""
    return max(10, max_steps // 4)


def run_job(ws: Workspace, partition: str, *, max_steps: int, policy_name: str, run_id: str,
            replay: ReplaySpec, fast_policy: str | None = None,
            train_overrides: dict[str, Any] | None = None) -> EmulatedResult:
    """One run through `run_training` under `policy_name`; the supervised job's figures.

    `train_overrides`: request fields (`trainwise.run_request.TrainRequest`) the benchmark sets,
    e.g. checkpoint_every_steps, checkpoint_autotune; `preemption_notice_s` is not one: the
    engine tells the trainer the provider's notice itself."""
    from cloud import emulated as replay_lib
    from trainwise import runs

    probe = replay_lib.load_replay_market(replay.trace_folder, replay.zone_files[0],
                                          replay.window_start_tick, 1,
                                          settings.data_dir() / "spot")
    every = every_steps(max_steps)
    fields: dict[str, Any] = {
        "partition": partition, "run_id": run_id, "max_steps": max_steps,
        "micro_batch_size": MICRO_BATCH_SIZE, "eval_every_steps": every,
        "checkpoint_every_steps": every, "eval_batches": EVAL_BATCHES,
        "eval_batch_size": EVAL_BATCH_SIZE, "instance_type": probe.instance_type,
        "region": probe.zone[:-1], "fast_policy": fast_policy or "noop",
        "allocation_policy": policy_name, "nodes": replay.nodes}
    overrides = dict(train_overrides or {})
    overrides.pop("preemption_notice_s", None)  # the engine's own (the provider's notice)
    unknown = set(overrides) - {f.name for f in dataclasses.fields(TrainRequest)}
    if unknown:
        raise ValueError(f"train_overrides {sorted(unknown)} are not TrainRequest fields; set "
                         "what the launchpad can set")
    request = TrainRequest(**{**fields, **overrides})
    try:
        runs.run_training(request, state_dir=ws.state_dir, tracking_uri=ws.tracking_uri,
                          experiment=EXPERIMENT, store=ws.store, duckdb_path=ws.duckdb_path,
                          replay=replay)
    except runs.RunInterruptedError:
        pass  # a run past max_wall_s: its figures are written all the same, status says so
    return read_result(ws.state_dir / "runs" / run_id)


def read_result(run_dir: Path) -> EmulatedResult:
    """The `EmulatedResult` the driver recorded in the run folder."""
    from trainwise.supervised_run import RECORD_FILE

    figures = dict(json.loads((run_dir / RECORD_FILE).read_text())["figures"])
    figures.pop("deadline_met", None)  # a property
    figures["run_dir"] = Path(figures["run_dir"])
    for name in ("holdings", "trainer_pids", "zones", "zones_held"):
        figures[name] = tuple(figures[name])
    return EmulatedResult(**figures)
