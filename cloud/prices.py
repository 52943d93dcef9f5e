"""Prices: on-demand list prices, spot prices, and the Spot Advisor's interruption bands.

On-demand prices are AWS public list prices (Linux, on-demand, USD per instance-hour) as shown on
aws.amazon.com/ec2/pricing/on-demand and in the EC2 price list API, for the instance types the
traces stand for and the ones users ask for, in the regions the traces cover. They are facts
typed in here, not fetched: nothing is downloaded at run time. They change rarely; update the
table (and its date) when AWS does.

Spot prices come from one of two stated sources, never from a guess:
- a stated discount off on-demand (`spot_price_from_discount`), e.g. the Can't Be Late paper's
  0.9731 USD/h for p3.2xlarge against 3.06 USD/h on-demand (Wu et al., NSDI'24);
- the AWS Spot Instance Advisor feed in `spot/prices/spot-advisor-2025-06.json`: per region and
  type, `s` is the saving vs on-demand in percent and `r` indexes the interruption-frequency band.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from cloud.traces import region_of_zone

PRICE_TABLE_DATE = "2025-06"

# The Can't Be Late paper's single-node setting (Wu et al., NSDI'24, section 6).
CANT_BE_LATE_ON_DEMAND_USD_PER_HOUR = 3.06
CANT_BE_LATE_SPOT_USD_PER_HOUR = 0.9731


@dataclass(frozen=True)
class InstanceType:
    name: str
    gpus: int
    gpu_model: str


INSTANCE_TYPES: dict[str, InstanceType] = {
    t.name: t
    for t in (
        InstanceType("p2.xlarge", 1, "K80"),
        InstanceType("p2.8xlarge", 8, "K80"),
        InstanceType("p2.16xlarge", 16, "K80"),
        InstanceType("p3.2xlarge", 1, "V100"),
        InstanceType("p3.8xlarge", 4, "V100"),
        InstanceType("p3.16xlarge", 8, "V100"),
        InstanceType("p4d.24xlarge", 8, "A100"),
        InstanceType("g4dn.xlarge", 1, "T4"),
        InstanceType("g4dn.12xlarge", 4, "T4"),
        InstanceType("g5.xlarge", 1, "A10G"),
        InstanceType("g5.12xlarge", 4, "A10G"),
    )
}

_US_REGIONS = ("us-east-1", "us-east-2", "us-west-2")

# AWS public on-demand list prices, Linux, USD per instance-hour; the same in these three regions.
_LIST_PRICE_USD_PER_HOUR: dict[str, float] = {
    "p2.xlarge": 0.90,
    "p2.8xlarge": 7.20,
    "p2.16xlarge": 14.40,
    "p3.2xlarge": 3.06,
    "p3.8xlarge": 12.24,
    "p3.16xlarge": 24.48,
    "p4d.24xlarge": 32.77,
    "g4dn.xlarge": 0.526,
    "g4dn.12xlarge": 3.912,
    "g5.xlarge": 1.006,
    "g5.12xlarge": 5.672,
}

ON_DEMAND_USD_PER_HOUR: dict[tuple[str, str], float] = {
    (name, region): price
    for name, price in _LIST_PRICE_USD_PER_HOUR.items()
    for region in _US_REGIONS
}

# Node shape in a trace file name -> the instance type it was recorded on (spot-traces README:
# V100 traces on p3, K80 traces on p2; "_8" means the 8-GPU size).
TRACE_SHAPE_INSTANCE: dict[str, str] = {
    "v100_1": "p3.2xlarge",
    "v100_8": "p3.16xlarge",
    "k80_1": "p2.xlarge",
    "k80_8": "p2.8xlarge",
}


def instance_type(name: str) -> InstanceType:
    if name not in INSTANCE_TYPES:
        raise ValueError(
            f"unknown instance type {name!r}; valid: {', '.join(sorted(INSTANCE_TYPES))}"
        )
    return INSTANCE_TYPES[name]


def on_demand_price(instance_type_name: str, region: str) -> float:
    """On-demand list price in USD per instance-hour; errors list the valid types and regions."""
    instance_type(instance_type_name)
    if (instance_type_name, region) not in ON_DEMAND_USD_PER_HOUR:
        regions = sorted(r for (n, r) in ON_DEMAND_USD_PER_HOUR if n == instance_type_name)
        raise ValueError(
            f"no list price for {instance_type_name} in region {region!r}; "
            f"valid regions: {', '.join(regions)}"
        )
    return ON_DEMAND_USD_PER_HOUR[(instance_type_name, region)]


def spot_price_from_discount(on_demand_usd_per_hour: float, discount: float) -> float:
    """Spot price at a stated discount (0.682 = 68.2% off on-demand)."""
    if not 0.0 <= discount < 1.0:
        raise ValueError(f"discount={discount} must be in [0, 1): a share off the on-demand price")
    if on_demand_usd_per_hour <= 0:
        raise ValueError(f"on_demand_usd_per_hour={on_demand_usd_per_hour} must be positive")
    return on_demand_usd_per_hour * (1.0 - discount)


@dataclass(frozen=True)
class AdvisorEntry:
    """One Spot Advisor row: saving vs on-demand and the interruption-frequency band."""

    instance_type: str
    region: str
    saving_percent: int
    interruption_band: str
    interruption_band_index: int


def default_advisor_path() -> Path:
    from trainwise import settings

    return settings.data_dir() / "spot" / "prices" / "spot-advisor-2025-06.json"


@functools.lru_cache(maxsize=4)
def _advisor(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"Spot Advisor feed {path} does not exist; check TRAINWISE_DATA_DIR"
        ) from None


def spot_advisor(
    instance_type_name: str, region: str, path: str | Path | None = None
) -> AdvisorEntry:
    """The advisor's saving and interruption band for a type in a region (Linux)."""
    feed = _advisor(str(path if path is not None else default_advisor_path()))
    regions = feed["spot_advisor"]
    if region not in regions:
        raise ValueError(
            f"the Spot Advisor has no region {region!r}; valid: {', '.join(sorted(regions))}"
        )
    linux = regions[region]["Linux"]
    if instance_type_name not in linux:
        raise ValueError(
            f"the Spot Advisor has no {instance_type_name!r} in {region}; "
            f"valid types there include: {', '.join(sorted(linux)[:20])} ..."
        )
    row = linux[instance_type_name]
    band = feed["ranges"][row["r"]]
    return AdvisorEntry(
        instance_type_name, region, int(row["s"]), band["label"], int(band["index"])
    )


def spot_price_from_advisor(
    instance_type_name: str, region: str, path: str | Path | None = None
) -> float:
    """On-demand list price less the advisor's saving for that type and region."""
    entry = spot_advisor(instance_type_name, region, path)
    return spot_price_from_discount(
        on_demand_price(instance_type_name, region), entry.saving_percent / 100.0
    )


def interruption_band(instance_type_name: str, region: str, path: str | Path | None = None) -> str:
    """The advisor's interruption-frequency band, e.g. '>20%'."""
    return spot_advisor(instance_type_name, region, path).interruption_band


def instance_for_trace(folder: str, zone_file: str) -> str:
    """Instance type a trace file was recorded on ('us-west-2a_k80_8.json' -> 'p2.8xlarge').

    `folder` is checked only for the known folders' naming; the shape in the file name decides.
    """
    name = Path(zone_file).name
    stem = name.removesuffix(".json")
    parts = stem.split("_", 1)
    if len(parts) != 2 or parts[1] not in TRACE_SHAPE_INSTANCE:
        raise ValueError(
            f"trace file {zone_file!r} in {folder!r} has no known node shape; valid "
            f"shapes: {', '.join(sorted(TRACE_SHAPE_INSTANCE))}"
        )
    region_of_zone(parts[0])  # validates the zone part of the name
    return TRACE_SHAPE_INSTANCE[parts[1]]
