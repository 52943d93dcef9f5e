"""`FastEnv`: one step = one fast tick (`tick_s` of wall time) of a data-parallel training loop.

What is measured data and what is a stated model:
- straggling: each rank's step-time inflation is drawn from the real Alibaba mini-batch traces
  (`cloud.stragglers.load_step_inflation`) and persists from tick to tick with probability
  `persist` (a slow node stays slow for a while, which is what re-sharing exploits);
- preemption notices: a spot node gets a notice at a hazard measured on real spot traces
  (reclaims per hour of spot-up time of one zone trace, drawn per episode), `notice_s` before the
  node is reclaimed. `hazards_per_h` are the region's own (retraining passes
  `rl.training_data.region_fast_stats`: its zones' newest days), so regions whose markets differ
  train different policies; without it, the zones of `preemption-1node-aws-2023-04`;
- gradient noise (MODEL, not data): B_noise grows linearly with progress from `noise0` to
  10 x `noise0` (McCandlish et al. 2018 report an order of magnitude over a run), measured with
  30 % log-normal noise; progress per step is 1 / (1 + B_noise / B) "ideal steps"
  (their eq. 2.11) and a step takes `overhead_ms` + the slowest rank's share of B.

Reward: ideal steps gained in the tick (scaled by 1/100), minus the progress lost to a preemption
(the work since the last complete checkpoint). A checkpoint costs `checkpoint_cost_s` of wall
time; a restart after a preemption costs `restart_s`; MIGRATE stops at once (losing the unsaved
work) and starts the restart during the notice instead of after the kill.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import gymnasium as gym
import numpy as np

from cloud.stragglers import load_step_inflation
from cloud.traces import load_folder
from controllers.fast_heuristic import HeuristicFastPolicy
from controllers.fast_types import FastAction, FastObservation, PreemptionResponse
from rl.fast_obs import (
    BATCH_CHOICES,
    FAST_OBS_SIZE,
    NOTICE_CHOICES,
    SHARE_CHOICES,
    apply_fast_choice,
    fast_features,
)

NOTICE_FOLDER = "preemption-1node-aws-2023-04"


@functools.cache
def notice_hazards_per_h(folder: str = NOTICE_FOLDER) -> tuple[float, ...]:
    """Preemptions per hour of spot availability, per zone of a real spot collection."""
    hazards = []
    for trace in load_folder(folder):
        a = trace.available
        drops = int(((a[:-1] >= 1) & (a[1:] == 0)).sum())
        up_h = float((a >= 1).sum()) * trace.tick_s / 3600.0
        if up_h > 0:
            hazards.append(drops / up_h)
    return tuple(hazards)


@functools.cache
def _inflation() -> np.ndarray:
    return load_step_inflation()


class FastEnv(gym.Env):
    metadata = {"render_modes": []}

    def __init__(self, ranks: int = 4, episode_ticks: int = 240, tick_s: float = 30.0,
                 persist: float = 0.9, noise0: float = 64.0, example_ms: float = 2.0,
                 overhead_ms: float = 60.0, micro_batch_size: int = 16, checkpoint_cost_s: float = 40.0,
                 checkpoint_interval_s: float = 1800.0, restart_s: float = 360.0,
                 notice_s: float = 120.0, hazard_scale: float = 1.0,
                 hazards_per_h: Sequence[float] | None = None):
        if ranks < 1 or episode_ticks < 1 or tick_s <= 0:
            raise ValueError(f"ranks={ranks}, episode_ticks={episode_ticks}, tick_s={tick_s} must be positive")
        self.ranks, self.episode_ticks, self.tick_s = ranks, episode_ticks, tick_s
        self.persist, self.noise0 = persist, noise0
        self.example_ms, self.overhead_ms = example_ms, overhead_ms
        self.micro0 = micro_batch_size
        self.checkpoint_cost_s, self.checkpoint_interval_s = checkpoint_cost_s, checkpoint_interval_s
        self.restart_s, self.notice_s = restart_s, notice_s
        measured = notice_hazards_per_h() if hazards_per_h is None else tuple(
            float(h) for h in hazards_per_h)
        if not measured or not all(math.isfinite(h) and h >= 0 for h in measured):
            raise ValueError(f"hazards_per_h={measured} must be one or more finite reclaim "
                             "rates per spot-up hour, 0 or more")
        self.hazards = tuple(h * hazard_scale for h in measured)
        self.inflation = _inflation()
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (FAST_OBS_SIZE,), np.float32)
        self.action_space = gym.spaces.MultiDiscrete(
            [len(SHARE_CHOICES), len(BATCH_CHOICES), len(NOTICE_CHOICES)])
        self.total_steps = 20000.0  # ideal steps of the whole run (sets how B_noise grows)

    def _observation(self) -> FastObservation:
        return FastObservation(
            step=self.steps, elapsed_s=self.t * self.tick_s, train_loss=1.0, grad_norm=1.0,
            grad_noise_scale=float(self.noise_measured), micro_batch_size=self.micro,
            grad_accum_steps=self.accum, learning_rate=self.lr,
            rank_step_time_ms=tuple(float(x) for x in self.rank_ms), dataloader_queue_depth=4,
            preemption_notice_s=self.notice_left if self.notice_left is not None else None,
            preemption_risk=min(1.0, self.hazard_per_h * 0.25),
            seconds_since_checkpoint=self.since_ckpt_s, checkpoint_cost_s=self.checkpoint_cost_s)

    def _observe(self) -> np.ndarray:
        self._obs = self._observation()
        self._heur = self.heuristic.act(self._obs)
        return fast_features(self._obs, self._heur)

    def _measure(self) -> None:
        rng = self.np_random
        keep = rng.random(self.ranks) < self.persist
        fresh = rng.choice(self.inflation, self.ranks)
        self.infl = np.where(keep, self.infl, fresh)
        batch = self.micro * self.accum * self.ranks
        self.rank_ms = self.overhead_ms + self.shares * batch * self.example_ms * self.infl
        b_noise = self.noise0 * (1.0 + 9.0 * min(1.0, self.progress / self.total_steps))
        self.noise_measured = b_noise * float(np.exp(rng.normal(0.0, 0.3)))
        self.b_noise = b_noise

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.heuristic = HeuristicFastPolicy()
        self.hazard_per_h = float(self.np_random.choice(self.hazards))
        self.t, self.steps = 0, 0
        self.micro, self.accum, self.lr = self.micro0, 2, 1e-3
        self.shares = np.full(self.ranks, 1.0 / self.ranks)
        self.infl = self.np_random.choice(self.inflation, self.ranks)
        self.progress = self.saved = 0.0
        self.since_ckpt_s = 0.0
        self.notice_left: float | None = None
        self.down_s = 0.0  # seconds of restart still to serve
        self._measure()
        return self._observe(), {}

    def _train(self, seconds: float) -> float:
        """Trains for `seconds` of wall time; returns ideal steps gained."""
        if seconds <= 0:
            return 0.0
        batch = self.micro * self.accum * self.ranks
        step_ms = float(np.max(self.overhead_ms + self.shares * batch * self.example_ms * self.infl))
        steps = seconds * 1000.0 / step_ms
        gain = steps / (1.0 + self.b_noise / batch)
        self.steps += int(steps)
        self.progress += gain
        self.since_ckpt_s += seconds
        return gain

    def _checkpoint(self) -> float:
        self.saved = self.progress
        self.since_ckpt_s = 0.0
        return self.checkpoint_cost_s

    def step(self, action):
        share, batch, notice = (int(a) for a in np.asarray(action).reshape(-1)[:3])
        act: FastAction = apply_fast_choice(self._obs, self._heur, share, batch, notice)
        self.micro, self.accum, self.lr = act.micro_batch_size, act.grad_accum_steps, act.learning_rate
        self.shares = np.asarray(act.rank_work_shares, dtype=np.float64)
        before = self.progress
        left = self.tick_s
        lost = 0.0
        if self.down_s > 0:
            used = min(left, self.down_s)
            self.down_s -= used
            left -= used
        if self.notice_left is not None and self.down_s == 0 and left > 0:
            response = act.preemption_response
            if response == PreemptionResponse.MIGRATE:
                lost = self.progress - self.saved
                self.progress = self.saved
                self.since_ckpt_s = 0.0
                self.down_s = max(0.0, self.restart_s - left)
                self.notice_left, left = None, 0.0
            elif response == PreemptionResponse.CHECKPOINT_NOW:
                left -= min(left, self._checkpoint())
            if self.notice_left is not None:
                run = min(left, self.notice_left)
                self._train(run)
                self.notice_left -= min(self.notice_left, self.tick_s)
                if self.notice_left <= 0:  # reclaimed: unsaved work is lost, restart
                    lost = self.progress - self.saved
                    self.progress = self.saved
                    self.since_ckpt_s = 0.0
                    self.notice_left = None
                    self.down_s = self.restart_s - (left - run)
                    left = 0.0
                else:
                    left -= run
        while left > 0:
            to_ckpt = self.checkpoint_interval_s - self.since_ckpt_s
            run = min(left, max(to_ckpt, 0.0))
            self._train(run)
            left -= run
            if left > 0:
                left -= min(left, self._checkpoint())
        if self.notice_left is None and self.down_s == 0:
            p = self.hazard_per_h * self.tick_s / 3600.0
            if self.np_random.random() < p:
                self.notice_left = self.notice_s
        self.t += 1
        self._measure()
        reward = (self.progress - before) / 100.0
        done = self.t >= self.episode_ticks
        info = {"progress": self.progress, "lost": lost}
        return self._observe(), float(reward), False, done, info
