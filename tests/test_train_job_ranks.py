# ruff: noqa: F811  (the imported pytest fixtures are used as test arguments)
"""The train job trains with one torchrun rank per provider node (issue 10 item 1, issue 11).

`run_training` runs for real on the small pystdlib state of tests/test_run_path_faults.py with
an allocation of 2 nodes at an `EmulatedProvider` (one zone, a short array standing for a trace
window): the two ranks train (gloo on CPU, one torch thread each), rank 0 checkpoints into the
object store, and the summary, MLflow and `gang.json` come from the gang. What the ranks cannot
run yet is refused before any node is launched.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from cloud import emulated as replay
from cloud.providers.emulated import EmulatedProvider
from controllers.fast_types import NoOpFastPolicy
from telemetry.reader import read_run_events
from tests.test_run_path_faults import (  # noqa: F401 - fixtures used by name
    PARTITION,
    built_state,
    request,
    run,
    state,
)
from trainwise import gang, runs
from trainwise.object_store import COMMIT_SUFFIX

ZONE = "us-east-1a"


def provider(available: list[int], seconds_per_tick: float = 0.5) -> EmulatedProvider:
    market = replay.ReplayMarket(ZONE, "p3.2xlarge", 195, np.asarray(available, dtype=np.int64),
                                 0, "test window", 0.918, 3.06, "test")
    return EmulatedProvider([market], replay.ReplayClock(195.0, seconds_per_tick),
                            replay.default_rules())


def test_two_nodes_train_with_two_ranks_and_the_run_records_the_gang(state):
    cloud = provider([0] * 100_000)
    summary = run(state, request(nodes=2, max_steps=6, eval_every_steps=3, grad_accum_steps=2,
                                 fast_policy="heuristic"), provider=cloud)
    assert summary.status == "completed" and summary.steps == 6 and summary.nodes == 2
    run_dir = state / "runs" / "run-a"
    events = read_run_events(run_dir / "telemetry" / "run-a")
    steps = [e for e in events if e["type"] == "step"]
    # Both ranks trained every step, as a gang of 2; each took one of the 2 micro batches.
    for rank in (0, 1):
        mine = [e for e in steps if e["rank"] == rank]
        assert [e["step"] for e in mine] == list(range(1, 7)), rank
        assert {(e["world_size"], e["micro_batches"]) for e in mine} == {(2, 1)}
    # The run's curriculum reached both ranks (the single process trains on the same version).
    starts = {e["rank"]: e["curriculum_version"] for e in events if e["type"] == "run_start"}
    assert starts == {0: summary.curriculum_version, 1: summary.curriculum_version}
    # The fast policy ran on rank 0 and its answers applied to the gang.
    decided = {e["policy"] for e in events if e["type"] == "decision" and e["layer"] == "fast"}
    assert decided == {"heuristic_fast"} and summary.fast_policy == "heuristic_fast"
    # Final eval loss from rank 0's last evaluation; cost: both nodes billed.
    evals = [e for e in events if e["type"] == "eval" and e["rank"] == 0]
    assert summary.final_eval_loss == pytest.approx(evals[-1]["eval_loss"])
    last_cost = {r: max(e["cost_usd"] for e in steps if e["rank"] == r) for r in (0, 1)}
    # The trainers' own estimates add up over both ranks; the bill is the provider's.
    assert summary.compute_estimate_usd >= sum(last_cost.values()) > last_cost[0]
    gang_bill = json.loads((state / "runs" / "run-a" / "gang.json").read_text())["cost_usd"]
    assert summary.cost_usd == pytest.approx(gang_bill) and gang_bill > 0
    # Rank 0 put the final checkpoint into the object store, committed.
    assert summary.checkpoint_uri.startswith((state / "objects").as_uri())
    prefix = state / "objects" / runs.checkpoint_prefix(PARTITION, "run-a")
    final = summary.checkpoint_uri.rsplit("/", 1)[1]
    assert (prefix / final).is_file() and (prefix / (final + COMMIT_SUFFIX)).is_file()
    assert not summary.pending
    # gang.json: rank r on node r, the nodes the provider launched.
    record = gang.read_gang(run_dir)
    launched = [n["node_id"] for n in record["launched"]]
    assert record["world_size"] == 2 and len(launched) == 2
    assert [(r["rank"], r["node_id"]) for r in record["ranks"]] == list(enumerate(launched))
    assert not any(cloud.state(n).alive for n in cloud.nodes()), "released at the end"
    # `trainwise explain` shows each rank's steps and the nodes the provider launched.
    from trainwise import explain

    text = explain.timeline("run-a", state / "runs")
    assert "ranks (2)" in text and all(node in text for node in launched)
    # MLflow has the gang's figures.
    from mlflow.tracking import MlflowClient

    metrics = MlflowClient(tracking_uri=f"sqlite:///{state / 'mlflow.db'}").get_run(
        summary.mlflow_run_id).data.metrics
    assert metrics["final/world_size"] == 2
    assert metrics["final/eval_loss"] == pytest.approx(summary.final_eval_loss)
    assert metrics["final/cost_usd"] == pytest.approx(summary.cost_usd)
    outcome = json.loads((run_dir / runs.OUTCOME_NAME).read_text())
    assert outcome["nodes"] == 2 and outcome["status"] == "completed"


class Custom(NoOpFastPolicy):
    name = "custom_fast"


@pytest.mark.parametrize("changes, setting", [
    ({"data_selection": "dynamic"}, r"data_selection='dynamic'.*use data_selection='static', "
                                    r"or nodes=1"),
    ({"grad_accum_steps": 1}, r"grad_accum_steps=1: .* set grad_accum_steps >= 2.*or nodes=1"),
    ({"fast_policy": "noop", "policy": Custom()}, r"fast policy 'custom_fast'.*fast_policy="
                                                   r"'heuristic'.*or nodes=1"),
])
def test_what_the_ranks_cannot_run_is_refused_before_a_launch(state, changes, setting):
    changes = dict(changes)
    policy = changes.pop("policy", None)
    cloud = provider([0] * 100_000)
    with pytest.raises(ValueError, match=setting):
        run(state, request(**{"nodes": 2, "grad_accum_steps": 2, **changes}), provider=cloud,
            fast_policy=policy)
    assert cloud.nodes() == [], "nothing launched, nothing billed"
    assert not (state / "runs" / "run-a" / "telemetry").exists()


def test_a_store_the_ranks_cannot_upload_to_is_refused(state):
    from trainwise.object_store import LocalObjectStore

    class OtherStore:  # answers like a store (preflight passes), but is no local folder
        def __init__(self, inner: LocalObjectStore) -> None:
            self.inner = inner

        def __getattr__(self, name: str):
            return getattr(self.inner, name)

    cloud = provider([0] * 100_000)
    with pytest.raises(ValueError, match=r"object store OtherStore.*TRAINWISE_S3_BUCKET"):
        run(state, request(nodes=2, grad_accum_steps=2), provider=cloud,
            store=OtherStore(LocalObjectStore(state / "objects")))
    assert cloud.nodes() == []


def test_one_node_still_trains_in_this_process(state):
    summary = run(state, request(nodes=1), provider=provider([0] * 100_000))
    record = gang.read_gang(state / "runs" / "run-a")
    assert summary.status == "completed" and record["world_size"] == 1 and record["ranks"] == []
    assert not (state / "runs" / "run-a" / "gang").exists(), "no torchrun segment"


# --- the gang answers a reclaim and a stop of the job (slow: torchrun started 2-3 times) --------
@pytest.mark.slow
def test_one_ranks_reclaim_is_answered_and_the_job_completes_from_the_store(state):
    # Spot for 2 nodes until tick 3, then 1: rank 1's node is reclaimed mid-run; the
    # replacement is on-demand (spot refused: a recorded fallback) and the gang resumes from
    # the checkpoint rank 0 put into the store.
    cloud = provider([2, 2, 2] + [1] * 100_000, seconds_per_tick=0.05)
    summary = run(state, request(nodes=2, market="spot", zone=ZONE, max_steps=40,
                                         grad_accum_steps=2),
                  provider=cloud)
    assert summary.status == "completed" and summary.steps == 40
    assert (summary.reclaims, summary.replacements) == (1, 1)
    record = gang.read_gang(state / "runs" / "run-a")
    events = [e["event"] for e in record["history"]]
    assert events == ["launch", "notice", "launch", "restore"], events
    restore = record["history"][-1]
    assert restore["source"] == "store" and 1 <= restore["step"] < 40
    assert record["ranks"][1]["node_id"] == record["history"][2]["nodes"][0]
    steps = [e for e in read_run_events(state / "runs" / "run-a" / "telemetry" / "run-a")
             if e["type"] == "step"]
    assert {e["rank"] for e in steps if e["step"] == 40} == {0, 1}


@pytest.mark.slow
def test_a_sigterm_to_the_job_stops_the_gang_with_a_checkpoint_and_a_rerun_resumes(state):
    import os
    import signal
    import threading
    import time

    telemetry = state / "runs" / "run-a" / "telemetry" / "run-a"

    def stop_when_training() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if telemetry.is_dir() and any(e["type"] == "step" for e in read_run_events(
                    telemetry, rank=1)):
                os.kill(os.getpid(), signal.SIGTERM)  # as a terminated Dagster run
                return
            time.sleep(0.1)

    threading.Thread(target=stop_when_training, daemon=True).start()
    with pytest.raises(runs.RunInterruptedError) as caught:
        run(state, request(nodes=2, max_steps=60, grad_accum_steps=2),
            provider=provider([0] * 100_000))
    stopped = caught.value.summary
    assert stopped.status == "preempted" and 1 <= stopped.steps < 60
    assert "SIGTERM to the train job" in stopped.pending
    summary = run(state, request(nodes=2, max_steps=60, grad_accum_steps=2),
                  provider=provider([0] * 100_000))
    assert summary.status == "completed" and summary.resumed_from_step == stopped.steps


@pytest.mark.slow
def test_the_lever_guard_and_live_control_reach_the_gang(state):
    # The guard's reference: a fixed-schedule run of the same schedule, in one process.
    schedule = dict(max_steps=8, eval_every_steps=2, grad_accum_steps=2)
    run(state, request(run_id="fixed", **schedule), provider=provider([0] * 100_000))
    from training.live_control import LIVE_CONTROL_FILE, write_live_control

    write_live_control(state / "runs" / "run-a" / LIVE_CONTROL_FILE, preemption_risk=0.5,
                       reason="test: the slow layer's risk")
    summary = run(state, request(nodes=2, lever_guard=True, fast_policy="heuristic", **schedule),
                  provider=provider([0] * 100_000))
    assert summary.status == "completed"
    decisions = [e for e in read_run_events(state / "runs" / "run-a" / "telemetry" / "run-a",
                                            rank=0) if e["type"] == "decision"]
    guard = [e for e in decisions if e["policy"] == "lever_guard"]
    assert guard and "run fixed" in guard[0]["reason"], "the guard judged against run 'fixed'"
    live = [e for e in decisions if e["policy"] == "slow_policy"]
    assert live and live[0]["action"]["preemption_risk"] == 0.5
    fast = [e for e in decisions if e["layer"] == "fast" and e["step"] > live[0]["step"]]
    assert fast and {e["observation"]["preemption_risk"] for e in fast} == {0.5}


@pytest.mark.slow
def test_the_regions_fast_champion_runs_on_rank_0(state):
    from tests.test_champion_loading import _champion

    _champion("fast")  # in this test's private TRAINWISE_HOME, region us-west-2
    summary = run(state, request(nodes=2, grad_accum_steps=2, fast_policy="heuristic"),
                  provider=provider([0] * 100_000))
    assert summary.fast_policy == "trainwise_learned_fast"
    decisions = [e for e in read_run_events(state / "runs" / "run-a" / "telemetry" / "run-a")
                 if e["type"] == "decision" and e["layer"] == "fast"]
    assert decisions and {(e["rank"], e["policy"]) for e in decisions} == {
        (0, "trainwise_learned_fast")}
    assert (state / "runs" / "run-a" / "gang" / "fast_champion.npz").is_file(), "pinned"


def test_a_batch_answer_with_fewer_micro_batches_than_ranks_is_fitted_to_the_gang():
    from controllers.fast_types import FastAction
    from training.ddp_worker import GangBatchFit

    class Halve(NoOpFastPolicy):
        name = "halve_accum"

        def act(self, observation):
            return FastAction(micro_batch_size=9, grad_accum_steps=1, learning_rate=1e-3,
                              rank_work_shares=(0.5, 0.5), reason="bigger micro batch")

    fitted = GangBatchFit(Halve(), world_size=2)
    action = fitted.act(None)
    assert (action.micro_batch_size, action.grad_accum_steps) == (5, 2), "global 9 -> 10"
    assert action.reason.startswith("bigger micro batch; 2 ranks: 1 x 9 became 2 x 5")
    assert fitted.name == "halve_accum"
    alone = GangBatchFit(Halve(), world_size=1).act(None)
    assert (alone.micro_batch_size, alone.grad_accum_steps) == (9, 1), "one process: as asked"


@pytest.mark.slow
@pytest.mark.integration
def test_rank_0_uploads_the_gangs_checkpoints_to_s3_on_moto(state, tmp_path, monkeypatch):
    from tests.test_checkpoint_upload import BUCKET, Moto
    from trainwise.object_store import S3ObjectStore

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")  # the ranks inherit the job's chain
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    server = Moto(tmp_path)
    server.start()
    try:
        store = S3ObjectStore(server.client(), BUCKET)
        summary = run(state, request(nodes=2, grad_accum_steps=2), provider=provider([0] * 10**5),
                      store=store)
        assert summary.status == "completed" and not summary.pending
        key = f"{runs.checkpoint_prefix(PARTITION, 'run-a')}/{summary.checkpoint_uri.rsplit('/')[-1]}"
        assert summary.checkpoint_uri == store.uri(key)
        assert store.exists(key + COMMIT_SUFFIX), "committed after the upload"
    finally:
        server.stop()
