"""One training run, end to end, without Dagster: data in, checkpoint + MLflow run out.

The `checkpoint` asset and the tests call `run_training`. In order:

1. validate every name and number of the request (nothing is written before this passes);
2. preflight: the state folder, the DuckDB path, MLflow and the object store answer
   (`trainwise.preflight`), so a bad setting costs a second, not a training;
3. load the shards and the current curriculum, price the emulated instance;
4. train on the nodes of the compute provider (`trainwise.gang`: TRAINWISE_PROVIDER, emulated
   by default; the request's market/zone/nodes, or the slow layer's `allocation.json`; more than
   one node: one torchrun rank per node, `trainwise.torchrun_gang`): a reclaim
   or a new allocation checkpoints, releases, launches the replacement, restores from the store
   and resumes; the provider's bill goes into the summary. Every checkpoint is uploaded as soon
   as it is durable (`CheckpointUploader`); an unfinished run (preempted, killed) is resumed from
   its last good checkpoint, from its run folder or, when that is gone (a new node), from the
   object store's last committed one under `checkpoints/<partition>/<run_id>`;
   The MLflow run opens as training starts and `trainwise.mlflow_live` streams the telemetry
   into it while the loop trains (the loop itself never talks to MLflow);
5. ingest the telemetry into DuckDB, drain the uploads, close the MLflow run (final metrics,
   figure, decision table, real end time and status; a completed run's checkpoint becomes a
   version of the registered model `trainwise-<partition>`). A service that fails here never
   fails a finished training: the checkpoint stays on disk and the summary's `pending` says
   what to redo;
6. a run that did not complete (preempted, stopped, migrated) raises `RunInterruptedError`
   after all of the above, so no caller can take a partial model for a finished one.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from controllers.fast_types import FastPolicy, NoOpFastPolicy
from training.safe_files import save_figure_atomic, write_atomic
from trainwise import guard_reference, mlflow_live, preflight, settings, tracking
from trainwise.object_store import ObjectStore

# The one schema of a run (re-exported here, where callers have always imported it from).
from trainwise.run_request import DATA_SELECTIONS, FAST_POLICIES, TrainRequest, trainer_config

# numpy's legacy seeding and most tools take seeds in [0, 2**32).
MAX_SEED = 2**32 - 1
# Seconds to wait after training for queued checkpoint uploads (they retry with backoff).
UPLOAD_DRAIN_TIMEOUT_S = 120.0
OUTCOME_NAME = "outcome.json"
INGEST_PENDING_NAME = "ingest_pending.json"


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
    # The trainer's own compute estimate (its wall time x the list price), not the bill: the
    # cost trainwise shows is `cost_usd` below, the provider's bill.
    compute_estimate_usd: float
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
    # Step of the checkpoint this call resumed from; None when it started at step 0.
    resumed_from_step: int | None = None
    # What still has to be redone (a failed ingest, upload or MLflow log); "" when nothing.
    pending: str = ""
    # The compute provider's side (`trainwise.gang`): where the run ended, the bill (node-seconds
    # on the provider's clock x the spot/on-demand price paid; the one cost trainwise shows).
    provider: str = ""
    market: str = ""
    zone: str = ""
    nodes: int = 0
    cost_usd: float = 0.0
    spot_share: float = 0.0
    reclaims: int = 0
    replacements: int = 0
    # The same work on demand, never interrupted (one changeover + the seconds trained), and the
    # node-seconds billed beyond it (`trainwise.gang.GangSession.fixed_schedule`).
    fixed_on_demand_usd: float = 0.0
    preemption_waste_node_s: float = 0.0

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
                f"{self.final_eval_loss:.4f}, bill {self.cost_usd:.4f} USD at "
                f"{self.provider or 'the provider'}")

    def saving_line(self) -> str:
        """The one line a user can repeat: the bill against the fixed on-demand schedule for
        the same steps (issue 28, item 2); says so when the fixed figure is not known."""
        fixed, bill = self.fixed_on_demand_usd, self.cost_usd
        if fixed is None or not math.isfinite(fixed) or fixed <= 0:
            return (f"trainwise {bill:.4f} USD; the fixed on-demand schedule's cost for the same "
                    "steps is not known for this run")
        saving = (fixed - bill) / fixed
        word = "a saving" if saving >= 0 else "an overspend"
        return (f"trainwise {bill:.4f} USD against the fixed on-demand schedule's {fixed:.4f} "
                f"USD for the same {self.steps} steps, {word} of {abs(saving):.1%}")

    def report(self, wall_s: float, dagster_run_id: str) -> str:
        accuracy = ("" if self.final_eval_accuracy is None or math.isnan(self.final_eval_accuracy)
                    else f"\n  eval accuracy   {self.final_eval_accuracy:.4f}")
        return (
            f"\ntrainwise demo: {self.status} in {wall_s:.0f} s\n"
            f"  data set        {self.partition} (curriculum {self.curriculum_version})\n"
            f"  steps           {self.steps}\n"
            f"  tokens seen     {self.tokens_seen:,}  (samples {self.samples_seen:,})\n"
            f"  eval loss       {self.final_eval_loss:.4f}{accuracy}\n"
            f"  saving          {self.saving_line()}\n"
            f"  trainer's own   {self.compute_estimate_usd:.4f} USD compute estimate, not the bill "
            f"({self.train_wall_s:.0f} s of trainer wall time x {self.instance_type} at "
            f"{self.price_usd_per_hour:.3f} USD/h)\n"
            f"  cloud           {self.provider} (on the provider's clock; the emulated one "
            f"replays the trace faster than real time): now {self.nodes} x {self.market} in "
            f"{self.zone}, bill {self.cost_usd:.4f} USD, spot share {self.spot_share:.0%}, "
            f"{self.reclaims} reclaim(s), {self.replacements} replacement(s); waste "
            f"{self.preemption_waste_node_s:.0f} node-s; fixed on-demand schedule "
            f"{self.fixed_on_demand_usd:.4f} USD\n"
            f"  checkpoint      {self.checkpoint_uri}\n"
            f"  MLflow          {self.mlflow_where}\n"
            f"  Dagster         run {dagster_run_id}: `make ui`, then Runs\n"
            f"  decisions       trainwise explain {self.run_id}\n"
            + (f"  PENDING         {self.pending}\n" if self.pending else "")
        )


COST_SUMMARY_NAME = "cost_summary.md"


def write_cost_summary(run_dir: Path) -> tuple[Path | None, str]:
    """`trainwise explain RUN --summary`'s table into the run folder (an MLflow artifact), and a
    note when it could not be made (the run's figures stay in its folder either way)."""
    from trainwise import cost_summary

    try:
        table = cost_summary.summarize(run_dir).markdown()
    except Exception as error:  # noqa: BLE001 - a summary is never worth the trained model
        return None, f"cost summary not made ({type(error).__name__}: {error})"
    path = run_dir / COST_SUMMARY_NAME
    write_atomic(path, table.encode("utf-8"))
    return path, ""


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
    if name == "goodput":
        raise ValueError("fast policy 'goodput' is built from a throughput profile of the run's "
                         "model and data (trainwise.goodput_lever.goodput_policy), not by name")
    raise ValueError(f"unknown fast policy {name!r}; valid: {', '.join(FAST_POLICIES)}")


def fast_policy_in_charge(name: str, region: str | None) -> tuple[FastPolicy, str]:
    """(policy, reason). "heuristic" (the default) means the incumbent of `region`: its promoted
    fast champion (`trainwise.champion`) when one is accepted, else `fast_policy(name)`, with why."""
    if name == "goodput":  # profiled once the data is loaded (`run_training`)
        return NoOpFastPolicy(), "goodput requested: profiled at start"
    incumbent = fast_policy(name)
    if name != "heuristic":
        return incumbent, f"{name} requested"
    if region is None:
        return incumbent, "heuristic requested (no region: no champion lookup)"
    from trainwise import champion

    return champion.fast_policy_in_charge(region, incumbent)


def cost_vs_loss_points(events: list[dict[str, Any]]) -> tuple[list[tuple[float, float]], str]:
    """(bill so far, eval loss) at each eval, and the x axis's label. The bill is the provider's
    (`telemetry.bill`), read at the eval's wall time; a run whose telemetry holds no bill (one
    written before bills were recorded) falls back to the trainer's compute estimate, so labelled."""
    from telemetry.bill import BillCurve

    evals = [e for e in events if e["type"] == "eval" and e.get("eval_loss") is not None]
    curve = BillCurve(events)
    if curve:
        return ([(curve.at(float(e["wall_time_s"])), float(e["eval_loss"])) for e in evals],
                "the provider's bill so far (USD)")
    estimate_at_step = {e["step"]: e["cost_usd"] for e in events if e["type"] == "step"}
    return ([(float(estimate_at_step.get(e["step"]) or 0.0), float(e["eval_loss"]))
             for e in evals], "trainer's compute estimate so far (USD), not the bill")


def plot_cost_vs_loss(events: list[dict[str, Any]], path: Path) -> Path | None:
    """Eval loss against dollars billed: the picture a user opens first in MLflow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points, x_label = cost_vs_loss_points(events)
    if not points:
        return None
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot([p[0] for p in points], [p[1] for p in points], marker="o")
    axis.set_xlabel(x_label)
    axis.set_ylabel("eval loss")
    axis.set_title("eval loss vs cost")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    return save_figure_atomic(figure, path)


def _mlflow_params(request: TrainRequest, config: Any, data_fingerprint: str, curriculum: Any,
                   policy_name: str, price: float, resumed_step: int | None) -> dict[str, Any]:
    """The MLflow params of a run: what it trained with (immutable; live changes are metrics)."""
    return {
        **{f"train/{k}": v for k, v in asdict(config).items()},
        "data/partition": request.partition,
        "data/fingerprint": data_fingerprint,
        "curriculum/version": curriculum.version,
        "curriculum/pruning_rate": curriculum.pruning_rate,
        "policy/fast": policy_name,
        "policy/slow": "slow_policy_sensor" if request.data_selection == "dynamic" else "none",
        "data/selection": request.data_selection,
        "cloud/instance_type": request.instance_type,
        "cloud/price_usd_per_hour": price,
        "cloud/provider_market": request.market,
        "cloud/zone": request.zone or "(provider default)",
        "cloud/nodes": request.nodes,
        "resume/from_step": -1 if resumed_step is None else resumed_step,
    }


def control_path(state_dir: Path, run_id: str) -> Path:
    """The control file a running trainer reads at fast-tick boundaries (the slow layer writes)."""
    return state_dir / "runs" / run_id / "control.json"


class RunFailedError(RuntimeError):
    """A (Dagster) run failed or did not complete; the message carries each step's own error."""


class RunInterruptedError(RuntimeError):
    """Training ended without completing (preempted, stopped, migrated). Raised after the
    checkpoint is kept, uploaded and the telemetry ingested; `summary` holds the figures and
    `resume_hint` says how to continue from the checkpoint."""

    def __init__(self, summary: RunSummary, max_steps: int) -> None:
        self.summary = summary
        self.resume_hint = (
            f"re-execute the Dagster run (it resumes training run {summary.run_id} from its last "
            f"good checkpoint), or call run_training again with run_id={summary.run_id!r}")
        super().__init__(
            f"training run {summary.run_id} ended {summary.status} at step {summary.steps} of "
            f"{max_steps}; its checkpoint is kept at {summary.checkpoint_uri}; to resume: "
            f"{self.resume_hint}")


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a whole number >= 1")


def validate_request(request: TrainRequest) -> None:
    """Every name and number of a request, checked before anything is written; each error names
    the field, the value and what is valid."""
    from telemetry.writer import rank_dir
    from training.shards import validate_partition

    try:
        # The telemetry writer's rule for a run id: one safe path part, no '..', no separator.
        rank_dir(Path("."), str(request.run_id), 0)
    except ValueError as error:
        raise ValueError(f"run_id: {error}") from error
    validate_partition(request.partition)  # a known name, never a path; lists the valid ones
    for name in ("max_steps", "micro_batch_size", "grad_accum_steps", "eval_every_steps",
                 "fast_every_steps", "eval_batches", "eval_batch_size"):
        _check_positive_int(name, getattr(request, name))
    every = request.checkpoint_every_steps
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ValueError(f"checkpoint_every_steps={every!r} must be a whole number >= 0 (0: no "
                         "periodic checkpoints)")
    if not isinstance(request.checkpoint_autotune, bool):
        raise ValueError(f"checkpoint_autotune={request.checkpoint_autotune!r} must be true or "
                         "false")
    seed = request.seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed={seed!r} must be a whole number in [0, {MAX_SEED}]")
    rate = request.learning_rate
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (
            math.isfinite(rate) and rate > 0):
        raise ValueError(f"learning_rate={rate!r} must be a finite number > 0 (e.g. 1e-3)")
    if request.fast_policy not in FAST_POLICIES:
        raise ValueError(f"fast_policy={request.fast_policy!r}; valid: {', '.join(FAST_POLICIES)}")
    if request.data_selection not in DATA_SELECTIONS:
        raise ValueError(f"data_selection={request.data_selection!r}; valid: "
                         f"{', '.join(DATA_SELECTIONS)}")
    from cloud.providers import MARKETS

    if request.market not in MARKETS:
        raise ValueError(f"market={request.market!r}; valid: {', '.join(MARKETS)}")
    _check_positive_int("nodes", request.nodes)
    from trainwise.goodput_lever import check_goodput_ranks

    check_goodput_ranks(request.fast_policy, request.nodes)
    _check_lever_guard(request)
    pace = request.replay_steps_per_tick
    if isinstance(pace, bool) or not isinstance(pace, (int, float)) or not (
            math.isfinite(pace) and pace >= 0):
        raise ValueError(f"replay_steps_per_tick={pace!r} must be a finite number >= 0 (0: the "
                         "provider's fixed replay speed)")
    if pace and request.allocation_policy:
        raise ValueError(f"replay_steps_per_tick={pace!r} paces the in-process engine's replay; "
                         f"under allocation_policy={request.allocation_policy!r} the supervised "
                         "engine sets its own speed: set replay_steps_per_tick to 0")
    if pace and request.nodes > 1:
        raise ValueError(f"replay_steps_per_tick={pace!r} is paced by the one trainer loop of a "
                         f"one-node run; a torchrun gang of nodes={request.nodes} is not paced "
                         "yet: set replay_steps_per_tick to 0")
    if request.allocation_policy:
        from cloud.policy_registry import registered_names

        if request.allocation_policy not in registered_names():
            raise ValueError(f"allocation_policy={request.allocation_policy!r} is not a "
                             f"registered allocation policy; valid: "
                             f"{', '.join(registered_names())}, or empty for the request's market")


def _check_lever_guard(request: TrainRequest) -> None:
    """The guard's fields; the reference run itself is read in run_training
    (`trainwise.guard_reference.resolve`: unknown run, other partition, short curve)."""
    if not isinstance(request.lever_guard, bool):
        raise ValueError(f"lever_guard={request.lever_guard!r} must be true or false")
    reference = request.lever_guard_reference_run
    if not isinstance(reference, str):
        raise ValueError(f"lever_guard_reference_run={reference!r} must be a run id, or empty "
                         "for the newest fixed-schedule run")
    if reference and not request.lever_guard:
        raise ValueError(f"lever_guard_reference_run={reference!r} is set but lever_guard is off; "
                         "turn lever_guard on, or clear lever_guard_reference_run")
    if reference:
        from telemetry.writer import rank_dir

        try:
            rank_dir(Path("."), reference, 0)  # one safe path part: it names a run folder
        except ValueError as error:
            raise ValueError(f"lever_guard_reference_run: {error}") from error


def read_outcome(run_dir: Path) -> dict[str, Any] | None:
    """What the last call of run_training recorded for this run folder, or None."""
    path = Path(run_dir) / OUTCOME_NAME
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        return None


def is_resumable(run_dir: Path) -> bool:
    """A run folder with committed checkpoints whose training did not complete (preempted,
    stopped, migrated, or killed before it could record an outcome)."""
    run_dir = Path(run_dir)
    outcome = read_outcome(run_dir)
    if outcome is not None and outcome.get("status") == "completed":
        return False
    from training.checkpoint import latest_checkpoint

    # Committed checkpoints only: a payload without its manifest (a writer killed in its first
    # checkpoint) is nothing to resume from, and the run starts over.
    return latest_checkpoint(run_dir / "checkpoints") is not None


def checkpoint_prefix(partition: str, run_id: str) -> str:
    """Object-store folder of a training run's checkpoints (the uploader's key prefix)."""
    return f"checkpoints/{partition}/{run_id}"


def store_status(store: ObjectStore | None, partition: str | None, run_id: str) -> str | None:
    """What the object store knows of a training run, for a node whose disk is new: "completed"
    (its outcome record says so), "resumable" (committed checkpoints, no completed outcome), or
    None (nothing there, or no store). A store that cannot be listed counts as knowing nothing:
    preflight already checked it answers, and a local folder still decides then."""
    if store is None or not partition:
        return None
    from trainwise.object_store import COMMIT_SUFFIX

    prefix = checkpoint_prefix(partition, run_id)
    try:
        keys = store.list_keys(prefix)
        if f"{prefix}/{OUTCOME_NAME}" in keys:
            outcome = json.loads(store.get_bytes(f"{prefix}/{OUTCOME_NAME}"))
            if outcome.get("status") == "completed":
                return "completed"
    except Exception as error:  # noqa: BLE001 - a store hiccup must not hide a local folder
        warnings.warn(f"object store listing of {prefix} failed ({error}); only local run "
                      "folders are considered for resuming", stacklevel=2)
        return None
    return "resumable" if any(k.endswith(COMMIT_SUFFIX) for k in keys) else None


def resumable_run_id(state_dir: Path, candidates: list[str], *, store: ObjectStore | None = None,
                     partition: str | None = None) -> str | None:
    """The first of `candidates` (training run ids, newest lineage first) that can be resumed:
    from its local run folder, or (when `store` and `partition` are given) from the object
    store's committed checkpoints, so a replacement node with an empty state folder resumes the
    lineage too. None when none can. Unsafe names are skipped, never joined to a path."""
    from telemetry.writer import rank_dir

    for run_id in candidates:
        try:
            rank_dir(Path("."), run_id, 0)
        except ValueError:
            continue
        run_dir = Path(state_dir) / "runs" / run_id
        if is_resumable(run_dir):
            return run_id
        local = read_outcome(run_dir)
        if local is not None and local.get("status") == "completed":
            continue
        if store_status(store, partition, run_id) == "resumable":
            return run_id
    return None


def _write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    # An unpredictable temp name (issue 31, class 2): a fixed `.name.tmp-<pid>` in the shared
    # run folder could be a planted link, written through.
    write_atomic(path, json.dumps(payload, indent=2, default=str).encode("utf-8"))


def _resume_point(run_dir: Path, request: TrainRequest, store: ObjectStore | None = None
                  ) -> tuple[Path | None, int | None]:
    """(checkpoint folder to resume from, its good checkpoint's step), or (None, None) for a
    fresh start. Refuses a run id that already completed and a folder of another partition.

    With `store`, the store's newest committed checkpoint of this run (same partition, same run
    id: the lineage) is brought into the run folder first unless the folder holds one at least
    as new, so a node whose state folder is new resumes where the lost one last uploaded."""
    outcome = read_outcome(run_dir)
    if (outcome is not None and outcome.get("status") == "completed") or store_status(
            store, request.partition, request.run_id) == "completed":
        raise ValueError(
            f"run_id {request.run_id!r} already completed ({run_dir} or the object store); "
            "choose a new run id (a completed run is never trained again in place)")
    previous = run_dir / "request.json"
    if previous.exists():
        try:
            earlier = json.loads(previous.read_text(encoding="utf-8")).get("partition")
        except ValueError:
            earlier = None
        if earlier is not None and earlier != request.partition:
            raise ValueError(
                f"run_id {request.run_id!r} belongs to partition {earlier!r}, not "
                f"{request.partition!r}; choose a new run id")
    if store_status(store, request.partition, request.run_id) == "resumable":
        from trainwise.emulated_store import restore_from_store

        point = restore_from_store(store, checkpoint_prefix(request.partition, request.run_id),
                                   run_dir / "checkpoints")
        if point is not None:
            for skipped, why in point.skipped:
                warnings.warn(f"resume of {request.run_id}: store checkpoint {skipped} skipped "
                              f"({why})", stacklevel=3)
    if not is_resumable(run_dir):
        return None, None
    from training.checkpoint import latest_good_checkpoint

    folder = run_dir / "checkpoints"
    good = latest_good_checkpoint(folder)
    if good is None:
        raise ValueError(
            f"run folder {run_dir} holds checkpoints but none passes its check, so run "
            f"{request.run_id!r} cannot be resumed; move {folder} away to start it over")
    for skipped, why in good.skipped:
        warnings.warn(f"resume of {request.run_id}: skipped {skipped} ({why})", stacklevel=3)
    return folder, good.step


def _upload_result(report: Any, checkpoint_path: Path) -> tuple[str | None, list[str]]:
    """(uri of the final checkpoint if it was uploaded, failures as text) from the
    CheckpointUploader's UploadReport (uploaded uris; failed (key, why) pairs)."""
    failures = [f"{key}: {why}" for key, why in report.failed]
    name = checkpoint_path.name
    final = next((str(u) for u in report.uploaded if str(u).rstrip("/").endswith("/" + name)),
                 None)
    return final, failures


def _ingest(telemetry_dir: Path, duckdb_path: Path, run_dir: Path, run_id: str
            ) -> tuple[int, str]:
    """(events ingested, pending text). A finished training never fails here: a busy or broken
    DuckDB is recorded in `ingest_pending.json` and `trainwise ingest RUN_ID` redoes it."""
    from telemetry import store as telemetry_store
    from trainwise.ledger_bill import store_ledger_bills

    marker = run_dir / INGEST_PENDING_NAME
    try:
        ingested = telemetry_store.ingest(telemetry_dir, duckdb_path)
        store_ledger_bills(telemetry_dir, duckdb_path)  # the bill dbt reports (issue 31)
    except Exception as error:  # noqa: BLE001 - any ingest failure must leave training intact
        pending = (f"telemetry ingest into {duckdb_path} failed ({type(error).__name__}: "
                   f"{error}); the telemetry files are kept in {telemetry_dir}; re-ingest with "
                   f"`trainwise ingest {run_id}`")
        _write_json_atomic(marker, {"telemetry_dir": str(telemetry_dir),
                                    "duckdb_path": str(duckdb_path), "error": repr(error)})
        warnings.warn(pending, stacklevel=3)
        return 0, pending
    marker.unlink(missing_ok=True)
    return ingested, ""


def _new_node_disk(uploader: Any, store: ObjectStore, request: TrainRequest, run_dir: Path,
                   result: Any, upload_timeout_s: float) -> tuple[Any, Path, list[str]]:
    """A replacement node's disk: the stopped node's uploads are drained, its local checkpoints
    dropped and the store's newest committed one restored. When the store did not get the
    stopped node's last checkpoint, the local copy is kept (never lose trained work) and the
    note says so. Returns (a new uploader, the folder to resume from, notes)."""
    import shutil

    from trainwise.emulated_store import restore_from_store
    from trainwise.object_store import CheckpointUploader

    prefix = checkpoint_prefix(request.partition, request.run_id)
    report = uploader.drain(upload_timeout_s)
    notes = [f"checkpoint upload failed: {key}: {why}" for key, why in report.failed]
    folder = run_dir / "checkpoints"
    final, _ = _upload_result(report, Path(result.checkpoint_path))
    if final is not None:
        shutil.rmtree(folder, ignore_errors=True)  # the lost node's disk
        point = restore_from_store(store, prefix, folder)
        if point is None or point.step < result.steps:
            notes.append(f"the store's checkpoint of {request.run_id} is older than step "
                         f"{result.steps}; resumed from step "
                         f"{point.step if point else 0}")
    else:
        notes.append(f"the stopped node's checkpoint (step {result.steps}) did not reach the "
                     f"store; the replacement resumed from the local copy {folder}")
    return CheckpointUploader(store, key_prefix=prefix), folder, notes


def run_training(
    request: TrainRequest,
    *,
    state_dir: Path,
    tracking_uri: str,
    experiment: str,
    store: ObjectStore,
    duckdb_path: Path,
    progress: bool = False,
    preflight_timeout_s: float = preflight.DEFAULT_TIMEOUT_S,
    upload_timeout_s: float = UPLOAD_DRAIN_TIMEOUT_S,
    mlflow_interval_s: float = mlflow_live.DEFAULT_INTERVAL_S,
    provider: Any = None,
    fast_policy: FastPolicy | None = None,
    allocation_policy: Any = None,
    replay: Any = None,
    register_model: bool = True,
) -> RunSummary:
    """Trains (or resumes) one run; see the module docstring for the order of things.

    `register_model`: a completed run's checkpoint becomes a version of the registered model
    `trainwise-<partition>`; a search's trials (trainwise.hpo) pass False, so the registry
    holds models a user trained, not every trial.

    Raises ValueError (a bad request, nothing written), `preflight.PreflightError` (a path or
    service is not usable, nothing trained) or `RunInterruptedError` (training did not complete;
    its checkpoint is kept and the call can be repeated with the same run id to resume).

    `provider`: the `cloud.providers.ComputeProvider` the run's nodes are launched at (default:
    TRAINWISE_PROVIDER, `trainwise.gang.provider_for_run`); an unknown zone or instance type or
    an unreachable provider is raised before any step is trained.

    `fast_policy`: when given, this object is the fast policy in charge (recorded by its `name`,
    reason "given by the caller") instead of the one `request.fast_policy` names; the `train`
    job gives none.

    `allocation_policy` (an allocation policy object; default: the request's
    `allocation_policy` name) and `replay` (a `trainwise.emulated.ReplaySpec`; default: the
    default trace window) run the job on the supervised engine (`trainwise.supervised_run`):
    the policy holds the nodes, the trainer is a child process, the bill is the provider's."""
    from telemetry import reader
    from training import curriculum as curriculum_lib
    from training import loop, shards

    # 1. Names and numbers: nothing is written until all pass.
    validate_request(request)
    # The guard's reference curve from an earlier run (files read, nothing written); the run id
    # it came from is recorded in request.json, so a resume keeps the same reference.
    reference = guard_reference.resolve(request, Path(state_dir))
    if reference is not None:
        request = replace(request, lever_guard_reference_run=reference.run_id)
    price = price_usd_per_hour(request.instance_type, request.region)
    if fast_policy is not None:
        policy, policy_reason = fast_policy, "given by the caller"
    else:
        policy, policy_reason = fast_policy_in_charge(request.fast_policy, request.region)
    # Every field the trainer shares with the request passes as it is (`trainer_config`); here
    # only what the driver derives.
    config = trainer_config(
        request,
        # The cosine floor may not exceed the peak rate (a tiny peak rate keeps itself).
        min_learning_rate=min(loop.TrainConfig.min_learning_rate, request.learning_rate),
        price_usd_per_hour=price,
        num_threads=settings.torch_threads(),
        lever_guard_reference=reference.points if reference is not None else (),
        lever_guard_reference_source=(f"run {reference.run_id}" if reference is not None
                                      else ""),
    )
    state_dir = Path(state_dir)
    run_dir = state_dir / "runs" / request.run_id
    # 2. Paths and services, before the data is loaded or a step is taken.
    preflight.check_services(state_dir=state_dir, duckdb_path=Path(duckdb_path),
                             tracking_uri=tracking_uri, store=store, timeout_s=preflight_timeout_s)
    # 3. Data (read only).
    examples = shards.load_shards(state_dir / "shards" / request.partition)
    curriculum = curriculum_lib.load_curriculum(state_dir / "curricula" / request.partition)
    guard_reference.check_fit(reference, config.model or loop.default_model_config(examples),
                              examples.fingerprint)
    # The node engine: an allocation policy (object or the request's name) -> supervised.
    if allocation_policy is None and request.allocation_policy:
        allocation_policy = request.allocation_policy
    supervised = allocation_policy is not None
    if supervised:
        from trainwise import supervised_run

        supervised_run.check_supported(store=store, data_selection=request.data_selection,
                                       fast_policy_object=fast_policy)
    if request.fast_policy == "goodput" and fast_policy is None:
        if supervised:  # the trainer process profiles it (`trainwise.emulated_worker`)
            policy_reason = "goodput requested: the trainer process profiles it at start"
        else:
            from trainwise.goodput_lever import goodput_policy

            policy, policy_reason = goodput_policy(config, examples)
    # The name recorded everywhere; under the supervised engine the trainer process builds the
    # policy itself from the request's name (and the region's champion), as here.
    policy_name = ("goodput" if supervised and request.fast_policy == "goodput"
                   else policy.name)
    resume_from, resumed_step = _resume_point(run_dir, request, store)
    from trainwise import gang

    session: gang.GangSession | None = None  # the in-process engine's nodes
    ranks = False
    # Earlier sessions' telemetry, listed before this one's provider rank writes its launch:
    # the MLflow tail skips these and follows everything this call writes, bills included.
    earlier_segments = mlflow_live.segments_now(run_dir / "telemetry" / request.run_id)
    if not supervised:
        session = gang.GangSession(
            provider if provider is not None else gang.provider_for_run(request.instance_type,
                                                                        request.region),
            gang.read_allocation(run_dir) or gang.Allocation(
                market=request.market, zone=request.zone, nodes=request.nodes,
                reason="the train request", source="request"),
            request.instance_type, run_dir, request.run_id, region=request.region,
            schedule_version=request.schedule_version)
        if request.replay_steps_per_tick:
            from trainwise.replay_pace import StepPacer

            session.pacer = StepPacer(float(request.replay_steps_per_tick))
        # More than one node: one torchrun rank per node (trainwise.torchrun_gang); what the
        # ranks cannot run yet is refused here, before any node is launched.
        ranks = session.allocation.nodes > 1
        if ranks:
            from trainwise import torchrun_gang

            torchrun_gang.check_ranks(request, store, policy, session.allocation.nodes)
        session.start()  # the provider's errors here: nothing is trained or written yet
    # From here the nodes are billed: whatever fails before training releases them.
    try:
        pruning = None
        if request.data_selection == "dynamic":
            from training import scoring
            from training.dynamic_pruning import DynamicPruningConfig

            pruning = DynamicPruningConfig(
                pruning_rate=curriculum.pruning_rate,
                initial_scores=scoring.read_scores(state_dir / "scores" / request.partition),
                control_path=control_path(state_dir, request.run_id))

        # 4. Train. request.json is written first: the slow-policy sensor finds a partition's live
        # run by this file.
        run_dir.mkdir(parents=True, exist_ok=True)
        request_path = run_dir / "request.json"
        _write_json_atomic(request_path, asdict(request))
        # Which fast policy is in charge and why (champion, or the heuristic and the refusal).
        _write_json_atomic(run_dir / "fast_policy.json",
                           {"fast_policy": policy_name, "reason": policy_reason})
        (run_dir / OUTCOME_NAME).unlink(missing_ok=True)  # this call's outcome replaces any earlier
        from trainwise.object_store import CheckpointUploader

        uploader = CheckpointUploader(store, key_prefix=checkpoint_prefix(request.partition,
                                                                          request.run_id))
        # The MLflow run opens now and follows the telemetry while the loop trains (never inside it).
        live = mlflow_live.LiveRun(mlflow_live.LiveRunSpec(
            tracking_uri=tracking_uri, experiment=experiment,
            run_name=f"{request.partition}-{request.run_id[:8]}",
            params={**_mlflow_params(request, config, examples.fingerprint, curriculum,
                                     policy_name, price, resumed_step),
                    "policy/fast_reason": policy_reason[:500],
                    **guard_reference.mlflow_params(reference)},
            tags={"dagster_run_id": request.run_id, "trainwise/training_run_id": request.run_id,
                  "partition": request.partition,
                  # The published schedule it started on (runs compared by version, issue 28).
                  "trainwise/schedule_version": request.schedule_version or "none",
                  "trainwise/schedule_override_reason": request.schedule_override_reason[:250]},
            telemetry_dir=run_dir / "telemetry" / request.run_id,
            consumption_path=run_dir / "telemetry" / request.run_id / "consumption.jsonl",
            control_path=control_path(state_dir, request.run_id) if pruning else None,
            proposal_path=(control_path(state_dir, request.run_id).with_name("control.pending.json")
                           if pruning else None)),
            skip_segments=earlier_segments,
            interval_s=mlflow_interval_s).start()
    except BaseException:
        if session is not None:
            session.close("failed before training")
        raise
    earlier_upload_failures: list[str] = []
    engine_outcome = None  # the supervised engine's
    try:
        if supervised:  # the allocation policy holds the nodes; the trainer is a child process
            engine_outcome = supervised_run.train_supervised(
                config=config, partition=request.partition, run_id=request.run_id,
                replay=replay if replay is not None else supervised_run.ReplaySpec(),
                allocation_policy=allocation_policy, state_dir=state_dir, run_dir=run_dir,
                store=store, key_prefix=checkpoint_prefix(request.partition, request.run_id),
                fast_policy=request.fast_policy, region=request.region,
                resume_step=resumed_step, nodes=request.nodes)
            result = engine_outcome.trainer
        elif ranks:  # the gang answers reclaims itself (node replaced, restored from the store)
            result, uploader = torchrun_gang.train_ranks(
                session, config, request=request, shards_dir=state_dir / "shards" /
                request.partition, curriculum=curriculum,
                curriculum_dir=state_dir / "curricula" / request.partition, run_dir=run_dir,
                policy=policy, resume_from=resume_from, store=store,
                key_prefix=checkpoint_prefix(request.partition, request.run_id),
                upload_timeout_s=upload_timeout_s)
        while session is not None and not ranks:
            # The set-up since the boot (MLflow, the uploader, building and restoring the model)
            # is inside the changeover the boot modelled: the provider's clock runs from the
            # loop's first step, as a gang's does (torchrun_gang).
            result = loop.train(config, examples, curriculum, run_dir,
                                fast_policy=session.policy(policy), progress=progress,
                                pruning=pruning, resume_from=resume_from,
                                on_checkpoint=uploader.submit, on_start=session.resume_clock)
            if result.status == "completed" or not session.stop_reason:
                break
            # Our own SIGTERM (a reclaim, or the slow layer's new allocation): the node goes,
            # its replacement restores from the store and training resumes.
            uploader, resume_from, note = _new_node_disk(uploader, store, request, run_dir,
                                                         result, upload_timeout_s)
            earlier_upload_failures += note
            session.note("restore", note[-1] if note else
                         f"replacement disk: step {result.steps} restored from the object store",
                         step=result.steps)
            if not session.replace():
                break
    except BaseException as error:
        live.abort(error)
        if session is not None:
            session.close("failed")
        # The checkpoints written so far still go out (briefly): a crash loses no more.
        uploader.drain(min(upload_timeout_s, 10.0))
        raise
    train_end_s = time.time()
    if session is not None:
        gang_record = session.close(result.status)
    else:  # the supervised engine's record of the nodes its policy held, and the bill
        assert engine_outcome is not None
        gang_record = engine_outcome.record
        _write_json_atomic(run_dir / supervised_run.RECORD_FILE, {
            **gang_record, "figures": supervised_run.result_record(engine_outcome.emulated)})
    live.stop()

    # A crash while recording (not a failing service: those are pending notes) still closes
    # the MLflow run instead of leaving it RUNNING.
    try:
        # 5. Record it everywhere; a failing service leaves the checkpoint and a pending note.
        pending: list[str] = list(earlier_upload_failures)
        if session is not None and session.failure:
            pending.append(session.failure)
        try:
            events = reader.read_run_events(result.telemetry_dir)
        except (ValueError, OSError) as error:  # a damaged segment must not fail the training
            events = []
            pending.append(f"reading telemetry for MLflow failed: {error}")
        # The checkpoint first (it is what a preempted node must save within its notice), then
        # the telemetry, then MLflow.
        checkpoint_path = Path(result.checkpoint_path)
        if engine_outcome is not None:  # the trainers uploaded their own checkpoints
            from trainwise.object_store import UploadReport

            report = UploadReport(uploaded=list(engine_outcome.uploaded),
                                  failed=list(engine_outcome.upload_failed))
        else:
            report = uploader.drain(upload_timeout_s)
        checkpoint_uri, failures = _upload_result(report, checkpoint_path)
        if checkpoint_uri is None:
            checkpoint_uri = checkpoint_path.resolve().as_uri()
            why = "; ".join(failures) or f"not uploaded within {upload_timeout_s:.0f} s"
            pending.append(f"checkpoint upload failed ({why}); the checkpoint is kept at "
                           f"{checkpoint_path}")
        elif failures:
            pending.append(f"earlier checkpoint uploads failed: {'; '.join(failures)}")
        ingested, ingest_pending = _ingest(result.telemetry_dir, Path(duckdb_path), run_dir,
                                           request.run_id)
        if ingest_pending:
            pending.append(ingest_pending)

        plot = plot_cost_vs_loss(events, run_dir / "eval_loss_vs_cost.png")
        cost_table, cost_note = write_cost_summary(run_dir)
        if cost_note:
            pending.append(cost_note)
        final = {
            "final/eval_loss": result.final_eval_loss,
            "final/eval_accuracy": result.final_eval_accuracy,
            # The bill (the cost shown everywhere); the trainer's estimate is labelled as one.
            "final/cost_usd": gang_record["cost_usd"],
            "final/compute_estimate_usd": result.cost_usd,
            "final/tokens": result.tokens_seen,
            "final/samples": result.samples_seen,
            "final/wall_s": result.elapsed_s,
            "final/spot_share": gang_record["spot_share"],
            "final/reclaims": gang_record["reclaims"],
            "final/world_size": gang_record["world_size"],
        }
        # A run preempted before its first eval has no eval loss: skip it, never log None.
        final = {k: v for k, v in final.items() if v is not None}
        mlflow_run_id, mlflow_where = "", ""
        checkpoint_tags = {"checkpoint_sha256": result.checkpoint_sha256,
                           "curriculum_version": curriculum.version,
                           "training_run_id": request.run_id, "partition": request.partition,
                           "checkpoint_uri": checkpoint_uri}
        try:
            mlflow_run_id = live.finish(
                result.status, end_time_s=train_end_s, final_metrics=final,
                artifacts=[p for p in (plot, request_path, cost_table) if p is not None],
                decisions_path=run_dir / mlflow_live.DECISIONS_NAME,
                model=mlflow_live.ModelToRegister(mlflow_live.model_name(request.partition),
                                                  checkpoint_path, checkpoint_tags)
                if register_model else None)
            mlflow_where = tracking.run_url(tracking_uri, mlflow_run_id)
        except Exception as error:  # noqa: BLE001 - the trained checkpoint outlives MLflow
            mlflow_run_id = live.run_id or ""
            pending.append(f"MLflow logging to {tracking_uri} failed ({type(error).__name__}: "
                           f"{error}); the run's figures are kept in {run_dir}")
            warnings.warn(pending[-1], stacklevel=2)
    except BaseException as error:
        live.abort(error)
        raise
    summary = RunSummary(
        run_id=request.run_id,
        partition=request.partition,
        status=result.status,
        steps=result.steps,
        tokens_seen=result.tokens_seen,
        samples_seen=result.samples_seen,
        final_eval_loss=(math.nan if result.final_eval_loss is None
                         else result.final_eval_loss),
        final_eval_accuracy=(math.nan if result.final_eval_accuracy is None
                             else result.final_eval_accuracy),
        compute_estimate_usd=result.cost_usd,
        train_wall_s=result.elapsed_s,
        instance_type=request.instance_type,
        price_usd_per_hour=price,
        curriculum_version=curriculum.version,
        fast_policy=policy_name,
        checkpoint_uri=checkpoint_uri,
        checkpoint_sha256=result.checkpoint_sha256,
        telemetry_dir=str(result.telemetry_dir),
        events_ingested=ingested,
        mlflow_run_id=mlflow_run_id,
        mlflow_where=mlflow_where,
        resumed_from_step=resumed_step,
        pending="; ".join(pending),
        provider=gang_record["provider"],
        market=gang_record["market"],
        zone=gang_record["zone"],
        nodes=gang_record["nodes"],
        cost_usd=gang_record["cost_usd"] or 0.0,
        spot_share=gang_record["spot_share"],
        reclaims=gang_record["reclaims"],
        replacements=gang_record["replacements"],
        fixed_on_demand_usd=gang_record["fixed_on_demand_usd"] or math.nan,
        preemption_waste_node_s=gang_record["preemption_waste_node_s"],
    )
    outcome = {**summary.metadata(), "checkpoint_path": str(checkpoint_path)}
    _write_json_atomic(run_dir / OUTCOME_NAME, outcome)
    # The store keeps the outcome next to the checkpoints: a node whose disk is new must know a
    # completed run is not to be trained again, and an unfinished one is to be resumed.
    try:
        store.put_bytes(json.dumps(outcome, default=str).encode(),
                        f"{checkpoint_prefix(request.partition, request.run_id)}/{OUTCOME_NAME}")
    except Exception as error:  # noqa: BLE001 - the local outcome is written; say what is missing
        warnings.warn(f"outcome of {request.run_id} not stored in the object store ({error}); "
                      f"the local {run_dir / OUTCOME_NAME} holds it", stacklevel=2)
    # 6. A partial model is never a success.
    if result.status != "completed":
        raise RunInterruptedError(summary, request.max_steps)
    return summary


def reingest(state_dir: Path, run_id: str, duckdb_path: Path) -> int:
    """Ingests a run's telemetry again (after `pending` said the ingest failed); returns the
    events ingested and clears the run's ingest_pending.json."""
    from telemetry.writer import rank_dir

    rank_dir(Path("."), run_id, 0)  # one safe path part, or a ValueError saying so
    run_dir = Path(state_dir) / "runs" / run_id
    telemetry_dir = run_dir / "telemetry" / run_id
    if not telemetry_dir.is_dir():
        raise FileNotFoundError(f"no telemetry for run {run_id!r} in {telemetry_dir}; "
                                "`trainwise explain` lists the run ids it finds")
    from telemetry import store as telemetry_store
    from trainwise.ledger_bill import store_ledger_bills

    ingested = telemetry_store.ingest(telemetry_dir, Path(duckdb_path))
    store_ledger_bills(telemetry_dir, Path(duckdb_path))
    (run_dir / INGEST_PENDING_NAME).unlink(missing_ok=True)
    return ingested
