"""`SlowEnv`: one step = one slow tick of the trace-driven simulator (`cloud.simulator.simulate`).

The simulator is a loop that calls `policy.act(observation)`; rather than fork its rules here
(two simulators would drift apart), the environment runs the unchanged `simulate` in a worker
thread whose policy hands each observation to `step` and waits for the action. So every rule the
cost suite and the oracle are checked against (preemption at the boundary, notice saves,
changeovers, per-second billing, completion charge) is the one the learner trains on.

Episode: a cell (cost-suite scenario) drawn with the env's RNG from `cells`; it ends when the work
is done or the deadline passes. Reward, in units of the job's on-demand cost (`cost_norm_usd`):
each step pays an estimate of the tick's bill (the price of the node set asked for), and the last
step pays the difference to the simulator's true cost (window bill + completion charge), so an
episode's return is exactly -cost / norm, minus `DEADLINE_MISS_PENALTY` on a missed deadline.
Deadline misses are also blocked by the masked safety net (`rl.slow_obs.apply_slow_choice`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

import gymnasium as gym
import numpy as np

from cloud.scenarios import Scenario
from cloud.simulator import SimResult, simulate
from controllers.allocation_types import AllocationAction, AllocationObservation
from rl.cells import heuristic_for
from rl.slow_obs import (
    CHECKPOINT_CHOICES_S,
    DEADLINE_MISS_PENALTY,
    SLOW_CHOICES,
    SLOW_OBS_SIZE,
    apply_slow_choice,
    slow_features,
)


class _Abort(Exception):
    """Ends an abandoned simulation (reset or close mid-episode)."""


class _SteppedPolicy:
    """The policy the simulator calls: hands the observation over and waits for the action."""

    name = "rl_slow_env"

    def __init__(self) -> None:
        self.to_env: queue.SimpleQueue = queue.SimpleQueue()
        self.to_sim: queue.SimpleQueue = queue.SimpleQueue()

    def act(self, observation: AllocationObservation) -> AllocationAction:
        self.to_env.put(("obs", observation))
        action = self.to_sim.get()
        if action is None:
            raise _Abort()
        return action


def cost_norm_usd(cell: Scenario) -> float:
    """On-demand cost of the whole job at the cheapest zone (the reward's unit)."""
    job, rules, market = cell.job, cell.rules, cell.market
    run_s = job.work_gpu_h / (job.node_count * job.gpus_per_node / rules.step_slowdown) * 3600.0
    return job.node_count * min(market.on_demand_usd_per_hour) * (run_s + rules.changeover_s) / 3600


class SlowEnv(gym.Env):
    metadata = {"render_modes": []}

    def __init__(self, cells: Sequence[Scenario], heuristic: str = "trainwise_heuristic"):
        if not cells:
            raise ValueError("SlowEnv needs at least one cell (see rl.cells.make_split)")
        self.cells = tuple(cells)
        self.heuristic_name = heuristic
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (SLOW_OBS_SIZE,), np.float32)
        self.action_space = gym.spaces.MultiDiscrete([len(SLOW_CHOICES), len(CHECKPOINT_CHOICES_S)])
        self._thread: threading.Thread | None = None
        self._stepper: _SteppedPolicy | None = None
        self.cell: Scenario | None = None
        self.result: SimResult | None = None

    # -- simulation thread -------------------------------------------------------------------
    def _start(self, cell: Scenario) -> None:
        stepper = _SteppedPolicy()

        def run() -> None:
            try:
                result = simulate(stepper, cell.job, cell.rules, cell.market, home_zone=cell.home_zone)
            except _Abort:
                return
            except BaseException as error:  # handed to the env thread, which raises it
                stepper.to_env.put(("error", error))
                return
            stepper.to_env.put(("done", result))

        self._stepper = stepper
        self._thread = threading.Thread(target=run, daemon=True, name="rl-slow-sim")
        self._thread.start()

    def _stop(self) -> None:
        if self._thread is not None and self._thread.is_alive() and self._stepper is not None:
            self._stepper.to_sim.put(None)
            self._thread.join(timeout=5.0)
        self._thread = self._stepper = None

    def _next(self) -> tuple[str, object]:
        kind, payload = self._stepper.to_env.get()
        if kind == "error":
            raise payload
        return kind, payload

    def _observe(self, obs: AllocationObservation) -> np.ndarray:
        self._obs = obs
        self._heuristic_action = self._heuristic.act(obs)
        return slow_features(obs, self._heuristic_action)

    # -- gymnasium API -------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self._stop()
        index = (options or {}).get("cell_index")
        if index is None:
            index = int(self.np_random.integers(len(self.cells)))
        self.cell = self.cells[index]
        self.norm_usd = cost_norm_usd(self.cell)
        self._heuristic = heuristic_for(self.cell, self.heuristic_name)
        self._paid_usd = 0.0
        self.result = None
        self._start(self.cell)
        kind, obs = self._next()
        if kind != "obs":  # a job that ends before its first decision cannot be built
            raise RuntimeError(f"cell {index} ended before its first tick")
        return self._observe(obs), {"cell_index": index}

    def step(self, action):
        if self._stepper is None:
            raise RuntimeError("call reset() before step()")
        choice, checkpoint = (int(a) for a in np.asarray(action).reshape(-1)[:2])
        obs = self._obs
        applied = apply_slow_choice(obs, self._heuristic_action, choice, checkpoint)
        self._stepper.to_sim.put(applied)
        kind, payload = self._next()
        info = {"reason": applied.reason}
        if kind == "obs":
            price = 0.0
            if applied.spot_nodes + applied.on_demand_nodes and applied.zone is not None:
                z = obs.zone_index(applied.zone)
                price = (applied.spot_nodes * obs.spot_price_usd_per_hour_by_zone[z]
                         + applied.on_demand_nodes * obs.on_demand_price_usd_per_hour_by_zone[z])
            if payload.launch_failed:  # the old set was kept (or nothing)
                price = (obs.spot_nodes * obs.spot_price_usd_per_hour_by_zone[obs.zone_index(obs.zone)]
                         + obs.on_demand_nodes * obs.on_demand_price_usd_per_hour_by_zone[
                             obs.zone_index(obs.zone)]) if obs.zone is not None else 0.0
            paid = price * obs.tick_s / 3600.0
            self._paid_usd += paid
            return self._observe(payload), -paid / self.norm_usd, False, False, info
        result: SimResult = payload
        self.result = result
        self._thread.join(timeout=5.0)
        self._thread = self._stepper = None
        reward = -(result.cost_usd - self._paid_usd) / self.norm_usd
        if not result.deadline_met:
            reward -= DEADLINE_MISS_PENALTY
        info.update(cost_usd=result.cost_usd, deadline_met=result.deadline_met)
        # The last observation is never acted on; repeat the previous one (gymnasium needs one).
        return slow_features(obs, self._heuristic_action), reward, True, False, info

    def close(self) -> None:
        self._stop()
