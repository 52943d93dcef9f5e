"""The search space of a hyperparameter study (`trainwise.hpo`) and its rungs.

Two kinds of knob, searched together:
- training hyperparameters of the run (`TRAINING_KNOBS`): the learning rate (log-uniform between
  `learning_rate_min` and `learning_rate_max`; equal bounds fix it) and the micro-batch size
  (a list of choices);
- the published schedule's knobs (`SCHEDULE_KNOBS`, `trainwise.schedule`): the pruning rate,
  the fast policy and the checkpoint-interval rule, each a list of choices.

A list of one value fixes that knob for every trial (and it is part of what the study may
propose); an empty list leaves it to the train config and the published schedule. A space
that varies nothing is refused: there would be nothing to search.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

TRAINING_KNOBS = ("learning_rate", "micro_batch_size")
SCHEDULE_KNOBS = ("pruning_rate", "fast_policy", "checkpoint_interval_rule")


class HpoError(ValueError):
    """A search that cannot run as asked; the message names the field and the fix."""


def rung_steps(min_steps: int, reduction_factor: int, rungs: int) -> list[int]:
    """Steps of each rung: `min_steps * reduction_factor**k`, k = 0..rungs-1 (the steps Optuna's
    successive-halving pruners compare trials at)."""
    for name, value, least in (("min_steps", min_steps, 1), ("reduction_factor",
                                                             reduction_factor, 2),
                               ("rungs", rungs, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise HpoError(f"{name}={value!r} must be a whole number >= {least}")
    return [min_steps * reduction_factor ** k for k in range(rungs)]


@dataclass(frozen=True)
class SearchSpace:
    """What a study varies; see the module docstring."""

    learning_rate_min: float
    learning_rate_max: float
    micro_batch_sizes: tuple[int, ...] = ()
    pruning_rates: tuple[float, ...] = ()
    fast_policies: tuple[str, ...] = ()
    checkpoint_interval_rules: tuple[str, ...] = ()

    def choices(self) -> dict[str, tuple[Any, ...]]:
        """Knob -> its choices, for the knobs given as a list (deduplicated, in order)."""
        given = {"micro_batch_size": self.micro_batch_sizes, "pruning_rate": self.pruning_rates,
                 "fast_policy": self.fast_policies,
                 "checkpoint_interval_rule": self.checkpoint_interval_rules}
        return {k: tuple(dict.fromkeys(v)) for k, v in given.items() if v}

    def searched(self) -> list[str]:
        """The knobs that vary between trials."""
        names = ["learning_rate"] if self.learning_rate_max > self.learning_rate_min else []
        return names + [k for k, v in self.choices().items() if len(v) > 1]

    def validate(self, schedule: dict[str, Any]) -> None:
        """Every bound and choice, against the published `schedule`; HpoError names the fix."""
        from controllers.checkpoint_interval import registered_rules
        from trainwise.run_request import FAST_POLICIES

        low, high = self.learning_rate_min, self.learning_rate_max
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                   and v > 0 for v in (low, high)) or low > high:
            raise HpoError(f"learning_rate_min={low!r}, learning_rate_max={high!r}: both must "
                           "be finite and > 0 with min <= max (equal: a fixed learning rate)")
        for size in self.micro_batch_sizes:
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise HpoError(f"micro_batch_sizes holds {size!r}; each must be a whole number "
                               ">= 1")
        lowest, highest = float(schedule["pruning_rate_min"]), float(schedule["pruning_rate_max"])
        for rate in self.pruning_rates:
            if not (isinstance(rate, (int, float)) and lowest <= rate <= highest):
                raise HpoError(f"pruning_rates holds {rate!r}, outside the published schedule's "
                               f"bounds [{lowest:g}, {highest:g}]; search within them, or "
                               "widen the bounds through schedule_change first")
        for name in self.fast_policies:
            if name not in FAST_POLICIES:
                raise HpoError(f"fast_policies holds {name!r}; valid: {', '.join(FAST_POLICIES)}")
        for name in self.checkpoint_interval_rules:
            if name not in registered_rules():
                raise HpoError(f"checkpoint_interval_rules holds {name!r}; registered: "
                               f"{', '.join(registered_rules())}")
        if not self.searched():
            raise HpoError(
                "the search space is empty: every knob is fixed (learning_rate_min == "
                "learning_rate_max and no list with two or more choices); give a learning-rate "
                "range or two or more micro_batch_sizes, pruning_rates, fast_policies or "
                "checkpoint_interval_rules")

    def check_point(self, point: dict[str, Any]) -> dict[str, Any]:
        """A configuration to try first (`first_trials`): searched knobs only, each within the
        space; HpoError names the knob and what is valid."""
        if not isinstance(point, dict) or not point:
            raise HpoError(f"first_trials holds {point!r}; each must be an object of searched "
                           f"knobs ({', '.join(self.searched())})")
        choices = self.choices()
        for name, value in point.items():
            if name not in self.searched():
                raise HpoError(f"first_trials names {name!r}, which is not searched; searched: "
                               f"{', '.join(self.searched())}")
            if name == "learning_rate":
                if not (isinstance(value, (int, float)) and self.learning_rate_min <= value
                        <= self.learning_rate_max):
                    raise HpoError(f"first_trials learning_rate={value!r} is outside "
                                   f"[{self.learning_rate_min:g}, {self.learning_rate_max:g}]")
            elif value not in choices[name]:
                raise HpoError(f"first_trials {name}={value!r} is not one of the choices "
                               f"{list(choices[name])}")
        return dict(point)

    def suggest(self, trial: Any) -> dict[str, Any]:
        """One configuration from an Optuna trial: searched knobs suggested, fixed ones set."""
        params: dict[str, Any] = {}
        if self.learning_rate_max > self.learning_rate_min:
            params["learning_rate"] = trial.suggest_float(
                "learning_rate", self.learning_rate_min, self.learning_rate_max, log=True)
        else:
            params["learning_rate"] = float(self.learning_rate_min)
        for name, choices in self.choices().items():
            params[name] = (trial.suggest_categorical(name, list(choices)) if len(choices) > 1
                            else choices[0])
        if "pruning_rate" in params:
            params["pruning_rate"] = float(params["pruning_rate"])
        return params
