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

A trace collection may instead state its prices in its `collection.toml`
(`on_demand_usd_per_hour`, `spot_usd_per_hour`, per file or for the whole collection; see
`docs/market_data.md`): that is how another cloud or an unlisted instance type is priced. A trace
file may record its own spot prices (`"prices": [...]`): where collection.toml states no spot
price, they are billed (their mean) before the Spot Advisor is asked. `node_prices` applies that
order and names the file and the fix when a price is missing.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from cloud.collections import COLLECTION_FILE, read_collection, region_of_zone

PRICE_TABLE_DATE = "2025-06"
# The start of a spot price source label that says the trace file's own prices are billed.
RECORDED_IN_TRACE = "recorded in the trace file"

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

# Legacy node-shape labels of the shipped traces ("v100_1" ...), which older file names carried
# and risk-model history names still use. Only `instance_for_trace`'s fallback for a folder that
# is absent (the labelled synthetic stand-in of the emulated cloud) reads a file name with it.
TRACE_SHAPE_INSTANCE: dict[str, str] = {
    "v100_1": "p3.2xlarge",
    "v100_8": "p3.16xlarge",
    "k80_1": "p2.xlarge",
    "k80_8": "p2.8xlarge",
}


def node_shape_of(instance_type_name: str) -> str:
    """'p3.2xlarge' -> 'v100_1' (GPU model and count) for listed types; else the type's name."""
    known = INSTANCE_TYPES.get(instance_type_name)
    return f"{known.gpu_model.lower()}_{known.gpus}" if known else instance_type_name


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


@dataclass(frozen=True)
class NodePrices:
    """USD per node-hour of one trace file's node type, and where each price came from."""

    on_demand_usd_per_hour: float
    spot_usd_per_hour: float
    on_demand_source: str
    spot_source: str


def node_prices(
    instance_type_name: str,
    region: str,
    provider: str,
    on_demand_usd_per_hour: float | None = None,
    spot_usd_per_hour: float | None = None,
    where: str = "",
    advisor_path: str | Path | None = None,
    file_name: str = "NAME",
    recorded_spot_usd_per_hour: float | None = None,
) -> NodePrices:
    """Prices stated in collection.toml first; then, for spot, the mean of the prices recorded in
    the trace file; else (AWS only) the list price and the Spot Advisor's saving for the region.
    `where` names the trace file in errors."""
    fix = (
        f"add on_demand_usd_per_hour = ... and spot_usd_per_hour = ... (USD per node-hour) to "
        f"its [files.\"{file_name}\"] table or to the top of {COLLECTION_FILE}"
    )
    if on_demand_usd_per_hour is not None:
        on_demand, on_demand_source = on_demand_usd_per_hour, COLLECTION_FILE
    elif provider != "aws":
        raise ValueError(
            f"no on-demand price for {where or instance_type_name}: the price list holds AWS "
            f"list prices only and the provider is {provider!r}; {fix}"
        )
    else:
        try:
            on_demand = on_demand_price(instance_type_name, region)
        except ValueError as error:
            raise ValueError(f"no on-demand price for {where or instance_type_name}: {error}; "
                             f"or {fix}") from None
        on_demand_source = f"AWS list price {PRICE_TABLE_DATE}"
    if spot_usd_per_hour is not None:
        return NodePrices(on_demand, spot_usd_per_hour, on_demand_source, COLLECTION_FILE)
    if recorded_spot_usd_per_hour is not None:
        return NodePrices(on_demand, recorded_spot_usd_per_hour, on_demand_source,
                          f"{RECORDED_IN_TRACE} (mean of its prices)")
    if provider != "aws":
        raise ValueError(
            f"no spot price for {where or instance_type_name}: the Spot Advisor covers AWS "
            f"only and the provider is {provider!r}; {fix}"
        )
    try:
        entry = spot_advisor(instance_type_name, region, advisor_path)
    except (FileNotFoundError, ValueError) as error:
        raise ValueError(f"no spot price for {where or instance_type_name}: {error}; "
                         f"or {fix}") from None
    return NodePrices(
        on_demand,
        spot_price_from_discount(on_demand, entry.saving_percent / 100.0),
        on_demand_source,
        f"Spot Advisor {PRICE_TABLE_DATE} saving ({entry.saving_percent}%)",
    )


def instance_for_trace(folder: str, zone_file: str, spot_dir: str | Path | None = None) -> str:
    """Instance type a trace file was recorded on, as its folder's collection.toml says.

    Only when the folder is absent (a bare clone: the emulated cloud then replays a labelled
    synthetic stand-in) is the legacy shape in the file name read ('us-west-2a_k80_8.json' ->
    'p2.8xlarge').
    """
    if spot_dir is None:
        from trainwise import settings

        spot_dir = settings.data_dir() / "spot"
    name = Path(zone_file).name
    path = Path(spot_dir) / folder
    if path.is_dir():
        files = read_collection(path).files
        if name not in files:
            raise ValueError(
                f"trace file {name!r} is not described in {path / COLLECTION_FILE}; add a "
                f'[files."{name}"] table (zone, instance_type); described: '
                f"{', '.join(sorted(files))}"
            )
        return files[name].instance_type
    parts = name.removesuffix(".json").split("_", 1)
    if len(parts) != 2 or parts[1] not in TRACE_SHAPE_INSTANCE:
        raise ValueError(
            f"trace folder {path} does not exist and {zone_file!r} has no known legacy node "
            f"shape ({', '.join(sorted(TRACE_SHAPE_INSTANCE))}); point TRAINWISE_DATA_DIR at "
            "the data or use a folder with a collection.toml"
        )
    region_of_zone(parts[0])  # validates the zone part of the name
    return TRACE_SHAPE_INSTANCE[parts[1]]
