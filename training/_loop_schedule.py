"""The published schedule inside the trainer (`trainwise.schedule`, issue 28 item 1).

At start the driver hands the schedule's run fields in `TrainConfig` (version, fast levers,
checkpoint-interval rule); `at_start` restricts the policy's levers and names the rule. When the
slow layer hands a newly published schedule through the live-control file, `switch` applies it
at that fast tick: the levers, the rule, and the fast policy itself where it can be built here
(noop and heuristic; goodput needs a throughput profile taken at start, so it waits for the
next start, and the decision record says so). Every decision after the switch carries the new
version (`LoopRun.write`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from controllers.checkpoint_interval import active_rule, registered_rules, set_rule
from controllers.fast_heuristic import HeuristicFastPolicy
from controllers.fast_types import NoOpFastPolicy

# The fast policy's own name (`.name`) for each schedule name it can be switched to here.
_POLICY_NAMES = {"noop": "noop", "heuristic": HeuristicFastPolicy.name}


def lever_owner(policy: Any) -> Any | None:
    """The heuristic whose levers a schedule restricts: the policy, or the one it wraps (a
    learned residual's `heuristic`, a gang wrapper's `inner`), else None."""
    for _ in range(4):
        if policy is None:
            return None
        if callable(getattr(type(policy), "set_levers", None)):
            return policy
        policy = getattr(policy, "heuristic", None) or getattr(policy, "inner", None)
    return None


@dataclass
class ScheduleInForce:
    """The schedule the trainer runs on now."""

    version: str
    fast_policy: str  # schedule name: noop | heuristic | goodput ("" when not known)
    fast_levers: tuple[str, ...]
    rule: str
    history: list[str] = field(default_factory=list)  # versions before this one

    @classmethod
    def at_start(cls, config: Any, policy: Any) -> ScheduleInForce:
        """Restricts the policy's levers; the interval rule is the one `training.loop.train`
        put in force for the call (`using_rule`, so the process's rule is back afterwards)."""
        levers = tuple(config.fast_levers)
        owner = lever_owner(policy)
        if levers and owner is not None:
            levers = tuple(owner.set_levers(levers))
        return cls(version=config.schedule_version, fast_policy=_schedule_name(policy),
                   fast_levers=levers, rule=active_rule())


def _schedule_name(policy: Any) -> str:
    name = getattr(policy, "name", "")
    for schedule_name, own in _POLICY_NAMES.items():
        if name == own:
            return schedule_name
    return ""


def switch(now: ScheduleInForce, policy: Any, wanted: dict[str, Any]
           ) -> tuple[Any, ScheduleInForce, dict[str, Any], str]:
    """(policy, schedule in force, action record, reason) after applying `wanted` (a
    live-control file's `schedule`). What cannot be applied in this process is listed under
    "deferred" with why; it applies at the run's next start."""
    applied: dict[str, Any] = {}
    deferred: dict[str, str] = {}
    rule = wanted["checkpoint_interval_rule"]
    if rule != now.rule:
        if rule in registered_rules():
            set_rule(rule)
            applied["checkpoint_interval_rule"] = rule
        else:
            deferred["checkpoint_interval_rule"] = (f"rule {rule!r} is not registered in the "
                                                    "trainer's process")
            rule = now.rule
    name = wanted["fast_policy"]
    levers = tuple(wanted["fast_levers"])
    if name != now.fast_policy and name in _POLICY_NAMES:
        policy = NoOpFastPolicy() if name == "noop" else HeuristicFastPolicy(levers=levers)
        applied["fast_policy"] = name
    elif name != now.fast_policy:
        deferred["fast_policy"] = (f"{name} is built from a throughput profile taken at start: "
                                   "it takes over at the run's next start")
        name = now.fast_policy
    owner = lever_owner(policy)
    if owner is not None and levers and tuple(sorted(levers)) != tuple(sorted(now.fast_levers)):
        levers = tuple(owner.set_levers(levers))
        applied["fast_levers"] = list(levers)
    elif owner is None:
        levers = now.fast_levers
    after = ScheduleInForce(version=str(wanted["version"]), fast_policy=name, fast_levers=levers,
                            rule=rule, history=[*now.history, now.version])
    action = {"schedule_version": after.version, "from_version": now.version,
              "applied": applied, "deferred": deferred}
    parts = [f"{k} -> {v}" for k, v in applied.items()] or ["nothing to change in the loop"]
    reason = (f"schedule {now.version or 'none'} -> {after.version}: " + ", ".join(parts)
              + "".join(f"; {k} deferred: {v}" for k, v in deferred.items()))
    return policy, after, action, reason
