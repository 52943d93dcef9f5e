"""The telemetry event schema: what a training rank records, one JSON object per line.

Every event carries `run_id`, `rank`, `wall_time_s` (Unix seconds) and `step` (the number of
optimizer steps completed when it was written). `to_record` turns an event into the plain dict
that is written, adding `type` and `schema_version`; `event_from_record` turns it back.

Non-finite floats (for example a gradient noise scale that is not yet estimated) are written as
JSON null, because NaN is not JSON and DuckDB's JSON reader refuses it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

SCHEMA_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class Event:
    """Fields every event has."""

    TYPE: ClassVar[str] = "event"

    run_id: str
    rank: int = 0
    step: int
    wall_time_s: float = field(default_factory=time.time)


@dataclass(frozen=True, kw_only=True)
class RunStartEvent(Event):
    """A trainer process starts (fresh or resumed) a run."""

    TYPE: ClassVar[str] = "run_start"

    model_kind: str
    model_config: dict[str, Any]
    model_fingerprint: str
    train_config: dict[str, Any]
    data_fingerprint: str
    curriculum_version: str | None
    instance_type: str
    price_usd_per_hour: float
    resumed_from: str | None = None
    # Curriculum version of the checkpoint when a resume switched to a new curriculum.
    previous_curriculum_version: str | None = None
    # Resume after a process died past its checkpoint: its telemetry recorded steps up to
    # `replay_to_step`, the checkpoint holds `replay_from_step`; the steps in between are done
    # again (preemption waste, not new training). `lost_s`: seconds billed since the checkpoint
    # that it does not hold (the billing clock restarts after them). None: fresh run, or no
    # telemetry of the run to compare with (records written before these fields also read None).
    # Since issue 31 (class 4) the three come from the trainer's run ledger
    # (`training.ledger`), never from telemetry, which anyone can add a segment to.
    replay_from_step: int | None = None
    replay_to_step: int | None = None
    lost_s: float | None = None
    # What the resume's bill ignored, one sentence each: ledger lines that failed their check,
    # telemetry figures beyond what the ledger commits (a planted or edited segment).
    billing_warnings: list[str] = field(default_factory=list)
    # Checkpoints a resume from a folder skipped because they failed their check: {path, reason}.
    skipped_checkpoints: list[dict[str, str]] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class StepEvent(Event):
    """One optimizer step finished (`step` already counts it)."""

    TYPE: ClassVar[str] = "step"

    train_loss: float
    learning_rate: float
    grad_norm: float
    grad_noise_scale: float
    micro_batch_size: int
    grad_accum_steps: int
    step_time_ms: float
    samples_seen: int
    tokens_seen: int
    elapsed_s: float
    cost_usd: float
    # "curriculum" while the curriculum's weighted subset is sampled, "anneal" at the end.
    sampler_phase: str = "curriculum"
    # Data parallelism (torchrun): every rank writes its own step event; `rank` (on Event) says
    # whose. A single process keeps the defaults (one rank, the whole batch, no wait), so
    # records written before these fields read the same.
    world_size: int = 1
    share: float = 1.0  # this rank's share of the global batch (its micro batches / global)
    micro_batches: int | None = None  # this rank's micro batches; None: all grad_accum_steps
    compute_ms: float | None = None  # its forward/backward (incl. emulated delays)
    # Waiting at the gradient all-reduce for the slowest rank: what a straggler costs the others.
    allreduce_wait_ms: float = 0.0
    allreduce_ms: float | None = None  # the all-reduce of the gradients itself


@dataclass(frozen=True, kw_only=True)
class EvalEvent(Event):
    """Loss (and accuracy for images) on the fixed held-out batches."""

    TYPE: ClassVar[str] = "eval"

    eval_loss: float
    eval_accuracy: float | None
    eval_examples: int
    eval_ms: float


@dataclass(frozen=True, kw_only=True)
class CheckpointEvent(Event):
    """A checkpoint is durable (written atomically with its manifest). `step` is the
    checkpoint's step: a background persist is recorded a few steps after its snapshot."""

    TYPE: ClassVar[str] = "checkpoint"

    path: str
    sha256: str
    size_bytes: int
    # Milliseconds training was blocked by this checkpoint (the checkpoint's overhead): for a
    # background persist the wait for the previous one plus the in-memory snapshot, for a
    # synchronous one the whole write.
    save_ms: float
    # "interval", "fast_policy", "preemption", "stop", "final", "migrate", "telemetry_failed"
    reason: str
    snapshot_ms: float | None = None  # copying the state in memory (part of save_ms)
    persist_ms: float | None = None  # serialise + write + fsync + manifest
    asynchronous: bool = False  # persisted in the background while training went on


@dataclass(frozen=True, kw_only=True)
class DecisionEvent(Event):
    """A policy decided something; the reason and the numbers behind it are kept."""

    TYPE: ClassVar[str] = "decision"

    layer: str  # "fast" or "slow"
    policy: str
    action: dict[str, Any]
    reason: str
    numbers: dict[str, float]
    observation: dict[str, Any]
    # Version of the published schedule the decision was made under (trainwise.schedule); ""
    # for a run not started on one (a library or benchmark call) and for older records.
    schedule_version: str = ""


@dataclass(frozen=True, kw_only=True)
class PreemptionEvent(Event):
    """A preemption notice (emulated spot reclaim: SIGTERM) reached the trainer."""

    TYPE: ClassVar[str] = "preemption"

    signal_name: str
    notice_s: float
    received_wall_time_s: float
    # What the trainer did: "checkpoint_and_exit", ...
    response: str


@dataclass(frozen=True, kw_only=True)
class RunEndEvent(Event):
    """The trainer process stops working on the run (it may be resumed later)."""

    TYPE: ClassVar[str] = "run_end"

    status: str
    elapsed_s: float
    cost_usd: float
    samples_seen: int
    tokens_seen: int
    final_eval_loss: float | None
    final_eval_accuracy: float | None
    checkpoint_path: str | None
    checkpoint_sha256: str | None
    error: str | None = None  # repr of the exception when status is "failed"


@dataclass(frozen=True, kw_only=True)
class BillEvent(Event):
    """The provider's bill for the run so far, written by whoever holds the nodes (rank 1000).

    This is the cost trainwise shows (MLflow `cost/usd`, Prometheus `trainwise_cost_usd`, the
    eval-loss-vs-cost plot): node-seconds at the price paid, boot, changeover, notice and idle
    time included. A step's `cost_usd` is the trainer's own compute estimate (its wall time x the
    list price), not the bill. `step` is the trainer's last step the writer knew of."""

    TYPE: ClassVar[str] = "bill"

    bill_usd: float
    provider: str
    provider_time_s: float  # on the provider's clock (the emulated one runs faster than wall)
    spot_share: float  # share of the billed node-seconds on spot
    nodes_held: int
    final: bool = False  # the run's nodes are released: this is the bill gang.json records


EVENT_TYPES: dict[str, type[Event]] = {
    cls.TYPE: cls
    for cls in (
        RunStartEvent,
        StepEvent,
        EvalEvent,
        CheckpointEvent,
        DecisionEvent,
        PreemptionEvent,
        RunEndEvent,
        BillEvent,
    )
}


def _json_safe(value: Any) -> Any:
    """NaN and infinities become None (JSON has no NaN); containers are walked."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def to_record(event: Event) -> dict[str, Any]:
    """The JSON-ready dict written for an event, with `type` and `schema_version`."""
    if type(event).TYPE not in EVENT_TYPES:
        raise TypeError(
            f"{type(event).__name__} is not a telemetry event type; use one of "
            f"{', '.join(sorted(c.__name__ for c in EVENT_TYPES.values()))}"
        )
    record = {"type": event.TYPE, "schema_version": SCHEMA_VERSION}
    record.update(_json_safe(dataclasses.asdict(event)))
    return record


def event_from_record(record: dict[str, Any]) -> Event:
    """Rebuilds the event dataclass from a record (null floats stay None)."""
    kind = record.get("type")
    if kind not in EVENT_TYPES:
        raise ValueError(
            f"telemetry record has unknown type {kind!r}; known: {', '.join(sorted(EVENT_TYPES))}"
        )
    cls = EVENT_TYPES[kind]
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in record.items() if k in names})


def share_changes(
    before: list[float] | tuple[float, ...], after: list[float] | tuple[float, ...],
    tolerance: float = 1e-6,
) -> list[tuple[int, float, float]]:
    """(rank, share before, share after) of every rank whose work share a decision changed.

    A different number of ranks (an elastic resize) counts every rank as changed. Used by
    `trainwise explain` and the Prometheus exporter to say who was re-balanced."""
    if len(before) != len(after):
        before = [math.nan] * len(after)
    return [(rank, float(old), float(new)) for rank, (old, new) in enumerate(zip(before, after))
            if not abs(float(new) - float(old)) <= tolerance]  # nan (resize) counts as changed
