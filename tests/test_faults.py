"""The fault-injection suite (benchmarks/faults): real trainer processes killed with SIGKILL (at a
random step, inside a checkpoint write), sent SIGTERM, fed hostile files, and four ingestions at
once. A few fast cases run by default; the full suite (>= 20 kills, >= 10 SIGTERMs, full disk)
is `slow` (make test-all).
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.faults import environment, harness, hostile, trials

# Smaller than the benchmark's run: each trial is two trainer processes (~5 s each, mostly imports).
TEST_SHAPE = harness.RunShape(max_steps=24, checkpoint_every_steps=4, eval_every_steps=8)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return trials.Suite.prepare(tmp_path_factory.mktemp("faults"), TEST_SHAPE)


def _assert_recovered(record):
    """Nothing lost, nothing corrupt, nothing run twice as new training."""
    assert record["hit"], f"the fault point was never reached: {record}"
    assert record["corrupt_checkpoints"] == []
    assert not record["resume_failed"], record.get("resume_error")
    assert record["params_identical"] and record["eval_loss_identical"]
    assert record["step_losses_differing"] == 0
    assert record.get("telemetry_error") is None
    assert record["rows_lost"] == 0 and record["rows_duplicated"] == 0, record
    assert record.get("temp_files_after_resume", 0) == 0  # killed writers' temp files cleaned


def test_kill9_at_a_random_step_resumes_to_the_reference(suite):
    record = trials.run_trial(suite, trials.KILL_RANDOM, 0, np.random.default_rng(1))
    _assert_recovered(record)
    assert record["lost_steps"] == record["last_recorded_step"] - record["resume_step"]
    if record["lost_steps"]:
        assert record["replay_rows"] >= record["lost_steps"]  # replays labelled, not duplicates


def test_kill9_inside_a_checkpoint_write_leaves_no_corrupt_checkpoint(suite):
    record = trials.run_trial(suite, trials.KILL_CHECKPOINT, 0, np.random.default_rng(2))
    _assert_recovered(record)


def test_sigterm_is_answered_with_a_durable_checkpoint_and_loses_nothing(suite):
    record = trials.run_trial(suite, trials.SIGTERM_RANDOM, 0, np.random.default_rng(1))
    _assert_recovered(record)
    assert record["answered"] and record["first_status"] == "preempted"
    assert record["lost_steps"] == 0
    assert 0.0 <= record["notice_to_durable_s"] < 10.0


def test_crafted_checkpoints_never_run_code(suite):
    donor = harness.Run(suite.work_dir / "reference", suite.shards_dir,
                        {**suite.base_config, "run_id": "reference"})
    cases = hostile.checkpoint_cases(suite.work_dir, donor, suite)
    assert hostile.executed(cases) == 0, cases
    direct = [c for c in cases if c["case"].endswith(("direct_load", "latest_good"))]
    assert direct and all(c["outcome"] == "refused" for c in direct), direct
    planted = next(c for c in cases if c["case"] == "checkpoint_planted_newest_then_resume")
    assert planted["outcome"] == "refused" and planted["fell_back_and_completed"], planted


def test_hostile_telemetry_and_traces_never_run_code_and_name_the_file(suite):
    cases = hostile.telemetry_cases(suite.work_dir) + hostile.trace_cases(suite.work_dir)
    assert hostile.executed(cases) == 0
    telemetry = [c for c in cases if c["case"].startswith("telemetry_")]
    assert all(c["outcome"] == "refused" and c["names_file"] for c in telemetry), [
        c for c in telemetry if not (c["outcome"] == "refused" and c["names_file"])]
    assert all(c["outcome"] == "refused" for c in cases if c["case"].startswith("trace_"))


def test_four_concurrent_ingestions_store_every_line_once(suite):
    result = environment.concurrent_ingestion(suite)
    assert result["failed_ingests"] == 0, result
    assert result["rows_lost"] == 0 and result["rows_duplicated"] == 0


@pytest.mark.slow
def test_full_suite_figures(tmp_path):
    from benchmarks.faults.suite import run_suite

    payload = run_suite(tmp_path, quick=False, seed=0, say=lambda _: None)
    figures = payload["figures"]
    assert figures["kill9_trials"] >= 20 and figures["sigterm_trials"] >= 10
    assert figures["code_executed_from_files"] == 0
    assert figures["corrupt_checkpoints"] == 0
    assert figures["failed_resumes"] == 0 and figures["resumes_not_bit_identical"] == 0
    assert figures["rows_lost"] == 0 and figures["rows_duplicated"] == 0
    assert figures["notices_unanswered"] == 0
    assert figures["concurrent_ingest_failures"] == 0
    assert figures["temp_files_left_after_resume"] == 0
    adversarial = figures["adversarial"]  # issue 31's classes: every generated case as expected
    assert adversarial["cases"] > 0 and adversarial["failed"] == 0, [
        r for r in payload["adversarial"] if not r["passed"]]
    assert figures["lost_steps_per_kill9"]["max"] <= figures["lost_work_bound_steps"]
    for case in payload["full_disk"]:
        assert "skipped" in case or (not case["resume_failed"] and case["telemetry_readable"]
                                     and case["corrupt_checkpoints"] == [])
