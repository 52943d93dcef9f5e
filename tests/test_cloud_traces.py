"""Spot trace loading: metadata from collection.toml, the meaning pinned per folder, the tick from
the file or the metadata, bad and hostile input refused with the file named."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from cloud import traces
from cloud.traces import (
    ALIGNED_AT_TICK_0,
    FOLDER_MEANING,
    TraceMeaning,
    default_spot_dir,
    load_collection,
    load_folder,
    load_trace,
    region_of_zone,
    scaled_availability,
)

SPOT_DIR = default_spot_dir()
needs_data = pytest.mark.skipif(not SPOT_DIR.is_dir(), reason=f"shared spot data not at {SPOT_DIR}")

PRICED = 'on_demand_usd_per_hour = 3.06\nspot_usd_per_hour = 0.9731\n'


def _collection(
    tmp_path: Path,
    files: dict[str, object],
    nodes: int = 1,
    meaning: str = "available_count",
    folder: str = "mine",
    extra: str = "",
) -> Path:
    """A folder of traces and its collection.toml (p3.2xlarge in us-east-1a, prices stated)."""
    path = tmp_path / folder
    path.mkdir(parents=True, exist_ok=True)
    tables = ""
    for index, (name, document) in enumerate(files.items()):
        raw = document if isinstance(document, bytes) else json.dumps(document).encode()
        (path / name).write_bytes(raw)
        tables += (f'[files."{name}"]\nzone = "us-east-1{"abcdef"[index]}"\n'
                   'instance_type = "p3.2xlarge"\n')
    (path / "collection.toml").write_text(
        f'provider = "aws"\nvalue_meaning = "{meaning}"\nnodes_per_file = {nodes}\n{PRICED}'
        f"{extra}\n{tables}"
    )
    return path


def test_every_shipped_folder_is_pinned_to_available_counts():
    # spot/SEMANTICS.md: checked value for value, a value counts AVAILABLE instances in all four.
    assert FOLDER_MEANING == {
        "availability-1node-aws-2023-02": TraceMeaning.AVAILABLE,
        "availability-1node-aws-2022-10": TraceMeaning.AVAILABLE,
        "preemption-1node-aws-2023-04": TraceMeaning.AVAILABLE,
        "preemption-4node-aws-2023-08": TraceMeaning.AVAILABLE,
    }


@needs_data
@pytest.mark.parametrize(
    "folder, files, tick_s, ticks, capacity, types",
    [
        ("availability-1node-aws-2023-02", 9, 195, {20158}, 1, {"p3.2xlarge"}),
        ("availability-1node-aws-2022-10", 8, 600, {3895}, 1,
         {"p2.xlarge", "p2.8xlarge", "p3.2xlarge", "p3.16xlarge"}),
        ("preemption-1node-aws-2023-04", 4, 32, {19961}, 1, {"p3.2xlarge"}),
        ("preemption-4node-aws-2023-08", 3, 300, {3664, 5131}, 4, {"p3.2xlarge"}),
    ],
)
def test_folders_load_with_their_own_tick(folder, files, tick_s, ticks, capacity, types):
    loaded = load_folder(folder)
    assert len(loaded) == files
    assert {t.tick_s for t in loaded} == {tick_s}
    assert {t.n_ticks for t in loaded} == ticks
    assert {t.capacity_nodes for t in loaded} == {capacity}
    assert {t.instance_type for t in loaded} == types
    for trace in loaded:
        assert trace.available.min() >= 0 and trace.available.max() <= capacity
        # No shipped folder records start times: zones are paired at tick 0, and say so.
        assert trace.start_time_s is None and trace.alignment == ALIGNED_AT_TICK_0


@needs_data
@pytest.mark.parametrize(
    "folder, zone_file, mean_available",
    [
        # Read as AVAILABLE, us-west-2b is the good zone (90.5%) and us-east-1a the bad one (16.7%);
        # reading them as PREEMPTED would swap that.
        ("availability-1node-aws-2023-02", "us-west-2b_v100_1.json", 0.9050),
        ("availability-1node-aws-2023-02", "us-east-1a_v100_1.json", 0.1667),
        ("availability-1node-aws-2022-10", "us-west-2a_k80_1.json", 0.8927),
        ("preemption-1node-aws-2023-04", "us-west-2b_v100_1.json", 0.7928),
        ("preemption-4node-aws-2023-08", "us-west-2c_v100_1.json", 3.2645),
    ],
)
def test_pinned_meaning_gives_the_raw_values_as_available(folder, zone_file, mean_available):
    path = SPOT_DIR / folder / zone_file
    trace = load_trace(path, FOLDER_MEANING[folder])
    raw = np.asarray(json.loads(path.read_text())["data"])
    np.testing.assert_array_equal(trace.available, raw)
    assert trace.available.mean() == pytest.approx(mean_available, abs=1e-3)


@needs_data
def test_recorded_spot_price_is_kept_and_metadata_names_the_node():
    trace = load_trace(
        SPOT_DIR / "preemption-1node-aws-2023-04" / "us-west-2b_v100_1.json", TraceMeaning.AVAILABLE
    )
    assert trace.recorded_spot_price_usd_per_hour == pytest.approx(0.918)
    assert (trace.zone, trace.region, trace.instance_type, trace.node_shape) == (
        "us-west-2b", "us-west-2", "p3.2xlarge", "v100_1")
    assert trace.on_demand_usd_per_hour == pytest.approx(3.06)


def test_names_are_not_parsed_for_meaning(tmp_path):
    # The old loader refused this name ('<zone>_<gpu>_<n>.json') and took the cluster size from
    # the folder name ('<N>node'); now collection.toml says both.
    folder = _collection(tmp_path, {"trace.json": {"metadata": {"gap_seconds": 60},
                                                   "data": [0, 3, 4]}}, nodes=4, folder="x")
    trace = load_trace(folder / "trace.json")
    assert (trace.zone, trace.capacity_nodes, trace.tick_s) == ("us-east-1a", 4, 60)


def test_preempted_meaning_inverts_against_nodes_per_file(tmp_path):
    document = {"metadata": {"gap_seconds": 60}, "data": [0, 2, 4, 1]}
    four = _collection(tmp_path, {"a.json": document}, nodes=4, meaning="preempted_count")
    assert load_trace(four / "a.json").available.tolist() == [4, 2, 0, 3]
    assert load_trace(four / "a.json", TraceMeaning.PREEMPTED).available.tolist() == [4, 2, 0, 3]
    with pytest.raises(ValueError, match="reads values as available but .* says preempted"):
        load_trace(four / "a.json", TraceMeaning.AVAILABLE)
    with pytest.raises(ValueError, match="capacity_nodes=2 but .* nodes_per_file = 4"):
        load_trace(four / "a.json", capacity_nodes=2)


@pytest.mark.parametrize(
    "document, message",
    [
        ({"metadata": {"gap_seconds": 60}, "data": [1, -1, 0]}, "negative value -1 at tick 1"),
        ({"metadata": {}, "data": [1, 0]}, "no metadata.gap_seconds and .* no tick_seconds"),
        ({"data": [1, 0]}, "no metadata.gap_seconds"),
        ({"metadata": {"gap_seconds": 0}, "data": [1]}, "must be a positive integer"),
        ({"metadata": {"gap_seconds": 60}, "data": []}, "has no data"),
        ({"metadata": {"gap_seconds": 60}}, "has no data"),
        ({"metadata": {"gap_seconds": 60}, "data": [0, 2]}, "exceeds the cluster size 1"),
        ({"metadata": {"gap_seconds": 60}, "data": [0.5, 1]}, "flat list of integers"),
        ({"metadata": {"gap_seconds": 60}, "data": [[1, 0]]}, "flat list of integers"),
        ({"metadata": {"gap_seconds": 60}, "data": [1, [0, 1]]}, "flat list of integers"),
        ([1, 0], "must be a JSON object"),
        (b'{"metadata":{"gap_seconds":60},"data":[NaN]}', "NaN is not a number"),
        (pickle.dumps({"data": [1]}), "not valid trace JSON"),
        (b'{"data":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    ],
)
def test_bad_traces_are_refused_naming_the_file(tmp_path, document, message):
    folder = _collection(tmp_path, {"bad.json": document})
    with pytest.raises(ValueError, match=message) as error:
        load_trace(folder / "bad.json")
    assert "bad.json" in str(error.value)


def test_a_huge_trace_is_refused_before_it_is_read(tmp_path, monkeypatch):
    folder = _collection(tmp_path, {"big.json": {"metadata": {"gap_seconds": 60},
                                                 "data": [1] * 100}})
    monkeypatch.setattr(traces, "MAX_TRACE_BYTES", 64)
    with pytest.raises(ValueError, match=r"big.json is \d+ bytes, over the 64-byte limit"):
        load_trace(folder / "big.json")


def test_metadata_and_file_must_agree(tmp_path):
    document = {"metadata": {"gap_seconds": 60}, "data": [1, 0, 1]}
    folder = _collection(tmp_path, {"a.json": document}, extra="tick_seconds = 30")
    with pytest.raises(ValueError, match="gap_seconds = 60 but .* tick_seconds = 30"):
        load_trace(folder / "a.json")
    folder = _collection(tmp_path, {"a.json": {"data": [1, 0, 1]}}, extra="tick_seconds = 30",
                         folder="tick-from-metadata")
    assert load_trace(folder / "a.json").tick_s == 30


def test_bad_meanings_and_folders_are_refused(tmp_path):
    folder = _collection(tmp_path, {"a.json": {"metadata": {"gap_seconds": 60}, "data": [1]}})
    with pytest.raises(TypeError, match="meaning must be a TraceMeaning"):
        load_trace(folder / "a.json", "available")
    with pytest.raises(FileNotFoundError, match="does not exist; folders with a collection.toml "
                                                "under .*: mine"):
        load_folder("some-other-folder", spot_dir=tmp_path)
    # A shipped folder's pinned meaning guards against a collection.toml that flips it.
    flipped = _collection(tmp_path, {"a.json": {"metadata": {"gap_seconds": 60}, "data": [1]}},
                          meaning="preempted_count", folder="preemption-4node-aws-2023-08")
    with pytest.raises(ValueError, match="checked value for value to count available"):
        load_folder(flipped.name, spot_dir=tmp_path)


def test_window_longer_than_the_trace_is_refused(tmp_path):
    folder = _collection(tmp_path, {"a.json": {"metadata": {"gap_seconds": 60},
                                               "data": [1, 0, 1, 1]}})
    trace = load_trace(folder / "a.json")
    assert trace.window(1, 3).tolist() == [0, 1, 1]
    with pytest.raises(ValueError, match="longer than the trace"):
        trace.window(0, 5)
    with pytest.raises(ValueError, match="valid starts are 0..1"):
        trace.window(2, 3)


def test_scaled_availability_sums_shifted_copies():
    base = np.array([4, 3, 2, 1, 0, 4])
    scaled = scaled_availability(base, copies=2, offset_ticks=2)
    assert scaled.tolist() == [4 + 2, 3 + 1, 2 + 0, 1 + 4]
    assert scaled_availability(base, 1, 0).tolist() == base.tolist()
    with pytest.raises(ValueError, match="do not fit"):
        scaled_availability(base, copies=4, offset_ticks=2)


@pytest.mark.parametrize(
    "zone, provider, region",
    [
        ("us-west-2a", None, "us-west-2"),
        ("us-gov-west-1b", "aws", "us-gov-west-1"),
        ("us-central1-a", None, "us-central1"),
        ("europe-west4-b", "gcp", "europe-west4"),
        ("eastus-1", None, "eastus"),
        ("westeurope-3", "azure", "westeurope"),
    ],
)
def test_region_of_zone_for_aws_gcp_and_azure(zone, provider, region):
    assert region_of_zone(zone, provider) == region


def test_region_of_zone_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="not a zone name like .* give its region"):
        region_of_zone("us-west-2")
    with pytest.raises(ValueError, match="not a zone name"):
        region_of_zone("us-central1-a", "aws")


def _real_folders() -> list:
    if not SPOT_DIR.is_dir():
        return [pytest.param(None, marks=pytest.mark.skip(reason=f"no spot data at {SPOT_DIR}"))]
    return sorted(p.name for p in SPOT_DIR.iterdir() if p.is_dir() and p.name != "prices")


@pytest.mark.parametrize("folder", _real_folders())
def test_every_real_folder_loads_from_its_collection_toml(folder):
    loaded = load_collection(folder)
    assert loaded.traces, folder
    for trace in loaded.traces:
        assert trace.capacity_nodes == loaded.nodes_per_file
        assert 0 < trace.spot_usd_per_hour < trace.on_demand_usd_per_hour
        assert trace.available.max() <= trace.capacity_nodes
