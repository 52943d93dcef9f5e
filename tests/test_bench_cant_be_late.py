"""The Can't Be Late scenario against the published reference, on a handful of its windows."""

from __future__ import annotations

import pytest

from benchmarks.cant_be_late import run as R
from benchmarks.cant_be_late import scenario as S
from cloud.traces import default_spot_dir

PEERS = S.peers_dir()
pytestmark = pytest.mark.skipif(
    not (PEERS / "policies-per-window.csv.gz").exists()
    or not (default_spot_dir() / "availability-1node-aws-2023-02").is_dir(),
    reason=f"the Can't Be Late reference ({PEERS}) or its traces are missing: this test needs "
    "../shared/data (TRAINWISE_DATA_DIR)",
)


def test_the_scenario_is_the_published_setting():
    rules = S.rules()
    assert (S.JOB.work_gpu_h, S.JOB.deadline_s, S.JOB.node_count) == (48.0, 52 * 3600.0, 1)
    assert rules.changeover_s == 360.0 and rules.checkpoint_save_s == 0.0
    assert rules.bill_finishing_tick_whole and not S.rules(False).bill_finishing_tick_whole
    ref = S.load_reference()
    for folder in S.COLLECTIONS.values():
        assert len(ref.offsets(folder)) == 1000
        markets = S.markets(folder)
        zone = next(k for k in markets if k != "*")
        assert markets[zone].spot_usd_per_hour == (0.9731,)
        assert markets[zone].on_demand_usd_per_hour == (3.06,)
        assert S.deadline_ticks(markets[zone]) * markets[zone].tick_s == 52 * 3600


def test_policies_and_oracle_match_the_reference_window_by_window():
    """Every 500th reference window of one zone per collection: the published on-demand,
    greedy and Uniform Progress costs to the reference's rounding, and the exact optimum."""
    result = R.run(stride=500, zones_limit=1)
    assert len(result["single"]) == 4 and len(result["multi"]) == 2
    for row in result["single"]:
        for name in R.POLICIES:
            assert row[name] == pytest.approx(row[f"{name}_published"], abs=1e-3), (name, row)
        assert row["oracle"] == pytest.approx(row["oracle_exact"], abs=1e-3), row
    for row in result["multi"]:
        assert row["oracle"] == pytest.approx(row["oracle_exact"], abs=1e-3), row
    summary = {(r["collection"], r["what"]): r for r in R.summarize(result)}
    assert all(r["share_within"] == 1.0 for r in summary.values())
