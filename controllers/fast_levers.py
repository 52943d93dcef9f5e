"""The fast-layer lever registry: one lever is one class in one module, registered by a decorator.

A lever is one thing the fast policy may turn inside the training loop (the batch, the rank
shares, the preemption response, a new trainer knob). `HeuristicFastPolicy.act` asks every
registered lever in `order`; each sees the observation and the draft action the levers before it
left, and answers with a `LeverProposal`: the knobs it changes, a reason fragment and numbers.
The policy folds the proposals into one `FastAction` (reasons joined with "; ", numbers merged).

Knobs: a key of `changes` is either a `FastAction` field (`ACTION_KNOBS`) or the lever's own
name, which puts the value into `FastAction.extras[name]`. A lever for a knob the loop does not
know yet defines `apply(run, value)` (a classmethod: the loop holds no lever instance, the policy
does); `LoopRun._apply_fast` calls it for each registered lever whose name is in the action's
extras (`apply_extras`). So a new lever touches one module:

    @register_lever("eval_every_steps", order=40)
    class EvalEveryLever(FastLever):
        def propose(self, observation, draft):
            return LeverProposal({"eval_every_steps": 4}, "loss flat: eval every 4 steps")

        @classmethod
        def apply(cls, run, value):
            run.config = dataclasses.replace(run.config, eval_every_steps=int(value))

Registration is by import (as SkyPilot's and Dagster's decorator registries): the built-in levers
register in `controllers.fast_levers_builtin`, which `controllers.fast_heuristic` imports; a new
lever's module must be imported before the policy is built (the policy takes the levers
registered at its construction). Pure: no I/O, imports nothing of training/, cloud/, trainwise/.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import fields
from types import MappingProxyType
from typing import Any, ClassVar, NamedTuple, TypeVar

from controllers.fast_types import FastAction, FastObservation, PreemptionResponse

# FastAction fields a lever may change (reason and numbers are built from every proposal;
# extras are filled through the lever's own name).
ACTION_KNOBS = frozenset(
    f.name for f in fields(FastAction) if f.name not in {"reason", "numbers", "extras"})


_EMPTY: Mapping[str, Any] = MappingProxyType({})


class LeverProposal(NamedTuple):
    """What one lever asks for at a tick. Empty changes: the draft stays as it is.

    A NamedTuple, not a frozen dataclass: every lever makes one at every fast tick inside the
    training loop, and a frozen dataclass's __init__ (one object.__setattr__ per field) cost
    about a tenth of the decision (issue 26's goal: a decision at most 20 us at the median)."""

    # FastAction field -> new value, or the lever's own name -> its extras value.
    changes: Mapping[str, Any] = _EMPTY
    # A fragment of the decision's reason ("" says nothing: left out of the joined reason).
    reason: str = ""
    # Figures for the decision record; a name another lever already gave is refused.
    numbers: Mapping[str, float] = _EMPTY


class FastLever:
    """Base of a registered lever. One instance per policy (so per run): state lives on it.

    `config` is the policy's config (a `FastHeuristicConfig` for the heuristic); a lever with
    settings of its own keeps them as class attributes or reads them from there.
    """

    name: ClassVar[str] = ""  # set by @register_lever
    order: ClassVar[int] = 0

    def __init__(self, config: Any = None) -> None:
        self.config = config

    def propose(self, observation: FastObservation, draft: FastAction) -> LeverProposal:
        raise NotImplementedError(
            f"lever {type(self).__name__} does not define propose(observation, draft); "
            "return a LeverProposal from it")

    def reset(self, observation: FastObservation) -> None:
        """A fallback tick (bad observation, or a lever failed): drop state the skipped tick
        would make stale. Default: nothing to drop."""

    # `apply(cls, run, value)`: defined only by levers of a knob outside FastAction's fields.
    apply: ClassVar[Callable[[Any, Any], None] | None] = None


_L = TypeVar("_L", bound=type[FastLever])
_REGISTRY: dict[str, type[FastLever]] = {}


def register_lever(name: str, *, order: int) -> Callable[[_L], _L]:
    """Class decorator: registers a `FastLever` subclass as `name`, asked in `order` (lower
    first; built-ins use 10, 20, 30). A name registered by another class is refused."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"fast lever name {name!r} must be an identifier (it is a record key)")
    if name in ACTION_KNOBS or name in {"reason", "numbers", "extras"}:
        raise ValueError(f"fast lever name {name!r} is a FastAction field; name the lever after "
                         "the new knob it controls (changes to FastAction fields need no name)")

    def decorate(cls: _L) -> _L:
        if not (isinstance(cls, type) and issubclass(cls, FastLever)):
            raise TypeError(f"@register_lever({name!r}) decorates {cls!r}; subclass FastLever")
        known = _REGISTRY.get(name)
        # The same class defined again (a module reloaded, or imported under a second name by
        # pytest) replaces itself; a different class under a taken name is a mistake.
        if known is not None and (known.__module__.rsplit(".", 1)[-1], known.__qualname__) != (
                cls.__module__.rsplit(".", 1)[-1], cls.__qualname__):
            raise ValueError(
                f"fast lever {name!r} is already registered by {known.__module__}."
                f"{known.__qualname__}; give {cls.__module__}.{cls.__qualname__} another name "
                "(or unregister_lever the old one first)")
        cls.name, cls.order = name, int(order)
        _REGISTRY[name] = cls
        return cls

    return decorate


def unregister_lever(name: str) -> None:
    """Removes a lever (tests, or a deployment switching one off); an unknown name is refused."""
    if name not in _REGISTRY:
        raise KeyError(f"no fast lever {name!r} is registered; registered: {sorted(_REGISTRY)}")
    del _REGISTRY[name]


def registered_levers() -> tuple[type[FastLever], ...]:
    """The registered lever classes in the order the policy asks them (order, then name)."""
    return tuple(sorted(_REGISTRY.values(), key=lambda cls: (cls.order, cls.name)))


def lever_named(name: str) -> type[FastLever] | None:
    return _REGISTRY.get(name)


def fold_proposal(lever: FastLever, draft: FastAction, proposal: LeverProposal,
                  reasons: list[str], numbers: dict[str, float]) -> FastAction:
    """The draft with one lever's proposal in; its reason and numbers appended to the lists."""
    if not isinstance(proposal, LeverProposal):
        raise TypeError(f"fast lever {lever.name!r} returned a {type(proposal).__name__} from "
                        "propose; return a LeverProposal")
    knobs = proposal.changes
    # Set operations, not a loop of checks: this runs for every lever at every fast tick.
    if not ACTION_KNOBS.issuperset(knobs):
        for key in knobs:
            if key not in ACTION_KNOBS and key != lever.name:
                raise ValueError(
                    f"fast lever {lever.name!r} proposed a change to {key!r}, which is neither a "
                    f"FastAction knob ({', '.join(sorted(ACTION_KNOBS))}) nor its own extras key "
                    f"{lever.name!r}; a new knob needs its own registered lever")
        own = knobs[lever.name]
        knobs = {key: value for key, value in knobs.items() if key != lever.name}
        knobs["extras"] = {**draft.extras, lever.name: own}
    taken = numbers.keys() & proposal.numbers.keys()
    if taken:
        raise ValueError(f"fast lever {lever.name!r} reports numbers {sorted(taken)}, which an "
                         "earlier lever already reported; prefix them with the lever's name")
    numbers.update(proposal.numbers)
    if proposal.reason:
        reasons.append(proposal.reason)
    if not knobs:
        return draft
    return action_with(draft, knobs)


def keep_everything(micro_batch_size: int, grad_accum_steps: int, learning_rate: float,
                    ranks: int) -> FastAction:
    """`FastAction(micro_batch_size, grad_accum_steps, learning_rate, equal shares)`: the draft
    every lever starts from, built as `action_with` copies (same fields and defaults, a fifth of
    the frozen dataclass's __init__), since the policy builds one at every fast tick."""
    action = object.__new__(FastAction)
    action.__dict__.update(micro_batch_size=micro_batch_size, grad_accum_steps=grad_accum_steps,
                           learning_rate=learning_rate, rank_work_shares=(1.0 / ranks,) * ranks,
                           preemption_response=PreemptionResponse.CONTINUE, reason="",
                           numbers={}, extras={})
    return action


def action_with(action: FastAction, changes: Mapping[str, Any]) -> FastAction:
    """`dataclasses.replace(action, **changes)` for FastAction field names, without its cost.

    FastAction is a frozen dataclass with no checks in __init__ and its fields in __dict__, so a
    copy with fields replaced is a dict update: several times cheaper than __init__ or replace,
    and the policy makes one per lever at every fast tick inside the training loop."""
    copy = object.__new__(FastAction)
    copy.__dict__.update(action.__dict__)
    copy.__dict__.update(changes)
    return copy


def extras_problems(extras: object) -> list[str]:
    """What is wrong with an action's extras for the loop to apply them ([] when nothing)."""
    if not isinstance(extras, Mapping):
        return [f"extras={extras!r} is not a mapping of lever name to value"]
    problems = []
    for key, value in extras.items():
        cls = _REGISTRY.get(key) if isinstance(key, str) else None
        if cls is None:
            problems.append(f"extras key {key!r} names no registered fast lever (registered: "
                            f"{sorted(_REGISTRY)}); import the module that registers it")
        elif cls.apply is None:
            problems.append(f"extras key {key!r}: lever {cls.__qualname__} defines no "
                            "apply(run, value), so the loop cannot honour it")
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            problems.append(f"extras[{key!r}]={value!r} is not a float, int or str")
        elif isinstance(value, float) and not math.isfinite(value):
            problems.append(f"extras[{key!r}]={value!r} is not finite")
    return problems


def apply_extras(run: Any, extras: Mapping[str, Any]) -> None:
    """Calls each lever's `apply(run, value)` for its key in `extras`, in registry order (the
    loop calls this from `LoopRun._apply_fast`; `run` is the LoopRun)."""
    if not extras:
        return
    for cls in registered_levers():
        if cls.name in extras and cls.apply is not None:
            cls.apply(run, extras[cls.name])
