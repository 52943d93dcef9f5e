"""The `aws` provider's market for the live slow tick (issue 27 item 2): EC2's spot prices in
the run's region, and the reclaims and spot refusals the run itself met.

- zones: the zones the provider launches in (the region's, only those with a subnet when
  TRAINWISE_EC2_SUBNET_IDS names subnets);
- spot price per zone: `describe_spot_price_history` for the instance type, the Linux price in
  effect now (`AwsProvider.spot_prices_now`); on-demand: the provider's own price, the one its
  bill uses;
- spot capacity: EC2 publishes none (a placement score is not a count). A zone counts as able to
  hold the gang's nodes when it lists a spot price for the type and the run was neither reclaimed
  there nor refused spot there (a launch that fell back to on-demand) in the last
  `RECLAIM_MEMORY_S`; else 0. The zone where the run holds spot nodes now holds them. The
  reason names each zone held back and why, so the allocation policy's choice is explained by
  what the run saw;
- the clock: Unix seconds (the provider's); job time counts from gang.json's first record. The
  slow tick's own interval is the tick.

Changeover, notice and checkpoint defaults are the emulated rules' (`cloud.emulated
.default_rules`): a real node's boot time is not measured here yet.
"""

from __future__ import annotations

from typing import Any

from cloud.providers.base import ProviderError
from trainwise import settings
from trainwise.market_types import Markets, held_zone_and_region

# A zone the run was reclaimed in, or refused spot in, is not offered spot again for this long:
# EC2's interruptions come in waves (the collections' consecutive runs are correlated).
RECLAIM_MEMORY_S = 3600.0


def spot_setbacks(history: list[dict[str, Any]]) -> list[tuple[str, float, str]]:
    """(zone, provider time, what) of each reclaim and each spot refusal in gang.json's history.

    A reclaim notice names no zone: it is the zone of the launch before it. A spot refusal is a
    launch the session made as the on-demand fallback ("fallback to on-demand"), in the zone it
    wanted spot in."""
    setbacks, zone = [], ""
    for entry in history:
        at = entry.get("provider_time_s")
        if at is None:
            continue
        event, reason = entry.get("event"), str(entry.get("reason", ""))
        if event == "launch":
            zone = str(entry.get("zone") or zone)
            if reason.startswith("fallback to on-demand"):
                setbacks.append((zone, float(at), "spot refused"))
        elif event == "notice" and reason.startswith("reclaim") and zone:
            setbacks.append((zone, float(at), "reclaimed"))
    return setbacks


def _origin_s(history: list[dict[str, Any]], now_s: float) -> float:
    times = [float(h["provider_time_s"]) for h in history if h.get("provider_time_s") is not None]
    return min(times) if times else now_s


def aws_markets(request: dict[str, Any], gang_record: dict[str, Any], now_wall_s: float, *,
                provider: Any = None) -> Markets | str:
    """EC2's market for the run now, or why there is none (the tick then keeps the nodes)."""
    # boto3 is the aws provider's optional dependency: loaded when a run is on aws.
    from botocore.exceptions import BotoCoreError, ClientError

    held_zone, region = held_zone_and_region(request, gang_record)
    instance_type = str(gang_record.get("instance_type") or request.get("instance_type") or "")
    nodes = max(1, int(gang_record.get("nodes") or request.get("nodes") or 1))
    try:
        if provider is None:
            from cloud.providers.aws import AwsProvider  # boto3 behind it (optional)

            provider = AwsProvider.for_run(instance_type, region)
        zones = tuple(provider.zones)
        spot = provider.spot_prices_now(instance_type)
        on_demand = tuple(float(provider.price_usd_per_hour(instance_type, z, "on_demand"))
                          for z in zones)
    except (ProviderError, ValueError, KeyError, BotoCoreError, ClientError) as error:
        return f"EC2's spot prices in {region} could not be read ({type(error).__name__}: {error})"
    if not zones:
        return f"EC2 lists no zone the provider can launch in, in region {region!r}"
    # The provider's clock is Unix seconds: the same scale as the wall clock.
    now_s = float(now_wall_s)
    history = list(gang_record.get("history") or [])
    recent: dict[str, str] = {}
    for zone, at, what in spot_setbacks(history):
        if now_s - at < RECLAIM_MEMORY_S:
            recent[zone] = f"{what} {(now_s - at) / 60:.0f} min ago"
    holding_spot = (str(gang_record.get("market") or "") == "spot"
                    and int(gang_record.get("nodes") or 0) > 0)
    available, notes = [], []
    for zone in zones:
        if holding_spot and zone == held_zone and zone in spot:
            available.append(nodes)  # the run holds spot nodes there now: they are there
        elif zone not in spot:
            available.append(0)
            notes.append(f"{zone}: no spot price for {instance_type}")
        elif zone in recent:
            available.append(0)
            notes.append(f"{zone}: {recent[zone]}")
        else:
            available.append(nodes)
    held_back = f" (held back: {'; '.join(notes)})" if notes else ""
    # A zone without a spot price keeps its on-demand price as the spot one: it is never chosen
    # for spot (0 available), and the policies need a finite price.
    return Markets(
        zones=zones, spot_available=tuple(available),
        spot_usd_per_hour=tuple(spot.get(z, od) for z, od in zip(zones, on_demand, strict=True)),
        on_demand_usd_per_hour=on_demand, now_s=now_s, origin_s=_origin_s(history, now_s),
        provider_per_wall_s=1.0, tick_s=float(settings.sensor_interval_s()),
        trace_time_s=now_s,
        source=(f"EC2 spot prices in {region} for {instance_type} (describe_spot_price_history; "
                f"a zone held back for {RECLAIM_MEMORY_S / 60:.0f} min after a reclaim or "
                f"refusal there){held_back}"))
