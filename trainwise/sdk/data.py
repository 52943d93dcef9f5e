"""The SDK's data path: a batch order that a checkpoint can hold and a resume can continue exactly.

`ResumableBatchSampler` draws each epoch's order from the run's seed and the epoch number only
(a permutation by numpy's PCG64), so the order of any epoch is known without replaying the ones
before it. Its position is counted in samples, not batches, so a batch size the fast layer changes
mid-epoch resumes at the right example.

`TrackedLoader` wraps the `torch.utils.data.DataLoader` built on it. What a checkpoint records is
the position after the last batch *handed to the user's loop*, not after the last batch the
sampler produced: with worker processes a DataLoader draws batches ahead of the loop, and those
were not trained on. Each batch the sampler yields queues the position after it; the loader pops
one per batch it hands over.

Data selection: `select` keeps only the given example indices (a curriculum's kept set); the
sampler draws its order over those. Multi-rank: every rank draws the same global order and takes
its own slice of each global batch (the global batch is `batch_size * world_size`).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch


class DataChangedError(ValueError):
    """The dataset a resume sees is not the one its checkpoint was trained on."""


def ids_fingerprint(n_examples: int, ids: Sequence[Any] | np.ndarray | None,
                    select: np.ndarray | None) -> str:
    digest = hashlib.sha256(f"n={n_examples};".encode())
    if ids is not None:
        digest.update(np.asarray([str(i) for i in ids]).astype("U").tobytes())
    if select is not None:
        digest.update(b"select:" + np.asarray(select, dtype=np.int64).tobytes())
    return digest.hexdigest()


class ResumableBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Batches of dataset indices; one epoch per `iter`; `state_dict` / `load_state_dict`."""

    def __init__(self, n_examples: int, batch_size: int, *, seed: int, shuffle: bool = True,
                 drop_last: bool = False, select: Sequence[int] | None = None,
                 rank: int = 0, world_size: int = 1) -> None:
        if n_examples < 1:
            raise ValueError("the dataset is empty: there is nothing to train on")
        if batch_size < 1:
            raise ValueError(f"batch_size {batch_size} must be >= 1")
        self.indices = (np.arange(n_examples, dtype=np.int64) if select is None
                        else np.unique(np.asarray(select, dtype=np.int64)))
        if select is not None and (self.indices.size == 0 or self.indices[0] < 0
                                   or self.indices[-1] >= n_examples):
            raise ValueError(f"select must name indices in 0..{n_examples - 1} (got "
                             f"{self.indices.size} after removing duplicates)")
        self.n_examples, self.seed, self.shuffle, self.drop_last = (
            n_examples, seed, shuffle, drop_last)
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.epoch = 0
        self.cursor = 0  # samples of this epoch's order already handed out (all ranks)
        # (epoch, cursor) after each batch yielded and not yet handed to the loop, with its indices
        self.positions: collections.deque[tuple[tuple[int, int], list[int]]] = collections.deque()
        self._order_epoch, self._order = -1, self.indices

    def order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            if self.shuffle:
                generator = np.random.Generator(np.random.PCG64([self.seed, epoch]))
                self._order = self.indices[generator.permutation(self.indices.size)]
            else:
                self._order = self.indices
            self._order_epoch = epoch
        return self._order

    def _global_batch(self) -> int:
        return self.batch_size * self.world_size

    def batches_per_epoch(self) -> int:
        """This rank's batches in a whole epoch (not what is left of the current one): what a
        framework that sizes its epochs once from len(loader) (HF Trainer, Lightning) is told."""
        size = self._global_batch()
        full, left = divmod(int(self.indices.size), size)
        if self.drop_last:
            return full
        return full + (1 if left > self.rank * self.batch_size else 0)

    def __len__(self) -> int:
        left = self.indices.size - self.cursor
        size = self._global_batch()
        return left // size if self.drop_last else -(-left // size)

    def __iter__(self) -> Iterator[list[int]]:
        self.positions.clear()
        epoch, cursor = self.epoch, self.cursor
        order = self.order(epoch)
        while cursor < order.size:
            size = self._global_batch()  # read each batch: the fast layer may have changed it
            chunk = order[cursor:cursor + size]
            if self.drop_last and chunk.size < size:
                break
            cursor += chunk.size
            mine = chunk[self.rank * self.batch_size:(self.rank + 1) * self.batch_size].tolist()
            self.cursor = cursor
            if mine:  # the last short global batch may hold nothing for this rank
                after = (epoch, cursor) if cursor < order.size else (epoch + 1, 0)
                self.positions.append((after, mine))
                yield mine
        self.epoch, self.cursor = epoch + 1, 0

    # The position a checkpoint holds is set by TrackedLoader (delivered batches only).
    def state_dict(self, delivered: tuple[int, int]) -> dict[str, Any]:
        return {"epoch": delivered[0], "cursor": delivered[1], "batch_size": self.batch_size,
                "seed": self.seed, "n_examples": self.n_examples, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "n_selected": int(self.indices.size)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in ("seed", "n_examples", "shuffle", "drop_last", "n_selected"):
            mine = int(self.indices.size) if name == "n_selected" else getattr(self, name)
            if state.get(name) != mine:
                raise DataChangedError(
                    f"the checkpoint's data order has {name}={state.get(name)!r}, this run "
                    f"{mine!r}: resume with the dataset and loader arguments it was trained "
                    "with, or start a new run (another run_id)")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.batch_size = int(state["batch_size"])


class TrackedLoader:
    """Iterates a DataLoader built on a ResumableBatchSampler and keeps the delivered position."""

    def __init__(self, loader: torch.utils.data.DataLoader, sampler: ResumableBatchSampler,
                 ids: np.ndarray | None, on_batch: Any = None) -> None:
        self.loader, self.sampler, self.ids, self._on_batch = loader, sampler, ids, on_batch
        self.delivered: tuple[int, int] = (sampler.epoch, sampler.cursor)
        self.last_indices: list[int] = []

    @property
    def batch_size(self) -> int:
        return self.sampler.batch_size

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            self.delivered, self.last_indices = self.sampler.positions.popleft()
            if self._on_batch is not None:
                self._on_batch(self)
            yield batch
        self.delivered = (self.sampler.epoch, self.sampler.cursor)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict(self.delivered)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
        self.delivered = (self.sampler.epoch, self.sampler.cursor)

    def example_ids(self, indices: list[int]) -> list[Any]:
        if self.ids is None:
            return list(indices)
        return [self.ids[i].item() if hasattr(self.ids[i], "item") else self.ids[i]
                for i in indices]

