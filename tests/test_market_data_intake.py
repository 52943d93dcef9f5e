"""A user's own market data, brought in without friction (issue 30, item 5): a collection too
short for a setting is skipped with a reason that names it and the run goes on; the cost suite
takes --collections, --jobs and --gang-size; collection.toml can say "a node is up if at least K
of its VMs are" and accepts CPU types; zones of unequal length paired at tick 0 are warned about;
spot prices recorded in trace files are billed; the example for a missing collection.toml gives
each file its own zone, and two files in one zone are refused naming them; every key is on the
reference page (docs/market_data.md)."""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from benchmarks.cost.__main__ import choose_settings, main, parse_args
from cloud import collections, emulated, scenarios
from cloud.collections import CollectionError, how_to_write, read_collection
from cloud.scenario_protocol import LOCO, LTO
from cloud.traces import (
    TraceAlignmentWarning,
    TracePriceWarning,
    default_spot_dir,
    load_collection,
    load_folder,
)
from tests.shared_data import needs_spot_data

SHARED_DATA = default_spot_dir().parent
needs_shared = pytest.mark.skipif(not (SHARED_DATA / "cluster").is_dir(),
                                  reason=f"shared data (fault log, step times) not at {SHARED_DATA}")
DOC = Path(__file__).resolve().parent.parent / "docs" / "market_data.md"

PRICED = """provider = "aws"
value_meaning = "available_count"
nodes_per_file = {nodes}
on_demand_usd_per_hour = 3.06
spot_usd_per_hour = 0.9731
{extra}
[files."us-east-1a_v100_1.json"]
zone = "us-east-1a"
instance_type = "p3.2xlarge"

[files."us-east-1c_v100_1.json"]
zone = "us-east-1c"
instance_type = "p3.2xlarge"
"""
FILES = ("us-east-1a_v100_1.json", "us-east-1c_v100_1.json")


def _write(spot: Path, name: str, toml: str, data: dict[str, list], tick_s: int = 600,
           prices: dict[str, list] | None = None) -> Path:
    folder = spot / name
    folder.mkdir(parents=True, exist_ok=True)
    for file, values in data.items():
        body = {"metadata": {"gap_seconds": tick_s}, "data": values}
        if prices and file in prices:
            body["prices"] = prices[file]
        (folder / file).write_text(json.dumps(body))
    (folder / "collection.toml").write_text(toml)
    return folder


def _market(ticks: int, nodes: int = 1, seed: int = 0) -> dict[str, list]:
    rng = np.random.default_rng(seed)
    # Runs of up and down ticks, so windows hold both.
    return {f: np.repeat(rng.integers(0, nodes + 1, size=ticks // 6 + 1), 6)[:ticks].tolist()
            for f in FILES}


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    """TRAINWISE_DATA_DIR in tmp_path: the shared non-spot data linked in, our own collections
    under spot/ (52 h windows are 312 ticks of 600 s; leave-time-out needs 624)."""
    data = tmp_path / "data"
    (data / "spot").mkdir(parents=True)
    if SHARED_DATA.is_dir():
        for entry in SHARED_DATA.iterdir():
            if entry.name != "spot":
                (data / entry.name).symlink_to(entry)
    spot = data / "spot"
    _write(spot, "long-1node", PRICED.format(nodes=1, extra=""), _market(800))
    _write(spot, "short-1node", PRICED.format(nodes=1, extra=""), {
        FILES[0]: _market(770)[FILES[0]], FILES[1]: _market(200)[FILES[1]]})
    _write(spot, "four-vm", PRICED.format(nodes=4, extra=""), _market(800, nodes=4, seed=1))
    monkeypatch.setenv("TRAINWISE_DATA_DIR", str(data))
    return data


# -- 1. a collection too short for a setting is skipped, naming it ------------------------------
def test_a_collection_too_short_for_the_window_is_skipped_with_its_reason(data_dir):
    setting = replace(scenarios.SINGLE_NODE, folders=("long-1node", "short-1node"))
    rules = scenarios.rules_for(setting)
    skipped: list[scenarios.SkippedCell] = []
    with pytest.warns(TraceAlignmentWarning):  # short-1node's zones: 770 and 200 ticks
        built = scenarios.build_scenarios(setting, rules, 2, protocol=LOCO,
                                          skipped=skipped)
    assert built and {s.source_folder for s in built} == {"long-1node"}
    (cell,) = skipped
    assert (cell.setting, cell.protocol, cell.folder) == ("single_node", LOCO,
                                                         "short-1node")
    for part in ("short-1node", "us-east-1c_v100_1.json", "200 ticks", "'single_node'",
                 "312 ticks", "52 h"):
        assert part in cell.reason
    # Leave-time-out also needs the fitted first half: 800 ticks fit, 200 do not.
    skipped.clear()
    built = scenarios.build_scenarios(setting, rules, 2, protocol=LTO, skipped=skipped)
    assert {s.source_folder for s in built} == {"long-1node"}
    assert [c.folder for c in skipped] == ["short-1node"]
    assert "leave-time-out fit" in skipped[0].reason
    # Without a list to collect into, the skip is a warning, not an abort.
    with pytest.warns(scenarios.SkippedCellWarning, match="skipped short-1node .* 200 ticks"):
        assert scenarios.build_scenarios(setting, rules, 1, protocol=LOCO)


# -- 2. the cost suite's collection, job-shape and gang-size options ----------------------------
def test_gang_size_scores_every_collection_that_can_hold_the_gang():
    nodes = {"long-1node": 1, "four-vm": 4, "big": 16}
    (one,) = scenarios.settings_for(nodes, gang_size=1)
    assert one.name == "single_node" and one.node_count == 1
    assert set(one.folders) == {"long-1node", "four-vm", "big"}
    (two,) = scenarios.settings_for(nodes, gang_size=2)
    assert (two.name, two.node_count, two.folders, two.synthetic) == (
        "gang_2node", 2, ("big", "four-vm"), False)
    assert scenarios.too_small_for(nodes, 2) == {
        "long-1node": "long-1node records 1-node markets, fewer than the 2-node gang asked "
                      "for; a spot gang could never run there"}
    assert scenarios.settings_for(nodes, gang_size=32) == ()


def test_the_cost_options_choose_collections_jobs_and_gang_size(data_dir):
    settings, shorts, sweep, left_out = choose_settings(parse_args(
        ["--collections", "four-vm,long-1node", "--gang-size", "2"]))
    assert [(s.name, s.folders) for s in settings] == [("gang_2node", ("four-vm",))]
    assert [s.name for s in shorts] == ["gang_2node_short"] and sweep is None
    assert [c.folder for c in left_out] == ["long-1node"]
    settings, shorts, sweep, _ = choose_settings(parse_args(
        ["--jobs", "gang_4node_short,slack_sweep"]))
    assert settings == () and [s.folders for s in shorts] == [("four-vm",)]
    assert sweep == "long-1node"
    with pytest.raises(SystemExit, match="no collection 'nope' in .* long-1node, short-1node"):
        choose_settings(parse_args(["--collections", "nope"]))
    with pytest.raises(SystemExit, match="no job shape 'gang_9node'.* valid: single_node, "
                                         "gang_4node, gang_4node_short, slack_sweep"):
        choose_settings(parse_args(["--jobs", "gang_9node"]))


@needs_shared
def test_the_cost_run_scores_chosen_collections_and_skips_a_short_one(data_dir, tmp_path):
    out = tmp_path / "out"
    with pytest.warns(TraceAlignmentWarning):
        status = main(["--quick", "--out", str(out), "--no-progress", "--policies",
                       "on_demand,uniform_progress", "--collections",
                       "long-1node,short-1node,four-vm", "--gang-size", "1", "--jobs",
                       "single_node"])
    assert status == 0
    document = json.loads((out / "cost.json").read_text())
    cells = {(r["setting"], r["folder"], r["protocol"], r["kind"])
             for r in document["scenarios"]}
    # four-vm, a 4-node collection, scored as the single-node job; short-1node skipped.
    assert {c[1] for c in cells} == {"long-1node", "four-vm"}
    assert {c[0] for c in cells} == {"single_node"}
    assert len(cells) == 8  # 2 collections x 2 protocols x 2 kinds
    assert [(c["folder"], c["protocol"]) for c in document["skipped"]] == [
        ("short-1node", "leave_one_collection_out"), ("short-1node", "leave_time_out")]
    assert document["selection"]["gang_size"] == 1
    markdown = (out / "cost.md").read_text()
    assert "## Not scored" in markdown and "skipped short-1node" in markdown


# -- 3, 4. a node up if at least K of its VMs are; CPU instance types ------------------------------
def test_a_node_is_up_when_at_least_k_of_its_vms_are(tmp_path, monkeypatch):
    extra = "up_if_at_least = 1\n"
    _write(tmp_path, "vm4", PRICED.format(nodes=4, extra=extra),
           {FILES[0]: [0, 1, 2, 4, 3, 0], FILES[1]: [4, 4, 0, 0, 1, 2]})
    loaded = load_collection("vm4", tmp_path)
    assert [t.available.tolist() for t in loaded.traces] == [[0, 1, 1, 1, 1, 0],
                                                            [1, 1, 0, 0, 1, 1]]
    assert {t.capacity_nodes for t in loaded.traces} == {1}
    assert loaded.meta.market_nodes == 1  # scored with the single-node job
    monkeypatch.setattr(scenarios, "default_spot_dir", lambda: tmp_path)
    assert scenarios.collection_nodes("vm4") == 1
    # Counted as preempted VMs, per file, and at least 3 of 4.
    toml = PRICED.format(nodes=4, extra="").replace("available_count", "preempted_count").replace(
        'instance_type = "p3.2xlarge"\n\n', 'instance_type = "p3.2xlarge"\nup_if_at_least = 3\n\n')
    _write(tmp_path, "vm4p", toml, {FILES[0]: [0, 1, 2, 4], FILES[1]: [0, 1, 2, 4]})
    a, b = load_collection("vm4p", tmp_path).traces
    assert a.available.tolist() == [1, 1, 0, 0] and a.capacity_nodes == 1
    assert b.available.tolist() == [4, 3, 2, 0] and b.capacity_nodes == 4  # as recorded
    _write(tmp_path, "vm5", PRICED.format(nodes=4, extra="up_if_at_least = 5\n"),
           {FILES[0]: [1], FILES[1]: [1]})
    with pytest.raises(CollectionError, match="up_if_at_least = 5 is more than the 4 VMs"):
        read_collection(tmp_path / "vm5")


def test_a_cpu_instance_type_is_accepted(tmp_path):
    toml = PRICED.format(nodes=1, extra="").replace('"p3.2xlarge"', '"c5.24xlarge"').replace(
        'instance_type = "c5.24xlarge"\n', 'instance_type = "c5.24xlarge"\ngpus_per_node = 0\n')
    _write(tmp_path, "cpu", toml, {FILES[0]: [1, 0, 1], FILES[1]: [1, 1, 0]})
    traces = load_folder("cpu", tmp_path)
    assert {t.gpus_per_node for t in traces} == {0}
    job = scenarios.SINGLE_NODE.job(traces[0].gpus_per_node)
    assert job.work_gpu_h == scenarios.SINGLE_NODE.train_h  # node-hours for a CPU node
    _write(tmp_path, "neg", toml.replace("gpus_per_node = 0", "gpus_per_node = -1"),
           {FILES[0]: [1], FILES[1]: [1]})
    with pytest.raises(CollectionError, match="gpus_per_node = -1 must be an integer, 0 or more"):
        read_collection(tmp_path / "neg")


# -- 5. zones of unequal length paired at tick 0 ----------------------------------------------
def test_zones_of_unequal_length_paired_at_tick_0_are_warned_about(tmp_path):
    _write(tmp_path, "uneven", PRICED.format(nodes=1, extra=""),
           {FILES[0]: [1] * 10, FILES[1]: [1] * 7})
    with pytest.warns(TraceAlignmentWarning) as caught:
        load_collection("uneven", tmp_path)
    (warning,) = [w for w in caught if w.category is TraceAlignmentWarning]
    text = str(warning.message)
    for part in ("uneven", "paired at tick 0", "first 7 ticks", "us-east-1a", "10 ticks",
                 "us-east-1c", "7 ticks", "start_time"):
        assert part in text
    _write(tmp_path, "even", PRICED.format(nodes=1, extra=""), {f: [1] * 7 for f in FILES})
    with warnings.catch_warnings():
        warnings.simplefilter("error", TraceAlignmentWarning)
        load_collection("even", tmp_path)


# -- 6. spot prices recorded in the trace files are billed --------------------------------------
def test_spot_prices_recorded_in_the_trace_files_are_billed(tmp_path):
    unpriced = PRICED.format(nodes=1, extra="").replace("on_demand_usd_per_hour = 3.06\n", "")
    unpriced = unpriced.replace("spot_usd_per_hour = 0.9731\n", "")
    _write(tmp_path, "rec", unpriced, {f: [1, 0, 1, 1] for f in FILES},
           prices={FILES[0]: [0.5] * 4, FILES[1]: [0.4, 0.4, 0.6, 0.6]})
    with pytest.warns(TracePriceWarning, match=r"vary \(0.4 to 0.6 USD/h\).* mean, 0.5000"):
        a, b = load_folder("rec", tmp_path)
    assert (a.spot_usd_per_hour, b.spot_usd_per_hour) == (0.5, 0.5)
    assert a.spot_price_source.startswith("recorded in the trace file") and a.spot_price_stated
    # The cost suite bills them (not the paper's 0.9731 it uses for a looked-up p3.2xlarge price).
    assert scenarios.trace_prices(a) == (0.5, 3.06)
    # So does the emulated cloud's replay.
    replay = emulated.load_replay_market("rec", FILES[0], 0, 4, tmp_path)
    assert replay.spot_usd_per_hour == 0.5
    assert replay.spot_price_source.startswith("recorded in the trace file")
    # A price stated in collection.toml wins over the recorded ones.
    _write(tmp_path, "stated", PRICED.format(nodes=1, extra=""), {f: [1] for f in FILES},
           prices={f: [0.5] for f in FILES})
    assert {t.spot_usd_per_hour for t in load_folder("stated", tmp_path)} == {0.9731}
    # Prices that cannot be billed say so, loudly.
    _write(tmp_path, "bad", PRICED.format(nodes=1, extra=""), {f: [1] for f in FILES},
           prices={f: ["n/a"] for f in FILES})
    with pytest.warns(TracePriceWarning, match="NOT billed"):
        load_folder("bad", tmp_path)


# -- 8. the example for a missing collection.toml; two files in one zone --------------------------
@needs_spot_data  # the example's files name no price: it is the Spot Advisor feed's
def test_the_example_gives_each_file_its_own_zone_and_loads(tmp_path):
    folder = tmp_path / "bare"
    folder.mkdir()
    names = ["us-east-1a_v100_1.json", "us-east-1c_v100_1.json", "us-west-2b_v100_1.json",
             "rack7.json"]
    for name in names:
        (folder / name).write_text(json.dumps({"metadata": {"gap_seconds": 60}, "data": [1, 0]}))
    text = how_to_write(folder)
    zones = re.findall(r'zone = "([^"]+)"', text)
    assert zones == ["ZONE-OF-rack7", "us-east-1a", "us-east-1c", "us-west-2b"]
    # Filled in where the name says nothing, the example loads as it is: no zone stamped twice.
    (rack := folder / "rack7.json").unlink()
    example = "\n".join(line.strip() for line in how_to_write(folder).split(
        "for example:", 1)[1].splitlines() if line.startswith("    "))
    (folder / "collection.toml").write_text(example)
    loaded = load_collection("bare", tmp_path)
    assert [t.zone for t in loaded.traces] == ["us-east-1a", "us-east-1c", "us-west-2b"]
    assert not rack.exists()
    # Many files: the first tables and how many more.
    many = tmp_path / "many"
    many.mkdir()
    for i in range(collections.EXAMPLE_FILES + 3):
        (many / f"z{i:02d}.json").write_text("{}")
    assert f"each of the other 3 files (z{collections.EXAMPLE_FILES}.json" in how_to_write(many)


def test_two_files_in_one_zone_are_refused_naming_them(tmp_path):
    toml = PRICED.format(nodes=1, extra="").replace('zone = "us-east-1c"', 'zone = "us-east-1a"')
    _write(tmp_path, "dup", toml, {f: [1] for f in FILES})
    with pytest.raises(CollectionError, match=r"files us-east-1a_v100_1.json, "
                                              r"us-east-1c_v100_1.json all say zone = "
                                              r"'us-east-1a'.* must be distinct"):
        load_folder("dup", tmp_path)
    # The same zone for two instance types is two markets: fine.
    other = toml.replace('instance_type = "p3.2xlarge"\n', 'instance_type = "p2.xlarge"\n', 1)
    _write(tmp_path, "two-types", other, {f: [1] for f in FILES})
    assert len(load_folder("two-types", tmp_path)) == 2


# -- 7. every key is on the reference page ------------------------------------------------------
def test_every_key_of_collection_toml_is_documented():
    text = DOC.read_text()
    keys = set(collections._TOP_KEYS) | set(collections._FILE_KEYS)
    missing = [k for k in sorted(keys) if f"`{k}`" not in text]
    assert not missing, f"docs/market_data.md does not describe {missing}"
    assert "docs/market_data.md" in collections.__doc__
