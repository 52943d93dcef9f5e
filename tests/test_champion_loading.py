"""The trainer and the slow tick put the region's promoted champion in charge, and fall back to
the heuristic (saying why) when there is none or its file is refused."""

import dataclasses
import json
import math

import numpy as np
import pytest

from controllers.allocation_heuristic import TrainwiseAllocationPolicy
from controllers.fast_heuristic import HeuristicFastPolicy
from controllers.fast_types import FastObservation
from rl.fast_obs import BATCH_CHOICES, FAST_OBS_LAYOUT, NOTICE_CHOICES, SHARE_CHOICES
from rl.fast_path import LearnedAllocationPolicy, LearnedFastPolicy
from rl.policy_file import PolicyWeights, save_policy
from rl.retrain import policy_dir
from rl.slow_obs import CHECKPOINT_CHOICES_S, SLOW_CHOICES, SLOW_OBS_LAYOUT
from trainwise import champion, runs, settings, slow_tick

REGION = "us-west-2"
OBS = FastObservation(
    step=100, elapsed_s=60.0, train_loss=2.5, grad_norm=1.2, grad_noise_scale=math.nan,
    micro_batch_size=16, grad_accum_steps=2, learning_rate=1e-3,
    rank_step_time_ms=(100.0, 100.0), dataloader_queue_depth=4, preemption_notice_s=None,
    preemption_risk=0.05, seconds_since_checkpoint=200.0, checkpoint_cost_s=10.0)


def _weights(kind: str, region: str = REGION, version: int = 3) -> PolicyWeights:
    """Small random hidden layer; the head's bias fixes the choice (fast: double the batch)."""
    layout = FAST_OBS_LAYOUT if kind == "fast" else SLOW_OBS_LAYOUT
    nvec = ((len(SHARE_CHOICES), len(BATCH_CHOICES), len(NOTICE_CHOICES)) if kind == "fast"
            else (len(SLOW_CHOICES), len(CHECKPOINT_CHOICES_S)))
    rng = np.random.default_rng(0)
    hidden = [(rng.normal(size=(8, len(layout))).astype(np.float32) * 0.01,
               np.zeros(8, np.float32))]
    bias = np.zeros(sum(nvec), np.float32)
    for start, pick in zip(np.cumsum((0, *nvec[:-1])), (0, 2, 0)):
        bias[start + pick] = 10.0
    return PolicyWeights(hidden, (np.zeros((sum(nvec), 8), np.float32), bias), nvec, layout,
                         kind, region, "test window", version)


def _champion(kind: str, **kwargs) -> None:
    save_policy(_weights(kind, **kwargs), policy_dir(kind, REGION) / "champion.npz")


def test_without_a_champion_the_heuristic_runs_and_the_reason_says_so():
    policy, reason = runs.fast_policy_in_charge("heuristic", REGION)
    assert isinstance(policy, HeuristicFastPolicy)
    assert f"no fast champion for {REGION}" in reason
    allocation, reason = champion.slow_policy_in_charge(REGION, TrainwiseAllocationPolicy())
    assert isinstance(allocation, TrainwiseAllocationPolicy)
    assert f"no slow champion for {REGION}" in reason


def test_a_champion_written_by_rl_is_loaded_and_used():
    _champion("fast")
    policy, reason = runs.fast_policy_in_charge("heuristic", REGION)
    assert isinstance(policy, LearnedFastPolicy) and policy.name == "trainwise_learned_fast"
    assert f"fast champion v3 for {REGION} in charge" in reason
    action = policy.act(OBS)
    assert action.reason == "rl fast (0,2,0)"  # the network's choice: double the batch
    assert action.micro_batch_size * action.grad_accum_steps == 64
    # NaN at decision time: the learned policy acts as the heuristic for that decision.
    nan_action = policy.act(dataclasses.replace(OBS, seconds_since_checkpoint=math.nan))
    assert "refused the observation" in nan_action.reason

    _champion("slow")
    allocation, reason = champion.slow_policy_in_charge(REGION, TrainwiseAllocationPolicy())
    assert isinstance(allocation, LearnedAllocationPolicy)
    assert f"slow champion v3 for {REGION} in charge" in reason
    # "noop" is an explicit choice: no champion lookup.
    assert runs.fast_policy_in_charge("noop", REGION)[0].name != policy.name


@pytest.mark.parametrize("damage", ["garbage", "other_region", "pickle"])
def test_a_refused_champion_leaves_the_heuristic_in_charge_with_the_refusal(damage):
    path = policy_dir("fast", REGION) / "champion.npz"
    if damage == "garbage":
        path.parent.mkdir(parents=True)
        path.write_bytes(b"not a policy: import os; os.system('touch /tmp/pwned')")
        expected = "not a readable npz"
    elif damage == "other_region":
        save_policy(_weights("fast", region="eu-west-1"), path)
        expected = "trained for region 'eu-west-1'"
    else:  # an object array: loading it would need unpickling, which is never done
        path.parent.mkdir(parents=True)
        with open(path, "wb") as f:
            np.savez(f, header=np.array([{"x": 1}], dtype=object))
        expected = "refused"
    policy, reason = runs.fast_policy_in_charge("heuristic", REGION)
    assert isinstance(policy, HeuristicFastPolicy)
    assert "refused" in reason and expected in reason and "heuristic_fast stays in charge" in reason


def _live_run(monkeypatch, region: str) -> None:
    """A run still training (request, no telemetry), with scores and a curriculum stubbed."""
    from training import curriculum, scoring

    home = settings.home_dir()
    run_dir = home / "runs" / "live-1"
    run_dir.mkdir(parents=True)
    (run_dir / "request.json").write_text(json.dumps(
        {"partition": "pystdlib", "max_steps": 100, "region": region}))
    (home / "scores" / "pystdlib").mkdir(parents=True)
    monkeypatch.setattr(scoring, "read_scores",
                        lambda _: type("T", (), {"loss": np.linspace(1.0, 3.0, 64)})())
    monkeypatch.setattr(curriculum, "load_curriculum",
                        lambda _: type("C", (), {"pruning_rate": 0.0})())


def test_the_slow_tick_records_the_allocation_policy_in_charge(monkeypatch):
    _live_run(monkeypatch, REGION)
    tick = slow_tick.decide(settings.home_dir(), "pystdlib")
    assert f"allocation policy: no slow champion for {REGION}" in tick.action.reason
    assert "no market view this tick: nodes kept" in tick.action.reason
    assert tick.action.allocation is None

    _champion("slow")
    tick = slow_tick.decide(settings.home_dir(), "pystdlib")
    assert f"allocation policy: slow champion v3 for {REGION} in charge" in tick.action.reason

    (policy_dir("slow", REGION) / "champion.npz").write_bytes(b"corrupt")
    tick = slow_tick.decide(settings.home_dir(), "pystdlib")
    assert "slow champion for us-west-2 refused" in tick.action.reason
    assert "trainwise_heuristic stays in charge" in tick.action.reason


def test_a_demo_run_trains_under_the_champion_and_records_it():
    """End to end: the demo job's run picks the fast champion of TRAINWISE_REGION, and its
    records (summary, MLflow params, the run folder) name the policy in charge and why."""
    import dagster as dg
    from mlflow.tracking import MlflowClient

    from pipelines.definitions import defs

    _champion("fast")
    with dg.instance_for_test() as instance:
        result = defs.resolve_job_def("demo").execute_in_process(
            partition_key="pystdlib", instance=instance, run_config={"ops": {"checkpoint": {
                "config": {"max_steps": 4, "eval_every_steps": 4, "fast_every_steps": 2}}}})
    assert result.success
    meta = {k: v.value for k, v in
            result.asset_materializations_for_node("checkpoint")[0].metadata.items()}
    assert meta["fast_policy"] == "trainwise_learned_fast"
    params = MlflowClient(tracking_uri=settings.mlflow_uri()).get_run(
        meta["mlflow_run_id"]).data.params
    assert params["policy/fast"] == "trainwise_learned_fast"
    assert f"fast champion v3 for {REGION} in charge" in params["policy/fast_reason"]
    recorded = json.loads((settings.home_dir() / "runs" / meta["run_id"]
                           / "fast_policy.json").read_text())
    assert recorded["fast_policy"] == "trainwise_learned_fast"
