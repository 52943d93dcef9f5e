"""MLflow live (issue 13, item 6): the run opens when training starts, metrics stream with their
real timestamps, the slow layer's control-file change shows during the run, the run closes with
its real times and status, and only a completed run becomes a registered model version.

`run_training` runs for real on a small pystdlib state with a sqlite MLflow in tmp; a fast
policy looks at MLflow from inside the training loop (the training thread) while it trains.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import shutil
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from controllers.fast_types import NoOpFastPolicy
from telemetry.events import StepEvent, to_record
from tests._preemption import SigtermAt
from training import scoring, shards
from training.curriculum import keep_everything, write_curriculum
from training.dynamic_pruning import write_pruning_control
from trainwise import mlflow_live, runs
from trainwise.object_store import LocalObjectStore

PARTITION = "pystdlib"
EXPERIMENT = "live"


@pytest.fixture(scope="module")
def built_state(tmp_path_factory) -> Path:
    """Shards, scores, a curriculum at pruning rate 0.3 and an MLflow database, built once."""
    root = tmp_path_factory.mktemp("mlflow_live_state")
    out = root / "shards" / PARTITION
    shards.build_shards(PARTITION, root / "no-data", out)
    examples = shards.load_shards(out)
    scoring.write_scores(scoring.difficulty_scores(examples), root / "scores" / PARTITION)
    write_curriculum(keep_everything(PARTITION, examples, pruning_rate=0.3, anneal_fraction=0.25),
                     root / "curricula" / PARTITION)
    MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}").search_experiments()
    return root


@pytest.fixture
def state(built_state, tmp_path) -> Path:
    target = tmp_path / "state"
    shutil.copytree(built_state, target)
    return target


def uri(state: Path) -> str:
    return f"sqlite:///{state / 'mlflow.db'}"


def request(**changes) -> runs.TrainRequest:
    base = runs.TrainRequest(
        partition=PARTITION, max_steps=6, micro_batch_size=4, grad_accum_steps=1,
        learning_rate=1e-3, eval_every_steps=3, seed=0, instance_type="p3.2xlarge",
        fast_policy="noop", run_id="live-a", fast_every_steps=2, data_selection="dynamic")
    return dataclasses.replace(base, **changes)


def train(state: Path, req: runs.TrainRequest, policy=None) -> runs.RunSummary:
    return runs.run_training(
        req, state_dir=state, tracking_uri=uri(state), experiment=EXPERIMENT,
        store=LocalObjectStore(state / "objects"), duckdb_path=state / "trainwise.duckdb",
        upload_timeout_s=30.0, mlflow_interval_s=0.2, fast_policy=policy)


def live_runs(client: MlflowClient, training_run_id: str) -> list:
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is None:
        return []
    return client.search_runs(
        [experiment.experiment_id],
        filter_string=f"tags.`trainwise/training_run_id` = '{training_run_id}'",
        order_by=["attributes.start_time ASC"])


class WatchMlflow(NoOpFastPolicy):
    """At one fast tick (inside the training loop): the slow layer writes the control file,
    then this looks at MLflow until the run and the change show up. The wall-clock span of the
    watch (`began_ms`, `ended_ms`) lies between two steps: their metrics' timestamps must too.
    The deadline only bounds a hang."""

    name = "watch_mlflow"

    def __init__(self, state: Path, run_id: str, at_step: int, rate: float) -> None:
        self.state, self.run_id, self.at_step, self.rate = state, run_id, at_step, rate
        self.seen: dict = {}
        self.began_ms = self.ended_ms = 0

    def act(self, observation):
        if observation.step == self.at_step and not self.seen:
            self.began_ms = int(time.time() * 1000)
            control = runs.control_path(self.state, self.run_id)
            # A larger change the gate holds for approval, then the one handed to the run.
            control.with_name("control.pending.json").write_text(json.dumps(
                {"pruning_rate": 0.1, "status": "pending: automatic approval is off"}))
            write_pruning_control(control, pruning_rate=self.rate, reason="test: slow layer")
            client = MlflowClient(tracking_uri=uri(self.state))
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                found = live_runs(client, self.run_id)
                if found and found[-1].data.metrics.get("control/pruning_rate") == self.rate:
                    run = found[-1]
                    self.seen = {"status": run.info.status, "run_id": run.info.run_id,
                                 "train_points": len(client.get_metric_history(
                                     run.info.run_id, "losses/train")),
                                 "requested_tag": run.data.tags.get(
                                     "trainwise/pruning_rate_requested")}
                    break
                time.sleep(0.1)  # polling MLflow until the run shows the change
            self.ended_ms = int(time.time() * 1000)
        return super().act(observation)


def test_run_is_live_while_training_and_closes_with_real_times(state):
    watcher = WatchMlflow(state, "live-a", at_step=2, rate=0.18)
    before_ms = int(time.time() * 1000)
    summary = train(state, request(), watcher)
    after_ms = int(time.time() * 1000)
    assert summary.status == "completed" and summary.pending == ""

    # During training: the run existed, RUNNING, with step metrics and the live rate change.
    assert watcher.seen, "the MLflow run (or its control/pruning_rate) never showed up live"
    assert watcher.seen["status"] == "RUNNING" and watcher.seen["train_points"] >= 1
    assert watcher.seen["requested_tag"] == "0.18"
    assert watcher.seen["run_id"] == summary.mlflow_run_id

    client = MlflowClient(tracking_uri=uri(state))
    run = client.get_run(summary.mlflow_run_id)
    assert run.info.status == "FINISHED"
    # Real start and end: opened before the first step, closed after the last, open across the
    # watch at step 2.
    history = client.get_metric_history(summary.mlflow_run_id, "losses/train")
    assert [m.step for m in history] == list(range(1, 7)), "each step logged once"
    assert before_ms <= run.info.start_time <= history[0].timestamp
    assert history[-1].timestamp <= run.info.end_time <= after_ms
    assert run.info.start_time <= watcher.began_ms <= watcher.ended_ms <= run.info.end_time
    from telemetry.reader import read_run_events

    steps = [e for e in read_run_events(Path(summary.telemetry_dir)) if e["type"] == "step"]
    assert [m.timestamp for m in history] == [int(e["wall_time_s"] * 1000) for e in steps]
    # Each point carries its step's time, not one time for all (the run's start, or when the
    # points were sent): steps 1-2 came before the watch, steps 3-6 after it.
    assert history[1].timestamp <= watcher.began_ms and watcher.ended_ms <= history[2].timestamp
    [requested] = client.get_metric_history(summary.mlflow_run_id, "control/pruning_rate")
    assert requested.value == pytest.approx(0.18)
    applied = client.get_metric_history(summary.mlflow_run_id, "data/pruning_rate")
    assert [m.value for m in applied] == [pytest.approx(0.18)]  # the sampler took it
    [proposed] = client.get_metric_history(summary.mlflow_run_id, "control/pruning_rate_proposed")
    assert proposed.value == pytest.approx(0.1)  # held for approval: never applied
    assert run.data.metrics["final/cost_usd"] == pytest.approx(summary.cost_usd)

    names = {a.path for a in client.list_artifacts(summary.mlflow_run_id)}
    assert {"decisions.csv", "eval_loss_vs_cost.png", "request.json", "model"} <= names
    table = Path(client.download_artifacts(summary.mlflow_run_id, "decisions.csv",
                                           str(state / "download")))
    rows = list(csv.DictReader(table.open()))
    assert {r["layer"] for r in rows} >= {"fast", "slow"}
    assert any(r["source"] == "control_file" and "0.18" in r["action"] for r in rows)
    assert any(r["source"] == "proposal" and r["reason"].startswith("pending") for r in rows)

    [version] = client.search_model_versions(f"name='{mlflow_live.model_name(PARTITION)}'")
    assert version.run_id == summary.mlflow_run_id
    assert version.tags["checkpoint_sha256"] == summary.checkpoint_sha256
    assert version.tags["curriculum_version"] == summary.curriculum_version
    assert run.data.tags["trainwise/model_version"] == f"trainwise-{PARTITION}/1"


def test_preempted_run_is_killed_and_not_registered_its_resume_is(state):
    with pytest.raises(runs.RunInterruptedError) as caught:
        train(state, request(data_selection="static"), SigtermAt(2))
    client = MlflowClient(tracking_uri=uri(state))
    first = client.get_run(caught.value.summary.mlflow_run_id)
    assert first.info.status == "KILLED" and first.data.tags["trainwise/status"] == "preempted"
    assert client.search_model_versions(f"name='trainwise-{PARTITION}'") == []

    resumed = train(state, request(data_selection="static"), NoOpFastPolicy())
    second = client.get_run(resumed.mlflow_run_id)
    assert second.info.status == "FINISHED" and second.info.run_id != first.info.run_id
    # The resumed run holds its own steps only: the first session's are in the first run.
    steps = [m.step for m in client.get_metric_history(resumed.mlflow_run_id, "losses/train")]
    assert steps == [3, 4, 5, 6]
    [version] = client.search_model_versions(f"name='trainwise-{PARTITION}'")
    assert version.run_id == resumed.mlflow_run_id


class RaiseAt(NoOpFastPolicy):
    name = "raise_at"

    def act(self, observation):
        if observation.step == 2:
            raise RuntimeError("policy bug at step 2")
        return super().act(observation)


def test_training_error_marks_the_run_failed_with_its_metrics(state):
    with pytest.raises(RuntimeError, match="policy bug"):
        train(state, request(data_selection="static"), RaiseAt())
    client = MlflowClient(tracking_uri=uri(state))
    [run] = live_runs(client, "live-a")
    assert run.info.status == "FAILED" and "policy bug" in run.data.tags["trainwise/error"]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "losses/train")] == [1, 2]
    assert client.search_model_versions(f"name='trainwise-{PARTITION}'") == []


# --- the tail, without training ------------------------------------------------------------------
def _step_line(step: int) -> bytes:
    record = to_record(StepEvent(
        run_id="r", step=step, wall_time_s=1_700_000_000.0 + step, train_loss=1.0 / step,
        learning_rate=1e-3, grad_norm=1.0, grad_noise_scale=float("nan"), micro_batch_size=4,
        grad_accum_steps=1, step_time_ms=5.0, samples_seen=4 * step, tokens_seen=64 * step,
        elapsed_s=float(step), cost_usd=0.001 * step))
    return (json.dumps(record, separators=(",", ":")) + "\n").encode()


def test_tail_reads_open_segments_incrementally_and_waits_for_torn_lines(tmp_path):
    from telemetry.writer import seal_segment

    run_dir = tmp_path / "r"
    segment = run_dir / "rank0" / "segment-00000.jsonl"
    segment.parent.mkdir(parents=True)
    tail = mlflow_live.TelemetryTail(run_dir)
    line3 = _step_line(3)
    segment.write_bytes(_step_line(1) + _step_line(2) + line3[:20])  # line 3 is being written
    assert [r["step"] for r in tail.poll()] == [1, 2]
    assert tail.poll() == []
    with open(segment, "ab") as handle:
        handle.write(line3[20:] + _step_line(4))
    assert [r["step"] for r in tail.poll()] == [3, 4]
    seal_segment(segment)
    assert tail.poll() == [], "a sealed segment's lines are not returned twice"
    other = run_dir / "rank0" / "segment-00001.jsonl"
    other.write_bytes(b'{"not": "an event"}\n')
    assert tail.poll() == [] and "segment-00001" in tail.problems[-1]


def test_mlflow_down_mid_run_keeps_metrics_for_a_later_tick(built_state, tmp_path):
    shutil.copy(built_state / "mlflow.db", tmp_path / "mlflow.db")  # migrated once, in the fixture
    run_dir = tmp_path / "telemetry" / "r"
    segment = run_dir / "rank0" / "segment-00000.jsonl"
    segment.parent.mkdir(parents=True)
    segment.write_bytes(_step_line(1) + _step_line(2))
    live = mlflow_live.LiveRun(mlflow_live.LiveRunSpec(
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="down", run_name="r",
        params={"a": 1}, tags={}, telemetry_dir=run_dir), interval_s=3600,
        skip_existing=False).start()
    real_log_batch, calls = live._client.log_batch, []

    def down(*args, **kwargs):
        calls.append(1)
        raise ConnectionRefusedError("connection refused")

    live._client.log_batch = down
    live.tick()
    assert calls and "kept for the next tick" in live.problems[-1]
    live._client.log_batch = real_log_batch
    with open(segment, "ab") as handle:
        handle.write(_step_line(3))
    live.tick()
    run_id = live.finish("completed", end_time_s=1_700_000_010.0, final_metrics={"final/x": 1})
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    history = client.get_metric_history(run_id, "losses/train")
    assert [m.step for m in history] == [1, 2, 3]
    assert [m.timestamp for m in history] == [1_700_000_001_000, 1_700_000_002_000,
                                              1_700_000_003_000]
    assert client.get_run(run_id).info.end_time == 1_700_000_010_000


def test_mlflow_gone_for_the_whole_run_never_stops_training(state, monkeypatch):
    from trainwise import services

    def refused(*args, **kwargs):
        raise ConnectionRefusedError("connection refused")

    monkeypatch.setattr(services.Backoff, "delays_s", lambda self: [0.0] * (self.tries - 1))
    monkeypatch.setattr(MlflowClient, "create_run", refused)  # gone after the preflight
    with pytest.warns(UserWarning, match="MLflow logging"):
        summary = train(state, request(data_selection="static", max_steps=3))
    assert summary.status == "completed" and summary.steps == 3
    assert "MLflow logging" in summary.pending and "connection refused" in summary.pending
    assert summary.mlflow_run_id == ""
