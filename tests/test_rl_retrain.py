"""Champion handling: the gate's decision promotes, a bad champion file falls back to the heuristic,
and a NaN observation makes the learned slow policy act as the heuristic."""

import dataclasses
import json

import numpy as np
import pytest

from rl.cells import heuristic_for, make_split
from rl.envs import SlowEnv
from rl.fast_path import LearnedAllocationPolicy, NumpyPolicy
from rl.policy_file import PolicyWeights, save_policy
from rl.retrain import apply_gate, load_champion_slow, policy_dir
from rl.slow_obs import CHECKPOINT_CHOICES_S, SLOW_CHOICES, SLOW_OBS_LAYOUT
from tests.shared_data import needs_spot_data

pytestmark = needs_spot_data

REGION = "us-west-2"


def _weights(choice: int) -> PolicyWeights:
    """A network that always picks `choice` (bias only), for exact control in tests."""
    rng = np.random.default_rng(0)
    n = len(SLOW_OBS_LAYOUT)
    hidden = [(rng.normal(size=(8, n)).astype(np.float32) * 0.01, np.zeros(8, np.float32))]
    logits = len(SLOW_CHOICES) + len(CHECKPOINT_CHOICES_S)
    bias = np.zeros(logits, np.float32)
    bias[choice] = 10.0
    bias[len(SLOW_CHOICES)] = 10.0
    return PolicyWeights(hidden, (np.zeros((logits, 8), np.float32), bias),
                         (len(SLOW_CHOICES), len(CHECKPOINT_CHOICES_S)), SLOW_OBS_LAYOUT, "slow",
                         REGION, "test", 1)


def _candidate(promote: bool) -> None:
    folder = policy_dir("slow", REGION)
    save_policy(_weights(0), folder / "v1.npz")
    (folder / "gate_v1.json").write_text(json.dumps({
        "promote": promote, "reason": "test", "cost_ratio": 0.9, "margin": 0.01,
        "candidate_misses": 0, "incumbent_misses": 0}))


def test_a_promoted_candidate_becomes_champion_and_a_refused_one_does_not():
    _candidate(promote=False)
    assert apply_gate("slow", REGION)["champion_version"] is None
    assert load_champion_slow(REGION) is None
    _candidate(promote=True)
    assert apply_gate("slow", REGION)["champion_version"] == 1
    assert load_champion_slow(REGION).weights.version == 1


def test_a_corrupt_champion_leaves_the_heuristic_in_charge():
    _candidate(promote=True)
    apply_gate("slow", REGION)
    champion = policy_dir("slow", REGION) / "champion.npz"
    champion.write_bytes(b"not a policy, maybe an attack: import os")
    assert load_champion_slow(REGION) is None


def test_no_candidate_names_the_asset_to_materialize():
    with pytest.raises(FileNotFoundError, match="slow_policy asset"):
        apply_gate("slow", "us-east-2")


def test_nan_in_the_observation_makes_the_learned_policy_act_as_the_heuristic():
    cell = make_split(region=REGION, windows_per_zone=6, kinds=("single_zone",)).train[0]
    env = SlowEnv([cell])
    env.reset(seed=0)
    obs = dataclasses.replace(env._obs, work_done_h=float("nan"))
    env.close()
    learned = LearnedAllocationPolicy(NumpyPolicy(_weights(4)), heuristic_for(cell))  # 4 = wait
    action = learned.act(obs)
    assert "refused the observation" in action.reason and "work_done_frac" in action.reason
    # With a clean observation the same network overrides the heuristic (waits).
    clean = learned.act(dataclasses.replace(obs, work_done_h=0.0))
    assert clean.reason == "rl: wait"
