"""Draws train batches from a curriculum: epoch-wise shuffled, weighted, exactly resumable.

Two phases:
- "curriculum": the curriculum's kept examples, each with its loss weight (1/keep-probability:
  unbiased rescaling, InfoBatch, Qin et al. ICLR'24);
- "anneal": the last `anneal_fraction` of `max_steps` draws from every train example with weight
  1, the quality guard InfoBatch calls annealing (the end of training sees the full data).

Within a phase the pool is shuffled once per epoch with a seeded numpy Generator; a batch that
runs past the end of an epoch takes the rest from the next permutation. The state (phase, epoch,
cursor, current permutation, generator state) round-trips through `state_dict`, so a resumed run
draws the very same batches.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from training.data_types import Curriculum, ExampleSet

PHASES = ("curriculum", "anneal")


def anneal_start_step(max_steps: int, anneal_fraction: float) -> int:
    """First step of the anneal phase: the last ceil(anneal_fraction * max_steps) steps."""
    if not 0.0 <= anneal_fraction <= 1.0:
        raise ValueError(f"anneal_fraction={anneal_fraction} must be in [0, 1]")
    return max_steps - math.ceil(anneal_fraction * max_steps)


def curriculum_pool(
    examples: ExampleSet, curriculum: Curriculum | None
) -> tuple[np.ndarray, np.ndarray]:
    """(positions, weights) of the kept train examples; all train examples at weight 1 if None."""
    if curriculum is None:
        positions = examples.train_positions
        return positions, np.ones(len(positions), dtype=np.float64)
    if curriculum.partition != examples.partition:
        raise ValueError(
            f"curriculum is for partition {curriculum.partition!r} but the examples are "
            f"{examples.partition!r}; build the curriculum from these shards"
        )
    if curriculum.data_fingerprint != examples.fingerprint:
        raise ValueError(
            f"curriculum {curriculum.version} was built from data "
            f"{curriculum.data_fingerprint[:12]} "
            f"but the examples are {examples.fingerprint[:12]}; re-materialize the curriculum"
        )
    if len(curriculum.example_ids) == 0:
        raise ValueError(
            f"curriculum {curriculum.version} keeps no examples; lower the pruning rate"
        )
    if curriculum.weights.shape != curriculum.example_ids.shape:
        raise ValueError(
            f"curriculum {curriculum.version} has {len(curriculum.weights)} weights for "
            f"{len(curriculum.example_ids)} examples; rebuild it"
        )
    weights = np.asarray(curriculum.weights, dtype=np.float64)
    if not np.all(np.isfinite(weights)) or np.any(weights <= 0):
        raise ValueError(f"curriculum {curriculum.version} has non-positive or non-finite weights")
    positions = examples.positions_of(curriculum.example_ids)
    if examples.is_eval[positions].any():
        raise ValueError(
            f"curriculum {curriculum.version} keeps held-out (eval) examples; rebuild it from "
            "the train split only"
        )
    return positions.astype(np.int64), weights


class CurriculumSampler:
    def __init__(
        self,
        examples: ExampleSet,
        curriculum: Curriculum | None,
        *,
        seed: int,
        max_steps: int,
    ) -> None:
        self.examples = examples
        self.max_steps = max_steps
        self.curriculum_version = curriculum.version if curriculum is not None else None
        fraction = curriculum.anneal_fraction if curriculum is not None else 0.0
        self.anneal_start = anneal_start_step(max_steps, fraction)
        self._pools = {
            "curriculum": curriculum_pool(examples, curriculum),
            "anneal": (
                examples.train_positions.astype(np.int64),
                np.ones(len(examples.train_positions), dtype=np.float64),
            ),
        }
        if len(self._pools["anneal"][0]) == 0:
            raise ValueError(
                f"partition {examples.partition!r} has no train examples (all are eval); "
                "rebuild the shards with a train split"
            )
        self._rng = np.random.default_rng(seed)
        self.phase = "curriculum" if self.anneal_start > 0 else "anneal"
        self.epoch = 0
        self.cursor = 0
        self._order = self._rng.permutation(len(self._pools[self.phase][0]))

    def phase_for_step(self, step: int) -> str:
        return "anneal" if step >= self.anneal_start else "curriculum"

    def _enter_phase(self, phase: str) -> None:
        # A phase change starts a fresh epoch over the new pool.
        self.phase = phase
        self.epoch += 1
        self.cursor = 0
        self._order = self._rng.permutation(len(self._pools[phase][0]))

    def next_batch(self, batch_size: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(row positions into the ExampleSet, float64 loss weights) for a batch at `step`."""
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        wanted = self.phase_for_step(step)
        if wanted != self.phase:
            self._enter_phase(wanted)
        positions, weights = self._pools[self.phase]
        taken: list[np.ndarray] = []
        needed = batch_size
        while needed > 0:
            if self.cursor >= len(self._order):
                self.epoch += 1
                self.cursor = 0
                self._order = self._rng.permutation(len(positions))
            chunk = self._order[self.cursor : self.cursor + needed]
            self.cursor += len(chunk)
            needed -= len(chunk)
            taken.append(chunk)
        picked = np.concatenate(taken)
        return positions[picked], weights[picked]

    def state_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "order": self._order.copy(),
            "rng_state": self._rng.bit_generator.state,
            "curriculum_version": self.curriculum_version,
            "pool_size": len(self._pools[self.phase][0]),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a saved state. If the curriculum changed since (the slow layer re-materialized
        it between the checkpoint and the resume), the generator and epoch count carry on and the
        curriculum phase starts a fresh epoch over the new pool; the anneal pool never changes."""
        if state["phase"] not in PHASES:
            raise ValueError(f"sampler state has unknown phase {state['phase']!r}")
        self._rng.bit_generator.state = state["rng_state"]
        self.epoch = int(state["epoch"])
        changed = state["curriculum_version"] != self.curriculum_version
        if changed and state["phase"] == "curriculum":
            self._enter_phase("curriculum")
            return
        pool_size = len(self._pools[state["phase"]][0])
        if int(state["pool_size"]) != pool_size or len(state["order"]) != pool_size:
            raise ValueError(
                f"sampler state is for a pool of {state['pool_size']} examples but this "
                f"{state['phase']} pool has {pool_size}; resume with the same data"
            )
        self.phase = state["phase"]
        self.cursor = int(state["cursor"])
        self._order = np.asarray(state["order"], dtype=np.int64).copy()
