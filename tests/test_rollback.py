"""curriculum_rollback makes a stored curriculum version current again, through the same gate,
and records from, to, who and why."""

import dagster as dg
import pytest

from pipelines.definitions import defs
from training import curriculum as curriculum_lib
from trainwise import settings

PARTITION = "pystdlib"
DATA_ASSETS = [dg.AssetKey(k) for k in ("data_shards", "difficulty_scores", "curriculum")]


@pytest.fixture
def instance():
    with dg.instance_for_test() as test_instance:
        yield test_instance


def _folder():
    return settings.home_dir() / "curricula" / PARTITION


def _build(instance, rate):
    """Data assets only (no training): the curriculum at `rate`, through its gate."""
    result = defs.resolve_job_def("demo").execute_in_process(
        partition_key=PARTITION, instance=instance, asset_selection=DATA_ASSETS,
        run_config={"ops": {"curriculum": {"config": {"pruning_rate": rate}}}})
    assert result.success
    return curriculum_lib.current_version(_folder())


def _rollback(instance, **config):
    return defs.resolve_job_def("curriculum_rollback").execute_in_process(
        partition_key=PARTITION, instance=instance, raise_on_error=False,
        run_config={"ops": {"curriculum": {"config": config}}})


@pytest.fixture
def two_versions(instance):
    old = _build(instance, 0.0)
    new = _build(instance, 0.4)
    assert old != new and curriculum_lib.current_version(_folder()) == new
    return old, new


def test_rollback_restores_a_version_through_the_gate_and_records_it(instance, two_versions):
    old, new = two_versions
    result = _rollback(instance, restore_version=old, reason="eval loss regressed at 0.4",
                       requested_by="bob")
    assert result.success
    [check] = result.get_asset_check_evaluations()
    assert check.passed and check.partition == PARTITION
    meta = result.asset_materializations_for_node("curriculum")[0].metadata
    assert meta["status"].value == "candidate (rollback)" and meta["version"].value == old
    assert curriculum_lib.current_version(_folder()) == old
    assert curriculum_lib.load_curriculum(_folder()).pruning_rate == 0.0
    record = curriculum_lib.read_history(_folder())[-1]
    assert record["event"] == "rollback"
    assert (record["from"], record["to"]) == (new, old)
    assert record["requested_by"] == "bob" and record["why"] == "eval loss regressed at 0.4"
    assert "curriculum_coverage" in record["approved_by"]


def test_rollback_that_fails_the_gate_keeps_the_current_version(instance, two_versions,
                                                                monkeypatch):
    old, new = two_versions
    real = curriculum_lib.coverage_report
    monkeypatch.setattr(curriculum_lib, "coverage_report", lambda examples, built: {
        **real(examples, built), "passed": False, "failures": ["injected"], "reason": "injected"})
    result = _rollback(instance, restore_version=old, reason="try", requested_by="bob")
    assert not result.success
    assert curriculum_lib.current_version(_folder()) == new
    assert curriculum_lib.read_history(_folder())[-1]["event"] == "rejected"


def test_rollback_to_an_unknown_version_names_the_stored_ones(instance, two_versions):
    old, new = two_versions
    result = _rollback(instance, restore_version="0123456789ab", reason="x", requested_by="bob")
    assert not result.success
    message = result.failure_data_for_node("curriculum").error.cause.message
    assert "0123456789ab" in message and old in message and new in message
    assert curriculum_lib.current_version(_folder()) == new


def test_rollback_needs_a_reason(instance, two_versions):
    old, new = two_versions
    result = _rollback(instance, restore_version=old, requested_by="bob")
    assert not result.success
    assert "reason" in result.failure_data_for_node("curriculum").error.cause.message
    assert curriculum_lib.current_version(_folder()) == new
