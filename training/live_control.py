"""The live-control file: the slow layer's checkpoint interval and preemption risk for a running
trainer.

Where: `<run folder>/live_control.json`, beside the pruning `control.json`. The run folder is the
trainer's `out_dir` (`trainwise.runs` trains in `<state>/runs/<run_id>`), so the trainer finds the
file there by itself; `TrainConfig.live_control_path` names another file when set.

Who writes: the Dagster slow-policy sensor (`source="slow_policy"`), tests, or a person. Who reads:
the trainer, at fast-tick boundaries; it applies each content (digest) once and records a
`decision` event (layer "live_control") naming the source and the reason. A bad file is refused
and recorded, and changes nothing.

Fields (None = leave as it is):
- `checkpoint_interval_s`: seconds of training between periodic checkpoints (> 0); the trainer
  converts it to steps with its measured step time.
- `preemption_risk`: P(preemption within the next `RISK_HORIZON_S` seconds), in [0, 1], from the
  hazard model; it goes into the fast policy's `FastObservation.preemption_risk`.
- `schedule`: a newly published schedule for the run (`trainwise.schedule`): {"version",
  "fast_policy", "fast_levers", "checkpoint_interval_rule"}; the trainer switches at that tick
  and stamps the new version on every decision after it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training._data_io import atomic_write_json, control_digest, read_control_json

LIVE_CONTROL_FILE = "live_control.json"
LIVE_CONTROL_FORMAT = "trainwise.live_control/1"
# The horizon the risk is stated for: the slow layer's `SlowObservation.risk_horizon_s` default.
RISK_HORIZON_S = 600.0

_FIX = "rewrite it with training.live_control.write_live_control"


@dataclass(frozen=True)
class LiveControl:
    """What the slow layer asks of a running trainer; None fields leave the current value."""

    checkpoint_interval_s: float | None
    preemption_risk: float | None
    reason: str
    source: str
    digest: str  # sha256 of the content and its write time: the trainer applies each once
    schedule: dict[str, Any] | None = None


def _interval(value: object, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        raise ValueError(f"{where}checkpoint_interval_s={value!r} must be a finite number of "
                         "seconds > 0")
    return float(value)


def _risk(value: object, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            0.0 <= value <= 1.0):
        raise ValueError(f"{where}preemption_risk={value!r} must be a probability in [0, 1]")
    return float(value)


_SCHEDULE_KEYS = ("version", "fast_policy", "fast_levers", "checkpoint_interval_rule")


def _schedule(value: object, where: str) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != set(_SCHEDULE_KEYS):
        raise ValueError(f"{where}schedule={value!r} must be an object with exactly "
                         f"{', '.join(_SCHEDULE_KEYS)}")
    levers = value["fast_levers"]
    if not all(isinstance(value[k], str) and value[k] for k in _SCHEDULE_KEYS
               if k != "fast_levers") or not (
            isinstance(levers, list) and all(isinstance(n, str) for n in levers)):
        raise ValueError(f"{where}schedule={value!r}: version, fast_policy and "
                         "checkpoint_interval_rule must be non-empty strings, fast_levers a list "
                         "of lever names")
    return {**value, "fast_levers": list(levers)}


def write_live_control(
    path: str | Path,
    *,
    checkpoint_interval_s: float | None = None,
    preemption_risk: float | None = None,
    reason: str = "",
    source: str = "slow_policy",
    schedule: dict[str, Any] | None = None,
) -> Path:
    """Atomically (tmp, fsync, rename) writes the live-control file a running trainer reads at its
    next fast tick. Refuses, before writing, an empty control or a value out of range."""
    if checkpoint_interval_s is None and preemption_risk is None and schedule is None:
        raise ValueError("write_live_control needs checkpoint_interval_s, preemption_risk and/or "
                         "schedule; an empty control would change nothing")
    content = {
        "format": LIVE_CONTROL_FORMAT,
        "checkpoint_interval_s": _interval(checkpoint_interval_s, ""),
        "preemption_risk": _risk(preemption_risk, ""),
        "schedule": _schedule(schedule, ""),
        "reason": str(reason), "source": str(source), "written_at_s": time.time(),
    }
    path = Path(path)
    atomic_write_json(path, content)
    return path


def read_live_control(path: str | Path) -> LiveControl:
    """Parses and validates a live-control file; ValueError names the file and the fix."""
    path = Path(path)
    content = read_control_json(path, fmt=LIVE_CONTROL_FORMAT, what="live-control file", fix=_FIX)
    where = f"live-control file {path}: "
    try:
        interval = _interval(content.get("checkpoint_interval_s"), where)
        risk = _risk(content.get("preemption_risk"), where)
        schedule = _schedule(content.get("schedule"), where)
    except ValueError as error:
        raise ValueError(f"{error}; {_FIX}") from error
    if interval is None and risk is None and schedule is None:
        raise ValueError(f"{where}sets none of checkpoint_interval_s, preemption_risk, schedule: "
                         f"{_FIX}")
    return LiveControl(
        checkpoint_interval_s=interval, preemption_risk=risk, schedule=schedule,
        reason=str(content.get("reason", "")), source=str(content.get("source", "")),
        digest=control_digest(content),
    )
