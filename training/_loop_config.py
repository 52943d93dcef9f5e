"""`TrainConfig` and the learning-rate schedule (re-exported by `training.loop`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from training.model import CNNConfig, GPTConfig


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int = 300
    """optimizer steps of the whole run; a resumed run continues toward the same number"""
    micro_batch_size: int = 32
    """examples per forward/backward pass at the start (the fast policy may change it)"""
    grad_accum_steps: int = 1
    """micro batches per optimizer step at the start; >= 2 also yields the gradient noise scale"""
    learning_rate: float = 1e-3
    """peak learning rate, reached after warmup"""
    min_learning_rate: float = 1e-4
    """floor of the cosine decay (nanoGPT: about learning_rate / 10)"""
    warmup_steps: int = 20
    """linear warmup steps"""
    lr_decay_steps: int | None = None
    """step where the cosine reaches min_learning_rate; None = max_steps"""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices (not on biases, norms)"""
    beta1: float = 0.9
    """AdamW beta1"""
    beta2: float = 0.99
    """AdamW beta2 (nanoGPT's choice for small char models)"""
    grad_clip: float = 1.0
    """clip the global gradient norm to this; 0 disables clipping"""
    eval_every_steps: int = 50
    """evaluate on the fixed held-out batches every this many steps (and at the end)"""
    eval_batches: int = 4
    """number of fixed held-out batches per evaluation"""
    eval_batch_size: int = 64
    """examples per held-out batch"""
    checkpoint_every_steps: int = 100
    """periodic checkpoint interval; 0 = only on stop, preemption, policy request and the end"""
    keep_checkpoints: int = 2
    """newest step checkpoints kept in <out_dir>/checkpoints (older ones are deleted)"""
    async_checkpoints: bool = True
    """interval checkpoints: snapshot in memory, write in the background (CheckFreq); the
    checkpoints that end a call (final, preemption, stop, ...) are always written before it ends"""
    fast_every_steps: int = 10
    """call the fast policy every this many steps"""
    seed: int = 1337
    """seeds model init (torch) and the sampler's shuffles (numpy)"""
    price_usd_per_hour: float = 0.0
    """price of the instance the run stands for; set by the caller from the price list"""
    instance_type: str = "local"
    """instance type the price is for (recorded only)"""
    num_threads: int = 1
    """torch intra-op threads during training (restored afterwards)"""
    run_id: str = ""
    """telemetry/run name; empty = the checkpoint's run id on resume, else a new one"""
    model: GPTConfig | CNNConfig | None = None
    """model architecture; None = the default for the data (GPT over its vocab, or the CNN)"""
    preemption_notice_s: float = 120.0
    """notice a spot preemption gives (AWS: two minutes); reported to the fast policy"""
    telemetry_events_per_segment: int = 1000
    """events per telemetry segment before it is sealed and the next one starts"""
    # -- live decisions (training.live_control; helper H10a) --
    live_control_path: str = ""
    """live-control file read at fast ticks (checkpoint interval, preemption risk); empty =
    <out_dir>/live_control.json, the run folder's own (training.live_control.LIVE_CONTROL_FILE)"""
    checkpoint_autotune: bool = False
    """re-tune the checkpoint interval at fast ticks by Young/Daly from the observed hazard and
    the measured save cost (controllers.checkpointing.CheckpointIntervalTuner); a live interval
    takes precedence; False = checkpoint_every_steps until a live interval arrives"""
    checkpoint_min_interval_s: float = 60.0
    """the autotuned interval's floor (seconds): never checkpoint more often than this"""

    def __post_init__(self) -> None:
        positive = ("max_steps", "micro_batch_size", "grad_accum_steps", "eval_every_steps",
                    "eval_batches", "eval_batch_size", "keep_checkpoints", "fast_every_steps",
                    "num_threads", "telemetry_events_per_segment")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)} must be >= 1")
        for name in ("warmup_steps", "checkpoint_every_steps", "weight_decay", "grad_clip",
                     "price_usd_per_hour", "preemption_notice_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)} must be >= 0")
        if not self.checkpoint_min_interval_s > 0:
            raise ValueError(f"TrainConfig.checkpoint_min_interval_s="
                             f"{self.checkpoint_min_interval_s} must be > 0 (seconds)")
        if not 0 < self.min_learning_rate <= self.learning_rate:
            raise ValueError(
                f"TrainConfig needs 0 < min_learning_rate ({self.min_learning_rate}) <= "
                f"learning_rate ({self.learning_rate})"
            )


def get_lr(step: int, config: TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_learning_rate (nanoGPT's `get_lr`)."""
    decay_steps = config.lr_decay_steps or config.max_steps
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / (config.warmup_steps + 1)
    if step >= decay_steps:
        return config.min_learning_rate
    ratio = (step - config.warmup_steps) / max(1, decay_steps - config.warmup_steps)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return config.min_learning_rate + coeff * (config.learning_rate - config.min_learning_rate)
