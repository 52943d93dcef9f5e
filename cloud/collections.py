"""What a folder of spot traces is: its `collection.toml`, read as data (tomllib, never code).

File names are not parsed for meaning: a folder of traces says what it holds in `collection.toml`
beside the files. (This module is `cloud.collections`; it never runs as a script, so it does not
shadow the standard library's `collections`.)

The reference page of the format, every key with its default, an example and the errors, is
`docs/market_data.md`. In short (a `[files."NAME"]` value overrides the collection-wide one):

    provider = "gcp"                    # required: aws, gcp, azure, ... (list prices: aws only)
    value_meaning = "available_count"   # required: "available_count" (a value counts nodes up)
                                        #   or "preempted_count" (it counts nodes taken away)
    nodes_per_file = 4                  # required: the cluster size each file records (0..N)
    up_if_at_least = 1                  # optional: the file records ONE node of nodes_per_file
                                        #   VMs, up when at least this many are (a 1-node market)
    kind = "preemption"                 # optional, free text (availability | preemption)
    source = "who recorded it, where"   # optional, free text
    tick_seconds = 300                  # optional when each file's metadata.gap_seconds says it
    start_time = 2024-05-01T00:00:00Z   # optional: the real instant of tick 0 (UTC offset needed)
    recorded_from_date = 2024-05-01     # optional: the day recording began (UTC); without
                                        #   start_time it places the collection in time
    on_demand_usd_per_hour = 3.67       # optional: per node; else the list in cloud/prices.py
    spot_usd_per_hour = 1.10            # optional: per node; else the prices recorded in the
                                        #   trace file, else the AWS Spot Advisor saving

    [files."a100-zone-a.json"]          # one table per trace file, required for each *.json
    zone = "us-central1-a"              # required: AWS us-west-2a, GCP us-central1-a, Azure eastus-1
                                        #   (distinct among the files of one instance type)
    instance_type = "a2-highgpu-1g"     # required
    region = "us-central1"              # optional: derived from the zone name when it follows
                                        #   AWS, GCP or Azure naming
    gpus_per_node = 1                   # required for types not in cloud/prices.py; 0: a CPU type
    ticks = 4000                        # optional check of the file's length
    # and, per file: tick_seconds, start_time, nodes_per_file, up_if_at_least,
    # on_demand_usd_per_hour, spot_usd_per_hour

Start times are given for every file or for none: zones are then aligned by real time, else
paired by tick index from each file's first tick (the loaded traces say which, and zones of
unequal length paired so are warned about).
"""

from __future__ import annotations

import datetime as dt
import difflib
import enum
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COLLECTION_FILE = "collection.toml"
# A collection.toml is a few KB; anything this large is not one (refused before parsing).
MAX_COLLECTION_BYTES = 1 << 20


class TraceMeaning(enum.Enum):
    """How to read one integer of a trace."""

    # The value is the number of spot instances available (running) at that tick.
    AVAILABLE = "available"
    # The value is the number of instances preempted (not available) at that tick.
    PREEMPTED = "preempted"


VALUE_MEANINGS: dict[str, TraceMeaning] = {
    "available_count": TraceMeaning.AVAILABLE,
    "preempted_count": TraceMeaning.PREEMPTED,
}

_REQUIRED_TOP = ("provider", "value_meaning", "nodes_per_file", "files")
# Keys that may appear at the top and in a file's table (the file's value wins).
_SHARED_KEYS = (
    "tick_seconds", "start_time", "nodes_per_file", "up_if_at_least", "on_demand_usd_per_hour",
    "spot_usd_per_hour",
)
_TOP_KEYS = (
    *_REQUIRED_TOP, *_SHARED_KEYS, "kind", "source", "value_meaning_note", "recorded_from_date",
)
_FILE_KEYS = (*_SHARED_KEYS, "zone", "region", "instance_type", "gpus_per_node", "ticks")


class CollectionError(ValueError):
    """A collection.toml that is missing, malformed or incomplete; the message says the fix."""


@dataclass(frozen=True)
class FileMeta:
    """What collection.toml says about one trace file."""

    name: str
    zone: str
    region: str
    instance_type: str
    nodes: int
    gpus_per_node: int | None = None
    tick_s: int | None = None
    ticks: int | None = None
    # Epoch seconds (UTC) of the file's tick 0, when known.
    start_time_s: float | None = None
    on_demand_usd_per_hour: float | None = None
    spot_usd_per_hour: float | None = None
    # The file records one node made of `nodes` VMs, up when at least this many are (None: the
    # values count nodes, 0..nodes).
    up_if_at_least: int | None = None

    @property
    def market_nodes(self) -> int:
        """Nodes of the market the file loads as: 1 with up_if_at_least, else nodes_per_file."""
        return 1 if self.up_if_at_least is not None else self.nodes


@dataclass(frozen=True)
class CollectionMeta:
    path: Path  # the collection.toml
    provider: str
    meaning: TraceMeaning
    nodes_per_file: int
    files: dict[str, FileMeta]
    kind: str = ""
    source: str = ""
    # Epoch seconds (UTC) of 00:00 on `recorded_from_date`, when it reads as a date (free text
    # otherwise: then None). Only orders collections in time where start_time is absent.
    recorded_from_s: float | None = None

    @property
    def folder(self) -> str:
        return self.path.parent.name

    @property
    def market_nodes(self) -> int:
        """The largest market a file of the collection loads as (nodes_per_file, or 1 where
        up_if_at_least makes a file one node of several VMs): the gang it can hold."""
        return max(f.market_nodes for f in self.files.values())

    @property
    def start_times_known(self) -> bool:
        return all(f.start_time_s is not None for f in self.files.values())


# `\Z`, not `$`: `$` also matches before a final newline ("us-east-1a\n" would pass).
_AWS_ZONE = re.compile(r"^(?P<region>[a-z]{2}(-gov)?-[a-z]+-\d+)[a-z]\Z")
_GCP_ZONE = re.compile(r"^(?P<region>[a-z]+-[a-z]+\d+)-[a-z]\Z")
_AZURE_ZONE = re.compile(r"^(?P<region>[a-z]+\d*)-\d\Z")
ZONE_PATTERNS = {"aws": _AWS_ZONE, "gcp": _GCP_ZONE, "azure": _AZURE_ZONE}


def region_of_zone(zone: str, provider: str | None = None) -> str:
    """'us-west-2a' -> 'us-west-2' (AWS), 'us-central1-a' -> 'us-central1' (GCP),
    'eastus-1' -> 'eastus' (Azure). Other namings need `region =` in collection.toml."""
    patterns = [ZONE_PATTERNS[provider]] if provider in ZONE_PATTERNS else ZONE_PATTERNS.values()
    for pattern in patterns:
        match = pattern.match(zone)
        if match:
            return match.group("region")
    raise ValueError(
        f"zone {zone!r} is not a zone name like 'us-west-2a' (AWS), 'us-central1-a' (GCP) or "
        "'eastus-1' (Azure); give its region in collection.toml: region = \"...\""
    )


# The example for a folder without collection.toml lists this many files' tables, then says how
# many more need one (an error message is no place for hundreds of tables).
EXAMPLE_FILES = 12


def zone_in_file_name(name: str) -> tuple[str, str] | None:
    """(zone, provider) a file name states, when one of its '_'-separated parts is an AWS, GCP
    or Azure zone name ('us-east-1a_v100_1.json' -> ('us-east-1a', 'aws')); else None. Only
    `how_to_write`'s example reads names: the loader takes zones from collection.toml."""
    for part in Path(name).stem.split("_"):
        for provider, pattern in ZONE_PATTERNS.items():
            if pattern.match(part):
                return part, provider
    return None


def how_to_write(folder: Path) -> str:
    """A collection.toml for `folder`: one table per trace file, each with its own zone (from the
    file name where it states one, else a placeholder to fill in)."""
    names = sorted(p.name for p in folder.glob("*.json")) or ["NAME.json"]
    found = [zone_in_file_name(name) for name in names]
    provider = next((f[1] for f in found if f is not None), "aws")
    tables = []
    for name, named in zip(names[:EXAMPLE_FILES], found, strict=False):
        zone = named[0] if named else None
        zone_line = (f'    zone = "{zone}"' + " " * max(1, 35 - len(f'zone = "{zone}"'))
                     + "# from the file name: check it\n") if zone else (
            f'    zone = "ZONE-OF-{Path(name).stem}"  # fill in: the zone this file was recorded '
            "in (one per file)\n")
        tables.append(f'    [files."{name}"]\n{zone_line}'
                      '    instance_type = "p3.2xlarge"       # the node type: check it\n')
    more = len(names) - EXAMPLE_FILES
    rest = (f"\nand one such table for each of the other {more} files "
            f"({', '.join(names[EXAMPLE_FILES:EXAMPLE_FILES + 3])}, ...).\n" if more > 0 else "")
    return (
        f"Write {folder / COLLECTION_FILE}, for example:\n\n"
        f'    provider = "{provider}"' + " " * (35 - len(f'provider = "{provider}"'))
        + "# aws, gcp, azure, ...\n"
        '    value_meaning = "available_count"  # or "preempted_count": what one value counts\n'
        "    nodes_per_file = 1                 # cluster size each file records\n\n"
        + "\n".join(tables) + rest + "\n"
        "Every zone is distinct among the files of one instance type. Optional keys (region, "
        "gpus_per_node, tick_seconds, start_time, up_if_at_least, on_demand_usd_per_hour, "
        "spot_usd_per_hour) are described in docs/market_data.md."
    )


def read_collection(folder: str | Path) -> CollectionMeta:
    """Parse and check `folder/collection.toml`; every error names the file and the fix."""
    folder = Path(folder)
    path = folder / COLLECTION_FILE
    if not path.is_file():
        raise CollectionError(
            f"spot trace folder {folder} has no {COLLECTION_FILE}: the loader reads what traces "
            f"mean from it, not from file names. {how_to_write(folder)}"
        )
    size = path.stat().st_size
    if size > MAX_COLLECTION_BYTES:
        raise CollectionError(
            f"{path} is {size} bytes, over the {MAX_COLLECTION_BYTES}-byte limit for a "
            "collection.toml: it is not one; keep only the metadata keys there"
        )
    try:
        document = tomllib.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError) as error:
        raise CollectionError(f"{path} is not valid UTF-8 TOML: {error}") from error
    return _parse(path, document)


def _parse(path: Path, doc: dict[str, Any]) -> CollectionMeta:
    _check_keys(path, "the top level", doc, _TOP_KEYS)
    missing = [key for key in _REQUIRED_TOP if key not in doc]
    if missing:
        raise CollectionError(
            f"{path} lacks {', '.join(missing)}; required at the top: "
            f"{', '.join(_REQUIRED_TOP[:-1])} and one [files.\"NAME\"] table per trace file "
            "(see cloud/collections.py)"
        )
    provider = _text(path, "provider", doc["provider"]).lower()
    meaning_text = doc["value_meaning"]
    if meaning_text not in VALUE_MEANINGS:
        raise CollectionError(
            f"{path}: value_meaning = {meaning_text!r} is not known; use one of "
            f"{', '.join(map(repr, VALUE_MEANINGS))} (see shared/data/spot/SEMANTICS.md: reading "
            "one as the other flips every availability)"
        )
    nodes = _positive_int(path, "nodes_per_file", doc["nodes_per_file"])
    tables = doc["files"]
    if not isinstance(tables, dict) or not tables:
        raise CollectionError(f'{path}: files must hold one [files."NAME"] table per trace file')
    files = {}
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise CollectionError(f'{path}: files."{name}" must be a table of keys')
        files[name] = _file_meta(path, name, table, doc, provider, nodes)
    _check_distinct_zones(path, files)
    known = [f.start_time_s is not None for f in files.values()]
    if any(known) and not all(known):
        without = [n for n, f in files.items() if f.start_time_s is None]
        raise CollectionError(
            f"{path} gives start_time for some files but not for {', '.join(without[:5])}: give "
            "it for every file (zones are then aligned by real time) or for none"
        )
    return CollectionMeta(
        path=path,
        provider=provider,
        meaning=VALUE_MEANINGS[meaning_text],
        nodes_per_file=nodes,
        files=files,
        kind=str(doc.get("kind", "")),
        source=str(doc.get("source", "")),
        recorded_from_s=_date_s(doc.get("recorded_from_date")),
    )


def _check_distinct_zones(path: Path, files: dict[str, FileMeta]) -> None:
    """Files of one instance type are the zones of one market: two saying the same zone would
    be one zone twice (refused here, naming them, not later by the market)."""
    seen: dict[tuple[str, str], list[str]] = {}
    for name, meta in files.items():
        seen.setdefault((meta.instance_type, meta.zone), []).append(name)
    for (instance_type, zone), names in seen.items():
        if len(names) > 1:
            raise CollectionError(
                f"{path}: files {', '.join(names)} all say zone = {zone!r} with instance_type = "
                f"{instance_type!r}; the zones of one instance type must be distinct (each file "
                "is one zone's market): give each file the zone it was recorded in, or put "
                "recordings of the same zone in folders of their own"
            )


def _file_meta(
    path: Path, name: str, table: dict, doc: dict, provider: str, nodes: int
) -> FileMeta:
    where = f'{path} [files."{name}"]'
    _check_keys(path, f'files."{name}"', table, _FILE_KEYS)
    for key in ("zone", "instance_type"):
        if key not in table:
            raise CollectionError(f'{where} lacks {key} = "..."; both zone and instance_type are '
                                  "required per file")
    zone = _text(where, "zone", table["zone"])
    if "region" in table:
        region = _text(where, "region", table["region"])
    else:
        try:
            region = region_of_zone(zone, provider)
        except ValueError as error:
            raise CollectionError(f"{where}: {error}") from None

    def shared(key: str) -> Any:
        return table.get(key, doc.get(key))

    def optional(key: str, parse) -> Any:
        value = shared(key)
        return None if value is None else parse(where, key, value)

    file_nodes = _positive_int(where, "nodes_per_file", table.get("nodes_per_file", nodes))
    up_if = optional("up_if_at_least", _positive_int)
    if up_if is not None and up_if > file_nodes:
        raise CollectionError(
            f"{where}: up_if_at_least = {up_if} is more than the {file_nodes} VMs the file "
            f"records (nodes_per_file = {file_nodes}); the node is up when at least "
            f"up_if_at_least of its nodes_per_file VMs are: use 1..{file_nodes}"
        )
    return FileMeta(
        name=name,
        zone=zone,
        region=region,
        instance_type=_text(where, "instance_type", table["instance_type"]),
        nodes=file_nodes,
        up_if_at_least=up_if,
        gpus_per_node=None if "gpus_per_node" not in table
        else _count(where, "gpus_per_node", table["gpus_per_node"]),
        tick_s=optional("tick_seconds", _positive_int),
        ticks=None if "ticks" not in table else _positive_int(where, "ticks", table["ticks"]),
        start_time_s=optional("start_time", _epoch_s),
        on_demand_usd_per_hour=optional("on_demand_usd_per_hour", _price),
        spot_usd_per_hour=optional("spot_usd_per_hour", _price),
    )


def _check_keys(path: Path, part: str, table: dict, valid: tuple[str, ...]) -> None:
    """Refuse keys that look like a typo of a valid one (a misspelt start_time would silently
    fall back to tick-0 pairing); other extra keys are free-form notes and are ignored."""
    for key in table:
        if key in valid:
            continue
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.75)
        if close:
            raise CollectionError(f"{path}: {part} has {key!r}; did you mean {close[0]!r}?")


def _text(where: object, key: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise CollectionError(f'{where}: {key} must be a non-empty string, e.g. {key} = "..."')
    return value.strip()


def _positive_int(where: object, key: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CollectionError(f"{where}: {key} = {value!r} must be a positive integer")
    return value


def _count(where: object, key: str, value: object) -> int:
    """0 or more (gpus_per_node = 0: a CPU instance type)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CollectionError(f"{where}: {key} = {value!r} must be an integer, 0 or more (0: a "
                              "CPU instance type)")
    return value


def _price(where: object, key: str, value: object) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise CollectionError(
            f"{where}: {key} = {value!r} must be a positive number of USD per node-hour"
        )
    if value > 10_000:
        raise CollectionError(f"{where}: {key} = {value!r} USD per node-hour is not plausible; "
                              "prices are per node-hour, not per month or per job")
    return float(value)


def _date_s(value: object) -> float | None:
    """`recorded_from_date` (a TOML date or datetime, or an ISO string) -> epoch seconds of its
    start in UTC; None for anything else: the key was free text for people before it ordered
    collections, so a note there must still load."""
    if isinstance(value, str):
        try:
            value = dt.date.fromisoformat(value.strip()[:10])
        except ValueError:
            return None
    if isinstance(value, dt.datetime):
        return (value if value.tzinfo else value.replace(tzinfo=dt.UTC)).timestamp()
    if isinstance(value, dt.date):
        return dt.datetime(value.year, value.month, value.day, tzinfo=dt.UTC).timestamp()
    return None


def _epoch_s(where: object, key: str, value: object) -> float:
    """A TOML offset datetime (or an ISO 8601 string) with a UTC offset -> epoch seconds."""
    if isinstance(value, str):
        try:
            value = dt.datetime.fromisoformat(value)
        except ValueError:
            value = None
    if not isinstance(value, dt.datetime) or value.tzinfo is None:
        raise CollectionError(
            f"{where}: {key} must be a date and time with a UTC offset, e.g. "
            f"{key} = 2023-08-03T00:00:00Z"
        )
    return value.timestamp()
