"""`fast_policy: goodput` in a train run (issue 12, 2): the Pollux batch policy is built from a
throughput profile of the run's own model and data measured at start, and steers the live run:
where a bigger batch is faster per sample the batch grows; where it is not (this CPU) the run
keeps the fixed batch. The profile is patched in the tests so both cases are deterministic on
any machine; one run also profiles for real.

`run_training` runs for real on the small pystdlib state of tests/test_run_path_faults.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from telemetry.reader import read_run_events
from tests.test_run_path_faults import built_state, request  # noqa: F401 - fixture, helper
from trainwise import runs
from trainwise.object_store import LocalObjectStore

SCHEDULE = dict(max_steps=12, micro_batch_size=4, grad_accum_steps=1, eval_every_steps=6,
                fast_every_steps=2)


@pytest.fixture
def state(built_state, tmp_path) -> Path:  # noqa: F811 - the imported fixture
    target = tmp_path / "state"
    shutil.copytree(built_state, target)
    return target


def run(state: Path, req: runs.TrainRequest) -> runs.RunSummary:
    return runs.run_training(
        req, state_dir=state, tracking_uri=f"sqlite:///{state / 'mlflow.db'}",
        experiment="goodput", store=LocalObjectStore(state / "objects"),
        duckdb_path=state / "trainwise.duckdb", upload_timeout_s=30.0)


def step_batches(state: Path, run_id: str) -> list[int]:
    events = read_run_events(state / "runs" / run_id / "telemetry" / run_id)
    return [e["micro_batch_size"] * e["grad_accum_steps"] for e in events if e["type"] == "step"]


def fast_reasons(state: Path, run_id: str) -> list[str]:
    events = read_run_events(state / "runs" / run_id / "telemetry" / run_id)
    return [e["reason"] for e in events if e["type"] == "decision" and e["layer"] == "fast"]


def profile_of(per_batch: dict[int, float]):
    def profile(model, examples, batch_sizes, **kwargs):
        return {b: per_batch[b] for b in batch_sizes if b in per_batch}
    return profile


def test_where_bigger_batches_are_faster_per_sample_goodput_grows_the_batch(state, monkeypatch):
    import training._loop_step as loop_step

    # A device-like profile: 4x the samples per second at 8x the batch.
    monkeypatch.setattr(loop_step, "profile_samples_per_s",
                        profile_of({4: 100.0, 8: 190.0, 16: 350.0, 32: 400.0}))
    summary = run(state, request(run_id="gp-fast", fast_policy="goodput", **SCHEDULE))
    assert summary.status == "completed"
    batches = step_batches(state, "gp-fast")
    assert batches[0] == 4 and max(batches) > 4
    assert any("goodput" in r for r in fast_reasons(state, "gp-fast"))


def test_where_bigger_is_not_faster_goodput_keeps_the_fixed_batch(state, monkeypatch):
    import training._loop_step as loop_step

    monkeypatch.setattr(loop_step, "profile_samples_per_s", profile_of({4: 100.0, 8: 101.0}))
    summary = run(state, request(run_id="gp-cpu", fast_policy="goodput", **SCHEDULE))
    assert summary.status == "completed"
    assert set(step_batches(state, "gp-cpu")) == {4}
    reasons = fast_reasons(state, "gp-cpu")
    # The goodput policy decided (not a no-op), and never split a step to measure the noise.
    assert reasons and all("not faster per sample" in r for r in reasons)
    assert all("split" not in r for r in reasons)


def test_a_real_profile_runs_and_a_gang_is_refused(state):
    summary = run(state, request(run_id="gp-real", fast_policy="goodput", **SCHEDULE))
    assert summary.status == "completed" and summary.steps == SCHEDULE["max_steps"]
    with pytest.raises(ValueError, match="goodput.*one node.*nodes 1"):
        run(state, request(run_id="gp-gang", fast_policy="goodput", nodes=2, **SCHEDULE))
    assert not (state / "runs" / "gp-gang").exists()
