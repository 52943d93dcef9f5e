"""The training step, evaluation and the gradient-noise-scale estimate used by `training.loop`."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from training.data_types import ExampleSet
from training.sampler import TrainSampler


def batch_tensors(examples: ExampleSet, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) for rows `positions`: text shifts by one token, images take labels."""
    if examples.kind == "text":
        rows = torch.from_numpy(np.ascontiguousarray(examples.inputs[positions], dtype=np.int64))
        return rows[:, :-1], rows[:, 1:]
    assert examples.labels is not None
    images = torch.from_numpy(np.ascontiguousarray(examples.inputs[positions]))
    labels = torch.from_numpy(np.ascontiguousarray(examples.labels[positions], dtype=np.int64))
    return images, labels


def tokens_per_example(examples: ExampleSet) -> int:
    """Predicted tokens per text example (block size); 0 for images."""
    return int(examples.inputs.shape[1]) - 1 if examples.kind == "text" else 0


def fixed_eval_batches(
    examples: ExampleSet, eval_batches: int, eval_batch_size: int
) -> list[np.ndarray]:
    """Fixed held-out batches: eval rows spread evenly over the split, the same every call."""
    eval_positions = examples.eval_positions
    if len(eval_positions) == 0:
        raise ValueError(
            f"partition {examples.partition!r} has no held-out (eval) examples; rebuild the "
            "shards with an eval share"
        )
    wanted = min(len(eval_positions), eval_batches * eval_batch_size)
    picks = np.unique(np.linspace(0, len(eval_positions) - 1, num=wanted).round().astype(np.int64))
    chosen = eval_positions[picks]
    return [chosen[i : i + eval_batch_size] for i in range(0, len(chosen), eval_batch_size)]


@torch.no_grad()
def evaluate(
    model: nn.Module, examples: ExampleSet, batches: list[np.ndarray]
) -> tuple[float, float | None, int]:
    """(mean per-example loss, accuracy for images else None, examples) on the fixed batches."""
    was_training = model.training
    model.eval()
    loss_sum = 0.0
    correct = 0
    count = 0
    device = next(model.parameters()).device  # a torchrun rank on a GPU; .to(cpu) is a no-op
    for positions in batches:
        inputs, targets = batch_tensors(examples, positions)
        inputs, targets = inputs.to(device), targets.to(device)
        logits, per_example = model(inputs, targets, reduction="none")
        loss_sum += float(per_example.double().sum())
        count += len(positions)
        if examples.kind == "image":
            correct += int((logits.argmax(dim=-1) == targets).sum())
    model.train(was_training)
    accuracy = correct / count if examples.kind == "image" else None
    return loss_sum / count, accuracy, count


@dataclass
class GradNoiseScale:
    """B_simple = tr(Sigma) / |G|^2 from micro-batch vs accumulated gradient norms.

    McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of Large-Batch Training",
    Appendix A: with gradients measured at two batch sizes B_small < B_big,
        |G|^2 ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
        S     ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)
    each unbiased but noisy, so both are smoothed by an exponential moving average before the
    ratio is taken (as the paper advises). Here B_small is the micro batch and B_big the
    accumulated batch, so the estimate is free when grad_accum_steps >= 2.
    """

    decay: float = 0.9
    ema_grad_sq: float = 0.0
    ema_noise: float = 0.0
    updates: int = 0
    # Measure at steps where step % every_steps == 0 only: flattening every micro-batch gradient
    # is what the estimate costs, and the EMA needs a sample every few steps, not every step
    # (Pollux estimates at intervals; the budget is <= 1% of step time). 1 = every step.
    every_steps: int = 1

    def due(self, step: int) -> bool:
        return self.every_steps >= 1 and step % self.every_steps == 0

    def update(self, micro_sq_norms: list[float], big_sq_norm: float, micro_batch: int) -> None:
        accum = len(micro_sq_norms)
        if accum < 2:
            return
        b_small, b_big = float(micro_batch), float(micro_batch * accum)
        small_sq = sum(micro_sq_norms) / accum
        grad_sq = (b_big * big_sq_norm - b_small * small_sq) / (b_big - b_small)
        noise = (small_sq - big_sq_norm) / (1.0 / b_small - 1.0 / b_big)
        self.ema_grad_sq = self.decay * self.ema_grad_sq + (1.0 - self.decay) * grad_sq
        self.ema_noise = self.decay * self.ema_noise + (1.0 - self.decay) * noise
        self.updates += 1

    @property
    def value(self) -> float:
        """The current B_simple estimate (examples), nan before any update or if |G|^2 <= 0."""
        if self.updates == 0 or self.ema_grad_sq <= 0.0:
            return math.nan
        # The bias corrections of the two EMAs cancel in the ratio.
        return self.ema_noise / self.ema_grad_sq


def _flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


@dataclass(frozen=True)
class StepOutcome:
    train_loss: float
    grad_norm: float
    cpu_s: float = 0.0  # thread CPU seconds of this step (sampler, forward, backward, optimizer)


class _StepCpuClock:
    """Thread CPU seconds spent in `train_step` in this process since the last `reset`.

    Benchmarks of time to quality read it at fast ticks: thread CPU time is what one torch thread
    costs whatever else the shared machine runs (wall time is not), and it leaves out evaluation,
    which is the benchmark's instrument, not the run's work."""

    def __init__(self) -> None:
        self.total_s = 0.0

    def reset(self) -> None:
        self.total_s = 0.0


STEP_CPU = _StepCpuClock()


def train_step(
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    sampler: TrainSampler,
    examples: ExampleSet,
    step: int,
    learning_rate: float,
    micro_batch_size: int,
    grad_accum_steps: int,
    grad_clip: float,
    noise_scale: GradNoiseScale,
) -> StepOutcome:
    """One optimizer step over `grad_accum_steps` micro batches of weighted per-example loss."""
    cpu_began = time.thread_time()
    model.train()
    for group in optimizer.param_groups:
        group["lr"] = learning_rate
    measure_noise = grad_accum_steps >= 2 and noise_scale.due(step)
    micro_sq_norms: list[float] = []
    accumulated: torch.Tensor | None = None
    train_loss = 0.0
    for _ in range(grad_accum_steps):
        positions, weights = sampler.next_batch(micro_batch_size, step)
        inputs, targets = batch_tensors(examples, positions)
        _, per_example = model(inputs, targets, reduction="none")
        # Dynamic pruning refreshes its loss table from these losses (InfoBatch: no extra pass).
        sampler.observe_losses(positions, per_example.detach())
        # Weighted loss: mean of per-example loss x curriculum weight (unbiased rescaling).
        loss = (per_example * torch.from_numpy(weights).to(per_example.dtype)).mean()
        (loss / grad_accum_steps).backward()
        train_loss += loss.item() / grad_accum_steps
        if measure_noise:
            # .grad holds sum_j g_j / accum so far; the difference is this micro batch's share.
            flat = _flat_grad(model)
            micro = flat if accumulated is None else flat - accumulated
            micro_sq_norms.append(float(micro.double().square().sum()) * grad_accum_steps**2)
            accumulated = flat
    if measure_noise and accumulated is not None:
        noise_scale.update(
            micro_sq_norms, float(accumulated.double().square().sum()), micro_batch_size
        )
    max_norm = grad_clip if grad_clip > 0 else math.inf
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    cpu_s = time.thread_time() - cpu_began
    STEP_CPU.total_s += cpu_s
    return StepOutcome(train_loss=train_loss, grad_norm=grad_norm, cpu_s=cpu_s)


def profile_samples_per_s(
    model: nn.Module, examples: ExampleSet, batch_sizes: list[int], *, repeats: int = 1,
    seed: int = 0, stop_below_speedup: float | None = None,
) -> dict[int, float]:
    """Measured training throughput (samples per thread-CPU second, the fastest of `repeats`
    timed passes after one warm-up pass) of forward + backward at each batch size, smallest first:
    the throughput(batch) term of goodput (Pollux, OSDI'21). Thread CPU time, not wall time: other
    work on a shared machine must not make one size look faster than another.

    `stop_below_speedup`: stop at the first size that is not faster per sample than the previous
    one by this share (bigger ones are not profiled), so on hardware where a bigger batch does not
    pay (a CPU) the profile costs 2 x (1 + repeats) passes, a few steps of a run. No optimizer
    step is taken and gradients are cleared: the model is left as it was."""
    if not batch_sizes or min(batch_sizes) < 1 or repeats < 1:
        raise ValueError(f"batch_sizes={batch_sizes} must be positive integers and repeats="
                         f"{repeats} >= 1")
    rng = np.random.default_rng(seed)
    train = examples.train_positions
    was_training = model.training
    model.train()
    rates: dict[int, float] = {}
    for batch in sorted(set(batch_sizes)):
        best_s = math.inf
        for attempt in range(repeats + 1):
            positions = rng.choice(train, size=batch, replace=len(train) < batch)
            inputs, targets = batch_tensors(examples, positions)
            began = time.thread_time()
            _, loss = model(inputs, targets)
            loss.backward()
            model.zero_grad(set_to_none=True)
            if attempt:  # the first pass warms caches and allocators up
                best_s = min(best_s, time.thread_time() - began)
        previous = rates[max(rates)] if rates else None
        rates[batch] = batch / max(best_s, 1e-9)
        if (stop_below_speedup is not None and previous is not None
                and rates[batch] < previous * (1.0 + stop_below_speedup)):
            break
    model.train(was_training)
    return rates
