"""Data parallelism for `training.loop`: torchrun + DistributedDataParallel with per-rank shares.

Switched on only when torch.distributed is initialised with more than one rank (under torchrun,
`training.ddp_worker` initialises it from WORLD_SIZE/RANK/MASTER_ADDR); a single process never
touches this module's collectives and keeps its bit-exact path.

How a step is split (the global batch is what a single process with the same `micro_batch_size`
and `grad_accum_steps` would train on):

- Every rank keeps an identical sampler and draws the whole global batch, `grad_accum_steps`
  micro batches in the same order as a single process would; rank r trains on its contiguous
  run of `counts[r]` of them (`micro_counts`: the fast policy's `rank_work_shares` rounded to
  whole micro batches, at least one each). Drawing is index arithmetic, so the duplicate draws
  cost nothing, and the partition is exact and deterministic for any shares.
- Gradient weighting: each micro batch's loss is mean(per-example loss x weight) / A with A the
  global number of micro batches, exactly as in the single process; the ranks' gradients are
  summed (all-reduce SUM), so sum over the global batch / global batch size comes out whatever
  the shares. DDP's own reducer would average (divide by world size) and fire on every rank's
  last backward; with uneven micro-batch counts and a wait to measure, every backward runs under
  `no_sync` and the gradients are all-reduced once per step here, after a small timed exchange of
  per-rank figures: the time spent in that exchange is the rank's wait for the slowest one.
  (Costs the overlap of all-reduce with backward, which a tiny model does not miss.)
- After the SUM every rank holds the same gradient, clips it the same way and takes the same
  optimizer step, so the replicas stay identical without a broadcast.

Telemetry: every rank writes its own segments (`rank<R>/`); its StepEvent carries world_size,
its share and micro batches, its compute time and its wait at the all-reduce (the rank fields
of `telemetry.events.StepEvent`). A preemption notice (SIGTERM) on any rank rides on the same
per-step exchange (a max over ranks), so the gang stops at one step boundary and rank 0 writes
one checkpoint.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from training import _loop_fast as fast
from training._loop_persist import CheckpointWriteError
from training._loop_run import LoopRun
from training._loop_state import build_state, rank_state
from training._loop_step import StepOutcome, batch_tensors
from training.checkpoint import to_checkpoint_types
from training.data_types import ExampleSet
from training.sampler import TrainSampler


@dataclass(frozen=True)
class Emulation:
    """Benchmarks only: an emulated device and straggler for one rank.

    `micro_batch_ms`: device time per micro batch, slept on top of the real forward/backward
    (on CPUs shared with other jobs, real compute time measures the neighbours, not the share);
    `slowdown`: step -> factor >= 1 that stretches this rank's compute (replayed traces)."""

    micro_batch_ms: float = 0.0
    slowdown: Callable[[int], float] | None = None


@dataclass
class DistContext:
    rank: int
    world_size: int
    backend: str
    device: torch.device
    emulation: Emulation | None = None  # benchmarks only


def current() -> DistContext | None:
    """The context when torch.distributed runs more than one rank, else None (single process)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    backend = str(dist.get_backend())
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), backend=backend,
                       device=device)


def init_from_env() -> DistContext | None:
    """Initialises the process group from torchrun's environment when WORLD_SIZE > 1:
    nccl when CUDA is present, gloo on CPU. Returns None for a single process."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # The store of torchrun's agent outlives a restart of the gang (elastic membership):
        # the ranks' addresses of the previous attempt are still in it, and a restarted rank
        # that read them would try to connect to a dead peer. A prefix per attempt keeps the
        # attempts apart.
        store, rank, world_size = next(dist.rendezvous("env://"))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend, store=dist.PrefixStore(f"trainwise/{attempt}", store),
                                rank=rank, world_size=world_size)
    return current()


def micro_counts(total: int, shares: Sequence[float]) -> tuple[int, ...]:
    """`total` micro batches split by `shares` (largest remainder), at least one per rank."""
    n = len(shares)
    if total < n:
        raise ValueError(
            f"grad_accum_steps={total} micro batches cannot give each of {n} ranks one; set "
            f"TrainConfig.grad_accum_steps >= {n} (it is the global count under torchrun)"
        )
    ideal = [max(0.0, s) * total for s in shares]
    counts = [max(1, math.floor(x)) for x in ideal]
    while sum(counts) < total:  # largest remainder first (lowest rank on ties)
        counts[max(range(n), key=lambda i: (ideal[i] - counts[i], -i))] += 1
    while sum(counts) > total:  # the floor of one gave too many: take from the most over
        counts[max((i for i in range(n) if counts[i] > 1),
                   key=lambda i: (counts[i] - ideal[i], -i))] -= 1
    return tuple(counts)


def all_gather_floats(values: Sequence[float], ctx: DistContext) -> list[list[float]]:
    mine = torch.tensor(list(values), dtype=torch.float64, device=ctx.device)
    parts = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(parts, mine)
    return [p.cpu().tolist() for p in parts]


def all_gather_object(value: Any, ctx: DistContext) -> list[Any]:
    parts: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(parts, value)
    return parts


def broadcast_object(value: Any, ctx: DistContext, src: int = 0) -> Any:
    box = [value if ctx.rank == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


@contextmanager
def gang_lock(out_dir: Path, ctx: DistContext, take: Callable[[], Any]) -> Iterator[None]:
    """Rank 0 takes the run-folder lock (`take()` returns a context manager); every rank learns
    whether it got it, so a refused lock stops the whole gang instead of leaving ranks waiting."""
    held = None
    error: BaseException | None = None
    if ctx.rank == 0:
        try:
            held = take()
            held.__enter__()
        except BaseException as caught:  # noqa: BLE001 - re-raised on every rank below
            error, held = caught, None
    refused = broadcast_object(repr(error) if error is not None else None, ctx)
    if error is not None:
        raise error
    if refused is not None:
        raise RuntimeError(f"rank 0 could not start the run in {out_dir}: {refused}")
    try:
        yield
    finally:
        if held is not None:
            held.__exit__(None, None, None)


def wrap_model(model: nn.Module, ctx: DistContext) -> nn.parallel.DistributedDataParallel:
    """DDP around the (already placed) model. No buffer broadcast: it is a collective per
    forward, and ranks run different numbers of forwards under uneven shares."""
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids,
                                               broadcast_buffers=False)


@dataclass(frozen=True)
class RankStep:
    outcome: StepOutcome
    counts: tuple[int, ...]
    compute_ms: tuple[float, ...]  # every rank's, gathered
    wait_ms: float  # this rank's
    allreduce_ms: float
    flags: tuple[float, ...]  # max over ranks of the flags passed in


def _sum_gradients(model: nn.Module) -> None:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def train_step_distributed(
    *,
    ddp: nn.parallel.DistributedDataParallel,
    optimizer: torch.optim.Optimizer,
    sampler: TrainSampler,
    examples: ExampleSet,
    step: int,
    learning_rate: float,
    micro_batch_size: int,
    grad_accum_steps: int,
    shares: Sequence[float],
    grad_clip: float,
    ctx: DistContext,
    flags: Sequence[float] = (),
) -> RankStep:
    """One optimizer step of the global batch, this rank's part of it (module docstring).
    `flags` (e.g. a pending preemption notice) are exchanged with the figures: every rank gets
    their maximum over ranks, so all of them act on the same step boundary."""
    model = ddp.module
    model.train()
    for group in optimizer.param_groups:
        group["lr"] = learning_rate
    counts = micro_counts(grad_accum_steps, shares)
    first = sum(counts[: ctx.rank])
    mine = range(first, first + counts[ctx.rank])
    began = time.perf_counter()
    loss_sum = 0.0
    with ddp.no_sync():
        for index in range(grad_accum_steps):
            positions, weights = sampler.next_batch(micro_batch_size, step)  # same on all ranks
            if index not in mine:
                continue
            inputs, targets = batch_tensors(examples, positions)
            inputs, targets = inputs.to(ctx.device), targets.to(ctx.device)
            _, per_example = ddp(inputs, targets, reduction="none")
            weight = torch.from_numpy(weights).to(per_example.dtype).to(ctx.device)
            loss = (per_example * weight).mean()
            (loss / grad_accum_steps).backward()
            loss_sum += loss.item() / grad_accum_steps
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    emulation = ctx.emulation
    if emulation is not None:
        time.sleep(emulation.micro_batch_ms * len(mine) / 1000.0)
        if emulation.slowdown is not None:  # a slower device: the same work takes longer
            compute_s = time.perf_counter() - began
            time.sleep(max(0.0, emulation.slowdown(step) - 1.0) * compute_s)
    compute_ms = (time.perf_counter() - began) * 1000.0
    waited = time.perf_counter()
    gathered = all_gather_floats([compute_ms, loss_sum, *flags], ctx)
    wait_ms = (time.perf_counter() - waited) * 1000.0
    reduced = time.perf_counter()
    _sum_gradients(model)
    allreduce_ms = (time.perf_counter() - reduced) * 1000.0
    max_norm = grad_clip if grad_clip > 0 else math.inf
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    train_loss = sum(row[1] for row in gathered)
    return RankStep(
        outcome=StepOutcome(train_loss=train_loss, grad_norm=grad_norm), counts=counts,
        compute_ms=tuple(row[0] for row in gathered), wait_ms=wait_ms, allreduce_ms=allreduce_ms,
        flags=tuple(max(row[2 + i] for row in gathered) for i in range(len(flags))),
    )


@dataclass
class DistributedLoopRun(LoopRun):
    """`LoopRun` for one rank of a torchrun gang: same loop, collective steps and decisions.

    Everything that decides where the loop goes next is the same on every rank: the fast
    policy runs on rank 0 and its action is broadcast; a preemption notice or a failed
    telemetry write on any rank reaches all of them through the per-step exchange, so every
    rank stops at the same step boundary; rank 0 writes the one checkpoint.
    """

    ctx: DistContext | None = None
    ddp: nn.parallel.DistributedDataParallel | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        assert self.ctx is not None and self.ddp is not None
        self.rank = self.ctx.rank
        if len(self.run.rank_work_shares) != self.ctx.world_size:  # fresh run
            self.run.rank_work_shares = [1.0 / self.ctx.world_size] * self.ctx.world_size
        self._gang_notice_rank: int | None = None  # a rank that got a notice, once exchanged
        self._local_notice = False
        self._gang_telemetry_failed = False
        self._rank_times_ms: tuple[float, ...] = ()

    def _telemetry_failed(self) -> bool:
        # Only the exchanged flag (as for a notice): a rank acting on its own failed write
        # would checkpoint alone and leave the others waiting in the next collective.
        return self._gang_telemetry_failed

    def _notice_pending(self, notice: fast.PreemptionSignal) -> bool:
        # Only the exchanged flag: a notice that arrived on this rank since the last exchange
        # is seen by all ranks after the next step (the flag rides on the per-step exchange of
        # figures, a max over ranks: no extra collective). A rank that got no signal of its own
        # records the gang's notice as its own, so its preemption event and the fast policy's
        # observation on rank 0 say where the notice came from and how much of it is left.
        self._local_notice = notice.pending
        if self._gang_notice_rank is None:
            return False
        if not notice.pending:
            notice.notify(f"SIGTERM to rank {self._gang_notice_rank} (gang notice)")
        return True

    def _update(self, learning_rate: float, micro: int,
                accum: int) -> tuple[StepOutcome, float, dict[str, Any]]:
        """This rank's part of the global batch, then the collective reduce; the per-step
        exchange carries the notice and telemetry flags (no gradient noise scale: nan)."""
        assert self.ctx is not None and self.ddp is not None
        # Notice flag: 1 + the rank that got it (0: none), so the max names one of them.
        flags = (float(self.rank + 1) if self._local_notice else 0.0,
                 float(self.telemetry_error is not None))
        done = train_step_distributed(
            ddp=self.ddp, optimizer=self.optimizer, sampler=self.sampler,
            examples=self.examples, step=self.run.step, learning_rate=learning_rate,
            micro_batch_size=micro, grad_accum_steps=accum, shares=self.run.rank_work_shares,
            grad_clip=self.config.grad_clip, ctx=self.ctx, flags=flags,
        )
        self._gang_notice_rank = int(done.flags[0]) - 1 if done.flags[0] > 0 else None
        self._gang_telemetry_failed = done.flags[1] > 0
        self._rank_times_ms = done.compute_ms
        mine = done.counts[self.rank]
        return done.outcome, math.nan, {
            "world_size": self.ctx.world_size, "share": mine / accum, "micro_batches": mine,
            "compute_ms": done.compute_ms[self.rank], "allreduce_wait_ms": done.wait_ms,
            "allreduce_ms": done.allreduce_ms}

    def _observation(self, last: dict[str, Any], notice_s: float | None) -> Any:
        return dataclasses.replace(super()._observation(last, notice_s),
                                   rank_step_time_ms=self._rank_times_ms)

    def _decide(self, observation: Any) -> tuple[Any, dict[str, float] | None]:
        """Rank 0 asks the policy with every rank's step time and broadcasts the action (or
        its error, re-raised on every rank); rank 0 alone writes the decision record."""
        assert self.ctx is not None
        if self.rank != 0:
            answer = broadcast_object(None, self.ctx)
            if "error" in answer:
                raise RuntimeError(f"rank 0's fast policy failed: {answer['error']}")
            return answer["action"], None
        decided = time.perf_counter()
        try:
            action = self.policy.act(observation)
            fast.validate_action(action, self._policy_name(), self.ctx.world_size)
            micro_counts(int(action.grad_accum_steps), action.rank_work_shares)
        except Exception as error:  # noqa: BLE001 - re-raised on every rank below
            broadcast_object({"error": repr(error)}, self.ctx)
            raise
        decision_ms = (time.perf_counter() - decided) * 1000.0
        broadcast_object({"action": action}, self.ctx)
        return action, {"decision_ms": decision_ms}

    def _apply_fast(self, action: Any, learning_rate: float) -> None:
        super()._apply_fast(action, learning_rate)
        self.run.rank_work_shares = [float(s) for s in action.rank_work_shares]

    def _gang_share(self, value: Any) -> Any:
        assert self.ctx is not None
        return value if self.ctx.world_size <= 1 else broadcast_object(value, self.ctx)

    def _checkpoint(self, reason: str) -> None:
        """One checkpoint for the gang: every rank's sampler position and RNGs are gathered to
        rank 0, which writes them with the model and optimizer (synchronously: every rank must
        know the checkpoint is durable before it goes on)."""
        assert self.ctx is not None
        if self._checkpoint_step == self.run.step and self.checkpoint_path is not None:
            return  # this boundary is already saved (the same answer on every rank)
        began = time.perf_counter()
        self._tick_clock()
        # Serialised here: all_gather_object's pickling of tensors fails on some storages, and
        # torch.save of checkpoint types loads back weights-only, as the checkpoint itself does.
        buffer = io.BytesIO()
        torch.save(to_checkpoint_types(rank_state(self.sampler)), buffer)
        blobs = all_gather_object(buffer.getvalue(), self.ctx)
        answer: dict[str, Any]
        if self.rank == 0:
            try:
                state = build_state(
                    run=self.run, model_kind=self.model_kind, model_config=self.model_config,
                    train_config=dataclasses.asdict(self.config), examples=self.examples,
                    curriculum=self.curriculum, model=self.model, optimizer=self.optimizer,
                    sampler=self.sampler,
                )
                parts = [torch.load(io.BytesIO(blob), weights_only=True) for blob in blobs]
                state.update(world_size=self.ctx.world_size, ranks=parts)
                now = time.perf_counter()
                result = self.persister.persist_now(
                    state, step=self.run.step, reason=reason, elapsed_s=self.run.elapsed_s,
                    blocking_s=now - began, snapshot_s=now - began,
                )
            except BaseException as error:
                broadcast_object({"error": repr(error)}, self.ctx)
                raise
            self._record(result)
            answer = {"path": str(result.info.path), "sha256": result.info.sha256}
            broadcast_object(answer, self.ctx)
        else:
            answer = broadcast_object(None, self.ctx)
            if "error" in answer:
                raise CheckpointWriteError(f"rank 0 could not write the checkpoint at step "
                                           f"{self.run.step}: {answer['error']}")
            self.checkpoint_path, self.checkpoint_sha256 = Path(answer["path"]), answer["sha256"]
        self._checkpoint_step = self.run.step
