# ruff: noqa: F811  (the imported pytest fixtures are used as test arguments)
"""A published schedule is what runs (issue 28, item 1).

The UI flow, end to end on a live run: a training run trains on the published schedule; a
schedule change (fast policy heuristic -> noop, interval rule trainwise -> fixed) is proposed,
approved by the user the Dagster run's tag names, and published by the gate; the slow-policy
sensor's next tick asks for a recorded `apply_run_decision` run that hands the new schedule to
the live run, whose decisions from that fast tick on are the new schedule's and carry its
version. The next run of the `train` job starts on it, a departure without a reason is refused,
and a rollback through the same gate brings the earlier version back.
"""

from __future__ import annotations

import json
import shutil
import threading
import time

import dagster as dg
import pytest

from pipelines.definitions import defs
from sensors.slow_policy import slow_policy_sensor
from telemetry.reader import read_run_events
from tests.test_approvals import _small_forecast  # noqa: F401 - autouse: a small forecast
from tests.test_run_path_faults import PARTITION, built_state, request, run  # noqa: F401
from training import scoring, shards
from training.loop import request_stop
from trainwise import approvals, explain, settings
from trainwise import schedule as schedule_lib

RUN_ID = "run-a"


@pytest.fixture
def home(built_state):
    """The deployment's state folder with pystdlib's shards, curriculum and difficulty scores."""
    target = settings.home_dir()
    shutil.copytree(built_state, target, dirs_exist_ok=True)
    examples = shards.load_shards(target / "shards" / PARTITION)
    scoring.write_scores(scoring.difficulty_scores(examples), target / "scores" / PARTITION)
    return target


@pytest.fixture
def instance():
    with dg.instance_for_test() as test_instance:
        yield test_instance


def _propose(instance, **config):
    result = defs.resolve_job_def("schedule_propose").execute_in_process(
        instance=instance, raise_on_error=False,
        run_config={"ops": {"schedule_change": {"config": config}}})
    [materialization] = result.asset_materializations_for_node("schedule_change")
    return materialization.metadata["hash"].value


def _approve(instance, content_hash, user="ada@example.com"):
    """Approves as the logged-in user: the run's `user` tag (Dagster+ sets it from the login)."""
    result = defs.resolve_job_def("schedule_approve").execute_in_process(
        instance=instance, raise_on_error=False, tags={approvals.USER_TAG: user},
        run_config={"ops": {"approvals": {"config": {"content_hash": content_hash,
                                                     "comment": "reviewed"}}}})
    [evaluation] = result.get_asset_check_evaluations()
    return evaluation


def _decisions(home):
    folder = home / "runs" / RUN_ID / "telemetry" / RUN_ID
    if not folder.is_dir():
        return []  # the run has not started writing yet
    return [e for e in read_run_events(folder) if e["type"] == "decision"]


def _wait_for(predicate, what, timeout_s=180.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _sensor_tick(instance):
    context = dg.build_sensor_context(instance=instance, definitions=defs)
    return slow_policy_sensor.evaluate_tick(context)


def test_an_approved_change_reaches_the_live_run_and_the_next_one_and_rolls_back(
        home, instance, monkeypatch):
    start = schedule_lib.published(home)
    assert start.origin.startswith("default") and start.schedule["fast_policy"] == "heuristic"
    # A run on the published schedule, as the train job starts it (no departure asked for).
    live_request = schedule_lib.apply_to_request(
        request(max_steps=100_000, fast_policy="heuristic", fast_every_steps=2,
                eval_every_steps=1000, checkpoint_every_steps=0),
        start, asked={}, override_reason="")
    assert live_request.schedule_version == start.version
    outcome: list = []

    def train():
        try:
            outcome.append(run(home, live_request))
        except Exception as error:  # noqa: BLE001 - the stop below ends it as preempted
            outcome.append(error)

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    try:
        _wait_for(lambda: any(d["layer"] == "fast" for d in _decisions(home)),
                  "the live run's first fast decision")

        # Propose, approve as the tagged user, and the gate publishes.
        proposal = _propose(instance, fast_policy="noop", checkpoint_interval_rule="fixed",
                            reason="measure the fixed schedule", requested_by="ada")
        evaluation = _approve(instance, proposal)
        assert evaluation.passed, evaluation.metadata
        new = schedule_lib.published(home)
        assert new.version != start.version and new.schedule["fast_policy"] == "noop"
        [record] = approvals.approvals(home / "governance" / "schedule")
        assert record["approver"] == "ada@example.com"
        assert record["identity_source"] == "dagster run tag 'user'"

        # The sensor's next tick hands it to the live run through a recorded run.
        tick = _sensor_tick(instance)
        [handover] = [r for r in tick.run_requests if r.job_name == "apply_run_decision"]
        decision = json.loads(handover.run_config["ops"]["hand_decision_to_run"]["config"][
            "decision_json"])
        assert decision["schedule"]["version"] == new.version
        applied = defs.resolve_job_def("apply_run_decision").execute_in_process(
            instance=instance, run_config=handover.run_config, tags=handover.tags)
        assert applied.success

        switched = _wait_for(lambda: [d for d in _decisions(home) if d["layer"] == "slow"
                                      and d["action"].get("schedule_version") == new.version],
                             "the live run's schedule switch")[0]
        _wait_for(lambda: [d for d in _decisions(home) if d["layer"] == "fast"
                           and d["step"] > switched["step"] + 4],
                  "fast decisions after the switch")
    finally:
        try:
            request_stop("test over")
        except RuntimeError:
            pass  # the run already ended; the assertions below say how
        trainer.join(timeout=120)
    assert not trainer.is_alive()

    assert switched["action"]["applied"] == {"fast_policy": "noop",
                                             "checkpoint_interval_rule": "fixed"}
    decisions = _decisions(home)
    assert {d["schedule_version"] for d in decisions} == {start.version, new.version}
    before = [d for d in decisions if d["layer"] == "fast" and d["step"] < switched["step"]]
    after = [d for d in decisions if d["layer"] == "fast" and d["step"] > switched["step"]]
    assert before and after
    assert {(d["policy"], d["schedule_version"]) for d in before} == {
        ("heuristic_fast", start.version)}
    assert {(d["policy"], d["schedule_version"]) for d in after} == {("noop", new.version)}
    handed = [json.loads(line) for line in
              (home / "runs" / RUN_ID / "slow_decisions.jsonl").read_text().splitlines()]
    assert handed[-1]["schedule"]["version"] == new.version
    assert handed[-1]["applied_by"].startswith("dagster run")
    assert new.version in explain.timeline(RUN_ID, home / "runs")

    # The next run starts on the new schedule; a departure needs a recorded reason.
    refused = defs.resolve_job_def("train").execute_in_process(
        partition_key=PARTITION, instance=instance, raise_on_error=False,
        run_config={"ops": {"checkpoint": {"config": {"max_steps": 2,
                                                      "fast_policy": "heuristic"}}}})
    assert not refused.success
    failure = refused.get_step_failure_events()[0].step_failure_data.error.message
    assert "schedule_override_reason" in failure and new.version in failure
    train = defs.resolve_job_def("train").execute_in_process(
        partition_key=PARTITION, instance=instance,
        run_config={"ops": {"checkpoint": {"config": {"max_steps": 2}}}})
    assert train.success
    assert train.dagster_run.tags["trainwise/schedule_version"] == new.version
    next_request = json.loads((home / "runs" / train.run_id / "request.json").read_text())
    assert (next_request["schedule_version"], next_request["fast_policy"],
            next_request["checkpoint_interval_rule"]) == (new.version, "noop", "fixed")

    # Rollback through the same gate: blocked until approved, and not held to the savings
    # threshold a change must meet (the version met it when first published).
    monkeypatch.setenv("TRAINWISE_MIN_FORECAST_SAVINGS_USD", "1000000")
    rollback = _propose(instance, rollback_to="previous", reason="noop costs too much")
    assert schedule_lib.published(home).version == new.version, "nothing live before approval"
    evaluation = _approve(instance, rollback, user="grace@example.com")
    assert evaluation.passed, evaluation.metadata
    assert schedule_lib.published(home).version == start.version
    events = [r["event"] for r in approvals.history(home / "governance" / "schedule")]
    assert events == ["proposed", "approved", "published", "proposed", "approved", "published"]
