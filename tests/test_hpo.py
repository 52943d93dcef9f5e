# ruff: noqa: F811  (the imported pytest fixtures are used as test arguments)
"""Cost-aware hyperparameter search (issue 28, item 5), through the `hpo_search` job.

A small real search on pystdlib: three trials of two rungs (4 and 8 steps) of real runs at the
emulated provider. The first two trials are given (`first_trials`): a learning rate of 1e-2 and
one of 1e-5, which at 4 steps is far behind, so ASHA must prune it after its first rung. Then:
each rung is a run folder with the provider's bill, MLflow holds each run's bill and eval loss
under the study's tag, a pruned trial trained fewer steps, the front is non-dominated, and the
chosen schedule knobs are a proposal the `schedule_approved` gate blocks until its hash is
approved, then publishes.
"""

from __future__ import annotations

import json
import math

import pytest

from pipelines.definitions import defs
from tests.test_approvals import _small_forecast  # noqa: F401 - autouse: a small forecast
from tests.test_run_path_faults import PARTITION, built_state  # noqa: F401
from tests.test_schedule_in_force import _approve, home, instance  # noqa: F401
from training import curriculum as curriculum_lib
from trainwise import approvals, gang, hpo, hpo_report, runs, settings
from trainwise import schedule as schedule_lib

STUDY = "tiny"
TRAIN = {"micro_batch_size": 4, "eval_batches": 2, "eval_batch_size": 16, "fast_every_steps": 2,
         "checkpoint_every_steps": 0}


def _search(instance, **config):
    return defs.resolve_job_def("hpo_search").execute_in_process(
        partition_key=PARTITION, instance=instance, raise_on_error=False,
        run_config={"ops": {"hpo_study": {"config": config}}})


def _failure(result) -> str:
    return result.get_step_failure_events()[0].step_failure_data.error.message


def _mlflow_runs(study: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=settings.mlflow_uri())
    experiment = client.get_experiment_by_name("trainwise-hpo")
    return client.search_runs([experiment.experiment_id],
                              f"tags.`{hpo_report.STUDY_TAG}` = '{study}'", max_results=100)


def test_a_small_search_trains_prunes_fronts_and_proposes_through_the_gate(home, instance,
                                                                            monkeypatch):
    # The size of the eval-loss change on 8-step runs is not what this test is about: the gate's
    # eval-loss threshold is tested in test_approvals; here it must not decide the outcome.
    monkeypatch.setenv("TRAINWISE_MAX_EVAL_LOSS_REGRESSION", "10")
    curriculum_before = curriculum_lib.current_version(home / "curricula" / PARTITION)
    start = schedule_lib.published(home)
    assert start.schedule["fast_policy"] == "heuristic"
    result = _search(
        instance, n_trials=3, min_steps=4, reduction_factor=2, rungs=2, seed=0,
        learning_rate_min=1e-5, learning_rate_max=3e-2, pruning_rates=[0.0, 0.3],
        fast_policies=["noop"], checkpoint_interval_rules=[], study_name=STUDY,
        first_trials=json.dumps([{"learning_rate": 1e-2, "pruning_rate": 0.0},
                                 {"learning_rate": 1e-5, "pruning_rate": 0.0}]),
        train=TRAIN)
    assert result.success, _failure(result)
    [materialization] = result.asset_materializations_for_node("hpo_study")
    study = hpo.read_result(home, STUDY)
    trials = study["trials"]
    assert len(trials) == 3 == materialization.metadata["trials"].value

    # Every rung is a real run folder with the provider's bill, on spot (the schedule allows it).
    records = [r for t in trials for r in t["runs"]] + [study["reference"]]
    for record in records:
        run_dir = home / "hpo" / STUDY / "state" / "runs" / record["run_id"]
        bill = gang.read_gang(run_dir)["cost_usd"]
        assert bill > 0 and math.isclose(record["bill_usd"], bill, rel_tol=1e-9)
        outcome = runs.read_outcome(run_dir)
        assert outcome["status"] == "completed" and outcome["steps"] == record["steps"]
        request = json.loads((run_dir / "request.json").read_text())
        assert request["max_steps"] == record["steps"] and request["market"] == "spot"
        assert math.isclose(outcome["final_eval_loss"], record["eval_loss"], rel_tol=1e-9)
    assert not (home / "runs").exists(), "trials train in the study's state, not the sensor's"
    assert curriculum_lib.current_version(home / "curricula" / PARTITION) == curriculum_before

    # The slow learning rate is pruned after its first rung: fewer steps, no second run.
    first, slow, _third = trials
    assert first["state"] == "COMPLETE" and first["steps"] == 8 and len(first["runs"]) == 2
    assert slow["pruned"] and slow["stopped_by"] == "pruner"
    assert slow["steps"] == 4 and [r["steps"] for r in slow["runs"]] == [4]
    assert not (home / "hpo" / STUDY / "state" / "runs" / f"hpo-{STUDY}-t001-s8").exists()
    assert slow["eval_loss"] > first["runs"][0]["eval_loss"]
    for trial in trials:
        assert trial["steps"] == (4 if trial["pruned"] else 8)
        assert trial["params"]["fast_policy"] == "noop"

    # MLflow: each run's bill and eval loss, grouped under the study's run.
    logged = {run.info.run_id: run for run in _mlflow_runs(STUDY)}
    from mlflow.tracking import MlflowClient

    # Trials are not models a user trained: none becomes a registered model version.
    assert MlflowClient(tracking_uri=settings.mlflow_uri()).search_model_versions() == []
    parent = study["mlflow_parent_run_id"]
    assert parent in logged and logged[parent].data.tags[hpo_report.ROLE_TAG] == "study"
    for record in records:
        [run_id] = record["mlflow_run_ids"]
        run = logged[run_id]
        assert run.data.tags["mlflow.parentRunId"] == parent
        assert math.isclose(run.data.metrics["hpo/bill_usd"], record["bill_usd"], rel_tol=1e-9)
        assert math.isclose(run.data.metrics["hpo/eval_loss"], record["eval_loss"],
                            rel_tol=1e-9)
        assert math.isclose(run.data.metrics["final/eval_loss"], record["eval_loss"],
                            rel_tol=1e-9)
    assert len(logged) == len(records) + 1

    # The front: no member dominated, every other completed trial dominated by a member.
    complete = [t for t in trials if t["state"] == "COMPLETE"]
    front = [t for t in complete if t["number"] in study["front"]]
    assert front and study["chosen"]["number"] in study["front"]
    for a in front:
        assert not any(hpo_report.dominates(b, a) for b in complete)
    for other in complete:
        if other["number"] not in study["front"]:
            assert any(hpo_report.dominates(a, other) for a in front)
    assert open(study["plot"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"

    # The proposal: the chosen schedule knobs, with the eval-loss change against the reference
    # (the chosen hyperparameters on the schedule in force); blocked until approved.
    folder = home / "governance" / "schedule"
    candidate = approvals.read_candidate(folder)
    assert candidate["hash"] == materialization.metadata["hash"].value
    assert candidate["to"]["fast_policy"] == "noop"
    assert candidate["to"]["pruning_rate"] == study["chosen"]["params"]["pruning_rate"]
    reference = study["reference"]
    assert reference["params"]["fast_policy"] == "heuristic"
    assert reference["params"]["learning_rate"] == study["chosen"]["params"]["learning_rate"]
    assert candidate["eval_loss_change"] == round(study["chosen"]["eval_loss"]
                                                  - reference["eval_loss"], 4)
    blocked = approvals.gate_report(folder, settings.min_forecast_savings_usd(),
                                    settings.max_eval_loss_regression())
    assert not blocked["passed"]
    assert blocked["failures"] == [f"no approval of {candidate['hash']}; approve it by "
                                   "materializing approvals with content_hash set to it"]
    assert schedule_lib.published(home).version == start.version
    evaluation = _approve(instance, candidate["hash"])
    assert evaluation.passed, evaluation.metadata
    now = schedule_lib.published(home)
    assert now.schedule["fast_policy"] == "noop"
    assert now.version == schedule_lib.version_of(candidate["to"])


def test_a_trial_budget_of_zero_is_refused_before_anything_is_trained(home, instance):
    result = _search(instance, n_trials=0, study_name="zero", train=TRAIN)
    assert not result.success
    message = _failure(result)
    assert "n_trials=0" in message and "at least 1" in message and "ops.hpo_study" in message
    assert not (home / "hpo" / "zero").exists()


def test_an_empty_search_space_is_refused_with_the_fix():
    schedule = schedule_lib.default_schedule()
    with pytest.raises(hpo.HpoError, match="search space is empty.*learning-rate range"):
        hpo.SearchSpace(1e-3, 1e-3, fast_policies=("noop",)).validate(schedule)
    with pytest.raises(hpo.HpoError, match="pruning_rates holds 0.95.*bounds"):
        hpo.SearchSpace(1e-4, 1e-3, pruning_rates=(0.0, 0.95)).validate(schedule)
    with pytest.raises(hpo.HpoError, match="fast_policies holds 'greedy'"):
        hpo.SearchSpace(1e-4, 1e-3, fast_policies=("greedy",)).validate(schedule)
    space = hpo.SearchSpace(1e-4, 1e-3, fast_policies=("noop", "heuristic"))
    with pytest.raises(hpo.HpoError, match="first_trials names 'pruning_rate'.*not searched"):
        space.check_point({"pruning_rate": 0.1})
    with pytest.raises(hpo.HpoError, match="outside"):
        space.check_point({"learning_rate": 1.0})
    with pytest.raises(hpo.HpoError, match="reduction_factor=1"):
        hpo.rung_steps(4, 1, 3)
    assert hpo.rung_steps(4, 3, 3) == [4, 12, 36]


def _row(number, bill, loss, state="COMPLETE", feasible=True):
    return {"number": number, "state": state, "run_bill_usd": bill, "eval_loss": loss,
            "feasible": feasible, "params": {"learning_rate": 1e-3, "fast_policy": "noop"},
            "runs": [{"run_id": f"r{number}"}]}


def test_the_front_and_the_choice():
    rows = [_row(0, 1.0, 3.0), _row(1, 2.0, 2.0), _row(2, 2.5, 2.5),  # 2 dominated by 1
            _row(3, 3.0, 1.995), _row(4, 0.5, 1.0, state="PRUNED"),  # pruned: not a candidate
            _row(5, 0.1, 0.5, feasible=False)]  # over the cost constraint
    assert hpo_report.pareto_front(rows) == [0, 1, 3]
    # The cheapest front trial within the tolerance of the best eval loss (1.995).
    assert hpo_report.choose(rows, 0.01)["number"] == 1
    assert hpo_report.choose(rows, 0.0)["number"] == 3
    assert hpo_report.choose(rows, 0.0)["schedule"] == {"fast_policy": "noop"}
    assert hpo_report.choose([_row(0, 1.0, 1.0, state="PRUNED")], 0.01) is None
