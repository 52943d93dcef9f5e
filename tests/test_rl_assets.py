"""slow_policy / fast_policy assets: one region partition each with a tiny budget, the blocking
gate, and the two schedules fanning out per region."""

import datetime
import json

import dagster as dg
import pytest

from assets.policies import (
    POLICY_DEFS,
    REGIONS,
    daily_fast_policy_retraining,
    fast_policy,
    fast_policy_gate,
    slow_policy,
    slow_policy_gate,
    weekly_slow_policy_retraining,
)
from rl.retrain import load_champion_slow, policy_dir
from tests.shared_data import needs_spot_data

pytestmark = needs_spot_data

TINY = {"config": {"budget": "tiny", "ppo_timesteps": 0}}


def _run(asset, check, region, config=TINY):
    return dg.materialize([asset, check], partition_key=region, raise_on_error=False,
                          run_config={"ops": {asset.key.path[-1]: config}})


def test_one_partition_of_each_policy_materializes_and_the_gate_keeps_the_clone_out():
    """The clone (no PPO) acts as the heuristic: not cheaper by the margin, so the gate refuses
    it and the heuristic stays in charge; the check fails (blocking, ERROR)."""
    region = "us-west-2"
    for asset, check in ((slow_policy, slow_policy_gate), (fast_policy, fast_policy_gate)):
        result = _run(asset, check, region)
        mats = result.asset_materializations_for_node(asset.key.path[-1])
        assert mats and mats[0].partition == region
        assert mats[0].metadata["bc_agreement"].value == 1.0
        evals = result.get_asset_check_evaluations()
        assert len(evals) == 1 and not evals[0].passed
        assert "refused" in evals[0].description
    kind_dir = policy_dir("slow", region)
    gate = json.loads((kind_dir / "gate_v1.json").read_text())
    assert gate["promote"] is False and gate["incumbent"] == "trainwise_heuristic"
    assert (kind_dir / "v1.npz").exists() and load_champion_slow(region) is None


def test_schedules_request_one_run_per_region():
    assert len(REGIONS) >= 2
    for schedule, cron in ((weekly_slow_policy_retraining, "0 3 * * 1"),
                           (daily_fast_policy_retraining, "0 4 * * *")):
        assert schedule.cron_schedule == cron
        context = dg.build_schedule_context(scheduled_execution_time=datetime.datetime(2026, 12, 7, 3))
        requests = list(schedule(context))
        assert sorted(r.partition_key for r in requests) == sorted(REGIONS)


def test_policy_defs_load_as_definitions():
    defs = dg.Definitions(assets=POLICY_DEFS["assets"], asset_checks=POLICY_DEFS["asset_checks"],
                          schedules=POLICY_DEFS["schedules"], jobs=POLICY_DEFS["jobs"])
    # Each retraining job materialises its own policy asset only.
    for layer in ("slow", "fast"):
        job = defs.resolve_job_def(f"{layer}_policy_retraining")
        assert set(job.asset_layer.selected_asset_keys) == {dg.AssetKey(f"{layer}_policy")}
    assert {s.name for s in defs.schedules} == {"weekly_slow_policy_retraining",
                                                "daily_fast_policy_retraining"}


def test_unknown_region_is_refused():
    with pytest.raises(Exception, match="region"):
        from rl.cells import make_split
        make_split(region="mars-1")


def test_the_fixed_partition_regions_are_the_training_collections_regions():
    """The partition keys are a constant (the code location must load without the data); they
    must still be exactly the regions the training collection covers."""
    from rl.cells import PARTITION_REGIONS, regions

    assert PARTITION_REGIONS == regions()
