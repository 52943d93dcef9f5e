"""The data-selection suite: four ways to choose training data, the same budget, real data.

Datasets (shards built by `training.shards.build_shards` from the shared data; the held-out split
is the one the shards define):
- `tinyshakespeare`: char-level GPT (2 layers, 4 heads, 64-dim embedding; 0.1M parameters) on
  65-character chunks (64 predicted tokens); train = the first 15,444 chunks, eval = the last
  1,715 (the corpus's contiguous tail); the eval loss is the mean over 512 eval chunks spread
  evenly over that tail (the same 512 at every evaluation and for every method).
- `mnist`: the trainer's CNN (16/32 channels, 64 hidden) on the MNIST test file's 10,000 digits;
  eval = every 10th image (ids 9, 19, ...: 1,000), train = the other 9,000; the eval loss and
  accuracy are over all 1,000 eval images.

Methods (`METHODS`), each `training.loop.train` with one torch thread:
- `full`: every train example every epoch (the static sampler, no curriculum);
- `random`: each epoch leaves out as many examples as InfoBatch would (floor(0.5 * n_below_mean)
  under the same kind of loss table), drawn uniformly, weight 1;
- `infobatch`: the paper's method (Qin et al., ICLR'24): rate 0.5, equal start scores (epoch 0 is
  full data), below-mean examples left out at random, kept ones weighted 1/(1-r), anneal 0.125;
- `trainwise`: the same draw, the rate set every slow tick (every 4 evaluations, about once per
  epoch; the policy sees the mean eval loss of each tick) by
  `controllers.pruning.decide_pruning_rate` (max rate 0.5, scaled by the loss table's dispersion,
  halved on a flat or slightly rising eval curve, 0 on a rise over 2%, before the first eval and
  in the anneal); start scores from `training.scoring.difficulty_scores` (proxy models; they
  matter only if a run starts with a rate above 0).

Budget (the same for every method): E epochs of the train split with the same learning-rate
schedule over epochs (warmup, cosine to lr/10). A pruned epoch counts as one epoch but costs
fewer sample passes (InfoBatch's protocol): `TrainConfig.max_steps` = the full-data run's steps,
and a pruning run stops when it has covered the same E epochs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.parallel import run_in_workers
from controllers.pruning import PruningConfig
from training.data_types import ExampleSet

METHODS = ("full", "random", "infobatch", "trainwise")
PRUNING_RATE = 0.5  # InfoBatch's default r, and the trainwise policy's maximum
ANNEAL_FRACTION = 0.125  # InfoBatch's delta = 0.875


@dataclass(frozen=True)
class DatasetSpec:
    name: str  # the shard partition
    epochs: int  # the budget
    batch_size: int
    learning_rate: float
    warmup_steps: int
    eval_every_steps: int
    eval_batches: int
    eval_batch_size: int
    model: dict[str, Any]  # GPTConfig (vocab_size and block_size from the data) or CNNConfig fields
    slow_every_evals: int = 4  # trainwise: one slow tick per this many evaluations
    max_train_examples: int | None = None  # quick mode: the first N train examples only
    max_eval_examples: int | None = None
    description: str = ""


FULL_SPECS = (
    DatasetSpec("tinyshakespeare", epochs=4, batch_size=32, learning_rate=2e-3, warmup_steps=100,
                eval_every_steps=100, eval_batches=4, eval_batch_size=128,
                model={"n_layer": 2, "n_head": 4, "n_embd": 64},
                description="char GPT, 2 layers x 64 dims (0.1M parameters), 4 epochs "
                            "(1,930 full-data steps, 3.95M tokens), batch 32, lr 2e-3"),
    DatasetSpec("mnist", epochs=10, batch_size=32, learning_rate=2e-3, warmup_steps=50,
                eval_every_steps=50, eval_batches=8, eval_batch_size=125,
                model={"channels_1": 16, "channels_2": 32, "hidden": 64},
                description="CNN 16/32 channels, 64 hidden (0.1M parameters), 10 epochs "
                            "(2,812 full-data steps), batch 32, lr 2e-3"),
)
QUICK_SPECS = (
    DatasetSpec("tinyshakespeare", epochs=4, batch_size=16, learning_rate=3e-3, warmup_steps=5,
                eval_every_steps=8, eval_batches=2, eval_batch_size=32,
                model={"n_layer": 1, "n_head": 2, "n_embd": 16},
                max_train_examples=256, max_eval_examples=64, description="quick"),
    DatasetSpec("mnist", epochs=4, batch_size=16, learning_rate=3e-3, warmup_steps=5,
                eval_every_steps=8, eval_batches=2, eval_batch_size=32,
                model={"channels_1": 4, "channels_2": 8, "hidden": 16},
                max_train_examples=256, max_eval_examples=64, description="quick"),
)


@dataclass(frozen=True)
class RunSpec:
    dataset: DatasetSpec
    method: str
    seed: int
    shards_dir: str  # <work>/shards/<partition>
    work_dir: str  # where the run writes its checkpoints and telemetry

    @property
    def run_id(self) -> str:
        return f"data-{self.dataset.name}-{self.method}-s{self.seed}"


def subset(examples: ExampleSet, max_train: int | None, max_eval: int | None) -> ExampleSet:
    """Quick mode: the first `max_train` train and `max_eval` eval examples (a new fingerprint)."""
    if max_train is None and max_eval is None:
        return examples
    train = examples.train_positions[:max_train]
    evals = examples.eval_positions[:max_eval]
    keep = np.sort(np.concatenate([train, evals]))
    tag = f"{examples.fingerprint}:{max_train}:{max_eval}"
    fingerprint = hashlib.sha256(tag.encode()).hexdigest()
    return ExampleSet(
        partition=examples.partition, kind=examples.kind, example_ids=examples.example_ids[keep],
        is_eval=examples.is_eval[keep], inputs=examples.inputs[keep],
        labels=None if examples.labels is None else examples.labels[keep], vocab=examples.vocab,
        shard_index=examples.shard_index[keep], fingerprint=fingerprint)


def load_examples(spec: DatasetSpec, shards_dir: str | Path) -> ExampleSet:
    from training.shards import load_shards

    return subset(load_shards(Path(shards_dir)), spec.max_train_examples, spec.max_eval_examples)


def train_config(spec: DatasetSpec, examples: ExampleSet, seed: int, run_id: str):
    from training.loop import TrainConfig
    from training.model import CNNConfig, GPTConfig

    if examples.kind == "text":
        model = GPTConfig(vocab_size=len(examples.vocab), block_size=examples.inputs.shape[1] - 1,
                          **spec.model)
    else:
        model = CNNConfig(**spec.model)
    n_train = len(examples.train_positions)
    max_steps = round(spec.epochs * n_train / spec.batch_size)
    return TrainConfig(
        max_steps=max_steps, micro_batch_size=spec.batch_size, grad_accum_steps=1,
        learning_rate=spec.learning_rate, min_learning_rate=spec.learning_rate / 10,
        warmup_steps=spec.warmup_steps, eval_every_steps=spec.eval_every_steps,
        eval_batches=spec.eval_batches, eval_batch_size=spec.eval_batch_size,
        checkpoint_every_steps=0, keep_checkpoints=1, fast_every_steps=10, seed=seed,
        num_threads=1, run_id=run_id, model=model)


def pruning_config(method: str, spec: DatasetSpec, examples: ExampleSet):
    """The DynamicPruningConfig of a method (None for full data)."""
    from training.dynamic_pruning import DynamicPruningConfig
    from training.scoring import difficulty_scores

    if method == "full":
        return None
    if method in ("random", "infobatch"):
        return DynamicPruningConfig(method=method, pruning_rate=PRUNING_RATE,
                                    anneal_fraction=ANNEAL_FRACTION)
    if method == "trainwise":
        return DynamicPruningConfig(
            method="infobatch", pruning_rate=0.0, anneal_fraction=ANNEAL_FRACTION,
            initial_scores=difficulty_scores(examples),
            slow_policy=PruningConfig(max_rate=PRUNING_RATE, anneal_fraction=ANNEAL_FRACTION),
            slow_every_steps=spec.eval_every_steps * spec.slow_every_evals)
    raise ValueError(f"unknown method {method!r}; valid: {', '.join(METHODS)}")


def plain_sampler_s(examples: ExampleSet, seed: int, steps: int, batch_size: int) -> float:
    """Seconds the static sampler takes to draw `steps` batches: the plain baseline the dynamic
    sampler's own time is compared with (its overhead)."""
    from training.sampler import CurriculumSampler

    sampler = CurriculumSampler(examples, None, seed=seed, max_steps=steps)
    began = time.perf_counter()
    for step in range(steps):
        sampler.next_batch(batch_size, step)
    return time.perf_counter() - began


def run_one(run: RunSpec) -> dict[str, Any]:
    """Train one (dataset, method, seed) and return its figures (runs in a worker process)."""
    import torch

    from telemetry.reader import read_run_events
    from training.consumption import epochs, read_consumption
    from training.loop import train

    torch.set_num_threads(1)
    examples = load_examples(run.dataset, run.shards_dir)
    config = train_config(run.dataset, examples, run.seed, run.run_id)
    pruning = pruning_config(run.method, run.dataset, examples)
    out_dir = Path(run.work_dir) / run.run_id
    began = time.perf_counter()
    result = train(config, examples, None, out_dir, pruning=pruning)
    wall_s = time.perf_counter() - began
    events = read_run_events(result.telemetry_dir)
    steps = [e for e in events if e["type"] == "step"]
    samples_at = {e["step"]: e["samples_seen"] for e in steps}
    tokens_at = {e["step"]: e["tokens_seen"] for e in steps}
    curve = [[e["step"], samples_at[e["step"]], tokens_at[e["step"]], e["eval_loss"],
              e["eval_accuracy"]] for e in events if e["type"] == "eval"]
    step_s = sum(e["step_time_ms"] for e in steps) / 1000.0
    record: dict[str, Any] = {
        "dataset": run.dataset.name, "method": run.method, "seed": run.seed, "run_id": run.run_id,
        "run_dir": str(out_dir), "steps": result.steps, "max_steps": config.max_steps,
        "budget_samples": config.max_steps * config.micro_batch_size,
        "samples": result.samples_seen, "tokens": result.tokens_seen,
        "final_eval_loss": result.final_eval_loss,
        "final_eval_accuracy": result.final_eval_accuracy,
        "wall_s": wall_s, "train_step_s": step_s,
        "eval_curve": curve, "eval_curve_columns": ["step", "samples", "tokens", "eval_loss",
                                                    "eval_accuracy"],
        "sampler_s": 0.0, "plain_sampler_s": 0.0, "overhead_share": 0.0, "epochs": [],
        "rate_decisions": [],
    }
    if pruning is not None:
        records = read_consumption(result.telemetry_dir)
        (close,) = [r for r in records if r["type"] == "close"]
        plain_s = plain_sampler_s(examples, run.seed, result.steps, config.micro_batch_size)
        record.update(
            sampler_s=close["sampler_s"], plain_sampler_s=plain_s,
            overhead_share=max(0.0, close["sampler_s"] - plain_s) / step_s,
            epochs=[{k: e[k] for k in ("epoch", "step", "phase", "rate", "kept", "skipped_count",
                                       "n_below_mean")} for e in epochs(records)],
            rate_decisions=[[r["step"], r["rate"], r["reason"]] for r in records
                            if r["type"] == "rate"])
    return record


def build_shards_once(spec: DatasetSpec, work_dir: Path) -> Path:
    """The partition's shards under <work>/shards/<partition> (idempotent: same bytes each time)."""
    from training.shards import build_shards
    from trainwise import settings

    out = work_dir / "shards" / spec.name
    build_shards(spec.name, settings.data_dir(), out)
    return out


def run_all(specs: tuple[DatasetSpec, ...], methods: tuple[str, ...], seeds: tuple[int, ...],
            work_dir: Path, jobs: int, log=print) -> list[dict[str, Any]]:
    """Every (dataset, method, seed); `jobs` worker processes (1 = in this process)."""
    runs = []
    for spec in specs:
        shards = build_shards_once(spec, work_dir)
        runs += [RunSpec(spec, m, s, str(shards), str(work_dir / "runs")) for m in methods
                 for s in seeds]
    # Longest first (full-data GPT), so two workers finish together.
    runs.sort(key=lambda r: (-r.dataset.epochs * (r.dataset.name == "tinyshakespeare"),
                             METHODS.index(r.method), r.seed))
    return run_in_workers(runs, run_one, jobs, _progress_line, log)


def _progress_line(result: dict[str, Any], done: int, total: int) -> str:
    accuracy = result["final_eval_accuracy"]
    extra = f" acc {accuracy:.4f}" if accuracy is not None else ""
    return (f"[{done}/{total}] {result['run_id']}: {result['samples']} sample passes, eval loss "
            f"{result['final_eval_loss']:.4f}{extra}, {result['wall_s']:.0f} s")


def spec_records(specs: tuple[DatasetSpec, ...]) -> list[dict[str, Any]]:
    return [dataclasses.asdict(s) for s in specs]
