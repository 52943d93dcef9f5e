"""The provider's bill in the run's telemetry, written as it grows and read back (issue 28, item 2).

trainwise shows one cost: the bill of whoever holds the run's nodes (node-seconds at the price
paid, boot, changeover, notice and idle time included). The holder (`trainwise.gang.GangSession`
for the in-process and torchrun engines, the supervised engine's `_Emulation`) owns a
`BillMeter` and writes a `BillEvent` under the provider's rank at most once per `every_wall_s`
of wall time while the bill moves, and always once when the nodes are released (`final`); that
last one is the figure `gang.json` records. MLflow's `cost/usd`, Prometheus's
`trainwise_cost_usd` and the eval-loss-vs-cost plot read these events; a step event's
`cost_usd` (the trainer's wall time x the list price) is shown only as a compute estimate.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_right
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from telemetry.events import BillEvent

BILL_TYPE = BillEvent.TYPE


@dataclass
class BillMeter:
    """Decides when a bill is written: on a change after `every_wall_s`, and at the end."""

    run_id: str
    provider: str
    rank: int
    every_wall_s: float = 1.0
    _last_wall_s: float = field(default=-math.inf, repr=False)
    _last_bill_usd: float | None = field(default=None, repr=False)
    _final_written: bool = field(default=False, repr=False)

    def due(self, final: bool = False) -> bool:
        """Whether a bill may be written now (asked first: reading a bill can cost API calls)."""
        if self._final_written:
            return False
        return final or time.monotonic() - self._last_wall_s >= self.every_wall_s

    def event(self, *, step: int, bill_usd: float, provider_time_s: float, spot_share: float,
              nodes_held: int, final: bool = False) -> BillEvent | None:
        """The event to write now, or None (not due, unchanged, not a number, or after the
        final one: a released run's bill does not move)."""
        if self._final_written or not math.isfinite(bill_usd):
            return None
        now = time.monotonic()
        if not final and (now - self._last_wall_s < self.every_wall_s
                          or bill_usd == self._last_bill_usd):
            return None
        self._last_wall_s, self._last_bill_usd = now, bill_usd
        self._final_written = final
        return BillEvent(run_id=self.run_id, rank=self.rank, step=max(0, int(step)),
                         bill_usd=float(bill_usd), provider=self.provider,
                         provider_time_s=float(provider_time_s),
                         spot_share=float(spot_share) if math.isfinite(spot_share) else 0.0,
                         nodes_held=int(nodes_held), final=final)


def bills(records: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The bill records among telemetry records, in wall-time order."""
    found = [r for r in records if r.get("type") == BILL_TYPE
             and isinstance(r.get("bill_usd"), (int, float))]
    return sorted(found, key=lambda r: float(r.get("wall_time_s") or 0.0))


def last_bill_usd(records: Iterable[Mapping[str, Any]]) -> float | None:
    """The newest bill (the final one when the run ended), or None when none was written."""
    found = bills(records)
    return float(found[-1]["bill_usd"]) if found else None


class BillCurve:
    """The bill at any wall time: the last bill written at or before it (0 before the first)."""

    def __init__(self, records: Iterable[Mapping[str, Any]]) -> None:
        found = bills(records)
        self._walls = [float(r.get("wall_time_s") or 0.0) for r in found]
        self._usd = [float(r["bill_usd"]) for r in found]

    def __bool__(self) -> bool:
        return bool(self._usd)

    def at(self, wall_time_s: float) -> float:
        index = bisect_right(self._walls, wall_time_s)
        return self._usd[index - 1] if index else 0.0


__all__ = ["BILL_TYPE", "BillCurve", "BillMeter", "bills", "last_bill_usd"]
