"""Retraining on rolling data (issue 30, items 1 and 2): the slow policy trains on the newest
weeks of the region's market data and is gated on what lies outside them; the fast policy's
notices come at the region's measured reclaim hazards. New data gives a new, recorded policy;
the same data and seed the same one; two regions with different data get different fast
policies, with the reason in the header.

Most tests build small collections (10-minute ticks, a few days) in a private
TRAINWISE_DATA_DIR, so they decide which data is newer; the fault log and the straggler traces
(non-spot shared data) are linked in. Budgets are `rl.retrain.TINY`: seconds per training.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from cloud.traces import default_spot_dir
from rl.fast_env import FastEnv
from rl.policy_file import load_policy
from rl.registry import train_data_tags
from rl.retrain import TINY, retrain_fast, retrain_slow
from rl.slow_obs import SLOW_OBS_LAYOUT
from rl.training_data import region_fast_stats, rolling_split, training_window
from tests.shared_data import needs_spot_data

SHARED_DATA = default_spot_dir().parent
needs_shared = pytest.mark.skipif(
    not (SHARED_DATA / "cluster").is_dir(),
    reason=f"shared data (fault log, step times) not at {SHARED_DATA} (set TRAINWISE_DATA_DIR)")

TICK_S = 600
DAY_TICKS = 86400 // TICK_S
EAST = ("us-east-1a", "us-east-1c")
WEST = ("us-west-2a", "us-west-2b")
# Small windows of new data: 4 days trained on (room for 52 h windows), 3 held out.
BUDGET = replace(TINY, train_days=4.0, held_out_days=3.0)


def _runs(ticks: int, seed: int, mean_up: float, mean_down: float) -> list[int]:
    """Alternating up (1) and down (0) runs of geometric lengths: a spot zone whose reclaim
    hazard is about one per `mean_up` ticks of spot-up time."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    up = True
    while len(out) < ticks:
        out += [int(up)] * int(rng.geometric(1.0 / (mean_up if up else mean_down)))
        up = not up
    return out[:ticks]


def _collection(spot: Path, name: str, zones_data: dict[str, list[int]],
                dated: str | None = None, start_time: str | None = None) -> None:
    folder = spot / name
    folder.mkdir(parents=True, exist_ok=True)
    lines = ['provider = "aws"', 'value_meaning = "available_count"', "nodes_per_file = 1",
             "on_demand_usd_per_hour = 3.06", "spot_usd_per_hour = 0.9731"]
    if dated:
        lines.append(f"recorded_from_date = {dated}")
    for zone, values in zones_data.items():
        (folder / f"{zone}_v100_1.json").write_text(
            json.dumps({"metadata": {"gap_seconds": TICK_S}, "data": values}))
        lines += ["", f'[files."{zone}_v100_1.json"]', f'zone = "{zone}"',
                  'instance_type = "p3.2xlarge"']
        if start_time:
            lines.append(f"start_time = {start_time}")
    (folder / "collection.toml").write_text("\n".join(lines) + "\n")


def _zones(zones: tuple[str, ...], days: float, seed: int, mean_up: float = 40.0,
           mean_down: float = 8.0) -> dict[str, list[int]]:
    return {z: _runs(int(days * DAY_TICKS), seed + i, mean_up, mean_down)
            for i, z in enumerate(zones)}


@pytest.fixture
def spot(tmp_path, monkeypatch) -> Path:
    """An empty spot folder in a private data dir, the shared non-spot data linked in."""
    data = tmp_path / "data"
    (data / "spot").mkdir(parents=True)
    for entry in SHARED_DATA.iterdir() if SHARED_DATA.is_dir() else ():
        if entry.name != "spot":
            (data / entry.name).symlink_to(entry)
    monkeypatch.setenv("TRAINWISE_DATA_DIR", str(data))
    return data / "spot"


def _weights(out: dict) -> str:
    return out["header"]["weights_sha256"]


def _span(cell, split) -> tuple[float, float]:
    market = next(m for m in split.window.markets if m.collection == cell.source_folder
                  and m.instance_type == cell.instance_type)
    start = market.start_s + cell.start_tick * market.tick_s
    return start, start + cell.market.n_ticks * market.tick_s


# -- (a) new data: a different policy, a different recorded window ------------------------------
@needs_shared
def test_new_data_moves_the_window_and_changes_the_policy(spot):
    _collection(spot, "east-2024-01", _zones(EAST, 10, seed=1), dated="2024-01-01")
    first = retrain_slow("us-east-1", BUDGET)
    # The trace grows by four days (same collection, same first ten days).
    longer = {z: v + _runs(4 * DAY_TICKS, 50 + i, 40, 8)
              for i, (z, v) in enumerate(_zones(EAST, 10, seed=1).items())}
    _collection(spot, "east-2024-01", longer, dated="2024-01-01")
    grown = retrain_slow("us-east-1", BUDGET)
    # A newer collection arrives.
    _collection(spot, "east-2024-02", _zones(EAST, 9, seed=7), dated="2024-02-01")
    newer = retrain_slow("us-east-1", BUDGET)

    outs = (first, grown, newer)
    assert len({_weights(o) for o in outs}) == 3
    assert len({o["header"]["train_window"] for o in outs}) == 3
    data = [o["header"]["train_data"] for o in outs]
    assert len({d["data_sha256"] for d in data}) == 3
    assert [d["end_utc"] for d in data] == ["2024-01-08T00:00Z", "2024-01-12T00:00Z",
                                            "2024-02-07T00:00Z"]
    assert [c["collection"] for c in data[2]["collections"]] == ["east-2024-02"]
    assert data[2]["collections"][0]["home_zones"] == list(EAST)
    # The record is in the file the loader reads, not only in the return value.
    loaded = load_policy(newer["path"], "slow", SLOW_OBS_LAYOUT, "us-east-1")
    assert loaded.train_data["data_sha256"] == data[2]["data_sha256"]
    assert "east-2024-02" in loaded.train_window and data[2]["data_sha256"][:16] in \
        loaded.train_window
    gate = json.loads(Path(newer["gate_path"]).read_text())
    assert gate["train_data_sha256"] == data[2]["data_sha256"]
    # ... and what the registry version and the asset's metadata carry.
    tags = train_data_tags(newer["header"]["train_data"])
    assert tags["train_data_sha256"] == data[2]["data_sha256"]
    assert tags["train_collections"] == "east-2024-02 us-east-1a,us-east-1c"
    assert (tags["train_start_utc"], tags["train_end_utc"]) == ("2024-02-03T00:00Z",
                                                                "2024-02-07T00:00Z")


# -- (b) the same data and seed: the same policy -------------------------------------------------
@needs_shared
def test_same_data_and_seed_give_identical_weights_and_another_seed_does_not(spot):
    _collection(spot, "east-2024-01", _zones(EAST, 10, seed=1), dated="2024-01-01")
    a = retrain_slow("us-east-1", BUDGET)
    b = retrain_slow("us-east-1", BUDGET)
    assert (a["version"], b["version"]) == (1, 2)
    assert _weights(a) == _weights(b)
    assert a["header"]["train_data"] == b["header"]["train_data"]
    c = retrain_slow("us-east-1", replace(BUDGET, seed=1))
    assert _weights(c) != _weights(a)
    assert c["header"]["train_data"]["seed"] == a["header"]["train_data"]["seed"] + 1


# -- (c) two regions, two data sets: two fast policies, and why ----------------------------------
@needs_shared
def test_regions_with_different_data_get_different_fast_statistics_and_policies(spot):
    # One collection: the east zones are reclaimed about every 5 up-ticks, the west ones about
    # every 200.
    data = {**_zones(EAST, 8, seed=3, mean_up=5, mean_down=3),
            **_zones(WEST, 8, seed=5, mean_up=200, mean_down=3)}
    _collection(spot, "mixed-2024-03", data, dated="2024-03-01")
    east, west = region_fast_stats("us-east-1", 7), region_fast_stats("us-west-2", 7)
    assert min(east.hazards_per_h) > 5 * max(west.hazards_per_h)
    assert {t["zone"] for t in east.per_trace} == set(EAST)
    assert {t["zone"] for t in west.per_trace} == set(WEST)
    assert east.data_sha256 != west.data_sha256

    out = {region: retrain_fast(region, replace(BUDGET, train_days=7.0))
           for region in ("us-east-1", "us-west-2")}
    assert _weights(out["us-east-1"]) != _weights(out["us-west-2"])
    for region, stats in (("us-east-1", east), ("us-west-2", west)):
        recorded = out[region]["header"]["train_data"]
        assert recorded["region_stats"]["reclaims_per_spot_up_h"] == [
            round(h, 6) for h in stats.hazards_per_h]
        assert "reclaim hazard" in recorded["why_regions_differ"]
        assert f"pooled {stats.pooled_per_h:.4f}/h" in out[region]["header"]["train_window"]
    # Same data and seed: the same fast policy again.
    again = retrain_fast("us-west-2", replace(BUDGET, train_days=7.0))
    assert _weights(again) == _weights(out["us-west-2"])


@needs_shared
def test_the_fast_env_draws_its_notices_at_the_hazards_it_is_given():
    def notices(hazards: tuple[float, ...]) -> int:
        env = FastEnv(episode_ticks=200, hazards_per_h=hazards)
        env.reset(seed=0)
        count = 0
        for _ in range(200):
            before = env.notice_left
            env.step(np.zeros(3, np.int64))
            count += before is None and env.notice_left is not None
        return count

    assert notices((0.0,)) == 0
    assert notices((20.0,)) > 5
    with pytest.raises(ValueError, match="hazards_per_h"):
        FastEnv(hazards_per_h=(float("nan"),))


@needs_spot_data
def test_the_real_regions_differ_in_their_measured_reclaim_hazards():
    stats = {r: region_fast_stats(r, 7) for r in ("us-east-1", "us-west-2")}
    assert stats["us-east-1"].hazards_per_h != stats["us-west-2"].hazards_per_h
    assert stats["us-east-1"].data_sha256 != stats["us-west-2"].data_sha256
    for region, s in stats.items():
        assert s.per_trace and all(t["zone"].startswith(region) for t in s.per_trace)


# -- (d) held out never overlaps the training window ---------------------------------------------
def _assert_disjoint(split) -> None:
    assert split.train and split.held_out
    for cell in split.train:
        assert split.window.holds(*_span(cell, split)), cell.start_tick
    for cell in split.held_out:
        assert not split.window.overlaps(*_span(cell, split)), (cell.source_folder,
                                                                cell.start_tick)
    # The tail after the window comes first (TINY's gate scores the first two cells).
    assert _span(split.held_out[0], split)[0] >= split.window.end_s


@needs_shared
def test_held_out_cells_never_overlap_the_training_window(spot):
    _collection(spot, "east-2024-01", _zones(EAST, 10, seed=1), dated="2024-01-01")
    _collection(spot, "east-2024-02", _zones(EAST, 7, seed=2), dated="2024-01-12")
    split = rolling_split("us-east-1", 8.0, 3.0, windows_per_zone=6)
    _assert_disjoint(split)
    # Eight recorded days back from 3 days before the end (01-16): four of the newer
    # collection, then, across the day without data, four of the older one.
    assert {c["collection"] for c in split.train_data["collections"]} == {
        "east-2024-01", "east-2024-02"}
    assert (split.train_data["start_utc"], split.train_data["end_utc"]) == (
        "2024-01-07T00:00Z", "2024-01-16T00:00Z")
    assert split.window.recorded_days == pytest.approx(8.0)


@needs_spot_data
def test_held_out_cells_never_overlap_the_training_window_on_the_real_data():
    for region in ("us-east-2", "us-west-2"):
        _assert_disjoint(rolling_split(region, 14.0, 3.0, windows_per_zone=6))


# -- how time order is established ---------------------------------------------------------------
@needs_shared
def test_time_order_comes_from_start_time_then_recorded_from_date_never_names(spot):
    # Named to sort first but older by its start_time (which wins over its recorded_from_date).
    _collection(spot, "a-old", _zones(EAST, 10, seed=1), dated="2025-06-01",
                start_time="2023-01-01T00:00:00Z")
    _collection(spot, "b-new", _zones(EAST, 10, seed=2), dated="2024-01-01")
    _collection(spot, "c-undated", _zones(EAST, 10, seed=3))
    split = rolling_split("us-east-1", 4.0, 3.0, windows_per_zone=4)
    assert {c["collection"] for c in split.train_data["collections"]} == {"b-new"}
    placed = {m.collection: m.placed_by for m in split.window.markets}
    assert placed == {"a-old": "start_time", "b-new": "recorded_from_date",
                      "c-undated": "undated"}
    held = {c.source_folder for c in split.held_out}
    assert {"a-old", "c-undated", "b-new"} <= held
    assert not any(c.source_folder == "c-undated" for c in split.train)


def test_without_data_retraining_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINWISE_DATA_DIR", str(tmp_path / "absent"))
    with pytest.raises(FileNotFoundError, match="TRAINWISE_DATA_DIR"):
        training_window("us-east-1", 14.0)


@needs_shared
def test_an_unknown_region_names_the_regions_there(spot):
    _collection(spot, "east-2024-01", _zones(EAST, 10, seed=1), dated="2024-01-01")
    with pytest.raises(ValueError, match="us-east-1"):
        rolling_split("mars-1", 4.0, 3.0)


def test_a_header_whose_train_data_is_not_an_object_is_refused(tmp_path):
    from rl.policy_file import PolicyFileError, PolicyWeights, save_policy
    from rl.slow_obs import CHECKPOINT_CHOICES_S, SLOW_CHOICES

    n, logits = len(SLOW_OBS_LAYOUT), len(SLOW_CHOICES) + len(CHECKPOINT_CHOICES_S)
    weights = PolicyWeights([(np.zeros((4, n), np.float32), np.zeros(4, np.float32))],
                            (np.zeros((logits, 4), np.float32), np.zeros(logits, np.float32)),
                            (len(SLOW_CHOICES), len(CHECKPOINT_CHOICES_S)), SLOW_OBS_LAYOUT,
                            "slow", "us-east-1", "w", 1, train_data={"data_sha256": "ab"})
    save_policy(weights, tmp_path / "ok.npz")
    assert load_policy(tmp_path / "ok.npz", "slow", SLOW_OBS_LAYOUT).train_data == {
        "data_sha256": "ab"}
    weights.train_data = ["not", "an", "object"]  # type: ignore[assignment]
    save_policy(weights, tmp_path / "bad.npz")
    with pytest.raises(PolicyFileError, match="train_data is not an object"):
        load_policy(tmp_path / "bad.npz", "slow", SLOW_OBS_LAYOUT)


def test_the_assets_tiny_budget_trains_on_the_scheduled_window_and_train_days_overrides_it():
    from assets.policies import PolicyTrainConfig, _budget
    from rl.retrain import DAILY_FAST, WEEKLY_SLOW

    tiny = PolicyTrainConfig(budget="tiny")
    assert _budget(tiny, WEEKLY_SLOW).train_days == WEEKLY_SLOW.train_days == 14.0
    assert _budget(tiny, DAILY_FAST).train_days == DAILY_FAST.train_days == 7.0
    assert _budget(tiny, DAILY_FAST).ppo_timesteps == TINY.ppo_timesteps
    assert _budget(PolicyTrainConfig(train_days=21.0), WEEKLY_SLOW).train_days == 21.0
