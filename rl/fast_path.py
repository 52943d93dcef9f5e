"""Decision-time forward pass in plain numpy, and the learned policies built on it.

`NumpyPolicy.predict(x)` equals stable-baselines3's `predict(x, deterministic=True)` for the
exported actor (tests/test_rl_policy_file.py) at a few microseconds a call (benchmarks/rl) instead
of sb3's ~160 us: three small mat-vecs, two tanh and one argmax per action component.

`LearnedAllocationPolicy` / `LearnedFastPolicy` wrap the incumbent heuristic: they compute the
heuristic's action (the residual's base and a feature), then the learned override. An observation
with NaN or infinity is refused by the network (`ValueError`) and the wrappers then act as the
heuristic, saying so in the reason.
"""

from __future__ import annotations

import numpy as np

from controllers.allocation_types import AllocationAction, AllocationObservation, AllocationPolicy
from controllers.fast_types import FastAction, FastObservation, FastPolicy
from rl.fast_obs import FAST_OBS_LAYOUT, apply_fast_choice, fast_features
from rl.policy_file import PolicyWeights, load_policy
from rl.slow_obs import SLOW_OBS_LAYOUT, apply_slow_choice, slow_features


class NumpyPolicy:
    def __init__(self, weights: PolicyWeights):
        self.weights = weights
        self._hidden = [(np.asarray(w, np.float32), np.asarray(b, np.float32))
                        for w, b in weights.hidden]
        self._head = (np.asarray(weights.head[0], np.float32), np.asarray(weights.head[1], np.float32))
        bounds = np.cumsum((0, *weights.nvec))
        self._slices = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
        self.width = len(weights.layout)
        # Preallocated outputs: the forward pass allocates nothing (about a third faster at
        # this size). So one NumpyPolicy must not be called from two threads at once.
        self._buffers = [np.empty(w.shape[0], np.float32) for w, _ in self._hidden]
        self._logits = np.empty(self._head[0].shape[0], np.float32)

    def predict(self, x: np.ndarray) -> tuple[int, ...]:
        """Deterministic action for one observation vector; NaN/inf refused."""
        if x.shape != (self.width,):
            raise ValueError(f"observation has shape {x.shape}, the policy's layout needs ({self.width},)")
        if x.dtype != np.float32:
            x = x.astype(np.float32)
        total = float(x.sum())
        if total != total or total in (np.inf, -np.inf):
            bad = [self.weights.layout[i] for i in np.flatnonzero(~np.isfinite(x))]
            raise ValueError(f"observation has NaN or infinite values in {', '.join(bad)}")
        h = x
        for (w, b), out in zip(self._hidden, self._buffers):
            np.dot(w, h, out=out)
            np.add(out, b, out=out)
            np.tanh(out, out=out)
            h = out
        logits = self._logits
        np.dot(self._head[0], h, out=logits)
        np.add(logits, self._head[1], out=logits)
        values = logits.tolist()
        chosen = []
        for s in self._slices:  # first maximum, as numpy's (and torch's) argmax
            part = values[s]
            chosen.append(part.index(max(part)))
        return tuple(chosen)

    def predict_batch(self, x: np.ndarray) -> np.ndarray:
        h = np.asarray(x, np.float32)
        for w, b in self._hidden:
            h = np.tanh(h @ w.T + b)
        logits = h @ self._head[0].T + self._head[1]
        return np.stack([logits[:, s].argmax(axis=1) for s in self._slices], axis=1)


class LearnedAllocationPolicy:
    """The learned slow policy behind the safety net; the heuristic when the input is bad."""

    name = "trainwise_learned"

    def __init__(self, network: NumpyPolicy, heuristic: AllocationPolicy):
        if tuple(network.weights.layout) != SLOW_OBS_LAYOUT:
            raise ValueError("the network was not trained on the slow observation layout")
        self.network, self.heuristic = network, heuristic

    @classmethod
    def from_file(cls, path, heuristic: AllocationPolicy, region: str | None = None):
        return cls(NumpyPolicy(load_policy(path, "slow", SLOW_OBS_LAYOUT, region)), heuristic)

    def act(self, observation: AllocationObservation) -> AllocationAction:
        base = self.heuristic.act(observation)
        try:
            choice, checkpoint = self.network.predict(slow_features(observation, base))
        except (ValueError, ZeroDivisionError) as error:
            return AllocationAction(base.zone, base.spot_nodes, base.on_demand_nodes,
                                    base.checkpoint_interval_s,
                                    f"learned policy refused the observation ({error}); "
                                    f"heuristic: {base.reason}", base.numbers)
        return apply_slow_choice(observation, base, choice, checkpoint)


class LearnedFastPolicy:
    """The learned fast policy on top of the heuristic fast policy."""

    name = "trainwise_learned_fast"

    def __init__(self, network: NumpyPolicy, heuristic: FastPolicy):
        if tuple(network.weights.layout) != FAST_OBS_LAYOUT:
            raise ValueError("the network was not trained on the fast observation layout")
        self.network, self.heuristic = network, heuristic

    def act(self, observation: FastObservation) -> FastAction:
        base = self.heuristic.act(observation)
        try:
            share, batch, notice = self.network.predict(fast_features(observation, base))
        except (ValueError, ZeroDivisionError) as error:
            return FastAction(base.micro_batch_size, base.grad_accum_steps, base.learning_rate,
                              base.rank_work_shares, base.preemption_response,
                              f"learned fast policy refused the observation ({error}); heuristic")
        return apply_fast_choice(observation, base, share, batch, notice)
