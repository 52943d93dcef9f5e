"""One schema for a training run, from the Dagster launchpad to the trainer.

`TrainRequest` is written once, here: each field with its default and the one line a user reads
in the launchpad (`doc`). The Dagster config of the `train` job (`assets.training.TrainRunConfig`)
is built from it (`config_fields`: every field but the ones the job fills in itself), and the
trainer's `training.loop.TrainConfig` takes every field the two share by name
(`trainer_config`), so a new knob is one field here (and in `TrainConfig` if the trainer reads
it), never a hand copy in three places.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

FastPolicyName = Literal["noop", "heuristic", "goodput"]
DataSelection = Literal["static", "dynamic"]
Market = Literal["on_demand", "spot"]
# Filled in by the train job (the Dagster partition, the lineage's run id, the setting), not set
# in the launchpad.
JOB_FIELDS = ("partition", "run_id", "region")
# Set from the published schedule (`trainwise.schedule`), not in the launchpad.
SCHEDULE_FIELDS = ("schedule_version", "fast_levers", "checkpoint_interval_rule")
# Launchpad choices whose value FROM_SCHEDULE (the default there) means "the published
# schedule's"; an explicit value that differs is a departure, refused without
# schedule_override_reason. (Dagster config has no optional choice, hence a named value.)
SCHEDULED_IN_LAUNCHPAD = ("fast_policy",)
FROM_SCHEDULE = "schedule"


def _doc(default: Any, doc: str) -> Any:
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True, kw_only=True)
class TrainRequest:
    """One training run: what to train, how, and on which nodes."""

    partition: str = _doc("", "Data partition (a Dagster partition key).")
    run_id: str = _doc("", "Training run id: its run folder, telemetry and checkpoints.")
    region: str = _doc("us-west-2", "Cloud region (prices, champions); TRAINWISE_REGION.")
    max_steps: int = _doc(300, "Optimizer steps.")
    micro_batch_size: int = _doc(32, "Examples per micro-batch at start (the fast policy may "
                                 "change it).")
    grad_accum_steps: int = _doc(1, "Micro-batches per optimizer step at start.")
    learning_rate: float = _doc(1e-3, "Peak learning rate (warm-up then cosine decay).")
    eval_every_steps: int = _doc(50, "Steps between evaluations on the held-out split.")
    eval_batches: int = _doc(4, "Held-out batches per evaluation (the same batches every time).")
    eval_batch_size: int = _doc(64, "Examples per held-out batch.")
    seed: int = _doc(0, "Seed of model init, sampler and RNG streams.")
    instance_type: str = _doc("", "Instance type the node stands for; empty = "
                              "TRAINWISE_INSTANCE_TYPE.")
    fast_policy: FastPolicyName = _doc(
        "heuristic", "Fast policy run inside the loop: heuristic (noise-scale batch, notices, "
        "stragglers), goodput (Pollux: batch by measured throughput x statistical efficiency, "
        "profiled at start; one node) or noop.")
    fast_every_steps: int = _doc(10, "Steps between fast-policy decisions.")
    checkpoint_every_steps: int = _doc(100, "Steps between periodic checkpoints (0: none but "
                                       "the final one and those a notice asks for).")
    checkpoint_autotune: bool = _doc(
        False, "Re-tune the checkpoint interval while training (Young/Daly from the observed "
        "hazard and the measured save cost) instead of every checkpoint_every_steps.")
    data_selection: DataSelection = _doc(
        "static", "static (the curriculum as built) | dynamic (InfoBatch per epoch, rate steered "
        "live by the slow-policy sensor through the run's control file).")
    market: Market = _doc(
        "on_demand", "Market of the run's nodes at the compute provider (TRAINWISE_PROVIDER, "
        "emulated by default); the slow-policy sensor may move the run later (checkpoint, "
        "release, launch, resume).")
    zone: str = _doc("", "Zone of the run's nodes; empty = the provider's first zone in "
                     "TRAINWISE_REGION.")
    nodes: int = _doc(1, "Nodes launched and billed for the run: one torchrun rank each; under "
                      "an allocation_policy one trainer process stands for the gang.")
    replay_steps_per_tick: float = _doc(
        0.0, "Emulated provider, one node: trainer steps per replayed trace tick; the replay "
        "speed is set from the loop's own wall time per step at its first fast ticks, so the "
        "trace meets the run at about the same step on any machine (trainwise/replay_pace.py). "
        "0: the provider's fixed 0.5 wall s per tick.")
    lever_guard: bool = _doc(
        False, "Switch off a lever (the fast policy's batch changes, dynamic pruning) that costs "
        "quality or time against the fixed schedule's eval-loss curve; the reason shows in "
        "`trainwise explain` and MLflow.")
    lever_guard_reference_run: str = _doc(
        "", "Training run id whose eval curve is the reference (same partition and schedule); "
        "empty = the newest completed fixed-schedule run (run one first: fast_policy noop).")
    allocation_policy: str = _doc(
        "", "Empty: the nodes are market/zone/nodes, held by the in-process engine. A registered "
        "allocation policy (trainwise_heuristic, uniform_progress, on_demand, ...): it chooses "
        "spot, on-demand or waiting and the zone at every tick of the replayed spot trace, and "
        "the trainer runs as a child process on the node it holds (trainwise/supervised_run.py, "
        "the engine the end-to-end and fidelity benchmarks measure); one node, static data.")
    schedule_override_reason: str = _doc(
        "", "Why this run departs from the published schedule (a fast_policy or allocation_policy "
        "other than the schedule's); recorded with the run. Empty: a departure is refused.")
    schedule_version: str = _doc("", "Version of the published schedule the run starts on.")
    fast_levers: tuple[str, ...] = _doc((), "Fast levers that may act; empty = every registered "
                                        "lever.")
    checkpoint_interval_rule: str = _doc("trainwise", "Rule of the checkpoint-interval chooser.")


FAST_POLICIES: tuple[str, ...] = typing.get_args(FastPolicyName)
DATA_SELECTIONS: tuple[str, ...] = typing.get_args(DataSelection)


def config_fields() -> dict[str, tuple[Any, Any]]:
    """(type, pydantic Field) of every launchpad field, for `pydantic.create_model`."""
    import pydantic

    hints = typing.get_type_hints(TrainRequest)
    fields: dict[str, tuple[Any, Any]] = {}
    for f in dataclasses.fields(TrainRequest):
        if f.name in JOB_FIELDS or f.name in SCHEDULE_FIELDS:
            continue
        if f.name in SCHEDULED_IN_LAUNCHPAD:
            choice = Literal[(FROM_SCHEDULE, *typing.get_args(hints[f.name]))]  # type: ignore
            fields[f.name] = (choice, pydantic.Field(
                default=FROM_SCHEDULE, description=f"{f.metadata['doc']} {FROM_SCHEDULE!r}: the "
                "published schedule's (trainwise.schedule)."))
        else:
            fields[f.name] = (hints[f.name], pydantic.Field(default=f.default,
                                                            description=f.metadata["doc"]))
    return fields


def shared_with_trainer() -> set[str]:
    """The request's fields the trainer takes as they are (the rest steer the driver)."""
    from training.loop import TrainConfig

    return {f.name for f in dataclasses.fields(TrainConfig)} & {
        f.name for f in dataclasses.fields(TrainRequest)}


def trainer_config(request: TrainRequest, **derived: Any) -> Any:
    """The trainer's `TrainConfig`: every field it shares with the request by name, then what
    the driver derives (price, thread count, the guard's curve, ...), which wins."""
    from training.loop import TrainConfig

    passed = {name: getattr(request, name) for name in sorted(shared_with_trainer())}
    return TrainConfig(**{**passed, **derived})
