"""A worked example of a fast-layer lever for a NEW trainer knob, in one module.

When the train loss has stopped falling, evaluating more often tells sooner whether the run
still learns (and gives the lever guard more points to judge by), so this lever asks for an
evaluation every `PLATEAU_EVAL_EVERY_STEPS` steps. It controls `TrainConfig.eval_every_steps`,
which is not a `FastAction` field: the value travels in `FastAction.extras["eval_every_steps"]`
and `apply` sets it on the running loop (`LoopRun._apply_fast` calls it). Importing this module
registers it; nothing else in the code base names it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from controllers.fast_levers import FastLever, LeverProposal, register_lever
from controllers.fast_types import FastAction, FastObservation


@register_lever("eval_every_steps", order=40)
class EvalEveryLever(FastLever):
    """Train loss flat over the last ticks -> evaluate every few steps."""

    # Ticks compared: the loss now against the loss this many ticks ago.
    WINDOW_TICKS = 2
    # A relative drop below this over the window is a plateau (0.02: less than 2% better).
    PLATEAU_MIN_RELATIVE_DROP = 0.02
    PLATEAU_EVAL_EVERY_STEPS = 2

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self._losses: list[float] = []

    def propose(self, observation: FastObservation, draft: FastAction) -> LeverProposal:
        self._losses = [*self._losses, observation.train_loss][-(self.WINDOW_TICKS + 1):]
        if len(self._losses) <= self.WINDOW_TICKS:
            return LeverProposal()  # too few ticks to tell: the knob stays as it is
        then, now = self._losses[0], self._losses[-1]
        drop = (then - now) / then if then > 0 else 0.0
        numbers = {"eval_lever_relative_loss_drop": drop}
        if drop >= self.PLATEAU_MIN_RELATIVE_DROP:
            return LeverProposal(numbers=numbers)
        every = self.PLATEAU_EVAL_EVERY_STEPS
        return LeverProposal(
            changes={"eval_every_steps": every},
            reason=(f"train loss flat ({then:.3f}->{now:.3f} over {self.WINDOW_TICKS} ticks, "
                    f"drop {drop:.1%} < {self.PLATEAU_MIN_RELATIVE_DROP:.0%}): evaluate every "
                    f"{every} steps"),
            numbers={**numbers, "eval_every_steps": float(every)},
        )

    def reset(self, observation: FastObservation) -> None:
        self._losses = []  # a bad tick breaks the window: start counting again

    @classmethod
    def apply(cls, run: Any, value: Any) -> None:
        # TrainConfig is frozen; the loop reads run.config.eval_every_steps at every step, so a
        # replaced config is in force from the next step (replace re-validates the value).
        if int(value) != run.config.eval_every_steps:
            run.config = dataclasses.replace(run.config, eval_every_steps=int(value))
