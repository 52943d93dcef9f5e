"""Any trace collection loads through its collection.toml: other clouds' zone names, prices stated
in the metadata, N-node markets as recorded, zones aligned by real start time; a folder without
metadata, a missing price or a bad key is refused naming the file and the fix. And the cost suite
runs a recorded gang market as recorded and labels its synthetic one."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from cloud import scenarios
from cloud.collections import MAX_COLLECTION_BYTES, CollectionError, read_collection
from cloud.traces import (
    ALIGNED_AT_TICK_0,
    ALIGNED_BY_START_TIME,
    default_spot_dir,
    load_collection,
    load_folder,
)

SPOT_DIR = default_spot_dir()
needs_data = pytest.mark.skipif(not SPOT_DIR.is_dir(), reason=f"shared spot data not at {SPOT_DIR}")


def _folder(tmp_path: Path, toml: str, traces: dict[str, list[int]], name: str = "mine",
            tick_s: int = 300) -> Path:
    path = tmp_path / name
    path.mkdir(parents=True, exist_ok=True)
    for file, data in traces.items():
        (path / file).write_text(json.dumps({"metadata": {"gap_seconds": tick_s}, "data": data}))
    (path / "collection.toml").write_text(toml)
    return path


GCP = """
provider = "gcp"
value_meaning = "available_count"
nodes_per_file = 1
on_demand_usd_per_hour = 3.67
spot_usd_per_hour = 1.10

[files."us-central1-a_a100_40gb_8.json"]
zone = "us-central1-a"
instance_type = "a2-highgpu-8g"
gpus_per_node = 8

[files."b.json"]
zone = "us-central1-b"
instance_type = "a2-highgpu-8g"
gpus_per_node = 8
spot_usd_per_hour = 1.25
"""


def test_gcp_zone_names_and_prices_from_the_metadata(tmp_path):
    _folder(tmp_path, GCP, {"us-central1-a_a100_40gb_8.json": [1, 0, 1], "b.json": [0, 1, 1]})
    loaded = load_collection("mine", tmp_path)
    a, b = loaded.traces
    assert (a.zone, a.region, a.instance_type, a.gpus_per_node) == (
        "us-central1-a", "us-central1", "a2-highgpu-8g", 8)
    assert (a.on_demand_usd_per_hour, a.spot_usd_per_hour) == (3.67, 1.10)
    # A file's own price wins over the collection's.
    assert (b.on_demand_usd_per_hour, b.spot_usd_per_hour) == (3.67, 1.25)
    assert a.prices_from_collection and a.provider == "gcp"
    # Both zones are one market (one instance type); the suite prices them as stated.
    assert list(scenarios.group_by_shape(list(loaded.traces))) == ["a2-highgpu-8g"]
    assert scenarios.trace_prices(b) == (1.25, 3.67)


def test_azure_zone_names_derive_the_region(tmp_path):
    toml = GCP.replace('"gcp"', '"azure"').replace('zone = "us-central1-a"', 'zone = "eastus-1"').replace(
        'zone = "us-central1-b"', 'zone = "eastus-2"')
    _folder(tmp_path, toml, {"us-central1-a_a100_40gb_8.json": [1], "b.json": [1]})
    assert {t.region for t in load_folder("mine", tmp_path)} == {"eastus"}


UNPRICED = """
provider = "aws"
value_meaning = "available_count"
nodes_per_file = 1

[files."x.json"]
zone = "us-east-1a"
instance_type = "{type}"
gpus_per_node = 8
"""


@pytest.mark.parametrize(
    "provider, instance, zone, message",
    [
        ("aws", "p5.48xlarge", "us-east-1a", "unknown instance type 'p5.48xlarge'"),
        ("aws", "p3.2xlarge", "eu-west-1a", "no list price for p3.2xlarge in region 'eu-west-1'"),
        ("gcp", "a2-highgpu-8g", "us-central1-a", "AWS list prices only"),
    ],
)
def test_a_missing_price_names_the_file_and_the_fix(tmp_path, provider, instance, zone, message):
    toml = UNPRICED.format(type=instance).replace('"aws"', f'"{provider}"').replace(
        "us-east-1a", zone)
    _folder(tmp_path, toml, {"x.json": [1, 0]})
    with pytest.raises(ValueError, match=message) as error:
        load_folder("mine", tmp_path)
    text = str(error.value)
    assert "x.json" in text and "on_demand_usd_per_hour" in text and "spot_usd_per_hour" in text


def test_an_unlisted_type_needs_its_gpu_count(tmp_path):
    toml = UNPRICED.format(type="p5.48xlarge").replace("gpus_per_node = 8\n", "") + (
        "on_demand_usd_per_hour = 98.3\nspot_usd_per_hour = 40.0\n")
    _folder(tmp_path, toml, {"x.json": [1]})
    with pytest.raises(ValueError, match=r"x.json: instance type 'p5.48xlarge' is not in .* "
                                         r"add gpus_per_node"):
        load_folder("mine", tmp_path)


def test_a_folder_without_collection_toml_is_refused_with_an_example(tmp_path):
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "us-central1-a_a100_40gb_8.json").write_text(
        json.dumps({"metadata": {"gap_seconds": 60}, "data": [1]}))
    with pytest.raises(CollectionError) as error:
        load_folder("bare", tmp_path)
    text = str(error.value)
    assert "has no collection.toml" in text and str(tmp_path / "bare" / "collection.toml") in text
    # The provider and the zone follow the file name where it states a zone (issue 30).
    for line in ('provider = "gcp"', 'value_meaning = "available_count"', "nodes_per_file = 1",
                 '[files."us-central1-a_a100_40gb_8.json"]', 'zone = "us-central1-a"',
                 "instance_type = "):
        assert line in text
    # The example is itself a collection.toml the loader reads (once its values are filled in).
    example = "\n".join(line.strip() for line in text.split("for example:", 1)[1].splitlines()
                        if line.startswith("    "))
    (tmp_path / "bare" / "collection.toml").write_text(example)
    assert read_collection(tmp_path / "bare").files.keys() == {"us-central1-a_a100_40gb_8.json"}


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.replace('value_meaning = "available_count"', 'value_meaning = "up"'),
         "value_meaning = 'up' is not known; use one of 'available_count', 'preempted_count'"),
        (lambda t: t.replace('value_meaning = "available_count"\n', ""), "lacks value_meaning"),
        (lambda t: t.replace("nodes_per_file = 1", "nodes_per_file = 0"),
         "nodes_per_file = 0 must be a positive integer"),
        (lambda t: t + "start_tme = 2024-01-01T00:00:00Z\n", "did you mean 'start_time'"),
        (lambda t: t + "spot_usd_per_hour = -1\n", "must be a positive number"),
        (lambda t: t + "start_time = 2024-01-01T00:00:00\n", "with a UTC offset"),
        (lambda t: t.replace('zone = "us-east-1a"', 'zone = "lab-rack-7"'),
         "'lab-rack-7' is not a zone name .* region ="),
        (lambda t: t + "[[oops\n", "not valid UTF-8 TOML"),
        (lambda t: t.replace('instance_type = "{type}"', ""), "lacks instance_type"),
    ],
)
def test_bad_metadata_is_refused_naming_the_file(tmp_path, edit, message):
    _folder(tmp_path, edit(UNPRICED), {"x.json": [1]})
    with pytest.raises(CollectionError, match=message) as error:
        load_folder("mine", tmp_path)
    assert "collection.toml" in str(error.value)


def test_a_huge_collection_toml_is_refused_unread(tmp_path):
    _folder(tmp_path, "# " + "x" * MAX_COLLECTION_BYTES, {"x.json": [1]})
    with pytest.raises(CollectionError, match="over the .*-byte limit"):
        read_collection(tmp_path / "mine")


def test_files_and_metadata_must_match(tmp_path):
    _folder(tmp_path, UNPRICED.format(type="p3.2xlarge"), {"x.json": [1], "stray.json": [1]})
    with pytest.raises(CollectionError, match='holds stray.json with no \\[files."NAME"\\] table'):
        load_folder("mine", tmp_path)
    (tmp_path / "mine" / "stray.json").unlink()
    (tmp_path / "mine" / "x.json").unlink()
    with pytest.raises(CollectionError, match="describes x.json, which .* does not hold"):
        load_folder("mine", tmp_path)


SIXTEEN = """
provider = "aws"
value_meaning = "available_count"
nodes_per_file = 16
on_demand_usd_per_hour = 3.06
spot_usd_per_hour = 0.9731

[files."a.json"]
zone = "us-east-1a"
instance_type = "p3.2xlarge"

[files."b.json"]
zone = "us-east-1b"
instance_type = "p3.2xlarge"
"""


def test_an_n_node_collection_loads_as_recorded(tmp_path):
    _folder(tmp_path, SIXTEEN, {"a.json": [16, 12, 0, 16], "b.json": [3, 16, 16, 9]})
    loaded = load_collection("mine", tmp_path)
    assert loaded.nodes_per_file == 16
    assert [t.available.tolist() for t in loaded.traces] == [[16, 12, 0, 16], [3, 16, 16, 9]]
    _folder(tmp_path, SIXTEEN, {"a.json": [17], "b.json": [1]}, name="over")
    with pytest.raises(ValueError, match="a.json: value 17 at tick 0 exceeds the cluster size 16"):
        load_folder("over", tmp_path)


@needs_data
def test_the_real_4_node_folder_loads_with_4_nodes():
    loaded = load_collection("preemption-4node-aws-2023-08")
    assert loaded.nodes_per_file == 4
    assert {t.capacity_nodes for t in loaded.traces} == {4}
    assert max(int(t.available.max()) for t in loaded.traces) == 4
    # Its files carry no start time: paired at tick 0, and the loaded object says so.
    assert loaded.alignment == ALIGNED_AT_TICK_0


def _timed(starts: list[str]) -> str:
    return SIXTEEN.replace("nodes_per_file = 16", "nodes_per_file = 1").replace(
        'zone = "us-east-1a"', f'zone = "us-east-1a"\nstart_time = {starts[0]}').replace(
        'zone = "us-east-1b"', f'zone = "us-east-1b"\nstart_time = {starts[1]}')


def test_zones_are_aligned_by_their_real_start_time(tmp_path):
    # b starts 10 min (2 ticks of 300 s) after a: a's first two ticks have no b counterpart.
    a = [1, 1, 0, 0, 1, 0, 1]
    b = [0, 0, 1, 1, 0]
    _folder(tmp_path, _timed(["2023-08-03T00:00:00Z", "2023-08-03T00:10:00Z"]),
            {"a.json": a, "b.json": b})
    loaded = load_collection("mine", tmp_path)
    ta, tb = loaded.traces
    assert loaded.alignment == ta.alignment == ALIGNED_BY_START_TIME
    assert (ta.offset_ticks, tb.offset_ticks) == (2, 0)
    assert ta.available.tolist() == [0, 0, 1, 0, 1] and tb.available.tolist() == b
    assert ta.start_time_s == tb.start_time_s == pytest.approx(1691021400.0)
    # The same files without start times: paired at tick 0, as before, and labelled so.
    _folder(tmp_path, SIXTEEN.replace("16", "1"), {"a.json": a, "b.json": b}, name="untimed")
    untimed = load_collection("untimed", tmp_path)
    assert untimed.alignment == ALIGNED_AT_TICK_0
    assert untimed.traces[0].available.tolist() == a
    # The cost suite's market then pairs the same instants.
    market = scenarios.market_from_traces(list(loaded.traces), (1.0, 1.0), (3.0, 3.0))
    np.testing.assert_array_equal(market.spot_available, [[0, 0, 1, 0, 1], b])


def test_start_times_must_be_all_or_none_and_overlap(tmp_path):
    partial = _timed(["2023-08-03T00:00:00Z", "2023-08-03T00:10:00Z"]).replace(
        "start_time = 2023-08-03T00:10:00Z\n", "")
    _folder(tmp_path, partial, {"a.json": [1], "b.json": [1]})
    with pytest.raises(CollectionError, match="start_time for some files but not for b.json"):
        load_folder("mine", tmp_path)
    _folder(tmp_path, _timed(["2023-08-03T00:00:00Z", "2023-08-04T00:00:00Z"]),
            {"a.json": [1, 0], "b.json": [1]}, name="apart")
    with pytest.raises(ValueError, match="never record at the same time"):
        load_folder("apart", tmp_path)


# -- the cost suite on gang markets -----------------------------------------------------------------
@pytest.fixture
def spot_dir(tmp_path, monkeypatch):
    """The suite reads its folders from tmp_path."""
    monkeypatch.setattr(scenarios, "load_folder", lambda folder: load_folder(folder, tmp_path))
    return tmp_path


def test_the_suite_runs_a_recorded_16_node_market_as_recorded(spot_dir):
    # The old suite summed four shifted copies of this into a 64-node market, silently.
    _folder(spot_dir, SIXTEEN, {"a.json": [16, 12, 0, 16] * 300, "b.json": [3, 16, 16, 9] * 300},
            name="real-16node")
    (group,) = scenarios.zone_groups(replace(scenarios.MULTI_NODE, folders=("real-16node",)))
    assert group.label == "real-16node" and group.market.spot_available.max() == 16
    assert group.market.n_ticks == 1200


def test_the_suite_refuses_a_gang_market_of_the_wrong_size(spot_dir):
    _folder(spot_dir, SIXTEEN.replace("= 16", "= 8"), {"a.json": [8], "b.json": [8]}, name="n8")
    with pytest.raises(ValueError, match=r"4 copies .* n8 records 8-node markets \(4 x 8 = 32"):
        scenarios.zone_groups(replace(scenarios.MULTI_NODE, folders=("n8",)))
    with pytest.raises(ValueError, match="n8 records 8-node markets, .* 16-node gang"):
        scenarios.zone_groups(replace(scenarios.MULTI_NODE, folders=("n8",), copies=1))


@needs_data
def test_the_suites_synthetic_market_is_labelled_synthetic():
    groups = scenarios.zone_groups(scenarios.MULTI_NODE, max_zones=1)
    assert [g.label for g in groups] == [
        "synthetic: 4 x preemption-4node-aws-2023-08 shifted 1 d"]
    assert "SYNTHETIC" in scenarios.MULTI_NODE.title
    (scenario, *_) = scenarios.build_scenarios(
        scenarios.MULTI_NODE, scenarios.rules_for(replace(scenarios.MULTI_NODE, stragglers=False)), 1,
        kinds=("single_zone",), max_zones=1)
    assert scenario.folder.startswith("synthetic: ")
    assert scenario.source_folder == "preemption-4node-aws-2023-08"
