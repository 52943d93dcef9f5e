"""Dynamic data pruning: the per-epoch draw, its inputs (scores, rate), where the rate comes from.

InfoBatch (Qin, Wang, Zheng et al., "InfoBatch: Lossless Training Speed Up by Unbiased Dynamic Data
Pruning", ICLR'24, Alg. 1 and github.com/NUS-HPC-AI-Lab/InfoBatch): keep a table of every train
example's latest loss (refreshed from the per-example losses of the training batches, so it costs
no extra forward pass). At the start of each epoch, among the examples whose score is below the
table's mean, leave out floor(r * n_below) chosen at random (r = the pruning rate); every kept
below-mean example gets loss weight n_below / (n_below - floor(r * n_below)) (= 1 / (1 - r) up to
rounding), so that for each example P(kept) * weight = 1 and the expected epoch gradient equals the
full-data one. Epochs in the final `anneal_fraction` of the budget train on every example at
weight 1. The paper starts from equal scores (nothing is below the mean, so epoch 0 is full
data); trainwise may start from `training.scoring.difficulty_scores` instead.

The baselines of `benchmarks.data`: "random" leaves out the same number of examples per epoch
(floor(r * n_below) under the same table) drawn uniformly from all examples, weight 1 (a uniform
subsample's batch mean is already unbiased).

Where the rate comes from: `DynamicPruningConfig.pruning_rate` at the start; then the slow layer,
either through a control file (`write_pruning_control`, read by the trainer at fast-tick
boundaries) or in-process (`SlowPruningTicker`: `controllers.pruning.decide_pruning_rate` on the
live score table and the eval-loss curve every `slow_every_steps`). A new rate takes effect at
the next epoch draw (InfoBatch draws its keep set once per epoch).

Bad input: a rate outside [0, 1) raises ValueError; NaN scores, scores of other shards and
model scores from another model (or from a step this run has not reached) are refused; a draw
that would leave out a whole shard or class is clamped: that group's examples are all kept at
weight 1 that epoch (still unbiased: probability 1, weight 1) and a warning is recorded. A static
curriculum that drops a whole shard or class is refused (see `training.sampler`).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from controllers.pruning import PruningConfig, PruningDecision, decide_pruning_rate
from controllers.slow_types import DataSummary, LossCurve, Progress
from training._data_io import atomic_write_json, control_digest, read_control_json
from training.curriculum import validate_pruning_rate
from training.data_types import ExampleSet
from training.scoring import ScoreTable

METHODS = ("infobatch", "random")
CONTROL_FORMAT = "trainwise.pruning_control/1"
_FINGERPRINT_TAG = re.compile(r"fingerprint=([0-9a-f]{64})")


@dataclass(frozen=True)
class DynamicPruningConfig:
    """How `training.loop.train(..., pruning=...)` prunes. With pruning, `TrainConfig.max_steps`
    is the FULL-DATA budget: the run covers max_steps * batch / n_train epochs and ends when it
    has; a pruned epoch takes fewer optimizer steps (InfoBatch's protocol: same epochs)."""

    method: Literal["infobatch", "random"] = "infobatch"
    """which examples an epoch leaves out (see the module docstring)"""
    pruning_rate: float = 0.5
    """initial rate r in [0, 1): share of the below-mean examples left out (InfoBatch default)"""
    anneal_fraction: float = 0.125
    """epochs ending in this last share of the budget use full data, weight 1 (InfoBatch: 0.125)"""
    initial_scores: ScoreTable | None = None
    """first score table (difficulty_scores); None = all equal, so epoch 0 is full data"""
    control_path: Path | None = None
    """control file the slow layer writes (write_pruning_control); read at fast-tick boundaries"""
    slow_policy: PruningConfig | None = None
    """when set, controllers.pruning.decide_pruning_rate sets the rate every slow_every_steps"""
    slow_every_steps: int = 100
    """steps between in-process slow ticks (only with slow_policy)"""
    record_consumption: bool = True
    """write <telemetry>/<run_id>/consumption.jsonl (what each step saw, what each epoch skipped)"""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"DynamicPruningConfig.method={self.method!r}; use one of {METHODS}")
        validate_pruning_rate(self.pruning_rate)
        if not 0.0 <= float(self.anneal_fraction) <= 1.0:
            raise ValueError(f"DynamicPruningConfig.anneal_fraction={self.anneal_fraction} must "
                             "be in [0, 1]")
        if self.slow_every_steps < 1:
            raise ValueError(f"DynamicPruningConfig.slow_every_steps={self.slow_every_steps} "
                             "must be >= 1")


@dataclass(frozen=True)
class EpochDraw:
    """One epoch's keep set over a pool (indices into the pool, not row positions)."""

    kept: np.ndarray  # int64 indices into the pool
    weights: np.ndarray  # float64 pruning weight of each kept example (times the base weight)
    skipped: np.ndarray  # int64 indices into the pool left out this epoch
    reason: str  # why `skipped` were left out, e.g. "pruned: below-mean loss, rate 0.5"
    rate: float
    n_below_mean: int
    upweight: float  # weight of kept below-mean examples (infobatch), else 1
    warnings: tuple[str, ...] = ()


def infobatch_keep_probabilities(pool_scores: np.ndarray, rate: float) -> np.ndarray:
    """P(kept this epoch) of each example: 1 at or above the mean score, else
    (n_below - floor(rate * n_below)) / n_below (exactly what `draw_epoch` realizes)."""
    rate = validate_pruning_rate(rate)
    scores = _finite_scores(pool_scores)
    below = scores < scores.mean()
    n_below = int(below.sum())
    probabilities = np.ones(len(scores))
    if n_below:
        probabilities[below] = (n_below - math.floor(rate * n_below)) / n_below
    return probabilities


def draw_epoch(
    *,
    method: str,
    pool_scores: np.ndarray,
    rate: float,
    rng: np.random.Generator,
    anneal: bool,
    groups: tuple[tuple[str, np.ndarray], ...] = (),
) -> EpochDraw:
    """The keep set of one epoch over a pool with the given scores (see the module docstring).

    `groups`: (name, value per pool example), e.g. ("shard", shard ids); a draw that would leave
    a group with no example is clamped (the group is kept whole at weight 1) with a warning.
    """
    if method not in METHODS:
        raise ValueError(f"pruning method {method!r}; use one of {METHODS}")
    rate = validate_pruning_rate(rate)
    scores = _finite_scores(pool_scores)
    n = len(scores)
    if n == 0:
        raise ValueError("the pruning pool is empty: the curriculum keeps no train example")
    everything = np.arange(n, dtype=np.int64)
    below = scores < scores.mean()
    n_below = int(below.sum())
    if anneal:
        return EpochDraw(everything, np.ones(n), np.zeros(0, np.int64), "anneal: full data",
                         0.0, n_below, 1.0)
    n_pruned = math.floor(rate * n_below)
    if n_pruned == 0:
        why = "rate 0" if rate == 0.0 else ("no example below the mean loss" if n_below == 0
                                            else f"rate {rate:g} of {n_below} rounds to none")
        return EpochDraw(everything, np.ones(n), np.zeros(0, np.int64), f"pruned: none ({why})",
                         rate, n_below, 1.0)
    weights = np.ones(n)
    upweight = 1.0
    if method == "infobatch":
        pruned = rng.choice(np.flatnonzero(below), n_pruned, replace=False)
        upweight = n_below / (n_below - n_pruned)
        weights[below] = upweight
        reason = f"pruned: below-mean loss, rate {rate:g}"
    else:
        pruned = rng.choice(n, n_pruned, replace=False)
        reason = f"pruned: random, rate {rate:g} (as many as InfoBatch would)"
    keep = np.ones(n, dtype=bool)
    keep[pruned] = False
    warnings = []
    for name, values in groups:
        lost = np.setdiff1d(np.unique(values), np.unique(values[keep]))
        for group in lost.tolist():
            members = values == group
            keep |= members
            weights[members] = 1.0
            warnings.append(f"coverage clamp: the draw would leave out every example of {name} "
                            f"{group}; its {int(members.sum())} examples are kept at weight 1 "
                            "this epoch")
    return EpochDraw(np.flatnonzero(keep), weights[keep], np.flatnonzero(~keep), reason, rate,
                     n_below, upweight, tuple(warnings))


def _finite_scores(pool_scores: np.ndarray) -> np.ndarray:
    scores = np.asarray(pool_scores, dtype=np.float64)
    bad = ~np.isfinite(scores)
    if bad.any():
        raise ValueError(f"{int(bad.sum())} of {len(scores)} pruning scores are NaN or infinite "
                         "(the model diverged): lower the learning rate or resume from an earlier "
                         "checkpoint; pruning on such scores would be arbitrary")
    return scores


# -- scores --------------------------------------------------------------------------------------
def tag_scores(table: ScoreTable, model_fingerprint: str) -> ScoreTable:
    """The table with the scoring model's fingerprint in its `scorer`, so that a run can tell
    scores of its own model from a stale checkpoint of another (see `check_initial_scores`)."""
    if not re.fullmatch(r"[0-9a-f]{64}", model_fingerprint or ""):
        raise ValueError("model_fingerprint must be 64 hex digits "
                         "(training.model.model_fingerprint)")
    scorer = _FINGERPRINT_TAG.sub("", table.scorer).strip()
    return ScoreTable(**{**table.__dict__, "scorer": f"{scorer} fingerprint={model_fingerprint}"})


def check_initial_scores(table: ScoreTable, examples: ExampleSet, *, model_fingerprint: str,
                         run_step: int) -> np.ndarray:
    """The score of every train example (train_positions order), after refusing scores that
    cannot describe this run: NaN, other shards, a missing train example, or model scores that
    are untagged, of another model, or from a step this run has not reached."""
    if table.data_fingerprint != examples.fingerprint:
        raise ValueError(
            f"initial scores were taken on shards {table.data_fingerprint[:12]}, this run trains "
            f"on {examples.fingerprint[:12]} of {examples.partition!r}: re-materialize "
            "difficulty_scores for these shards")
    if table.step is not None:
        found = _FINGERPRINT_TAG.search(table.scorer)
        if found is None:
            raise ValueError(
                f"initial scores come from a model ({table.scorer}) that is not named: tag them "
                "with training.dynamic_pruning.tag_scores(table, model_fingerprint), or use proxy "
                "scores (difficulty_scores(examples) with model=None)")
        if found.group(1) != model_fingerprint:
            raise ValueError(
                f"initial scores come from another model (fingerprint {found.group(1)[:12]}, "
                f"{table.scorer.split()[0]}) than this run's ({model_fingerprint[:12]}): a stale "
                "checkpoint of another model; re-score with this run's model or use proxy scores")
        if table.step > run_step:
            raise ValueError(
                f"initial scores come from step {table.step}, but this run is at step {run_step}: "
                "they are from another run's checkpoint; re-score with this run's model")
    by_position = np.full(len(examples.example_ids), np.nan)
    by_position[examples.positions_of(table.example_ids)] = _finite_scores(table.loss)
    train_scores = by_position[examples.train_positions]
    if np.isnan(train_scores).any():
        missing = int(np.isnan(train_scores).sum())
        raise ValueError(f"initial scores miss {missing} train examples of {examples.partition!r}: "
                         "re-materialize difficulty_scores")
    return train_scores


# -- the control file the slow layer writes ------------------------------------------------------
@dataclass(frozen=True)
class PruningControl:
    """What the slow layer asks for; None fields leave the current value unchanged."""

    pruning_rate: float | None
    curriculum_dir: Path | None
    curriculum_version: str | None
    reason: str
    digest: str  # sha256 of the content: the trainer applies each content once


def write_pruning_control(path: str | Path, *, pruning_rate: float | None = None,
                          curriculum_dir: str | Path | None = None,
                          curriculum_version: str | None = None, reason: str = "") -> Path:
    """Atomically (tmp, fsync, rename) write the control file a running trainer reads at its next
    fast-tick boundary. Refuses a rate outside [0, 1) before anything is written."""
    if pruning_rate is None and curriculum_dir is None:
        raise ValueError("write_pruning_control needs pruning_rate and/or curriculum_dir")
    content = {
        "format": CONTROL_FORMAT,
        "pruning_rate": None if pruning_rate is None else validate_pruning_rate(pruning_rate),
        "curriculum_dir": None if curriculum_dir is None else str(curriculum_dir),
        "curriculum_version": curriculum_version, "reason": reason, "written_at_s": time.time(),
    }
    path = Path(path)
    atomic_write_json(path, content)
    return path


def read_pruning_control(path: str | Path) -> PruningControl:
    """Parses and validates a control file; ValueError names the file and the bad field."""
    path = Path(path)
    content = read_control_json(
        path, fmt=CONTROL_FORMAT, what="pruning control file",
        fix="rewrite it with training.dynamic_pruning.write_pruning_control")
    rate = content.get("pruning_rate")
    if rate is not None:
        try:
            rate = validate_pruning_rate(rate)
        except ValueError as error:
            raise ValueError(f"pruning control file {path}: {error}") from error
    directory = content.get("curriculum_dir")
    return PruningControl(
        pruning_rate=rate, curriculum_dir=Path(directory) if directory else None,
        curriculum_version=content.get("curriculum_version"), reason=str(content.get("reason", "")),
        digest=control_digest(content),
    )


# -- the in-process slow tick --------------------------------------------------------------------
@dataclass
class SlowPruningTicker:
    """The slow layer's pruning decision inside the trainer (deterministic, checkpointable):
    `controllers.pruning.decide_pruning_rate` on the live score table and the eval-loss curve.
    The Dagster sensor makes the same decision from telemetry and writes the control file.

    The curve the policy sees has one point per slow tick: the mean of the evaluations since the
    previous tick (a slow layer reads telemetry aggregated over its tick, not single evaluations,
    whose step-to-step noise would trip the regression guard at random)."""

    config: PruningConfig
    every_steps: int
    last_tick_step: int = 0
    eval_steps: list[int] = field(default_factory=list)  # one per tick that saw evaluations
    eval_losses: list[float] = field(default_factory=list)  # mean eval loss over that tick
    window: list[float] = field(default_factory=list)  # evaluations since the last tick
    window_step: int = 0

    def observe_eval(self, step: int, eval_loss: float) -> None:
        self.window.append(float(eval_loss))
        self.window_step = int(step)

    def due(self, step: int) -> bool:
        return step - self.last_tick_step >= self.every_steps

    def decide(self, *, step: int, pool_scores: np.ndarray, fraction_done: float,
               work_done: float) -> PruningDecision:
        self.last_tick_step = step
        if self.window:
            self.eval_steps.append(self.window_step)
            self.eval_losses.append(sum(self.window) / len(self.window))
            self.window = []
        scores = _finite_scores(pool_scores)
        mean = float(scores.mean())
        data = DataSummary(num_examples=len(scores), mean_loss_score=mean,
                           std_loss_score=float(scores.std()),
                           share_below_mean=float((scores < mean).mean()))
        curve = LossCurve(eval_losses=tuple(self.eval_losses), eval_steps=tuple(self.eval_steps),
                          tokens_seen=int(work_done))
        # Work in full-data-equivalent sample passes; the decision does not use wall time.
        progress = Progress(work_done=min(1.0, fraction_done), work_total=1.0, elapsed_s=0.0,
                            time_left_s=0.0)
        return decide_pruning_rate(data, curve, progress, self.config)

    def state_dict(self) -> dict:
        return {"last_tick_step": self.last_tick_step, "eval_steps": list(self.eval_steps),
                "eval_losses": list(self.eval_losses), "window": list(self.window),
                "window_step": self.window_step}

    def load_state_dict(self, state: dict) -> None:
        self.last_tick_step = int(state["last_tick_step"])
        self.eval_steps = [int(s) for s in state["eval_steps"]]
        self.eval_losses = [float(v) for v in state["eval_losses"]]
        self.window = [float(v) for v in state["window"]]
        self.window_step = int(state["window_step"])
