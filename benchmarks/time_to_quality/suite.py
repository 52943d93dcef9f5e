"""Time to quality: the runs. Each (workload, lever, seed) is one `training.loop.train` call.

Workloads (`FULL_WORKLOADS`; shards built by `training.shards.build_shards` from the shared data
through `trainwise.settings.data_dir()`, held-out split as the shards define it):
- `shakespeare_multi`: char GPT 2 layers x 48 dims on the first 1,536 train chunks (64 predicted
  characters each) for 6 epochs, batch 32: the multi-epoch regime where data selection can act.
- `shakespeare_short`: the same GPT on all 15,444 train chunks for 360 steps of batch 12
  (0.28 epoch): the short regime of the issue (batch 12, well under 2 epochs).
- `mnist`: the trainer's CNN (8/16 channels, 64 hidden) on the first 2,000 train digits for
  6 epochs, batch 32.
Sized so the whole suite fits in well under an hour on a shared 2-core machine.
Eval: the same fixed held-out windows for every lever and seed (`fixed_eval_batches`).

Levers (`LEVERS`):
- `fixed`: fixed batch, full data, no fast policy: the baseline.
- `noise_batch`: today's gradient-noise batch heuristic (`HeuristicFastPolicy`, default config).
- `goodput`: `controllers.batch_scaling.GoodputBatchPolicy` built as a train run builds it
  (`trainwise.goodput_lever.goodput_policy`: a throughput profile measured at start on this
  machine; its CPU is counted against the lever).
- `prune_scored`: InfoBatch draw at rate 0.5 with initial scores from
  `training.scoring.difficulty_scores` (reference-model per-example loss: bigram for text,
  logistic regression for images), kept below-mean examples weighted 1/(1-r), anneal 0.125.
- `noise_guarded`, `prune_guarded`: `noise_batch` and `prune_scored` with the lever guard in the
  run (`TrainConfig.lever_guard`): its reference is the mean eval curve of the fixed schedule's
  runs of the OTHER seeds on the workload (leave-one-out, so no seed is judged against itself);
  a lever it judges to cost quality or time is switched off mid-run. They run after the fixed
  runs (or reuse them, `--reuse`).

CPU-seconds: thread CPU time inside `train_step` (`training._loop_step.STEP_CPU`; one torch
thread), read at every fast tick; evaluation is the instrument and is left out.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.parallel import run_in_workers

LEVERS = ("fixed", "noise_batch", "goodput", "prune_scored", "noise_guarded", "prune_guarded")
GUARDED = {"noise_guarded": "noise_batch", "prune_guarded": "prune_scored"}
PRUNING_RATE = 0.5
ANNEAL_FRACTION = 0.125


@dataclass(frozen=True)
class Workload:
    name: str
    partition: str  # shard partition
    steps: int  # the fixed schedule's optimizer steps
    batch_size: int
    learning_rate: float
    warmup_steps: int
    eval_every_steps: int
    eval_batches: int
    eval_batch_size: int
    model: dict[str, Any]
    max_train_examples: int | None = None
    max_eval_examples: int | None = None
    description: str = ""


FULL_WORKLOADS = (
    Workload("shakespeare_multi", "tinyshakespeare", steps=288, batch_size=32,
             learning_rate=3e-3, warmup_steps=20, eval_every_steps=24, eval_batches=4,
             eval_batch_size=128, model={"n_layer": 2, "n_head": 4, "n_embd": 48},
             max_train_examples=1536,
             description="char GPT 2 layers x 48 dims, 1,536 train chunks x 6 epochs (288 steps "
                         "of batch 32), eval on 512 fixed held-out chunks"),
    Workload("shakespeare_short", "tinyshakespeare", steps=360, batch_size=12,
             learning_rate=3e-3, warmup_steps=20, eval_every_steps=30, eval_batches=4,
             eval_batch_size=128, model={"n_layer": 2, "n_head": 4, "n_embd": 48},
             description="char GPT 2 layers x 48 dims, all 15,444 train chunks, 360 steps of "
                         "batch 12 (0.28 epoch), eval on 512 fixed held-out chunks"),
    Workload("mnist", "mnist", steps=375, batch_size=32, learning_rate=2e-3, warmup_steps=20,
             eval_every_steps=25, eval_batches=4, eval_batch_size=125,
             model={"channels_1": 8, "channels_2": 16, "hidden": 64}, max_train_examples=2000,
             description="CNN 8/16 channels, 64 hidden, 2,000 train digits x 6 epochs (375 "
                         "steps of batch 32), eval on 500 fixed held-out digits"),
)
QUICK_WORKLOADS = (
    Workload("shakespeare_multi", "tinyshakespeare", steps=48, batch_size=16,
             learning_rate=3e-3, warmup_steps=4, eval_every_steps=8, eval_batches=2,
             eval_batch_size=32, model={"n_layer": 1, "n_head": 2, "n_embd": 16},
             max_train_examples=128, max_eval_examples=64, description="quick"),
    Workload("shakespeare_short", "tinyshakespeare", steps=24, batch_size=8,
             learning_rate=3e-3, warmup_steps=4, eval_every_steps=8, eval_batches=2,
             eval_batch_size=32, model={"n_layer": 1, "n_head": 2, "n_embd": 16},
             max_train_examples=1024, max_eval_examples=64, description="quick"),
    Workload("mnist", "mnist", steps=48, batch_size=16, learning_rate=3e-3, warmup_steps=4,
             eval_every_steps=8, eval_batches=2, eval_batch_size=32,
             model={"channels_1": 4, "channels_2": 8, "hidden": 16}, max_train_examples=128,
             max_eval_examples=64, description="quick"),
)


@dataclass(frozen=True)
class RunSpec:
    workload: Workload
    lever: str
    seed: int
    shards_dir: str
    work_dir: str
    reference: tuple[tuple[float, float], ...] = ()  # guarded levers: the fixed schedule's curve

    @property
    def run_id(self) -> str:
        return f"ttq-{self.workload.name}-{self.lever}-s{self.seed}"


class RecordingPolicy:
    """Wraps a fast policy; at each tick records (step, train_step CPU seconds so far)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = f"recording({inner.name})"
        self.ticks: list[tuple[int, float]] = []
        self.cpu_offset_s = 0.0  # CPU the lever spent before training (goodput's profile)

    def act(self, observation):
        from training._loop_step import STEP_CPU

        self.ticks.append((observation.step, self.cpu_offset_s + STEP_CPU.total_s))
        return self.inner.act(observation)


def train_config(workload: Workload, examples, seed: int, run_id: str):
    from training.loop import TrainConfig
    from training.model import CNNConfig, GPTConfig

    if examples.kind == "text":
        model = GPTConfig(vocab_size=len(examples.vocab), block_size=examples.inputs.shape[1] - 1,
                          **workload.model)
    else:
        model = CNNConfig(**workload.model)
    # Fast ticks at a divisor of the eval interval (half of it when even): every evaluation step
    # must have a CPU reading, or the curve loses its points.
    every = workload.eval_every_steps
    fast_every = every // 2 if every % 2 == 0 else every
    return TrainConfig(
        max_steps=workload.steps, micro_batch_size=workload.batch_size, grad_accum_steps=1,
        learning_rate=workload.learning_rate, min_learning_rate=workload.learning_rate / 10,
        warmup_steps=workload.warmup_steps, eval_every_steps=workload.eval_every_steps,
        eval_batches=workload.eval_batches, eval_batch_size=workload.eval_batch_size,
        checkpoint_every_steps=0, keep_checkpoints=1, fast_every_steps=fast_every, seed=seed,
        num_threads=1, run_id=run_id, model=model)


def lever_setup(lever: str, workload: Workload, examples, config) -> tuple[Any, Any, float]:
    """(fast policy, pruning config, CPU seconds spent before training) of a lever."""
    from controllers.fast_heuristic import HeuristicFastPolicy
    from controllers.fast_types import NoOpFastPolicy
    from training.dynamic_pruning import DynamicPruningConfig
    from training.scoring import difficulty_scores

    lever = GUARDED.get(lever, lever)  # the guard is in the config, the lever the same
    if lever == "fixed":
        return NoOpFastPolicy(), None, 0.0
    if lever == "noise_batch":
        return HeuristicFastPolicy(), None, 0.0
    if lever == "goodput":
        # The train job's own construction (profile of the run's model at start, base batch =
        # the config's micro x accum batch, candidates up to 8x).
        from trainwise.goodput_lever import goodput_policy

        began = time.thread_time()
        policy, _ = goodput_policy(config, examples)
        return policy, None, time.thread_time() - began
    if lever == "prune_scored":
        began = time.thread_time()
        scores = difficulty_scores(examples)  # its CPU is counted against the lever
        pruning = DynamicPruningConfig(method="infobatch", pruning_rate=PRUNING_RATE,
                                       anneal_fraction=ANNEAL_FRACTION, initial_scores=scores,
                                       record_consumption=False)
        return NoOpFastPolicy(), pruning, time.thread_time() - began
    raise ValueError(f"unknown lever {lever!r}; valid: {', '.join(LEVERS)}")


# Workloads this process has trained once, untimed. The first run of a workload in a process
# paid one-time costs (kernel and allocator set-up) inside its timed steps, and the fixed
# schedule always ran first: identical computations then measured up to 8% apart.
_WARMED: set[str] = set()
WARM_UP_STEPS = 20


def _warm_up(workload: Workload, examples, config, work_dir: Path) -> None:
    """Train `WARM_UP_STEPS` steps of this workload once per process, outside any measure."""
    if workload.name in _WARMED:
        return
    from training.loop import train

    warm = dataclasses.replace(config, max_steps=WARM_UP_STEPS, eval_every_steps=WARM_UP_STEPS,
                               run_id=f"warm-up-{workload.name}-{os.getpid()}")
    train(warm, examples, None, work_dir / warm.run_id)
    _WARMED.add(workload.name)


def interleaved(workloads: tuple[Workload, ...], levers: list[str], seeds: tuple[int, ...]
                ) -> list[tuple[Workload, str, int]]:
    """(workload, lever, seed) with the levers rotated per seed, so that no setting always runs
    first (or always right after another) within a workload."""
    order = []
    for w in workloads:
        for i, seed in enumerate(seeds):
            shift = i % len(levers) if levers else 0
            order += [(w, lever, seed) for lever in levers[shift:] + levers[:shift]]
    return order


def run_one(run: RunSpec) -> dict[str, Any]:
    """Train one (workload, lever, seed); its eval curve against samples and CPU-seconds."""
    import torch

    from benchmarks.data.suite import subset
    from telemetry.reader import read_run_events
    from training._loop_step import STEP_CPU
    from training.loop import train
    from training.shards import load_shards

    torch.set_num_threads(1)
    w = run.workload
    examples = subset(load_shards(Path(run.shards_dir)), w.max_train_examples,
                      w.max_eval_examples)
    config = train_config(w, examples, run.seed, run.run_id)
    _warm_up(w, examples, config, Path(run.work_dir))
    if run.lever in GUARDED:
        if not run.reference:
            raise ValueError(f"{run.run_id}: a guarded lever needs the fixed schedule's curve "
                             "from other seeds; run or --reuse fixed with >= 2 seeds")
        config = dataclasses.replace(config, lever_guard=True, lever_guard_reference=run.reference)
    inner, pruning, setup_cpu_s = lever_setup(run.lever, w, examples, config)
    policy = RecordingPolicy(inner)
    policy.cpu_offset_s = setup_cpu_s
    out_dir = Path(run.work_dir) / run.run_id
    STEP_CPU.reset()
    began = time.perf_counter()
    result = train(config, examples, None, out_dir, fast_policy=policy, pruning=pruning)
    wall_s = time.perf_counter() - began
    cpu_at = dict(policy.ticks)
    cpu_at[result.steps] = setup_cpu_s + STEP_CPU.total_s
    cpu_at.setdefault(0, setup_cpu_s)
    events = read_run_events(result.telemetry_dir)
    steps = [e for e in events if e["type"] == "step"]
    samples_at = {e["step"]: e["samples_seen"] for e in steps}
    samples_at[0] = 0
    curve = []
    for e in events:
        if e["type"] == "eval" and e["step"] in cpu_at:
            curve.append([e["step"], samples_at[e["step"]], cpu_at[e["step"]], e["eval_loss"]])
    batches = sorted({e["micro_batch_size"] * e["grad_accum_steps"] for e in steps})
    decisions = [e["reason"] for e in events if e["type"] == "decision"
                 and e["policy"] != "lever_guard"]
    guard_offs = [{"step": e["step"], "lever": e["action"].get("lever"), "reason": e["reason"]}
                  for e in events if e["type"] == "decision" and e["policy"] == "lever_guard"
                  and e["action"].get("guard") == "switch_off"]
    return {
        "workload": w.name, "lever": run.lever, "seed": run.seed, "run_id": run.run_id,
        "steps": result.steps, "samples": result.samples_seen,
        "train_cpu_s": cpu_at[result.steps], "setup_cpu_s": setup_cpu_s, "wall_s": wall_s,
        "final_eval_loss": result.final_eval_loss, "global_batches_used": batches,
        "last_decision": decisions[-1] if decisions else "", "guard_switch_offs": guard_offs,
        "eval_curve": curve, "eval_curve_columns": ["step", "samples", "cpu_s", "eval_loss"],
    }


def build_shards_once(partition: str, work_dir: Path) -> Path:
    from training.shards import build_shards
    from trainwise import settings

    out = work_dir / "shards" / partition
    build_shards(partition, settings.data_dir(), out)
    return out


def fixed_reference(runs: list[dict[str, Any]], workload: str, seed: int
                    ) -> tuple[tuple[float, float], ...]:
    """Mean (samples, eval loss) of the fixed schedule's runs of the other seeds (their evals
    fall at the same samples: fixed batch)."""
    curves = [r["eval_curve"] for r in runs if r["workload"] == workload
              and r["lever"] == "fixed" and r["seed"] != seed]
    if not curves:
        return ()
    points: dict[float, list[float]] = {}
    for curve in curves:
        for _, samples, _, loss in curve:
            points.setdefault(float(samples), []).append(float(loss))
    return tuple((x, sum(v) / len(v)) for x, v in sorted(points.items())
                 if len(v) == len(curves))


def run_all(workloads: tuple[Workload, ...], levers: tuple[str, ...], seeds: tuple[int, ...],
            work_dir: Path, jobs: int, log=print,
            reused: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The runs of `levers`; guarded levers after the others, with references from the fixed
    runs (these, or `reused` ones)."""
    plain = [lever for lever in levers if lever not in GUARDED]
    guarded = [lever for lever in levers if lever in GUARDED]
    shards = {w.name: build_shards_once(w.partition, work_dir) for w in workloads}
    specs = [RunSpec(w, lever, s, str(shards[w.name]), str(work_dir / "runs"))
             for w, lever, s in interleaved(workloads, plain, seeds)]
    results = run_in_workers(specs, run_one, jobs, _progress_line, log) if specs else []
    if guarded:
        known = results + list(reused or [])
        specs = [RunSpec(w, lever, s, str(shards[w.name]), str(work_dir / "runs"),
                         fixed_reference(known, w.name, s))
                 for w, lever, s in interleaved(workloads, guarded, seeds)]
        results += run_in_workers(specs, run_one, jobs, _progress_line, log)
    return results


def _progress_line(r: dict[str, Any], done: int, total: int) -> str:
    return (f"[{done}/{total}] {r['run_id']}: {r['samples']} samples, {r['train_cpu_s']:.1f} CPU-s,"
            f" eval loss {r['final_eval_loss']:.4f}, batches {r['global_batches_used']}, "
            f"{r['wall_s']:.0f} s")


def workload_records(workloads: tuple[Workload, ...]) -> list[dict[str, Any]]:
    return [dataclasses.asdict(w) for w in workloads]
