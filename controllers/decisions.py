"""Decision records: what each layer decided, why, and the numbers behind it.

Every action the controller takes is recorded as one `Decision`. The log keeps them in memory and
hands each to an optional sink (the trainer's telemetry writer, the simulator's recorder), so the
same record feeds telemetry, MLflow and `trainwise explain`, which prints `format_timeline`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Layer = Literal["fast", "slow"]
LAYERS: tuple[str, ...] = ("fast", "slow")


@dataclass(frozen=True)
class Decision:
    """One decision of one layer: when, what was asked, the one-line reason and its numbers."""

    time_s: float  # run time when decided (trainer elapsed_s, simulator clock)
    step: int  # training step when decided (-1 when the layer has no step, e.g. before start)
    layer: Layer
    policy: str  # name of the policy that decided (e.g. "heuristic_fast")
    action: dict[str, Any]  # JSON-friendly form of the action
    reason: str
    numbers: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict (the telemetry event body); `from_dict` reads it back."""
        return {
            "time_s": self.time_s,
            "step": self.step,
            "layer": self.layer,
            "policy": self.policy,
            "action": dict(self.action),
            "reason": self.reason,
            "numbers": dict(self.numbers),
        }

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> Decision:
        """Reads back a `to_dict` record (e.g. from telemetry); a missing key raises ValueError."""
        missing = [k for k in ("time_s", "step", "layer", "policy", "action", "reason")
                   if k not in record]
        if missing:
            raise ValueError(
                f"decision record lacks {', '.join(missing)}; expected a dict written by "
                "Decision.to_dict()"
            )
        layer = record["layer"]
        if layer not in LAYERS:
            raise ValueError(f"decision layer {layer!r} is not one of {LAYERS}")
        return cls(
            time_s=float(record["time_s"]),
            step=int(record["step"]),
            layer=layer,
            policy=str(record["policy"]),
            action=dict(record["action"]),
            reason=str(record["reason"]),
            numbers={str(k): float(v) for k, v in dict(record.get("numbers", {})).items()},
        )


DecisionSink = Callable[[Decision], None]


class DecisionLog:
    """Decisions in memory (the last `max_kept`, or all) plus an optional sink called on each.

    The sink is called synchronously in `record`; an exception it raises propagates, so a broken
    telemetry writer is seen, not silently dropped.
    """

    def __init__(self, sink: DecisionSink | None = None, max_kept: int | None = None) -> None:
        if max_kept is not None and max_kept <= 0:
            raise ValueError(f"max_kept must be positive or None (keep all), got {max_kept}")
        self._sink = sink
        self._decisions: deque[Decision] = deque(maxlen=max_kept)
        self.recorded_total = 0  # counts also the decisions dropped by max_kept

    def record(self, decision: Decision) -> None:
        self._decisions.append(decision)
        self.recorded_total += 1
        if self._sink is not None:
            self._sink(decision)

    @property
    def decisions(self) -> list[Decision]:
        return list(self._decisions)

    def __len__(self) -> int:
        return len(self._decisions)

    def __iter__(self):
        return iter(self._decisions)

    def of_layer(self, layer: Layer) -> list[Decision]:
        return [d for d in self._decisions if d.layer == layer]

    def to_dict(self) -> dict[str, Any]:
        """The kept decisions as JSON-friendly dicts, with how many were recorded in all."""
        return {
            "recorded_total": self.recorded_total,
            "decisions": [d.to_dict() for d in self._decisions],
        }


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_format_value(v) for v in value) + "]"
    return str(value)


def format_mapping(values: Mapping[str, Any]) -> str:
    """`k=v k=v` with floats at 4 significant digits: compact enough for one timeline line."""
    return " ".join(f"{k}={_format_value(v)}" for k, v in values.items())


def format_timeline(decisions: Iterable[Decision | Mapping[str, Any]]) -> str:
    """The decision timeline of a run, one decision per block, in time order.

    Accepts `Decision`s or their `to_dict()` records (as read from telemetry). Each block is
    `time_s step layer policy: reason`, then the action and the numbers on indented lines.
    """
    rows = [d if isinstance(d, Decision) else Decision.from_dict(d) for d in decisions]
    rows.sort(key=lambda d: (d.time_s, d.step))
    if not rows:
        return "no decisions recorded"
    lines = [f"{'time_s':>10} {'step':>8} {'layer':<5} policy: reason"]
    for d in rows:
        lines.append(f"{d.time_s:>10.1f} {d.step:>8d} {d.layer:<5} {d.policy}: {d.reason}")
        lines.append(f"{'':>26}action  {format_mapping(d.action)}")
        if d.numbers:
            lines.append(f"{'':>26}numbers {format_mapping(d.numbers)}")
    return "\n".join(lines)
