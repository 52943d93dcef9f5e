"""The two data contracts between data preparation and the trainer.

`ExampleSet` is what `training.shards.load_shards` returns; `Curriculum` is what
`training.curriculum.build_curriculum` writes and `load_curriculum` reads. The trainer consumes
both and never reads parquet itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np


@dataclass(frozen=True)
class ExampleSet:
    """Every example of one data partition, train and eval, in memory.

    text:  inputs int64 (N, block_size + 1) token ids; target of position t is input t + 1.
    image: inputs uint8 (N, 28, 28); labels int64 (N,).
    """

    partition: str
    kind: Literal["text", "image"]
    example_ids: np.ndarray  # int64 (N,), unique within the partition, stable across rebuilds
    is_eval: np.ndarray  # bool (N,): held-out split, fixed at shard build time
    inputs: np.ndarray
    labels: np.ndarray | None
    vocab: tuple[str, ...] | None  # text: index -> character; image: None
    shard_index: np.ndarray  # int32 (N,): which shard file each example came from
    fingerprint: str  # sha256 over the shard checksums: changes iff the data changes

    @property
    def train_positions(self) -> np.ndarray:
        return np.flatnonzero(~self.is_eval)

    @property
    def eval_positions(self) -> np.ndarray:
        return np.flatnonzero(self.is_eval)

    def positions_of(self, example_ids: np.ndarray) -> np.ndarray:
        """Row positions of the given example ids (raises KeyError naming a missing id)."""
        order = np.argsort(self.example_ids)
        found = np.searchsorted(self.example_ids, example_ids, sorter=order)
        found = np.clip(found, 0, len(order) - 1)
        positions = order[found]
        bad = self.example_ids[positions] != example_ids
        if bad.any():
            missing = int(np.asarray(example_ids)[bad][0])
            raise KeyError(
                f"example id {missing} is not in partition {self.partition!r}; "
                "the curriculum was built from other shards: re-materialize the curriculum"
            )
        return positions


@dataclass(frozen=True)
class Curriculum:
    """A versioned manifest of the train examples kept and the loss weight of each.

    Weights implement unbiased rescaling: an example kept with probability p has weight 1/p, so
    the expected gradient equals the full-data gradient (InfoBatch, Qin et al. ICLR'24).
    """

    partition: str
    version: str  # content hash of (ids, weights, rate, data fingerprint)
    example_ids: np.ndarray  # int64 (K,) kept train examples
    weights: np.ndarray  # float64 (K,) loss weights, >= 1
    pruning_rate: float  # in [0, 1): 0 keeps all
    data_fingerprint: str  # ExampleSet.fingerprint the curriculum was built from
    scores_step: int | None  # training step of the model that scored the examples; None = proxy
    # Last share of training that uses full data with weight 1 (quality guard).
    anneal_fraction: float = 0.125
