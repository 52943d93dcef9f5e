"""`TrainConfig` and the learning-rate schedule (re-exported by `training.loop`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from controllers.checkpoint_interval import DEFAULT_MIN_INTERVAL_S
from controllers.checkpointing import SPOT_NOTICE_S
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
    """the run's own periodic checkpoint interval, in steps, until an interval in seconds arrives
    from the checkpoint-interval chooser (controllers.checkpoint_interval: the slow layer's via
    the live-control file, or checkpoint_autotune); 0 = only on stop, preemption, policy request
    and the end"""
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
    preemption_notice_s: float = SPOT_NOTICE_S
    """notice a spot preemption gives (AWS: two minutes); reported to the fast policy"""
    telemetry_events_per_segment: int = 1000
    """events per telemetry segment before it is sealed and the next one starts"""
    # -- live decisions (training.live_control; helper H10a) --
    live_control_path: str = ""
    """live-control file read at fast ticks (checkpoint interval, preemption risk); empty =
    <out_dir>/live_control.json, the run folder's own (training.live_control.LIVE_CONTROL_FILE)"""
    checkpoint_autotune: bool = False
    """re-tune the checkpoint interval at fast ticks with the one checkpoint-interval chooser
    (controllers.checkpoint_interval, which the slow layer and the allocation heuristic ask too)
    from the observed hazard and the measured save cost; a live interval takes precedence;
    False = checkpoint_every_steps until a live interval arrives"""
    # -- the published schedule (trainwise.schedule), as the driver resolved it --
    schedule_version: str = ""
    """version (content hash) of the schedule the run started on; stamped on every decision
    record; a live-control file may switch it at a fast tick"""
    fast_levers: tuple[str, ...] = ()
    """levers of the fast heuristic that may act (controllers.fast_levers); empty = every
    registered lever"""
    checkpoint_interval_rule: str = "trainwise"
    """rule of the one checkpoint-interval chooser (controllers.checkpoint_interval) in this
    trainer process"""
    checkpoint_min_interval_s: float = DEFAULT_MIN_INTERVAL_S
    """the autotuned interval's floor (seconds): never checkpoint more often than this"""
    # -- lever guard (controllers.lever_guard; issue 12) --
    lever_guard: bool = False
    """judge the run's levers (batch changes by the fast policy, dynamic pruning) at every
    evaluation and switch off one that costs quality or time, with the reason recorded as a
    decision (policy "lever_guard"); False = levers run unjudged"""
    lever_guard_reference: tuple[tuple[float, float], ...] = ()
    """the fixed schedule's (samples, eval loss) curve on this workload (calibration, e.g. the
    time_to_quality benchmark's fixed runs); empty = quality is not judged in the run, only the
    batch lever's own cost"""
    lever_guard_reference_source: str = ""
    """where the reference curve came from (e.g. "run fixed-20261201"), named in the guard's
    decisions so `trainwise explain` says what the levers were judged against"""
    lever_guard_loss_tolerance: float = 0.02
    """relative eval loss above the reference at the same samples that counts as a strike"""
    lever_guard_time_tolerance: float = 0.05
    """relative seconds per sample above the fixed batch shape's that counts as a strike"""
    lever_guard_patience: int = 3
    """consecutive strikes (evaluations) before a lever is switched off"""
    lever_guard_warmup_fraction: float = 0.2
    """share of the budget's samples before quality is judged (early curves cross)"""

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
        self._check_lever_guard()
        if not self.checkpoint_min_interval_s > 0:
            raise ValueError(f"TrainConfig.checkpoint_min_interval_s="
                             f"{self.checkpoint_min_interval_s} must be > 0 (seconds)")
        if not 0 < self.min_learning_rate <= self.learning_rate:
            raise ValueError(
                f"TrainConfig needs 0 < min_learning_rate ({self.min_learning_rate}) <= "
                f"learning_rate ({self.learning_rate})"
            )

    def _check_lever_guard(self) -> None:
        if self.lever_guard_patience < 1:
            raise ValueError(f"TrainConfig.lever_guard_patience={self.lever_guard_patience} "
                             "must be >= 1 (evaluations)")
        for name in ("lever_guard_loss_tolerance", "lever_guard_time_tolerance"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)} must be >= 0")
        if not 0 <= self.lever_guard_warmup_fraction < 1:
            raise ValueError(f"TrainConfig.lever_guard_warmup_fraction="
                             f"{self.lever_guard_warmup_fraction} must be in [0, 1)")
        for point in self.lever_guard_reference:
            if len(point) != 2 or not all(math.isfinite(float(v)) for v in point) \
                    or float(point[0]) < 0:
                raise ValueError(
                    f"TrainConfig.lever_guard_reference has {point!r}: give (samples, eval "
                    "loss) pairs of finite numbers, samples >= 0 (the fixed schedule's curve)")
        # A frozen dataclass: store the curve as a tuple of float pairs whatever was passed.
        object.__setattr__(self, "lever_guard_reference", tuple(
            (float(s), float(v)) for s, v in self.lever_guard_reference))


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
