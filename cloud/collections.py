"""What a folder of spot traces is: its `collection.toml`, read as data (tomllib, never code).

File names are not parsed for meaning: a folder of traces says what it holds in `collection.toml`
beside the files. (This module is `cloud.collections`; it never runs as a script, so it does not
shadow the standard library's `collections`.)

The format, every key (a `[files."NAME"]` value overrides the collection-wide one):

    provider = "gcp"                    # required: aws, gcp, azure, ... (list prices: aws only)
    value_meaning = "available_count"   # required: "available_count" (a value counts nodes up)
                                        #   or "preempted_count" (it counts nodes taken away)
    nodes_per_file = 4                  # required: the cluster size each file records (0..N)
    kind = "preemption"                 # optional, free text (availability | preemption)
    source = "who recorded it, where"   # optional, free text
    tick_seconds = 300                  # optional when each file's metadata.gap_seconds says it
    start_time = 2024-05-01T00:00:00Z   # optional: the real instant of tick 0 (UTC offset needed)
    on_demand_usd_per_hour = 3.67       # optional: per node; else the list in cloud/prices.py
    spot_usd_per_hour = 1.10            # optional: per node; else the AWS Spot Advisor saving

    [files."a100-zone-a.json"]          # one table per trace file, required for each *.json
    zone = "us-central1-a"              # required: AWS us-west-2a, GCP us-central1-a, Azure eastus-1
    instance_type = "a2-highgpu-1g"     # required
    region = "us-central1"              # optional: derived from the zone name when it follows
                                        #   AWS, GCP or Azure naming
    gpus_per_node = 1                   # required for types not in cloud/prices.py
    ticks = 4000                        # optional check of the file's length
    # and, per file: tick_seconds, start_time, nodes_per_file, on_demand_usd_per_hour,
    # spot_usd_per_hour

Start times are given for every file or for none: zones are then aligned by real time, else
paired by tick index from each file's first tick (the loaded traces say which).
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
    "tick_seconds", "start_time", "nodes_per_file", "on_demand_usd_per_hour", "spot_usd_per_hour",
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


@dataclass(frozen=True)
class CollectionMeta:
    path: Path  # the collection.toml
    provider: str
    meaning: TraceMeaning
    nodes_per_file: int
    files: dict[str, FileMeta]
    kind: str = ""
    source: str = ""

    @property
    def folder(self) -> str:
        return self.path.parent.name

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


def how_to_write(folder: Path) -> str:
    """A minimal collection.toml for `folder`, with a stub table for its first trace files."""
    names = sorted(p.name for p in folder.glob("*.json"))[:3] or ["NAME.json"]
    tables = "\n".join(
        f'    [files."{name}"]\n    zone = "us-east-1a"                # the zone it was recorded in\n'
        f'    instance_type = "p3.2xlarge"       # the node type\n'
        for name in names
    )
    return (
        f"Write {folder / COLLECTION_FILE}, for example:\n\n"
        '    provider = "aws"                   # aws, gcp, azure, ...\n'
        '    value_meaning = "available_count"  # or "preempted_count": what one value counts\n'
        "    nodes_per_file = 1                 # cluster size each file records\n\n"
        f"{tables}\n"
        "Optional keys (region, gpus_per_node, tick_seconds, start_time, "
        "on_demand_usd_per_hour, spot_usd_per_hour) are listed in cloud/collections.py."
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

    return FileMeta(
        name=name,
        zone=zone,
        region=region,
        instance_type=_text(where, "instance_type", table["instance_type"]),
        nodes=_positive_int(where, "nodes_per_file", table.get("nodes_per_file", nodes)),
        gpus_per_node=None if "gpus_per_node" not in table
        else _positive_int(where, "gpus_per_node", table["gpus_per_node"]),
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


def _price(where: object, key: str, value: object) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise CollectionError(
            f"{where}: {key} = {value!r} must be a positive number of USD per node-hour"
        )
    if value > 10_000:
        raise CollectionError(f"{where}: {key} = {value!r} USD per node-hour is not plausible; "
                              "prices are per node-hour, not per month or per job")
    return float(value)


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
