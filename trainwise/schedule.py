"""The published schedule: what every new run and every live run's next slow tick uses.

A schedule names, for both layers (issue 28, item 1):
- `allocation_policy`: the slow layer's node policy (the slow tick's policy in charge; a run on
  the supervised engine is driven by it);
- `fast_policy`: the policy inside the training loop (heuristic, noop, goodput);
- `fast_levers`: which of the heuristic's registered levers may act (the notice answer,
  `preemption`, cannot be switched off: a reclaim would lose the work since the last save);
- `checkpoint_interval_rule`: the rule of the one interval chooser
  (`controllers.checkpoint_interval`);
- `pruning_rate` and its bounds: the curriculum the next build uses, and the range the slow layer
  may steer a live run's rate within;
- `budget_usd`: the most a run may spend (the forecast's blocking check);
- `allocation_rule`: free text recorded with it.

The version is the content hash of the full schedule (`approvals.content_hash`), the same digits
the approver saw. Before any publication it is the settings' schedule, versioned the same way
and labelled "default". Published files written by an older trainwise name fewer fields; the
missing ones take the defaults (so the hash of an old file's schedule is that of its filled-in
form). Pure: reads files, writes nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainwise import settings

FOLDER = ("governance", "schedule")
HASH_HEX_DIGITS = 16
# The notice answer: without it a reclaim loses everything since the last save.
REQUIRED_LEVER = "preemption"
DEFAULT_RULE = "trainwise"
DEFAULT_RATE_BOUNDS = (0.0, 0.9)
# Fields of a schedule a run request carries (the rest steer the slow layer or the forecast).
RUN_FIELDS = ("fast_policy", "fast_levers", "checkpoint_interval_rule")


class ScheduleError(ValueError):
    """A schedule (or a run's departure from it) that cannot stand; the message names the fix."""


def builtin_levers() -> list[str]:
    from controllers import fast_levers_builtin  # noqa: F401 - registers the built-in levers
    from controllers.fast_levers import registered_levers

    return [cls.name for cls in registered_levers()]


def default_schedule() -> dict[str, Any]:
    """The schedule before any approved change: the settings, every lever, the one rule."""
    return {"pruning_rate": settings.pruning_rate(),
            "pruning_rate_min": DEFAULT_RATE_BOUNDS[0],
            "pruning_rate_max": DEFAULT_RATE_BOUNDS[1],
            "allocation_policy": settings.get("TRAINWISE_ALLOCATION_POLICY"),
            "fast_policy": "heuristic",
            "fast_levers": builtin_levers(),
            "checkpoint_interval_rule": DEFAULT_RULE,
            "budget_usd": settings.budget_usd(),
            "allocation_rule": ""}


def complete(schedule: dict[str, Any]) -> dict[str, Any]:
    """`schedule` with every field the defaults have (older files name fewer) and nothing else."""
    defaults = default_schedule()
    unknown = set(schedule) - set(defaults)
    if unknown:
        raise ScheduleError(f"schedule names unknown field(s) {sorted(unknown)}; known: "
                            f"{sorted(defaults)}")
    return {**defaults, **schedule}


def validate(schedule: dict[str, Any]) -> dict[str, Any]:
    """The completed schedule, or ScheduleError naming the field and the fix."""
    from cloud.policy_registry import policy_names
    from controllers.checkpoint_interval import registered_rules
    from trainwise.run_request import FAST_POLICIES

    s = complete(schedule)
    low, high, rate = (float(s["pruning_rate_min"]), float(s["pruning_rate_max"]),
                       float(s["pruning_rate"]))
    if not 0.0 <= low <= rate <= high < 1.0:
        raise ScheduleError(f"pruning rates must satisfy 0 <= pruning_rate_min ({low:g}) <= "
                            f"pruning_rate ({rate:g}) <= pruning_rate_max ({high:g}) < 1")
    if s["allocation_policy"] not in policy_names():
        raise ScheduleError(f"allocation_policy {s['allocation_policy']!r} is not registered; "
                            f"registered: {', '.join(policy_names())}")
    if s["fast_policy"] not in FAST_POLICIES:
        raise ScheduleError(f"fast_policy {s['fast_policy']!r} is unknown; valid: "
                            f"{', '.join(FAST_POLICIES)}")
    levers = list(s["fast_levers"])
    known = builtin_levers()
    if any(name not in known for name in levers):
        raise ScheduleError(f"fast_levers {levers} names levers that are not registered; "
                            f"registered: {', '.join(known)}")
    if REQUIRED_LEVER not in levers:
        raise ScheduleError(f"fast_levers {levers} leaves out {REQUIRED_LEVER!r}: the notice "
                            "answer cannot be switched off (a reclaim would lose the work since "
                            "the last save); keep it in the list")
    s["fast_levers"] = [name for name in known if name in levers]  # one order: one hash
    if s["checkpoint_interval_rule"] not in registered_rules():
        raise ScheduleError(f"checkpoint_interval_rule {s['checkpoint_interval_rule']!r} is not "
                            f"registered; registered: {', '.join(registered_rules())}")
    if not float(s["budget_usd"]) > 0:
        raise ScheduleError(f"budget_usd={s['budget_usd']!r} must be > 0 USD")
    return s


@dataclass(frozen=True)
class Published:
    """The schedule in force, its version (content hash) and how it got there."""

    schedule: dict[str, Any]
    version: str
    origin: str  # "default (settings)" or "published <time> by <approver>"

    def label(self) -> str:
        return f"{self.version} ({self.origin})"


def content_hash(content: dict[str, Any]) -> str:
    """First 16 hex digits of the sha256 of the canonical JSON of what is approved."""
    text = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:HASH_HEX_DIGITS]


def version_of(schedule: dict[str, Any]) -> str:
    return content_hash(complete(schedule))


def read_current(folder: Path) -> dict[str, Any] | None:
    """`current.json` of the schedule folder `<state>/governance/schedule` (None before any
    publication). A file that is not a schedule is refused by name: governance never runs on a
    guess."""
    path = Path(folder) / "current.json"
    if not path.is_file():
        return None
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ScheduleError(f"published schedule {path} is unreadable ({error}); restore it from "
                            "history.jsonl's last 'published' record or roll back") from error
    if not isinstance(content, dict) or not isinstance(content.get("schedule"), dict):
        raise ScheduleError(f"published schedule {path} has no 'schedule' object; restore it "
                            "from history.jsonl's last 'published' record or roll back")
    return content


def published(state_dir: Path) -> Published:
    """The schedule new runs start on and live runs switch to at their next slow tick."""
    current = read_current(Path(state_dir).joinpath(*FOLDER))
    if current is None:
        schedule = default_schedule()
        return Published(schedule, version_of(schedule), "default (settings)")
    schedule = complete(current["schedule"])
    record = current.get("published") or {}
    who = (record.get("approval") or {}).get("approver", "?")
    return Published(schedule, version_of(schedule), f"published by approval of {who}")


def run_departures(published_schedule: Published, asked: dict[str, Any]) -> dict[str, Any]:
    """The run fields a request asks for that differ from the published schedule's."""
    return {name: value for name, value in asked.items()
            if value is not None and published_schedule.schedule.get(name) != value}


def apply_to_request(request: Any, published_schedule: Published, *,
                     asked: dict[str, Any], override_reason: str) -> Any:
    """The request on the published schedule: its run fields from the schedule, its version
    named. A field asked for explicitly that differs from the schedule is a departure: refused
    without `override_reason` (a recorded why), kept with it."""
    departures = run_departures(published_schedule, asked)
    if departures and not override_reason.strip():
        names = ", ".join(f"{k}={v!r} (schedule: {published_schedule.schedule.get(k)!r})"
                          for k, v in departures.items())
        raise ScheduleError(
            f"the run departs from the published schedule {published_schedule.version}: {names}."
            " Propose the change through schedule_change and its approval, leave the field empty"
            " to run on the schedule, or give schedule_override_reason (recorded with the run)")
    fields = {name: published_schedule.schedule[name] for name in RUN_FIELDS}
    fields.update(departures)
    fields["fast_levers"] = tuple(fields["fast_levers"])
    version = published_schedule.version
    if departures:
        version = f"{version}+override"
    return dataclasses.replace(request, **fields, schedule_version=version)


def request_from_launchpad(launchpad: dict[str, Any], published_schedule: Published,
                           **job_fields: Any) -> Any:
    """The run request of a `train` launchpad config (`TrainRunConfig.model_dump()`) and the
    fields the job fills in, on the published schedule: a launchpad choice left at
    `FROM_SCHEDULE` takes the schedule's value, an explicit one that differs (or a named
    allocation policy other than the schedule's) is a departure (`apply_to_request`)."""
    from trainwise.run_request import FROM_SCHEDULE, SCHEDULED_IN_LAUNCHPAD, TrainRequest

    given = dict(launchpad)
    asked = {name: given.pop(name) for name in SCHEDULED_IN_LAUNCHPAD}
    asked = {name: value for name, value in asked.items() if value != FROM_SCHEDULE}
    if given.get("allocation_policy"):
        asked["allocation_policy"] = given["allocation_policy"]
    return apply_to_request(TrainRequest(**{**given, **job_fields}), published_schedule,
                            asked=asked, override_reason=given.get("schedule_override_reason",
                                                                   ""))


def clip_rate(rate: float, schedule: dict[str, Any]) -> tuple[float, str]:
    """A live pruning rate within the schedule's bounds, and a note when it was clipped."""
    low, high = float(schedule["pruning_rate_min"]), float(schedule["pruning_rate_max"])
    clipped = min(max(float(rate), low), high)
    if abs(clipped - float(rate)) < 1e-12:
        return float(rate), ""
    return clipped, f"rate {rate:.2f} clipped to the schedule's [{low:g}, {high:g}]"


def last_handed_schedule(run_dir: Path) -> dict[str, Any] | None:
    """The last schedule switch handed to a live run (its `slow_decisions.jsonl`), or None."""
    handed = None
    log = run_dir / "slow_decisions.jsonl"
    if log.is_file():
        for line in log.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a torn last line is no switch
            if isinstance(record, dict) and (record.get("schedule") or {}).get("version"):
                handed = record["schedule"]
    return handed


def run_schedule_version(run_dir: Path) -> str:
    """The schedule version a live run is on: the last switch handed to it, else the one it
    started on (`request.json`); "" for a run not started on a schedule (a library or
    benchmark call)."""
    handed = last_handed_schedule(run_dir)
    if handed is not None:
        return str(handed["version"])
    request_path = run_dir / "request.json"
    if request_path.is_file():
        return str(json.loads(request_path.read_text()).get("schedule_version") or "")
    return ""
