"""Spot trace loading: the meaning pinned per folder, the tick from the file, bad input refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cloud.traces import (
    FOLDER_MEANING,
    TraceMeaning,
    default_spot_dir,
    load_folder,
    load_trace,
    region_of_zone,
    scaled_availability,
)

SPOT_DIR = default_spot_dir()
needs_data = pytest.mark.skipif(not SPOT_DIR.is_dir(), reason=f"shared spot data not at {SPOT_DIR}")


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
    "folder, files, tick_s, ticks, capacity",
    [
        ("availability-1node-aws-2023-02", 9, 195, {20158}, 1),
        ("availability-1node-aws-2022-10", 8, 600, {3895}, 1),
        ("preemption-1node-aws-2023-04", 4, 32, {19961}, 1),
        ("preemption-4node-aws-2023-08", 3, 300, {3664, 5131}, 4),
    ],
)
def test_folders_load_with_their_own_tick(folder, files, tick_s, ticks, capacity):
    traces = load_folder(folder)
    assert len(traces) == files
    assert {t.tick_s for t in traces} == {tick_s}
    assert {t.n_ticks for t in traces} == ticks
    assert {t.capacity_nodes for t in traces} == {capacity}
    for trace in traces:
        assert trace.available.min() >= 0 and trace.available.max() <= capacity


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
def test_recorded_spot_price_is_kept_when_the_file_has_one():
    trace = load_trace(
        SPOT_DIR / "preemption-1node-aws-2023-04" / "us-west-2b_v100_1.json", TraceMeaning.AVAILABLE
    )
    assert trace.recorded_spot_price_usd_per_hour == pytest.approx(0.918)
    assert (
        trace.zone == "us-west-2b" and trace.region == "us-west-2" and trace.node_shape == "v100_1"
    )


def _write(tmp_path: Path, name: str, document: object, folder: str = "preemption-1node-x") -> Path:
    path = tmp_path / folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document))
    return path


def test_preempted_meaning_inverts_against_the_cluster_size(tmp_path):
    path = _write(
        tmp_path,
        "us-east-1a_v100_1.json",
        {"metadata": {"gap_seconds": 60}, "data": [0, 2, 4, 1]},
        folder="preemption-4node-test",
    )
    assert load_trace(path, TraceMeaning.PREEMPTED).available.tolist() == [4, 2, 0, 3]
    assert load_trace(path, TraceMeaning.AVAILABLE).available.tolist() == [0, 2, 4, 1]
    one = _write(
        tmp_path, "us-east-1a_v100_1.json", {"metadata": {"gap_seconds": 60}, "data": [1, 0]}
    )
    assert load_trace(one, TraceMeaning.PREEMPTED).available.tolist() == [0, 1]


@pytest.mark.parametrize(
    "document, message",
    [
        ({"metadata": {"gap_seconds": 60}, "data": [1, -1, 0]}, "negative value -1 at tick 1"),
        ({"metadata": {}, "data": [1, 0]}, "no metadata.gap_seconds"),
        ({"data": [1, 0]}, "no metadata.gap_seconds"),
        ({"metadata": {"gap_seconds": 0}, "data": [1]}, "must be a positive integer"),
        ({"metadata": {"gap_seconds": 60}, "data": []}, "has no data"),
        ({"metadata": {"gap_seconds": 60}}, "has no data"),
        ({"metadata": {"gap_seconds": 60}, "data": [0, 2]}, "exceeds the cluster size 1"),
        ({"metadata": {"gap_seconds": 60}, "data": [0.5, 1]}, "must be integers"),
    ],
)
def test_bad_traces_are_refused_with_the_reason(tmp_path, document, message):
    path = _write(tmp_path, "us-east-1a_v100_1.json", document)
    with pytest.raises(ValueError, match=message):
        load_trace(path, TraceMeaning.AVAILABLE)


def test_bad_names_and_meanings_are_refused(tmp_path):
    good = {"metadata": {"gap_seconds": 60}, "data": [1]}
    with pytest.raises(ValueError, match="is not '<zone>_<gpu>_<n>.json'"):
        load_trace(_write(tmp_path, "trace.json", good), TraceMeaning.AVAILABLE)
    with pytest.raises(TypeError, match="meaning must be a TraceMeaning"):
        load_trace(_write(tmp_path, "us-east-1a_v100_1.json", good), "available")
    with pytest.raises(ValueError, match="has no pinned meaning; pass meaning="):
        load_folder("some-other-folder", spot_dir=tmp_path)
    with pytest.raises(ValueError, match="does not say its cluster size"):
        load_trace(
            _write(tmp_path, "us-east-1a_v100_1.json", good, folder="mystery"),
            TraceMeaning.AVAILABLE,
        )


def test_window_longer_than_the_trace_is_refused(tmp_path):
    path = _write(
        tmp_path, "us-east-1a_v100_1.json", {"metadata": {"gap_seconds": 60}, "data": [1, 0, 1, 1]}
    )
    trace = load_trace(path, TraceMeaning.AVAILABLE)
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


def test_region_of_zone():
    assert region_of_zone("us-west-2a") == "us-west-2"
    with pytest.raises(ValueError, match="not an AWS zone name"):
        region_of_zone("us-west-2")
