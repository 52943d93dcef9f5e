# ruff: noqa: F811  (the imported pytest fixtures are used as test arguments)
"""The rules of a schedule (issue 28, item 1), without Dagster: what a schedule may say, how a run
request is put on it, who may approve, where a rollback may go, and what the trainer does with
a schedule at start and at a switch."""

from __future__ import annotations

import dataclasses
import json

import pytest

from controllers.checkpoint_interval import active_rule, set_rule
from controllers.fast_heuristic import HeuristicFastPolicy
from controllers.fast_types import NoOpFastPolicy
from tests.test_run_path_faults import built_state, request, run, state  # noqa: F401
from training._loop_config import TrainConfig
from training._loop_schedule import ScheduleInForce, switch
from trainwise import approvals, settings
from trainwise import schedule as schedule_lib
from trainwise.run_request import TrainRequest


def _folder():
    return settings.home_dir().joinpath(*schedule_lib.FOLDER)


def test_a_schedule_must_keep_the_notice_answer_and_name_registered_parts():
    base = schedule_lib.default_schedule()
    with pytest.raises(schedule_lib.ScheduleError, match="preemption"):
        schedule_lib.validate({**base, "fast_levers": ["batch_scaling"]})
    with pytest.raises(schedule_lib.ScheduleError, match="not registered"):
        schedule_lib.validate({**base, "checkpoint_interval_rule": "daly-ish"})
    with pytest.raises(schedule_lib.ScheduleError, match="allocation_policy"):
        schedule_lib.validate({**base, "allocation_policy": "cheapest"})
    with pytest.raises(schedule_lib.ScheduleError, match="pruning_rate_max"):
        schedule_lib.validate({**base, "pruning_rate": 0.95})
    with pytest.raises(schedule_lib.ScheduleError, match="unknown field"):
        schedule_lib.validate({**base, "gpu": "h100"})
    # Lever order does not change the version: one schedule, one hash.
    a = schedule_lib.validate({**base, "fast_levers": ["preemption", "batch_scaling"]})
    b = schedule_lib.validate({**base, "fast_levers": ["batch_scaling", "preemption"]})
    assert schedule_lib.version_of(a) == schedule_lib.version_of(b)


def test_an_older_published_file_is_completed_and_a_damaged_one_refused():
    folder = _folder()
    folder.mkdir(parents=True)
    (folder / "current.json").write_text(json.dumps(
        {"schedule": {"pruning_rate": 0.4, "allocation_policy": "uniform_progress",
                      "allocation_rule": ""}}))
    published = schedule_lib.published(settings.home_dir())
    assert published.schedule["pruning_rate"] == 0.4
    assert published.schedule["fast_policy"] == "heuristic"  # the default fills it in
    (folder / "current.json").write_text("{not json")
    with pytest.raises(schedule_lib.ScheduleError, match="current.json.*roll back"):
        schedule_lib.published(settings.home_dir())


def test_a_request_takes_the_schedule_and_departs_only_with_a_reason():
    published = schedule_lib.Published(
        schedule_lib.validate({**schedule_lib.default_schedule(), "fast_policy": "noop",
                               "fast_levers": ["preemption"],
                               "checkpoint_interval_rule": "fixed"}), "v1", "test")
    base = TrainRequest(partition="pystdlib", run_id="r", fast_policy="heuristic")
    on = schedule_lib.apply_to_request(base, published, asked={}, override_reason="")
    assert (on.fast_policy, on.fast_levers, on.checkpoint_interval_rule, on.schedule_version) == (
        "noop", ("preemption",), "fixed", "v1")
    with pytest.raises(schedule_lib.ScheduleError, match="schedule_override_reason"):
        schedule_lib.apply_to_request(base, published, asked={"fast_policy": "heuristic"},
                                      override_reason="")
    off = schedule_lib.apply_to_request(base, published, asked={"fast_policy": "heuristic"},
                                        override_reason="reference run for the lever guard")
    assert (off.fast_policy, off.schedule_version) == ("heuristic", "v1+override")
    same = schedule_lib.apply_to_request(base, published, asked={"fast_policy": "noop"},
                                         override_reason="")
    assert same.schedule_version == "v1", "asking for the schedule's own value is no departure"


def test_who_approves_comes_from_the_run_tag_the_allow_list_and_the_verified_rule(monkeypatch):
    assert approvals.approver_identity("", {"user": "ada@x.io"}) == (
        "ada@x.io", "dagster run tag 'user'")
    with pytest.raises(approvals.ApprovalError, match="not the user who launched"):
        approvals.approver_identity("grace", {"user": "ada@x.io"})
    who, source = approvals.approver_identity("grace", {})
    assert who == "grace" and "unverified" in source
    monkeypatch.setenv("TRAINWISE_APPROVERS", "ada@x.io, lin@x.io")
    with pytest.raises(approvals.ApprovalError, match="TRAINWISE_APPROVERS"):
        approvals.approver_identity("grace", {})
    assert approvals.approver_identity("", {"user": "lin@x.io"})[0] == "lin@x.io"
    monkeypatch.setenv("TRAINWISE_REQUIRE_VERIFIED_APPROVER", "1")
    with pytest.raises(approvals.ApprovalError, match="verified"):
        approvals.approver_identity("ada@x.io", {})


def _publish(to: dict, approver: str = "ada") -> str:
    folder = _folder()
    proposal = approvals.propose(folder, to, forecast_savings_usd=1.0, eval_loss_change=0.0,
                                 evidence={}, reason="t", requested_by="t")
    approvals.record_approval(folder, approver, proposal["hash"])
    report = approvals.audit_and_publish(folder, 0.0, 0.05, checked_by="test")
    assert report["passed"], report
    return report["version"]


def test_a_rollback_goes_only_to_a_version_that_was_in_force_and_needs_an_approval():
    folder = _folder()
    with pytest.raises(approvals.ApprovalError, match="nothing has been published"):
        approvals.rollback_target(folder, "previous")
    default_version = schedule_lib.version_of(schedule_lib.default_schedule())
    first = _publish({**schedule_lib.default_schedule(), "fast_policy": "noop"})
    second = _publish({**schedule_lib.default_schedule(), "budget_usd": 20.0})
    assert approvals.rollback_target(folder, "previous")["version"] == first
    assert approvals.rollback_target(folder, default_version)["version"] == default_version
    with pytest.raises(approvals.ApprovalError, match="in force"):
        approvals.rollback_target(folder, second)
    with pytest.raises(approvals.ApprovalError, match="no schedule that has been in force"):
        approvals.rollback_target(folder, "0123456789abcdef")
    target = approvals.rollback_target(folder, default_version)
    proposal = approvals.propose(folder, target["schedule"], forecast_savings_usd=-50.0,
                                 eval_loss_change=None, evidence={}, reason="undo",
                                 requested_by="t", rollback_of=default_version)
    blocked = approvals.audit_and_publish(folder, 0.0, 0.05, checked_by="test")
    assert not blocked["passed"] and "no approval" in blocked["status"]
    approvals.record_approval(folder, "ada", proposal["hash"])
    # Negative savings and no eval evidence would block a change; a rollback passes on approval.
    report = approvals.audit_and_publish(folder, 0.0, 0.05, checked_by="test")
    assert report["passed"] and report["version"] == default_version
    assert schedule_lib.published(settings.home_dir()).version == default_version


@pytest.fixture
def rule_restored():
    before = active_rule()
    yield
    set_rule(before)


def test_the_trainer_restricts_levers_at_start_and_switches_what_it_can(rule_restored):
    policy = HeuristicFastPolicy()
    config = TrainConfig(schedule_version="v1", fast_levers=("preemption",),
                         checkpoint_interval_rule="fixed")
    set_rule("fixed")  # what training.loop.train puts in force for the call
    now = ScheduleInForce.at_start(config, policy)
    assert [lever.name for lever in policy.levers] == ["preemption"]
    assert (now.version, now.fast_policy, now.rule) == ("v1", "heuristic", "fixed")
    policy2, after, action, reason = switch(now, policy, {
        "version": "v2", "fast_policy": "heuristic", "fast_levers": ["batch_scaling",
                                                                     "preemption"],
        "checkpoint_interval_rule": "trainwise"})
    assert policy2 is policy and [lever.name for lever in policy.levers] == [
        "batch_scaling", "preemption"]
    assert action["applied"] == {"checkpoint_interval_rule": "trainwise",
                                 "fast_levers": ["batch_scaling", "preemption"]}
    assert active_rule() == "trainwise" and after.history == ["v1"]
    # goodput needs a profile taken at start: deferred, and the record says why.
    policy3, later, action, reason = switch(after, policy2, {
        "version": "v3", "fast_policy": "goodput", "fast_levers": ["batch_scaling",
                                                                   "preemption"],
        "checkpoint_interval_rule": "trainwise"})
    assert policy3 is policy2 and later.fast_policy == "heuristic"
    assert "fast_policy" in action["deferred"] and "next start" in reason


class _RuleSeen(NoOpFastPolicy):
    """Keeps everything; notes the interval rule in force at each fast tick."""

    def __init__(self) -> None:
        self.rules: set[str] = set()

    def act(self, observation):
        self.rules.add(active_rule())
        return super().act(observation)


def test_a_run_trains_under_its_schedules_rule_and_the_process_gets_its_own_back(state):
    before = active_rule()
    assert before != "fixed"
    seen = _RuleSeen()
    run(state, dataclasses.replace(request(max_steps=6), checkpoint_interval_rule="fixed"),
        fast_policy=seen)
    assert seen.rules == {"fixed"}, "the trainer chose intervals under another rule"
    assert active_rule() == before, "the run's rule leaked into the process after it"


def test_the_launchpad_takes_the_schedule_unless_it_departs_with_a_reason():
    published = schedule_lib.Published(
        schedule_lib.validate({**schedule_lib.default_schedule(), "fast_policy": "noop"}),
        "v1", "test")
    jobs = {"partition": "pystdlib", "run_id": "r"}
    on = schedule_lib.request_from_launchpad({"fast_policy": "schedule"}, published, **jobs)
    assert (on.fast_policy, on.schedule_version) == ("noop", "v1")
    with pytest.raises(schedule_lib.ScheduleError, match="fast_policy='heuristic'"):
        schedule_lib.request_from_launchpad({"fast_policy": "heuristic"}, published, **jobs)
    with pytest.raises(schedule_lib.ScheduleError, match="allocation_policy='on_demand'"):
        schedule_lib.request_from_launchpad(
            {"fast_policy": "schedule", "allocation_policy": "on_demand"}, published, **jobs)
    kept = schedule_lib.request_from_launchpad(
        {"fast_policy": "heuristic", "schedule_override_reason": "guard reference"}, published,
        **jobs)
    assert (kept.fast_policy, kept.schedule_version) == ("heuristic", "v1+override")
