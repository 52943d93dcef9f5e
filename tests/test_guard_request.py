"""The lever guard from a train request (issue 12): a run launched with `lever_guard` on judges
its levers against an earlier run's eval curve, found for it (the newest fixed-schedule run of
the partition) or named; a bad reference is refused before anything is written.

`run_training` runs for real on the small pystdlib state of tests/test_run_path_faults.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from controllers.fast_types import FastAction, FastObservation
from telemetry.reader import read_run_events
from tests.test_run_path_faults import built_state, request  # noqa: F401 - fixture, helper
from trainwise import explain, guard_reference, runs
from trainwise.object_store import LocalObjectStore

EXPERIMENT = "guard"
# The fixed schedule: 12 steps of 4 samples, evaluated every 3 steps (4 points).
SCHEDULE = dict(max_steps=12, micro_batch_size=4, grad_accum_steps=1, eval_every_steps=3)


def run(state: Path, req: runs.TrainRequest, policy=None) -> runs.RunSummary:
    return runs.run_training(
        req, state_dir=state, tracking_uri=f"sqlite:///{state / 'mlflow.db'}",
        experiment=EXPERIMENT, store=LocalObjectStore(state / "objects"),
        duckdb_path=state / "trainwise.duckdb", upload_timeout_s=30.0, fast_policy=policy)


def events(state: Path, run_id: str) -> list[dict]:
    return read_run_events(state / "runs" / run_id / "telemetry" / run_id)


def guard_decisions(state: Path, run_id: str) -> list[dict]:
    return [e for e in events(state, run_id)
            if e["type"] == "decision" and e["policy"] == "lever_guard"]


@pytest.fixture(scope="module")
def fixed_state(built_state, tmp_path_factory) -> Path:  # noqa: F811 - the imported fixture
    """The state with one completed fixed-schedule run, "fixed" (levers off, no guard)."""
    root = tmp_path_factory.mktemp("guard_state") / "state"
    shutil.copytree(built_state, root)
    run(root, request(run_id="fixed", **SCHEDULE))
    return root


@pytest.fixture
def state(fixed_state, tmp_path) -> Path:
    target = tmp_path / "state"
    shutil.copytree(fixed_state, target)
    return target


class BadBatchLever:
    """A batch lever that costs quality: from step 2, 8x the batch at a learning rate that
    wrecks the model, so its eval loss stays far above the fixed schedule's."""

    name = "bad_batch_lever"

    def act(self, observation: FastObservation) -> FastAction:
        wanted = observation.step >= 2
        return FastAction(
            micro_batch_size=32 if wanted else observation.micro_batch_size,
            grad_accum_steps=observation.grad_accum_steps,
            learning_rate=0.5 if wanted else observation.learning_rate,
            rank_work_shares=(1.0,), reason="test: a bad batch lever" if wanted else "keep")


def test_a_guarded_run_finds_the_fixed_run_and_trains_against_its_curve(state):
    fixed_curve = guard_reference.curve_from_events(events(state, "fixed"))
    assert len(fixed_curve) == 4 and fixed_curve[-1][0] == 12 * 4

    summary = run(state, request(run_id="guarded", lever_guard=True, **SCHEDULE))

    start = next(e for e in events(state, "guarded") if e["type"] == "run_start")
    assert start["train_config"]["lever_guard"] is True
    assert [tuple(p) for p in start["train_config"]["lever_guard_reference"]] == list(fixed_curve)
    recorded = json.loads((state / "runs" / "guarded" / "request.json").read_text())
    assert recorded["lever_guard_reference_run"] == "fixed"
    resumed = guard_reference.resolve(request(run_id="guarded", lever_guard=True, **SCHEDULE),
                                      state)
    assert (resumed.run_id, resumed.how) == ("fixed", "resume")  # a resume keeps its reference
    decisions = guard_decisions(state, "guarded")
    assert decisions[0]["action"]["guard"] == "start"
    assert "fixed schedule's curve (4 points, run fixed)" in decisions[0]["reason"]
    params = MlflowClient(f"sqlite:///{state / 'mlflow.db'}").get_run(
        summary.mlflow_run_id).data.params
    assert params["guard/reference_run"] == "fixed"
    assert params["guard/reference_chosen"] == "automatic"
    assert params["guard/reference_points"] == "4"
    assert params["train/lever_guard"] == "True"
    assert params["train/lever_guard_reference"].startswith("run fixed (automatic; fixed schedule")


def test_the_guard_switches_a_bad_lever_off_and_explain_shows_why(state):
    run(state, request(run_id="bad-lever", lever_guard=True, **SCHEDULE), BadBatchLever())
    offs = [d for d in guard_decisions(state, "bad-lever") if d["action"]["guard"] == "switch_off"]
    assert [d["action"]["lever"] for d in offs] == ["batch"]
    assert "switched off" in offs[0]["reason"]
    assert offs[0]["reason"].startswith("costs quality")  # against the fixed run's curve
    text = explain.timeline("bad-lever", state / "runs")
    assert f"guard: step {offs[0]['step']}: batch switched off: costs quality" in text
    # The bad-lever run is newer and completed, but its batch changed: never a reference.
    found = guard_reference.resolve(request(run_id="next", lever_guard=True, **SCHEDULE), state)
    assert (found.run_id, found.how) == ("fixed", "automatic")


def test_a_reference_run_that_does_not_exist_is_refused_by_name(state):
    with pytest.raises(ValueError, match=r"lever_guard_reference_run='no-such-run': no such run"):
        run(state, request(run_id="named", lever_guard=True,
                           lever_guard_reference_run="no-such-run", **SCHEDULE))
    assert not (state / "runs" / "named").exists()  # refused before anything is written


def test_a_reference_of_another_schedule_or_with_one_point_is_refused(state):
    with pytest.raises(ValueError, match=r"'fixed' ran another schedule \(global_batch 4 \(this "
                                         r"run: 8\)"):
        run(state, request(run_id="other", lever_guard=True, lever_guard_reference_run="fixed",
                           **{**SCHEDULE, "micro_batch_size": 8}))
    run(state, request(run_id="one-eval", **{**SCHEDULE, "eval_every_steps": 50}))
    with pytest.raises(ValueError, match=r"'one-eval' has 1 evaluation\(s\); the guard needs"):
        run(state, request(run_id="short", lever_guard=True,
                           lever_guard_reference_run="one-eval", **SCHEDULE))


def test_without_a_fixed_run_the_error_says_to_run_it_first(built_state, tmp_path):  # noqa: F811
    state = tmp_path / "state"
    shutil.copytree(built_state, state)
    with pytest.raises(ValueError, match=r"run the fixed schedule first .* or name a reference"):
        run(state, request(run_id="guarded", lever_guard=True, **SCHEDULE))
    with pytest.raises(ValueError, match=r"lever_guard_reference_run='fixed' is set but "
                                         r"lever_guard is off"):
        runs.validate_request(request(lever_guard_reference_run="fixed"))


def test_the_dagster_config_carries_the_guard_fields_off_by_default():
    from assets.training import TrainRunConfig

    assert TrainRunConfig().lever_guard is False
    assert TrainRunConfig().lever_guard_reference_run == ""
    from trainwise import schedule as schedule_lib
    from trainwise import settings

    dumped = TrainRunConfig(lever_guard=True, lever_guard_reference_run="fixed").model_dump()
    # As the train job builds it: the launchpad on the published schedule (issue 28).
    req = schedule_lib.request_from_launchpad(
        dumped, schedule_lib.published(settings.home_dir()), instance_type="p3.2xlarge",
        partition="pystdlib", run_id="r", region="us-west-2")
    assert (req.lever_guard, req.lever_guard_reference_run) == (True, "fixed")
    runs.validate_request(req)


def test_a_reference_of_other_shards_or_another_model_is_refused():
    from dataclasses import asdict

    from training.model import GPTConfig

    model = GPTConfig(vocab_size=90)
    reference = guard_reference.GuardReference(
        run_id="fixed", points=((4.0, 4.4), (8.0, 4.1)), how="named", fixed_schedule=True,
        model_config=asdict(model), data_fingerprint="a" * 64)
    guard_reference.check_fit(reference, model, "a" * 64)  # the same model and shards: kept
    with pytest.raises(ValueError, match=r"'fixed' trained on shards aaaaaaaaaaaa, this run on "
                                         r"bbbbbbbbbbbb \(rebuilt since\)"):
        guard_reference.check_fit(reference, model, "b" * 64)
    with pytest.raises(ValueError, match=r"'fixed' trained another model \(differs in n_layer\)"):
        guard_reference.check_fit(reference, GPTConfig(vocab_size=90, n_layer=4), "a" * 64)
