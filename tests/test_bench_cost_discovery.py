"""The cost suite scores every collection in the spot data folder: a 1-node collection a user adds
joins the single-node cells, an N-node one runs as an N-node gang as recorded (with its short
job), and on the shared data the discovered settings are exactly the suite's own."""

from __future__ import annotations

import json
import shutil

import pytest

from benchmarks.cost import main
from cloud import scenarios
from tests.shared_data import needs_spot_data

OURS = {"availability-1node-aws-2023-02": 1, "availability-1node-aws-2022-10": 1,
        "preemption-1node-aws-2023-04": 1, "preemption-4node-aws-2023-08": 4}


def test_the_shared_collections_give_the_suites_own_settings():
    assert scenarios.settings_for(OURS) == scenarios.SETTINGS
    assert scenarios.short_settings(scenarios.settings_for(OURS)) == scenarios.SHORT_SETTINGS


def test_an_added_collection_is_scored_by_its_node_count():
    settings = {s.name: s for s in scenarios.settings_for({**OURS, "gcp-a100-1node": 1,
                                                       "aws-16node": 16})}
    assert settings["single_node"].folders[-1] == "gcp-a100-1node"
    assert settings["single_node"].folders[:3] == scenarios.SINGLE_NODE_FOLDERS
    gang = settings["gang_16node"]
    assert (gang.node_count, gang.folders, gang.copies, gang.synthetic) == (
        16, ("aws-16node",), 1, False)
    assert gang.train_h == scenarios.GANG_4NODE.train_h and gang.deadline_h == 52.0
    short = {s.name: s for s in scenarios.short_settings(settings.values())}
    assert set(short) == {"gang_4node_short", "gang_16node_short"}
    assert (short["gang_16node_short"].train_h, short["gang_16node_short"].deadline_h) == (
        4.0, 5.2)
    # The synthetic 16-node market stays where its 4-node source is, and only there.
    assert "multi_node" in settings
    assert "multi_node" not in {s.name for s in scenarios.settings_for({"aws-16node": 16})}
    assert not scenarios.settings_for({})


@needs_spot_data
@pytest.mark.slow
def test_the_quick_suite_scores_a_collection_added_to_the_data_folder(tmp_path, monkeypatch):
    shared = scenarios.default_spot_dir().parent
    data = tmp_path / "data"
    (data / "spot").mkdir(parents=True)
    for entry in shared.iterdir():
        if entry.name != "spot":
            (data / entry.name).symlink_to(entry)
    for entry in (shared / "spot").iterdir():  # the collections, the price feeds
        (data / "spot" / entry.name).symlink_to(entry)
    # Another cloud's 1-node market: two real traces, their metadata rewritten as GCP zones.
    source = shared / "spot" / "preemption-1node-aws-2023-04"
    added = data / "spot" / "gcp-test-1node"
    added.mkdir()
    for name in ("us-east-1c_v100_1.json", "us-west-2b_v100_1.json"):
        shutil.copy(source / name, added / name)
    (added / "collection.toml").write_text(
        'provider = "gcp"\nvalue_meaning = "available_count"\nnodes_per_file = 1\n'
        'on_demand_usd_per_hour = 3.67\nspot_usd_per_hour = 1.10\n\n'
        '[files."us-east-1c_v100_1.json"]\nzone = "us-central1-a"\n'
        'instance_type = "a2-highgpu-1g"\ngpus_per_node = 1\n\n'
        '[files."us-west-2b_v100_1.json"]\nzone = "us-central1-b"\n'
        'instance_type = "a2-highgpu-1g"\ngpus_per_node = 1\n')
    monkeypatch.setenv("TRAINWISE_DATA_DIR", str(data))
    out = tmp_path / "out"
    out.mkdir()
    assert main(["--quick", "--out", str(out), "--no-progress", "--policies",
                 "on_demand,uniform_progress,trainwise_heuristic"]) == 0
    document = json.loads((out / "cost.json").read_text())
    cells = {(r["protocol"], r["kind"]) for r in document["headline"]
             if r["collection"] == "gcp-test-1node"}
    assert cells == {(p, k) for p in ("leave_one_collection_out", "leave_time_out")
                     for k in ("single_zone", "multi_zone")}
    assert document["oracle_violations"] == []
