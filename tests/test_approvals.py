"""Schedule changes go live only with an approval of their current content hash (issue 13,
item 2): the gate blocks an unapproved proposal, an approval publishes it, a stale approval
approves nothing, and the thresholds (savings, eval-loss regression) hold."""

import dagster as dg
import pytest

from pipelines.definitions import defs
from trainwise import approvals, settings


@pytest.fixture(autouse=True)
def _small_forecast(monkeypatch, tmp_path):
    # The embedded market and a short job keep each proposal's Monte Carlo under a second.
    monkeypatch.setenv("TRAINWISE_DATA_DIR", str(tmp_path / "no-shared-data"))
    monkeypatch.setenv("TRAINWISE_FORECAST_WORK_GPU_H", "2")
    monkeypatch.setenv("TRAINWISE_FORECAST_DEADLINE_H", "4")
    monkeypatch.setenv("TRAINWISE_FORECAST_SAMPLES", "4")
    monkeypatch.setenv("TRAINWISE_MIN_FORECAST_SAVINGS_USD", "-1000")


@pytest.fixture
def instance():
    with dg.instance_for_test() as test_instance:
        yield test_instance


def _folder():
    return settings.home_dir() / "governance" / "schedule"


def _propose(instance, **config):
    return defs.resolve_job_def("schedule_propose").execute_in_process(
        instance=instance, raise_on_error=False,
        run_config={"ops": {"schedule_change": {"config": config}}})


def _approve(instance, content_hash, approver="ada"):
    return defs.resolve_job_def("schedule_approve").execute_in_process(
        instance=instance, raise_on_error=False,
        run_config={"ops": {"approvals": {"config": {
            "approver": approver, "content_hash": content_hash, "comment": "looks fine"}}}})


def _check(result):
    [evaluation] = result.get_asset_check_evaluations()
    return evaluation


def test_unapproved_proposal_is_blocked_then_an_approval_publishes_it(instance):
    before = approvals.current_schedule(_folder())
    proposed = _propose(instance, allocation_policy="skypilot_failover", reason="cheaper")
    assert not proposed.success
    gate = _check(proposed)
    assert not gate.passed and "no approval" in gate.description
    meta = proposed.asset_materializations_for_node("schedule_change")[0].metadata
    content_hash = meta["hash"].value
    assert meta["eval_loss_change"].value == 0.0  # allocation only: same data trained on
    assert "forecast" in meta["evidence"].value
    assert approvals.current_schedule(_folder()) == before  # nothing went live

    approved = _approve(instance, content_hash)
    assert approved.success
    assert _check(approved).passed
    now = approvals.current_schedule(_folder())
    assert now == {**before, "allocation_policy": "skypilot_failover"}
    published = approvals.history(_folder())[-1]
    assert published["event"] == "published" and published["hash"] == content_hash
    assert published["approval"]["approver"] == "ada" and published["approval"]["time"] > 0
    assert approvals.read_candidate(_folder()) is None


def test_stale_approval_cannot_approve_a_changed_proposal(instance, monkeypatch):
    monkeypatch.setenv("TRAINWISE_MIN_FORECAST_SAVINGS_USD", "1000000")  # blocks A after approval
    first = _propose(instance, allocation_policy="greedy_spot")
    hash_a = first.asset_materializations_for_node("schedule_change")[0].metadata["hash"].value
    approved_a = _approve(instance, hash_a)
    assert not approved_a.success and not _check(approved_a).passed  # approved, savings too low

    monkeypatch.setenv("TRAINWISE_MIN_FORECAST_SAVINGS_USD", "-1000")
    second = _propose(instance, allocation_policy="on_demand")
    hash_b = second.asset_materializations_for_node("schedule_change")[0].metadata["hash"].value
    assert hash_b != hash_a
    gate = _check(second)
    assert not gate.passed and "stale" in gate.description and hash_a in gate.description
    # Approving the old hash again is refused outright, and nothing went live.
    again = _approve(instance, hash_a)
    assert not again.success
    assert not again.asset_materializations_for_node("approvals")
    assert approvals.current_schedule(_folder())["allocation_policy"] == settings.get(
        "TRAINWISE_ALLOCATION_POLICY")
    assert _approve(instance, hash_b).success


def test_eval_loss_regression_blocks_even_an_approved_change(instance, monkeypatch):
    current = settings.pruning_rate()
    runs = [{"partition": "p", "pruning_rate": current, "eval_loss": 2.0},
            {"partition": "p", "pruning_rate": 0.6, "eval_loss": 2.3},
            {"partition": "q", "pruning_rate": 0.6, "eval_loss": 9.0}]  # q: no pair, ignored
    monkeypatch.setattr(approvals, "mlflow_runs", lambda *a, **k: (runs, "3 MLflow runs"))
    proposed = _propose(instance, pruning_rate=0.6)
    meta = proposed.asset_materializations_for_node("schedule_change")[0].metadata
    assert meta["eval_loss_change"].value == pytest.approx(0.3)
    approved = _approve(instance, meta["hash"].value)
    assert not approved.success
    assert "TRAINWISE_MAX_EVAL_LOSS_REGRESSION" in _check(approved).description
    assert approvals.current_schedule(_folder())["pruning_rate"] == current

    monkeypatch.setenv("TRAINWISE_MAX_EVAL_LOSS_REGRESSION", "0.5")
    rechecked = _approve(instance, meta["hash"].value, approver="grace")
    assert rechecked.success
    assert approvals.current_schedule(_folder())["pruning_rate"] == 0.6


def test_rate_change_without_evidence_is_blocked(tmp_path):
    folder = tmp_path / "gov"
    proposal = approvals.propose(folder, {**approvals.default_schedule(), "pruning_rate": 0.5},
                                 forecast_savings_usd=3.0, eval_loss_change=None, evidence={},
                                 reason="", requested_by="t")
    approvals.record_approval(folder, "ada", proposal["hash"])
    report = approvals.audit_and_publish(folder, 0.0, 0.05, checked_by="test")
    assert not report["passed"] and "no eval-loss evidence" in report["status"]


def test_hash_binds_content_and_approval_input_is_checked(tmp_path):
    base = approvals.default_schedule()
    one = approvals.content_hash({"to": {**base, "pruning_rate": 0.4}})
    assert one == approvals.content_hash({"to": {**base, "pruning_rate": 0.4}})
    assert one != approvals.content_hash({"to": {**base, "pruning_rate": 0.41}})
    folder = tmp_path / "gov"
    with pytest.raises(approvals.ApprovalError, match="no schedule_change proposal"):
        approvals.record_approval(folder, "ada", one)
    proposal = approvals.propose(folder, {**base, "allocation_rule": "x"},
                                 forecast_savings_usd=1.0, eval_loss_change=0.0, evidence={},
                                 reason="", requested_by="t")
    with pytest.raises(approvals.ApprovalError, match="approver is empty"):
        approvals.record_approval(folder, " ", proposal["hash"])


def test_allocation_policy_is_a_choice_checked_by_the_schema(instance):
    with pytest.raises(dg.DagsterInvalidConfigError, match="fancy"):
        _propose(instance, allocation_policy="fancy")


def test_a_proposal_that_changes_nothing_is_refused(instance):
    result = _propose(instance, pruning_rate=settings.pruning_rate())
    assert not result.success
    assert "changes nothing" in str(result.all_events)
