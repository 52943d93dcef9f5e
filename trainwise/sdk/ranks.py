"""Several ranks of one run (torchrun): the process group, and the few small collectives that keep
the ranks' checkpoints at the same steps.

A run of `world_size > 1` ranks trains one model, so its ranks must stop at one step boundary and
resume from one step: a rank that left alone on its own notice would leave the others blocked in
their next gradient all-reduce, and a resume that took each rank's own newest checkpoint would
start the ranks at different steps after a crash between two ranks' commits. `Ranks` holds what
it takes, each a one-element all-reduce or broadcast:

- `join(spec, device)`: the process group from torchrun's environment (env://), nccl when the
  run's device is a GPU and gloo otherwise (`spec.dist_backend` names one); a group the job
  initialised itself is used as it is and left to the job to destroy;
- `max_float`, `min_int`, `all_true`, `any_true`, `same_everywhere`, `from_rank0`: the
  agreements `trainwise.sdk.run` asks for (a notice at each step, the fast action, a resume);
- `agree_on_step(ranks, steps, load, tag)`: the newest checkpoint step every rank can load, each
  loaded checkpoint written by the same start of the run.

The small tensors live on the rank's GPU for nccl (nccl reduces device memory only) and on the
CPU for gloo.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainwise.sdk.spec import RunSpec, RunSpecError

TORCHRUN_ADDRESS = ("MASTER_ADDR", "MASTER_PORT")


@dataclass
class Ranks:
    rank: int
    world_size: int
    backend: str
    device: torch.device  # where the collectives' tensors live
    created: bool  # the SDK initialised the group, so it destroys it at the end

    def _reduce(self, values: list[float], dtype: torch.dtype, op: Any) -> list[float]:
        tensor = torch.tensor(values, dtype=dtype, device=self.device)
        dist.all_reduce(tensor, op=op)
        return tensor.tolist()

    def max_float(self, value: float) -> float:
        return float(self._reduce([value], torch.float64, dist.ReduceOp.MAX)[0])

    def min_int(self, value: int) -> int:
        return int(self._reduce([value], torch.int64, dist.ReduceOp.MIN)[0])

    def all_true(self, flag: bool) -> bool:
        return self.min_int(int(bool(flag))) == 1

    def any_true(self, flag: bool) -> bool:
        return self.min_int(-int(bool(flag))) == -1

    def same_everywhere(self, value: int) -> bool:
        """True when every rank passed the same `value` (one all-reduce: max(v) == -max(-v))."""
        high, minus_low = self._reduce([value, -value], torch.int64, dist.ReduceOp.MAX)
        return int(high) == -int(minus_low)

    def from_rank0(self, values: list[int]) -> list[int]:
        tensor = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.broadcast(tensor, src=0)
        return [int(v) for v in tensor.tolist()]

    def close(self) -> None:
        """Destroys the group if the SDK made it; a job's own group is the job's to destroy."""
        if self.created and dist.is_initialized():
            dist.destroy_process_group()
        self.created = False


def _backend(asked: str, device: torch.device) -> str:
    if asked == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if asked == "nccl" and device.type != "cuda":
        raise RunSpecError(f"dist_backend 'nccl' needs the run on a GPU, but its device is "
                           f"{device}: use dist_backend 'gloo' (or 'auto') on the CPU")
    return asked


def _tensor_device(backend: str, device: torch.device) -> torch.device:
    if backend != "nccl":
        return torch.device("cpu")
    # A job's own nccl group on a run placed on the CPU still reduces on its current GPU.
    return device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())


def join(spec: RunSpec, device: torch.device) -> Ranks | None:
    """This process's place in the run's process group (None for a single process); initialises
    the group from torchrun's environment when the job has not."""
    if spec.world_size < 2:
        return None
    if not dist.is_available():
        raise RunSpecError(f"world_size {spec.world_size}: this torch build ({torch.__version__}) "
                           "has no torch.distributed, so the ranks cannot stop together on a "
                           "notice; install a torch with distributed support, or run one process")
    if dist.is_initialized():
        theirs = (dist.get_rank(), dist.get_world_size())
        if theirs != (spec.rank, spec.world_size):
            raise RunSpecError(f"the process group this job initialised is rank {theirs[0]} of "
                               f"{theirs[1]}, the run spec rank {spec.rank} of {spec.world_size}: "
                               "launch with the same rank count the spec names (or drop "
                               "rank/world_size from trainwise.init's arguments)")
        backend = str(dist.get_backend())
        return Ranks(spec.rank, spec.world_size, backend, _tensor_device(backend, device), False)
    backend = _backend(spec.dist_backend, device)
    missing = [name for name in TORCHRUN_ADDRESS if not os.environ.get(name)]
    if missing:
        raise RunSpecError(f"world_size {spec.world_size} (rank {spec.rank}) but {missing} is "
                           "not set, so the ranks cannot find each other: launch them with "
                           "torchrun (it sets these), or call torch.distributed."
                           "init_process_group yourself before trainwise.init()")
    if backend == "nccl":
        torch.cuda.set_device(device)  # nccl binds the group to the current device
    dist.init_process_group(backend, init_method="env://", rank=spec.rank,
                            world_size=spec.world_size,
                            timeout=timedelta(seconds=spec.collective_timeout_s))
    return Ranks(spec.rank, spec.world_size, backend, _tensor_device(backend, device), True)


def agree_on_step(ranks: Ranks, steps: Iterable[int], load: Callable[[int], Any],
                  tag: Callable[[Any], int]) -> tuple[int, Any] | None:
    """The newest step that every rank can `load` (None when there is none) and this rank's
    load of it. `steps`: the steps this rank holds (local or committed to the store); `tag`: the
    start of the run that wrote a loaded checkpoint, which must be the same on every rank (a
    rank that kept a checkpoint of a later step from a start that was abandoned holds another
    history at that step). Every rank calls it: each round is two or three all-reduces, and
    each round drops the step it tried, so it ends."""
    mine = set(steps)
    while True:
        step = ranks.min_int(max(mine, default=-1))
        if step < 0:
            return None
        loaded = load(step) if step in mine else None
        if ranks.all_true(loaded is not None) and ranks.same_everywhere(tag(loaded)):
            return step, loaded
        mine = {s for s in mine if s < step}
