"""PPO with the behaviour-cloned warm start: version 1 acts exactly as the heuristic."""

import tempfile

import numpy as np
import pytest

from cloud.simulator import simulate
from rl.cells import heuristic_for, make_split
from rl.envs import FastEnv, SlowEnv
from rl.fast_path import LearnedAllocationPolicy, NumpyPolicy
from rl.policy_file import weights_from_sb3
from rl.slow_obs import SLOW_OBS_LAYOUT
from rl.train import train_policy
from tests.shared_data import needs_spot_data

pytestmark = needs_spot_data


@pytest.fixture(scope="module")
def split():
    return make_split(region="us-west-2", windows_per_zone=6, kinds=("single_zone",))


def test_tiny_ppo_on_the_fast_env_runs_and_logs_a_curve(tmp_path, monkeypatch):
    # Training leaves nothing in the temp folder (SB3's default logger makes an SB3-<time>
    # folder there on every learn()).
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    curve = []
    model, report = train_policy(lambda: FastEnv(episode_ticks=32), total_timesteps=512, n_envs=2,
                                 n_steps=128, bc_states=256,
                                 log=lambda name, value, step: curve.append((name, step, value)))
    assert report.bc_agreement == 1.0
    assert report.ppo_timesteps == 512 and report.episode_returns
    assert any(name == "episode_return" for name, _, _ in curve)
    assert not list(tmp_path.glob("SB3-*"))


def test_version_1_the_clone_costs_exactly_what_the_heuristic_costs(split):
    cells = split.train[:2]
    model, report = train_policy(lambda: SlowEnv(cells), total_timesteps=0, n_envs=1, bc_states=800)
    assert report.bc_agreement == 1.0
    learned = NumpyPolicy(weights_from_sb3(model, "slow", SLOW_OBS_LAYOUT, "us-west-2"))
    for cell in split.held_out[:3]:  # never seen in training
        mine = simulate(LearnedAllocationPolicy(learned, heuristic_for(cell)), cell.job, cell.rules,
                        cell.market, home_zone=cell.home_zone)
        base = simulate(heuristic_for(cell), cell.job, cell.rules, cell.market,
                        home_zone=cell.home_zone)
        assert mine.cost_usd == pytest.approx(base.cost_usd) and mine.deadline_met == base.deadline_met


def test_untrained_ppo_is_not_the_heuristic(split):
    """Without the clone, the random initial policy picks overrides: the warm start matters."""
    from stable_baselines3 import PPO

    env = SlowEnv(split.train[:1])
    fresh = PPO("MlpPolicy", env, seed=1, device="cpu")
    env.close()
    obs = np.random.default_rng(0).normal(size=(200, len(SLOW_OBS_LAYOUT))).astype(np.float32)
    assert np.mean(np.all(fresh.predict(obs, deterministic=True)[0] == 0, axis=1)) < 0.9
