"""A team's registered job under an allocation policy (issue 26, items 5/6): the supervised engine
the built-in train job runs on (`trainwise.emulated.supervise`) runs the user's SDK job instead of
its own worker (`trainwise.user_job_supervised`). The plain-loop example (`examples/plain_loop/`,
its project file) runs on the real 2023-02 us-east-1a V100 trace window where spot is up 4 ticks
and then reclaimed (`tests/test_cloud_emulated.py`'s `_window_start`, as the built-in engine's
tests pick it): under trainwise_heuristic it rides spot, the reclaim SIGTERMs the job, the SDK
commits a checkpoint to the object store and exits 143, the replacement starts on an empty disk
and resumes from the store; under on_demand it holds on-demand only. Both end with the weights of
an uninterrupted run (bit for bit) and a bill from the provider.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from telemetry.reader import read_run_events
from tests._example_job import assert_same_weights_and_data
from tests.shared_data import needs_spot_data
from tests.test_cloud_emulated import FOLDER, ZONE_FILE, _window_start
from trainwise import user_job_supervised
from trainwise.emulated import ReplaySpec
from trainwise.sdk.spec import RunSpec, write_spec
from trainwise.user_jobs import job_env
from trainwise.user_project import load_project_file

pytestmark = needs_spot_data

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "plain_loop"
JOB = "blobs-classifier"
MAX_STEPS = 40  # the example's own arguments say 40 (they override the spec's)
# Slow enough that the window's reclaim (about 420 emulated s after the boot, 0.43 wall s at
# 975x) lands mid-run: 40 steps of 0.05 s stand for about 1950 emulated s.
STEP_SLEEP_S = "0.05"


def replay_spec() -> ReplaySpec:
    return ReplaySpec(trace_folder=FOLDER, zone_files=(ZONE_FILE,),
                      window_start_tick=_window_start(), seconds_per_tick=0.2, max_wall_s=240.0)


def _job(args: tuple[str, ...] = ("--step-sleep-s", STEP_SLEEP_S)):
    job = load_project_file(EXAMPLE / "trainwise.toml").jobs[JOB]
    return dataclasses.replace(job, args=(*job.args, *args))


def _spec(base: Path, run_id: str, **changes) -> RunSpec:
    fields = dict(run_id=run_id, run_dir=str(base / "runs" / run_id), max_steps=MAX_STEPS,
                  checkpoint_every_steps=10, store_root=str(base / "store"))
    fields.update(changes)
    return RunSpec(**fields)


def _store_checkpoint(spec: RunSpec, step: int) -> Path:
    return (Path(str(spec.store_root)) / spec.checkpoint_key_prefix / "rank0"
            / f"step-{step:07d}.pt")


def _committed(spec: RunSpec) -> list[int]:
    folder = _store_checkpoint(spec, 0).parent
    return sorted(int(p.name[5:12]) for p in folder.glob("step-*.pt.commit"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The example run once, uninterrupted, with the same spec (no launcher, no notice)."""
    base = tmp_path_factory.mktemp("reference")
    spec = _spec(base, "reference")
    spec_path = write_spec(spec, base / "spec.json")
    done = subprocess.run([sys.executable, str(EXAMPLE / "train.py")],
                          env=job_env(EXAMPLE, spec_path), cwd=EXAMPLE, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return torch.load(_store_checkpoint(spec, MAX_STEPS), map_location="cpu", weights_only=True)


_RUNS: dict[str, tuple[RunSpec, user_job_supervised.SupervisedUserJob]] = {}


@pytest.fixture(scope="module")
def supervised(tmp_path_factory):
    """The example under an allocation policy (each run once per module, about 15 s)."""

    def run(policy: str) -> tuple[RunSpec, user_job_supervised.SupervisedUserJob]:
        if policy not in _RUNS:
            base = tmp_path_factory.mktemp(policy)
            spec = _spec(base, f"plain-{policy.replace('_', '-')}")
            fast = "heuristic" if policy == "trainwise_heuristic" else "noop"
            _RUNS[policy] = spec, user_job_supervised.supervise_user_job(
                _job(), EXAMPLE, spec, replay_spec(), policy, fast_policy=fast)
        return _RUNS[policy]

    yield run
    _RUNS.clear()


def test_trainwise_rides_spot_answers_the_reclaim_and_resumes_from_the_store(supervised):
    spec, out = supervised("trainwise_heuristic")
    result, record, figures = out.result, out.record, out.figures
    assert result["status"] == "completed", result["failure"]
    assert result["outcome"]["step"] == MAX_STEPS
    # A reclaim can land during the last step (timing: a loaded machine): the run is complete,
    # the job left on the notice, and the result says how to finish its own code.
    reclaimed_last = result["outcome"]["status"] == "preempted"
    assert result["outcome"]["status"] == "completed" or (
        reclaimed_last and "reclaimed at its last step" in result["note"]), result["outcome"]
    assert record["engine"] == "supervised" and record["allocation_policy"] == "trainwise_heuristic"
    assert figures.preemptions >= 1 and result["reclaims"] == figures.preemptions
    assert figures.spot_node_s > 0 and record["spot_share"] > 0, "it rode spot while it was up"
    assert record["replacements"] >= 1 and figures.resumes >= 1
    segments = result["segments"]
    assert [s["returncode"] for s in segments][-1] == (143 if reclaimed_last else 0)
    stopped = [s for s in segments if s["stop_reason"] == "preemption"]
    assert stopped and all(s["returncode"] == 143 and s["status"] == "preempted"
                           for s in stopped)
    first = [s for s in stopped if s["step"] < MAX_STEPS][0]  # a reclaim mid-run
    # The notice was answered with a checkpoint committed to the store, and the next node (an
    # empty disk: the engine deleted the stopped node's checkpoints) resumed from it.
    assert 0 < first["step"] < MAX_STEPS and first["step"] in _committed(spec)
    after = segments[first["index"] + 1]
    assert Path(after["log"]).read_text().splitlines()[0] == (
        f"resumed True at step {first['step']}")
    starts = [e for e in read_run_events(Path(spec.run_dir) / "telemetry" / spec.run_id, rank=0)
              if e["type"] == "run_start"]
    assert starts[0]["resumed_from"] is None
    assert starts[1]["resumed_from"].endswith(f"step-{first['step']:07d}.pt")
    # Each spawn had its own run spec, with the notice the node really gets.
    spawned = json.loads((Path(spec.run_dir) / "emulated" / "spec-001.json").read_text())
    assert spawned["notice_s"] >= 10.0 and spawned["fast_policy"] == "heuristic"
    assert spawned["instance_type"] == figures.instance_type
    # ... and the preemption risk the engine gives a built-in trainer: the first start, on spot
    # with no reclaim seen yet, half a reclaim over the horizon (1 - e^-0.5).
    first_spec = json.loads((Path(spec.run_dir) / "emulated" / "spec-000.json").read_text())
    assert first_spec["preemption_risk"] == pytest.approx(1.0 - math.exp(-0.5))


def test_on_demand_holds_no_spot_and_completes_in_one_segment(supervised):
    spec, out = supervised("on_demand")
    result, record, figures = out.result, out.record, out.figures
    assert result["status"] == "completed", result["failure"]
    assert record["spot_share"] == 0.0 and figures.spot_node_s == 0.0
    assert figures.preemptions == 0 and result["reclaims"] == 0
    assert [s["returncode"] for s in result["segments"]] == [0]
    assert record["cost_usd"] == pytest.approx(record["fixed_on_demand_usd"])


@pytest.mark.parametrize("policy", ["trainwise_heuristic", "on_demand"])
def test_final_weights_equal_an_uninterrupted_run_and_the_bill_is_the_providers(
        supervised, reference, policy):
    spec, out = supervised(policy)
    assert out.result["status"] == "completed", out.result["failure"]
    final = torch.load(_store_checkpoint(spec, MAX_STEPS), map_location="cpu", weights_only=True)
    assert_same_weights_and_data(final, reference, MAX_STEPS)
    figures = out.figures
    billed = sum(h["price_usd_per_hour"] * (h["end_s"] - h["launch_s"]) / 3600.0
                 for h in figures.holdings)
    assert out.result["cost_usd"] > 0
    assert out.result["cost_usd"] == pytest.approx(billed, rel=1e-9)
    # The provider's records and the job's steps are one run's telemetry (trainwise explain).
    events = read_run_events(Path(spec.run_dir) / "telemetry" / spec.run_id)
    assert any(e["type"] == "decision" and e["policy"] == policy for e in events)
    assert max(e["step"] for e in events if e["type"] == "step") == MAX_STEPS
    bills = [e for e in events if e["type"] == "bill"]
    assert bills[-1]["final"] and bills[-1]["bill_usd"] == pytest.approx(billed, rel=1e-9)
    written = json.loads((Path(spec.run_dir) / "user_job.json").read_text())
    assert written["status"] == "completed" and written["allocation_policy"] == policy


def test_trainwise_costs_less_than_on_demand_here(supervised):
    """Spot was up most of this window: the heuristic's bill is below on-demand's."""
    assert supervised("trainwise_heuristic")[1].figures.cost_usd < (
        supervised("on_demand")[1].figures.cost_usd)


def test_a_job_that_crashes_fails_with_its_log_and_its_node_released(tmp_path):
    folder = tmp_path / "team"
    folder.mkdir()
    (folder / "train.py").write_text("print('loading'); raise RuntimeError('boom in user code')\n")
    (folder / "rows.jsonl").write_text('{"id": 1, "text": "a"}\n')
    (folder / "trainwise.toml").write_text('[datasets.rows]\npath = "rows.jsonl"\nid_column = '
                                           '"id"\n\n[jobs.crash]\nentry = "train.py"\n'
                                           'dataset = "rows"\nframework = "hf_trainer"\n')
    job = load_project_file(folder / "trainwise.toml").jobs["crash"]
    out = user_job_supervised.supervise_user_job(job, folder, _spec(tmp_path, "crash"),
                                                 replay_spec(), "on_demand")
    assert out.result["status"] == "failed"
    assert "exited with code 1" in out.result["failure"]
    assert "boom in user code" in out.result["failure"]
    assert all(h["end_s"] is not None for h in out.figures.holdings), "nodes released"
    # The Trainer builds its loader once: the launcher leaves batch_scaling out of its spec (the
    # SDK would refuse it at init).
    spawned = json.loads((tmp_path / "runs" / "crash" / "emulated" / "spec-000.json").read_text())
    assert spawned["fast_levers"] == ["preemption"]
    assert json.loads((tmp_path / "runs" / "crash" / "user_job.json").read_text())[
        "status"] == "failed"


def test_without_max_steps_or_a_store_nothing_is_launched(tmp_path):
    with pytest.raises(ValueError, match="needs max_steps"):
        user_job_supervised.supervise_user_job(_job(), EXAMPLE,
                                               _spec(tmp_path, "x", max_steps=None),
                                               replay_spec(), "on_demand")
    with pytest.raises(ValueError, match="needs store_root"):
        user_job_supervised.supervise_user_job(_job(), EXAMPLE,
                                               _spec(tmp_path, "x", store_root=None),
                                               replay_spec(), "on_demand")
    with pytest.raises(ValueError, match="trainwise_heuristic"):  # the valid names
        user_job_supervised.supervise_user_job(_job(), EXAMPLE, _spec(tmp_path, "x"),
                                               replay_spec(), "nope")
    assert not (tmp_path / "runs").exists()


def test_the_launchpad_runs_a_registered_job_under_an_allocation_policy(tmp_path, monkeypatch):
    """assets/user_jobs.py: `allocation_policy` set -> the supervised engine on the replay."""
    import dagster as dg

    from assets.data import data_shards_asset
    from assets.partitions import partitions_for
    from assets.resources import MLflowResource, ObjectStoreResource, StateResource
    from assets.user_jobs import user_job_defs

    monkeypatch.setenv("TRAINWISE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(user_job_supervised, "replay_for_run", replay_spec)
    project = load_project_file(EXAMPLE / "trainwise.toml")
    shards = data_shards_asset(partitions_for(project), project.datasets)
    [asset] = user_job_defs(project, shards)["assets"]
    resources = {"state": StateResource(home=str(tmp_path / "home")),
                 "object_store": ObjectStoreResource(local_root=str(tmp_path / "store")),
                 "mlflow": MLflowResource(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")}
    assert dg.materialize([shards], partition_key="blobs", resources=resources).success

    def launch(**config) -> dg.ExecuteInProcessResult:
        return dg.materialize(
            [shards.to_source_asset(), asset], resources=resources, raise_on_error=False,
            run_config={"ops": {"user_job_run": {"config": {"job": JOB, **config}}}})

    refused = launch(run_id="nope-1", max_steps=MAX_STEPS, allocation_policy="nope")
    assert not refused.success
    assert not (tmp_path / "home" / "runs" / "nope-1" / "supervised.json").exists()
    done = launch(run_id="od-1", max_steps=MAX_STEPS, allocation_policy="on_demand")
    assert done.success
    [materialization] = done.asset_materializations_for_node("user_job_run")
    meta = {k: v.value for k, v in materialization.metadata.items()}
    assert meta["status"] == "completed" and meta["allocation_policy"] == "on_demand"
    assert meta["steps"] == MAX_STEPS and meta["cost_usd"] > 0 and meta["reclaims"] == 0
    record = json.loads((tmp_path / "home" / "runs" / "od-1" / "supervised.json").read_text())
    assert record["engine"] == "supervised" and record["spot_share"] == 0.0
    assert record["cost_usd"] == pytest.approx(meta["cost_usd"])


def test_the_benchmark_refuses_a_folder_without_a_project_file(tmp_path, capsys):
    from benchmarks.end_to_end_hf import main
    from benchmarks.run_all import SUITES

    assert SUITES["end_to_end_hf"] == "benchmarks.end_to_end_hf"
    with pytest.raises(SystemExit) as stopped:
        main(["--quick", "--example", str(tmp_path), "--results-dir", str(tmp_path)])
    assert stopped.value.code == 2 and "has no trainwise.toml" in capsys.readouterr().err
