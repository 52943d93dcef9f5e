"""Draws train batches: from a static curriculum (`CurriculumSampler`) or with dynamic pruning
(`DynamicPruningSampler`); both epoch-wise shuffled, weighted, exactly resumable, and both meet
the `TrainSampler` interface the loop calls.

CurriculumSampler, two phases:
- "curriculum": the curriculum's kept examples, each with its loss weight (1/keep-probability:
  unbiased rescaling, InfoBatch, Qin et al. ICLR'24);
- "anneal": the last `anneal_fraction` of `max_steps` draws from every train example with weight
  1, the quality guard InfoBatch calls annealing (the end of training sees the full data).

Within a phase the pool is shuffled once per epoch with a seeded numpy Generator; a batch that
runs past the end of an epoch takes the rest from the next permutation. The state (phase, epoch,
cursor, current permutation, generator state) round-trips through `state_dict`, so a resumed run
draws the very same batches.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from training.consumption import ConsumptionWriter
from training.curriculum import load_curriculum, validate_pruning_rate
from training.data_types import Curriculum, ExampleSet
from training.dynamic_pruning import (
    DynamicPruningConfig,
    SlowPruningTicker,
    check_initial_scores,
    draw_epoch,
    read_pruning_control,
)

PHASES = ("curriculum", "anneal")


def _curriculum_dict(curriculum: Curriculum | None) -> dict[str, Any] | None:
    """A pending curriculum as plain data for the checkpoint (loaded weights-only: no classes)."""
    if curriculum is None:
        return None
    return {"partition": curriculum.partition, "version": curriculum.version,
            "example_ids": curriculum.example_ids.copy(), "weights": curriculum.weights.copy(),
            "pruning_rate": curriculum.pruning_rate,
            "data_fingerprint": curriculum.data_fingerprint,
            "scores_step": curriculum.scores_step, "anneal_fraction": curriculum.anneal_fraction}


def _curriculum_from_dict(value: dict[str, Any] | None) -> Curriculum | None:
    if value is None:
        return None
    return Curriculum(
        partition=str(value["partition"]), version=str(value["version"]),
        example_ids=np.asarray(value["example_ids"], dtype=np.int64).copy(),
        weights=np.asarray(value["weights"], dtype=np.float64).copy(),
        pruning_rate=float(value["pruning_rate"]),
        data_fingerprint=str(value["data_fingerprint"]),
        scores_step=None if value["scores_step"] is None else int(value["scores_step"]),
        anneal_fraction=float(value["anneal_fraction"]),
    )


class TrainSampler(Protocol):
    """What `training.loop` calls on a sampler (at step boundaries, in this order per step:
    next_batch and observe_losses per micro batch, then on_fast_tick / observe_eval)."""

    phase: str

    def next_batch(self, batch_size: int, step: int) -> tuple[np.ndarray, np.ndarray]: ...
    def observe_losses(self, positions: np.ndarray, losses: Any) -> None: ...
    def observe_eval(self, step: int, eval_loss: float) -> None: ...
    def on_fast_tick(self, step: int) -> None: ...
    def progress_steps(self, step: int) -> float: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


def refuse_lost_groups(examples: ExampleSet, kept_positions: np.ndarray, what: str) -> None:
    """ValueError if `kept_positions` leave out every train example of a shard (or, for images,
    of a class): a curriculum must not silently remove a part of the data."""
    train = examples.train_positions
    groups = [("shard", examples.shard_index)]
    if examples.kind == "image" and examples.labels is not None:
        groups.append(("class", examples.labels))
    for name, values in groups:
        lost = np.setdiff1d(np.unique(values[train]), np.unique(values[kept_positions]))
        if len(lost):
            raise ValueError(f"{what} keeps no train example of {name} {int(lost[0])} of "
                             f"{examples.partition!r}: lower the pruning rate and re-materialize "
                             "the curriculum")


def anneal_start_step(max_steps: int, anneal_fraction: float) -> int:
    """First step of the anneal phase: the last ceil(anneal_fraction * max_steps) steps."""
    if not 0.0 <= anneal_fraction <= 1.0:
        raise ValueError(f"anneal_fraction={anneal_fraction} must be in [0, 1]")
    return max_steps - math.ceil(anneal_fraction * max_steps)


def curriculum_pool(
    examples: ExampleSet, curriculum: Curriculum | None
) -> tuple[np.ndarray, np.ndarray]:
    """(positions, weights) of the kept train examples; all train examples at weight 1 if None."""
    if curriculum is None:
        positions = examples.train_positions
        return positions, np.ones(len(positions), dtype=np.float64)
    if curriculum.partition != examples.partition:
        raise ValueError(
            f"curriculum is for partition {curriculum.partition!r} but the examples are "
            f"{examples.partition!r}; build the curriculum from these shards"
        )
    if curriculum.data_fingerprint != examples.fingerprint:
        raise ValueError(
            f"curriculum {curriculum.version} was built from data "
            f"{curriculum.data_fingerprint[:12]} "
            f"but the examples are {examples.fingerprint[:12]}; re-materialize the curriculum"
        )
    if len(curriculum.example_ids) == 0:
        raise ValueError(
            f"curriculum {curriculum.version} keeps no examples; lower the pruning rate"
        )
    if curriculum.weights.shape != curriculum.example_ids.shape:
        raise ValueError(
            f"curriculum {curriculum.version} has {len(curriculum.weights)} weights for "
            f"{len(curriculum.example_ids)} examples; rebuild it"
        )
    weights = np.asarray(curriculum.weights, dtype=np.float64)
    if not np.all(np.isfinite(weights)) or np.any(weights <= 0):
        raise ValueError(f"curriculum {curriculum.version} has non-positive or non-finite weights")
    positions = examples.positions_of(curriculum.example_ids)
    if examples.is_eval[positions].any():
        raise ValueError(
            f"curriculum {curriculum.version} keeps held-out (eval) examples; rebuild it from "
            "the train split only"
        )
    refuse_lost_groups(examples, positions, f"curriculum {curriculum.version}")
    return positions.astype(np.int64), weights


class CurriculumSampler:
    """A static curriculum's kept examples, then full data for the anneal (see the docstring)."""

    def __init__(
        self,
        examples: ExampleSet,
        curriculum: Curriculum | None,
        *,
        seed: int,
        max_steps: int,
    ) -> None:
        self.examples = examples
        self.max_steps = max_steps
        self.curriculum_version = curriculum.version if curriculum is not None else None
        fraction = curriculum.anneal_fraction if curriculum is not None else 0.0
        self.anneal_start = anneal_start_step(max_steps, fraction)
        self._pools = {
            "curriculum": curriculum_pool(examples, curriculum),
            "anneal": (
                examples.train_positions.astype(np.int64),
                np.ones(len(examples.train_positions), dtype=np.float64),
            ),
        }
        if len(self._pools["anneal"][0]) == 0:
            raise ValueError(
                f"partition {examples.partition!r} has no train examples (all are eval); "
                "rebuild the shards with a train split"
            )
        self._rng = np.random.default_rng(seed)
        self.phase = "curriculum" if self.anneal_start > 0 else "anneal"
        self.epoch = 0
        self.cursor = 0
        self._order = self._rng.permutation(len(self._pools[self.phase][0]))

    def phase_for_step(self, step: int) -> str:
        return "anneal" if step >= self.anneal_start else "curriculum"

    def _enter_phase(self, phase: str) -> None:
        # A phase change starts a fresh epoch over the new pool.
        self.phase = phase
        self.epoch += 1
        self.cursor = 0
        self._order = self._rng.permutation(len(self._pools[phase][0]))

    def next_batch(self, batch_size: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(row positions into the ExampleSet, float64 loss weights) for a batch at `step`."""
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        wanted = self.phase_for_step(step)
        if wanted != self.phase:
            self._enter_phase(wanted)
        positions, weights = self._pools[self.phase]
        taken: list[np.ndarray] = []
        needed = batch_size
        while needed > 0:
            if self.cursor >= len(self._order):
                self.epoch += 1
                self.cursor = 0
                self._order = self._rng.permutation(len(positions))
            chunk = self._order[self.cursor : self.cursor + needed]
            self.cursor += len(chunk)
            needed -= len(chunk)
            taken.append(chunk)
        picked = np.concatenate(taken)
        return positions[picked], weights[picked]

    # The static sampler learns nothing from losses or evals and has no control input.
    def observe_losses(self, positions: np.ndarray, losses: Any) -> None:
        pass

    def observe_eval(self, step: int, eval_loss: float) -> None:
        pass

    def on_fast_tick(self, step: int) -> None:
        pass

    def progress_steps(self, step: int) -> int:
        """The budget is counted in optimizer steps."""
        return step

    def close(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "order": self._order.copy(),
            "rng_state": self._rng.bit_generator.state,
            "curriculum_version": self.curriculum_version,
            "pool_size": len(self._pools[self.phase][0]),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a saved state. If the curriculum changed since (the slow layer re-materialized
        it between the checkpoint and the resume), the generator and epoch count carry on and the
        curriculum phase starts a fresh epoch over the new pool; the anneal pool never changes."""
        if state.get("kind") == DynamicPruningSampler.kind:
            raise ValueError("the checkpoint was written with dynamic pruning: resume it with "
                             "train(..., pruning=DynamicPruningConfig(...)) or start fresh")
        if state["phase"] not in PHASES:
            raise ValueError(f"sampler state has unknown phase {state['phase']!r}")
        self._rng.bit_generator.state = state["rng_state"]
        self.epoch = int(state["epoch"])
        changed = state["curriculum_version"] != self.curriculum_version
        if changed and state["phase"] == "curriculum":
            self._enter_phase("curriculum")
            return
        pool_size = len(self._pools[state["phase"]][0])
        if int(state["pool_size"]) != pool_size or len(state["order"]) != pool_size:
            raise ValueError(
                f"sampler state is for a pool of {state['pool_size']} examples but this "
                f"{state['phase']} pool has {pool_size}; resume with the same data"
            )
        self.phase = state["phase"]
        self.cursor = int(state["cursor"])
        self._order = np.asarray(state["order"], dtype=np.int64).copy()


class DynamicPruningSampler:
    """InfoBatch-style dynamic pruning over a running per-example loss table.

    Epochs: each epoch draws its keep set (`training.dynamic_pruning.draw_epoch`) from the table
    and the current rate, then shuffles it; a batch that runs past the end of an epoch takes the
    rest from the next one. Epochs that end in the last `anneal_fraction` of the budget use every
    train example at weight 1.

    Budget: `max_steps * samples_per_step / n_train` full-data epochs; `progress_steps` converts
    the epochs covered into full-data steps, which the loop uses for its learning-rate schedule
    and its stopping point: a pruned run covers the same epochs in fewer optimizer steps.

    Inputs between epochs: `set_pruning_rate` / `set_curriculum` (API), the control file and the
    in-process slow tick (read at `on_fast_tick`); each change applies from the next epoch draw
    and is recorded. With a static curriculum the pruning acts on its kept examples (weights
    multiply: both draws are unbiased, so is their product); the anneal uses every train example.

    Resume: `state_dict` holds the table, the epoch's keep set and order, the rate, the generator
    and the slow tick's history, so a resumed run draws the same batches. The curriculum passed
    to a resumed run replaces the checkpoint's pool only if it differs from the one the
    checkpointing process was given.
    """

    kind = "dynamic_pruning"

    def __init__(
        self,
        examples: ExampleSet,
        curriculum: Curriculum | None,
        *,
        config: DynamicPruningConfig,
        seed: int,
        max_steps: int,
        samples_per_step: int,
        model_fingerprint: str,
        consumption_path: str | Path | None = None,
    ) -> None:
        if max_steps < 1 or samples_per_step < 1:
            raise ValueError(f"max_steps={max_steps} and samples_per_step={samples_per_step} "
                             "must be >= 1")
        self.examples = examples
        self.config = config
        self.model_fingerprint = model_fingerprint
        self.rate = validate_pruning_rate(config.pruning_rate)
        self._train = examples.train_positions.astype(np.int64)
        if len(self._train) == 0:
            raise ValueError(f"partition {examples.partition!r} has no train examples (all are "
                             "eval); rebuild the shards with a train split")
        self._table_index = np.full(len(examples.example_ids), -1, dtype=np.int64)
        self._table_index[self._train] = np.arange(len(self._train))
        if config.initial_scores is None:
            self._scores = np.ones(len(self._train))  # InfoBatch's start: nothing below the mean
        else:
            self._scores = check_initial_scores(config.initial_scores, examples,
                                                model_fingerprint=model_fingerprint, run_step=0)
        self.budget_epochs = max_steps * samples_per_step / len(self._train)
        self._steps_per_epoch = len(self._train) / samples_per_step
        self._given = curriculum
        self._given_version = curriculum.version if curriculum is not None else None
        self._pool, self._pool_weights = curriculum_pool(examples, curriculum)
        self._pool_version = self._given_version
        self._pending: Curriculum | None = None
        self._rng = np.random.default_rng(seed)
        self.ticker = (SlowPruningTicker(config.slow_policy, config.slow_every_steps)
                       if config.slow_policy is not None else None)
        self.phase = "curriculum"
        self.epoch = 0
        self.cursor = 0
        self._order: np.ndarray | None = None  # row positions of this epoch, shuffled
        self._weights: np.ndarray | None = None
        self._step = 0
        self._control_key: tuple | None = None
        self._control_digest: str | None = None
        self._consumption_path = Path(consumption_path) if consumption_path else None
        self._recorder: ConsumptionWriter | None = None
        self.sampler_s = 0.0  # wall time spent in this sampler (its overhead), this process
        self.samples_drawn = 0

    # -- records --------------------------------------------------------------------------------
    def _open_recorder(self, step: int) -> ConsumptionWriter | None:
        """The consumption writer, opened on first use (after a resume has restored the step)."""
        if self._recorder is None and self._consumption_path is not None \
                and self.config.record_consumption:
            self._recorder = ConsumptionWriter(
                self._consumption_path, start_step=step, method=self.config.method,
                partition=self.examples.partition, budget_epochs=self.budget_epochs)
        return self._recorder

    def _record(self, record: dict[str, Any]) -> None:
        recorder = self._open_recorder(int(record["step"]))
        if recorder is not None:
            recorder.write(record)

    def _ids(self, positions: np.ndarray) -> list[int]:
        return self.examples.example_ids[positions].tolist()

    # -- inputs ---------------------------------------------------------------------------------
    def set_pruning_rate(self, rate: float, *, reason: str = "", source: str = "api") -> None:
        """Sets the rate of the next epoch draws; ValueError outside [0, 1)."""
        self.rate = validate_pruning_rate(rate)
        self._record({"type": "rate", "step": self._step, "rate": self.rate, "source": source,
                      "reason": reason, "applies_from_epoch": self._next_epoch()})

    def set_curriculum(self, curriculum: Curriculum, *, source: str = "api") -> None:
        """Replaces the pool from the next epoch draw; refuses a curriculum of other data or one
        that drops a whole shard or class (ValueError)."""
        curriculum_pool(self.examples, curriculum)  # validates before anything changes
        self._pending = curriculum
        self._record({"type": "curriculum", "step": self._step, "version": curriculum.version,
                      "rate": curriculum.pruning_rate, "source": source,
                      "applies_from_epoch": self._next_epoch()})

    def _next_epoch(self) -> int:
        return self.epoch + 1 if self._order is not None else 0

    def _poll_control(self) -> None:
        path = self.config.control_path
        try:
            stat = path.stat()
        except FileNotFoundError:
            return
        key = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        if key == self._control_key:
            return  # unchanged since the last tick: one stat() per fast tick
        self._control_key = key
        try:
            control = read_pruning_control(path)
            if control.digest == self._control_digest:
                return
            self._control_digest = control.digest
            if control.curriculum_dir is not None:
                self.set_curriculum(load_curriculum(control.curriculum_dir,
                                                    control.curriculum_version),
                                    source="control_file")
            if control.pruning_rate is not None:
                self.set_pruning_rate(control.pruning_rate, reason=control.reason,
                                      source="control_file")
        except (ValueError, FileNotFoundError, KeyError) as error:
            # A bad control file must not kill a long run: refuse it, keep the current inputs,
            # and leave the reason where the user looks (the consumption record).
            self._record({"type": "warning", "step": self._step,
                          "message": f"control file refused, inputs unchanged: {error}"})

    # -- the loop's calls -----------------------------------------------------------------------
    def _draw(self, step: int) -> None:
        if self._pending is not None:
            self._pool, self._pool_weights = curriculum_pool(self.examples, self._pending)
            self._pool_version, self._pending = self._pending.version, None
        # An epoch is pruned only if it ends within the first (1 - anneal_fraction) of the budget.
        limit = (1.0 - self.config.anneal_fraction) * self.budget_epochs
        anneal = self.epoch + 1 > limit + 1e-9
        pool = self._train if anneal else self._pool
        base = np.ones(len(pool)) if anneal else self._pool_weights
        groups = [("shard", self.examples.shard_index[pool])]
        if self.examples.kind == "image" and self.examples.labels is not None:
            groups.append(("class", self.examples.labels[pool]))
        draw = draw_epoch(method=self.config.method,
                          pool_scores=self._scores[self._table_index[pool]], rate=self.rate,
                          rng=self._rng, anneal=anneal, groups=tuple(groups))
        kept = pool[draw.kept]
        weights = base[draw.kept] * draw.weights
        order = self._rng.permutation(len(kept))
        self._order, self._weights, self.cursor = kept[order], weights[order], 0
        self.phase = "anneal" if anneal else "curriculum"
        skipped = [{"reason": draw.reason, "ids": self._ids(pool[draw.skipped])}]
        if not anneal and self._pool_version is not None:
            outside = np.setdiff1d(self._train, pool)
            skipped.append({"reason": f"not in curriculum {self._pool_version}",
                            "ids": self._ids(outside)})
        self._record({
            "type": "epoch", "step": step, "epoch": self.epoch, "phase": self.phase,
            "method": self.config.method, "rate": draw.rate, "kept": len(kept),
            "skipped_count": int(sum(len(s["ids"]) for s in skipped)), "skipped": skipped,
            "reason": draw.reason, "n_below_mean": draw.n_below_mean, "upweight": draw.upweight,
            "score_mean": float(self._scores.mean()), "curriculum_version": self._pool_version,
        })
        for message in draw.warnings:
            self._record({"type": "warning", "step": step, "epoch": self.epoch, "message": message})

    def next_batch(self, batch_size: int, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(row positions into the ExampleSet, float64 loss weights) for a batch at `step`."""
        began = time.perf_counter()
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self._step = step
        positions, weights = [], []
        needed = batch_size
        while needed > 0:
            if self._order is None:
                self._draw(step)
            elif self.cursor >= len(self._order):
                self.epoch += 1
                self._draw(step)
            end = self.cursor + needed
            positions.append(self._order[self.cursor:end])
            weights.append(self._weights[self.cursor:end])
            needed -= len(positions[-1])
            self.cursor += len(positions[-1])
        batch = np.concatenate(positions) if len(positions) > 1 else positions[0]
        batch_weights = np.concatenate(weights) if len(weights) > 1 else weights[0]
        self.samples_drawn += len(batch)
        recorder = self._open_recorder(step)
        if recorder is not None:
            recorder.batch(step, self.epoch, self.examples.example_ids[batch], batch_weights)
        self.sampler_s += time.perf_counter() - began
        return batch, batch_weights

    def observe_losses(self, positions: np.ndarray, losses: Any) -> None:
        """Refreshes the table from the training batch's per-example losses (InfoBatch: no
        extra forward pass). `losses`: a torch tensor or array, one loss per position."""
        began = time.perf_counter()
        values = losses.detach().numpy() if hasattr(losses, "detach") else np.asarray(losses)
        self._scores[self._table_index[positions]] = values
        self.sampler_s += time.perf_counter() - began

    def observe_eval(self, step: int, eval_loss: float) -> None:
        if self.ticker is not None:
            self.ticker.observe_eval(step, eval_loss)

    def on_fast_tick(self, step: int) -> None:
        """A fast-tick boundary: read the control file, run the slow tick when it is due."""
        began = time.perf_counter()
        self._step = step
        if self.config.control_path is not None:
            self._poll_control()
        if self.ticker is not None and self.ticker.due(step):
            pool_scores = self._scores[self._table_index[self._pool]]
            fraction = self.progress_steps(step) / (self.budget_epochs * self._steps_per_epoch)
            decision = self.ticker.decide(step=step, pool_scores=pool_scores,
                                          fraction_done=fraction,
                                          work_done=self.samples_drawn)
            self.rate = decision.rate
            self._record({"type": "rate", "step": step, "rate": decision.rate,
                          "source": "slow_policy", "reason": decision.reason,
                          "numbers": decision.numbers, "applies_from_epoch": self._next_epoch()})
        self.sampler_s += time.perf_counter() - began

    def epochs_covered(self) -> float:
        """Epochs drawn so far, the current one in proportion to its position."""
        if self._order is None:
            return 0.0
        return self.epoch + self.cursor / len(self._order)

    def progress_steps(self, step: int) -> float:
        """Full-data-equivalent steps covered (the loop's clock for its budget and schedule)."""
        return self.epochs_covered() * self._steps_per_epoch

    def close(self) -> None:
        if self._recorder is not None:
            self._recorder.close({"type": "close", "step": self._step, "sampler_s": self.sampler_s,
                                  "epochs_covered": self.epochs_covered(),
                                  "samples_drawn": self.samples_drawn})

    # -- checkpoint -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self._recorder is not None:
            self._recorder.flush(durable=True)  # the record is complete up to every checkpoint
        return {
            "kind": self.kind, "method": self.config.method, "phase": self.phase,
            "data_fingerprint": self.examples.fingerprint,
            "model_fingerprint": self.model_fingerprint, "n_train": len(self._train),
            "rate": self.rate, "epoch": self.epoch, "cursor": self.cursor,
            "order": None if self._order is None else self._order.copy(),
            "weights": None if self._weights is None else self._weights.copy(),
            "scores": self._scores.copy(), "rng_state": self._rng.bit_generator.state,
            "given_version": self._given_version, "pool_version": self._pool_version,
            "pool": self._pool.copy(), "pool_weights": self._pool_weights.copy(),
            "pending": _curriculum_dict(self._pending), "control_digest": self._control_digest,
            "ticker": self.ticker.state_dict() if self.ticker is not None else None,
            "step": self._step, "samples_drawn": self.samples_drawn,
            "budget_epochs": self.budget_epochs,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a saved state; refuses one of another kind, method, model or data."""
        if state.get("kind") != self.kind:
            raise ValueError("the checkpoint was written without dynamic pruning: resume it "
                             "without pruning= or start fresh")
        if state["method"] != self.config.method:
            raise ValueError(f"the checkpoint prunes with {state['method']!r}, this run with "
                             f"{self.config.method!r}: resume with the same method")
        if state["data_fingerprint"] != self.examples.fingerprint or \
                state["n_train"] != len(self._train):
            raise ValueError("the checkpoint's loss table is for other shards: resume with the "
                             "same data or start fresh")
        if state["model_fingerprint"] != self.model_fingerprint:
            raise ValueError("the checkpoint's loss table was scored by another model "
                             f"({state['model_fingerprint'][:12]}, this run "
                             f"{self.model_fingerprint[:12]}): start fresh")
        scores = np.asarray(state["scores"], dtype=np.float64)
        if not np.isfinite(scores).all():
            raise ValueError("the checkpoint's loss table holds NaN or infinite losses: resume "
                             "from an earlier checkpoint")
        self._scores = scores.copy()
        self.rate = float(state["rate"])
        self.phase = state["phase"]
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = None if state["order"] is None else np.asarray(state["order"]).copy()
        self._weights = None if state["weights"] is None else np.asarray(state["weights"]).copy()
        self._rng.bit_generator.state = state["rng_state"]
        self._pool = np.asarray(state["pool"], dtype=np.int64).copy()
        self._pool_weights = np.asarray(state["pool_weights"], dtype=np.float64).copy()
        self._pool_version = state["pool_version"]
        self._pending = _curriculum_from_dict(state["pending"])
        self._control_digest = state["control_digest"]
        self._step, self.samples_drawn = int(state["step"]), int(state["samples_drawn"])
        if self.ticker is not None and state["ticker"] is not None:
            self.ticker.load_state_dict(state["ticker"])
        if self._given is not None and self._given.version != state["given_version"]:
            # The slow layer re-materialized the curriculum between checkpoint and resume: it
            # replaces the checkpoint's pool from the next epoch draw.
            self.set_curriculum(self._given, source="resume")
