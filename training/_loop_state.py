"""What `training.loop` checkpoints and restores, and the checks on its inputs.

`RunState.lineage` is a random id drawn when a run starts fresh and restored on every resume:
`training.checkpoint` writes it (with the run id, the step, the checkpoint it follows, the data
and model fingerprints and the seed) into each checkpoint's signed manifest, so a checkpoint of
another run, or of another history of this run id, is told apart from the run's own.
"""

from __future__ import annotations

import dataclasses
import math
import random
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from training._loop_step import GradNoiseScale
from training.checkpoint import arrays_from_tensors, to_checkpoint_types
from training.data_types import Curriculum, ExampleSet
from training.model import CNNConfig, GPTConfig, config_dict, model_fingerprint
from training.sampler import TrainSampler

STATE_FORMAT = "trainwise-train-state-2"  # 2: tensors and plain data only (weights-only load)


@dataclass
class RunState:
    """The mutable progress of a run; every field goes into the checkpoint."""

    run_id: str
    step: int = 0
    # Current batch shape and learning-rate multiplier: the fast policy may have changed them.
    micro_batch_size: int = 1
    grad_accum_steps: int = 1
    lr_scale: float = 1.0
    samples_seen: int = 0
    tokens_seen: int = 0
    elapsed_s: float = 0.0  # across all processes that worked on the run
    cost_usd: float = 0.0
    last_eval_loss: float | None = None
    last_eval_accuracy: float | None = None
    last_eval_step: int | None = None
    last_checkpoint_elapsed_s: float = 0.0
    last_checkpoint_cost_s: float = math.nan  # nan until a checkpoint was written
    noise_scale: GradNoiseScale = field(default_factory=GradNoiseScale)
    # Under torchrun: each rank's share of the global batch, set at fast ticks (empty = equal
    # shares; a single process never uses it).
    rank_work_shares: list[float] = field(default_factory=list)
    # Levers the guard switched off in this run (lever -> reason): they stay off on resume.
    levers_off: dict[str, str] = field(default_factory=dict)
    # Drawn at a fresh start, kept by resumes (module docstring); binds checkpoints to this run.
    lineage: str = field(default_factory=lambda: uuid.uuid4().hex)


def default_model_config(examples: ExampleSet) -> GPTConfig | CNNConfig:
    """The default model for the data: GPT over its vocabulary and block, or the 10-class CNN."""
    if examples.kind == "text":
        if not examples.vocab:
            raise ValueError(
                f"text partition {examples.partition!r} has no vocab; rebuild its shards"
            )
        return GPTConfig(vocab_size=len(examples.vocab), block_size=examples.inputs.shape[1] - 1)
    return CNNConfig()


def check_examples_fit(examples: ExampleSet, config: GPTConfig | CNNConfig) -> None:
    """Raises if the data cannot be fed to a model of `config`."""
    if examples.kind == "text":
        if not isinstance(config, GPTConfig):
            raise ValueError(f"text partition {examples.partition!r} needs a GPTConfig model")
        if examples.inputs.ndim != 2 or examples.inputs.shape[1] < 2:
            raise ValueError(
                f"text inputs must be (N, block_size + 1), got {examples.inputs.shape}"
            )
        if examples.inputs.shape[1] - 1 > config.block_size:
            raise ValueError(
                f"examples have {examples.inputs.shape[1] - 1} tokens but the model's "
                f"block_size is {config.block_size}; use a model with block_size >= that"
            )
        if len(examples.inputs) and int(examples.inputs.max()) >= config.vocab_size:
            raise ValueError(
                f"token id {int(examples.inputs.max())} >= vocab_size {config.vocab_size}; "
                "use a model with the partition's vocabulary size"
            )
    elif examples.kind == "image":
        if not isinstance(config, CNNConfig):
            raise ValueError(f"image partition {examples.partition!r} needs a CNNConfig model")
        if examples.labels is None or len(examples.labels) != len(examples.inputs):
            raise ValueError(f"image partition {examples.partition!r} needs one label per image")
        if len(examples.labels) and int(examples.labels.max()) >= config.num_classes:
            raise ValueError(
                f"label {int(examples.labels.max())} >= num_classes {config.num_classes}; "
                "use a model with enough classes"
            )
    else:
        raise ValueError(f"unknown ExampleSet kind {examples.kind!r}; use 'text' or 'image'")


def rank_state(sampler: TrainSampler) -> dict[str, Any]:
    """This process's sampler position and RNGs (each torchrun rank saves its own)."""
    return {
        "sampler": sampler.state_dict(),
        "rng": {
            "torch": torch.get_rng_state(),
            # The dict form: {"bit_generator", "state": {"key", "pos"}, "has_gauss", "gauss"}.
            "numpy": np.random.get_state(legacy=False),
            "python": random.getstate(),  # (version, tuple of 625 ints, gauss_next)
        },
    }


def build_state(
    *,
    run: RunState,
    model_kind: str,
    model_config: GPTConfig | CNNConfig,
    train_config: dict[str, Any],
    examples: ExampleSet,
    curriculum: Curriculum | None,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    sampler: TrainSampler,
) -> dict[str, Any]:
    """Everything needed to resume exactly, as tensors and plain data (see training.checkpoint:
    the file is loaded weights-only, so no numpy arrays, numpy scalars or custom classes).

    Numpy arrays (sampler order, loss table, the numpy RNG key) become tensors of the same dtype;
    `restore_state` turns them back into arrays. Model and optimizer state dicts are kept as
    they are (tensors already; the model's OrderedDict keeps its `_metadata`).
    """
    state = dataclasses.asdict(run)
    state.update(rank_state(sampler))
    state.update(
        format=STATE_FORMAT,
        model_kind=model_kind,
        model_config=config_dict(model_config),
        model_fingerprint=model_fingerprint(model_kind, model_config),
        train_config=train_config,
        partition=examples.partition,
        data_fingerprint=examples.fingerprint,
        curriculum_version=curriculum.version if curriculum is not None else None,
    )
    state = to_checkpoint_types(state)
    state.update(model=model.state_dict(), optimizer=optimizer.state_dict())
    return state


def restore_state(
    state: dict[str, Any],
    *,
    examples: ExampleSet,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    sampler: TrainSampler,
    source: str,
    rank: int = 0,
    world_size: int = 1,
) -> RunState:
    """Loads model, optimizer, sampler and RNGs from `state`; returns the run's progress.

    A checkpoint of a torchrun run holds every rank's RNG and sampler state (`ranks`, see
    `rank_state`); it resumes only at the world size that wrote it."""
    saved_world = int(state.get("world_size", 1))
    if saved_world != world_size:
        raise ValueError(
            f"checkpoint {source} was written by a run of {saved_world} rank(s) but this run has "
            f"{world_size}: each rank's sampler position and RNG are saved for {saved_world}. "
            f"Resume with torchrun --nproc_per_node={saved_world} (times --nnodes), or start "
            "fresh"
        )
    if state.get("format") != STATE_FORMAT:
        raise ValueError(
            f"checkpoint {source} holds {state.get('format')!r}, not {STATE_FORMAT!r}; start fresh"
        )
    if state["data_fingerprint"] != examples.fingerprint:
        raise ValueError(
            f"checkpoint {source} was trained on data {state['data_fingerprint'][:12]} of "
            f"partition {state['partition']!r}, but these examples are "
            f"{examples.fingerprint[:12]} of {examples.partition!r}; resume with the same shards "
            "or start fresh"
        )
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    own = state["ranks"][rank] if world_size > 1 else state
    sampler.load_state_dict(arrays_from_tensors(own["sampler"]))
    torch.set_rng_state(own["rng"]["torch"])
    np.random.set_state(arrays_from_tensors(own["rng"]["numpy"]))
    version, internal, gauss_next = own["rng"]["python"]
    random.setstate((version, tuple(internal), gauss_next))
    names = {f.name for f in dataclasses.fields(RunState)}
    values = {k: v for k, v in state.items() if k in names}
    values["noise_scale"] = GradNoiseScale(**state["noise_scale"])
    values["rank_work_shares"] = [float(s) for s in state.get("rank_work_shares", [])]
    values["levers_off"] = {str(k): str(v) for k, v in state.get("levers_off", {}).items()}
    return RunState(**values)
