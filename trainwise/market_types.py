"""What a provider's market view is made of (`trainwise.market_view`, `market_view_aws`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cloud.collections import region_of_zone


@dataclass(frozen=True)
class Markets:
    """A provider's market now, per zone of the run's region (tuples aligned with `zones`), and
    its clock. Provider seconds are the provider's own (`now_s()`); job time is provider seconds
    since `origin_s` (0 for the emulated provider, whose clock starts with the job; the first
    record's Unix time on a real cloud)."""

    zones: tuple[str, ...]
    spot_available: tuple[int, ...]
    spot_usd_per_hour: tuple[float, ...]
    on_demand_usd_per_hour: tuple[float, ...]
    now_s: float
    origin_s: float
    provider_per_wall_s: float
    tick_s: float
    trace_time_s: float
    source: str  # what the view was read from, for the reason


def held_zone_and_region(request: dict[str, Any], gang_record: dict[str, Any]
                         ) -> tuple[str, str]:
    """(zone the run holds or last asked for, '' when none; its region, else the request's)."""
    held_zone = str(gang_record.get("zone") or (gang_record.get("allocation") or {}).get(
        "zone") or "")
    region = region_of_zone(held_zone) if held_zone else str(request.get("region") or "us-west-2")
    return held_zone, region
