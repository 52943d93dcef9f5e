"""SlowEnv / FastEnv: gymnasium and stable-baselines3 checks, seeding, exact slow-layer reward."""

import time

import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from stable_baselines3.common.env_checker import check_env as sb3_check_env

from cloud.simulator import simulate
from rl.cells import heuristic_for, make_split
from rl.envs import FastEnv, SlowEnv
from rl.slow_obs import SLOW_OBS_SIZE, apply_slow_choice, safety_net
from tests.shared_data import needs_spot_data

pytestmark = needs_spot_data


@pytest.fixture(scope="module")
def split():
    return make_split(region="us-west-2", windows_per_zone=6)


def _episode(env, action, seed=0, options=None):
    obs, _ = env.reset(seed=seed, options=options)
    total, steps, info = 0.0, 0, {}
    while True:
        obs, reward, terminated, truncated, info = env.step(np.asarray(action))
        total += reward
        steps += 1
        if terminated or truncated:
            return total, steps, info


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_both_envs_pass_gymnasium_and_sb3_checks(split):
    slow = SlowEnv(split.train[:2])
    check_env(slow, skip_render_check=True)
    sb3_check_env(slow)
    slow.close()
    fast = FastEnv(episode_ticks=20)
    check_env(fast, skip_render_check=True)
    sb3_check_env(fast)


def test_slow_env_return_is_the_simulators_cost_and_heuristic_choice_is_the_heuristic(split):
    cell = split.train[0]
    env = SlowEnv([cell])
    start = time.perf_counter()
    total, steps, info = _episode(env, [0, 0])
    steps_per_s = steps / (time.perf_counter() - start)
    direct = simulate(heuristic_for(cell), cell.job, cell.rules, cell.market, home_zone=cell.home_zone)
    assert info["cost_usd"] == pytest.approx(direct.cost_usd)
    assert -total * env.norm_usd == pytest.approx(direct.cost_usd, rel=1e-9)
    assert info["deadline_met"]
    assert steps_per_s > 500, f"{steps_per_s:.0f} steps/s"
    env.close()


def test_slow_env_is_seeded_and_reset_mid_episode_is_clean(split):
    env = SlowEnv(split.train)
    first = env.reset(seed=7)[1]["cell_index"]
    for _ in range(5):
        env.step(env.action_space.sample())
    assert env.reset(seed=7)[1]["cell_index"] == first  # abandoned simulation was stopped
    obs, _ = env.reset(seed=3)
    assert obs.shape == (SLOW_OBS_SIZE,) and obs.dtype == np.float32
    env.close()


def test_safety_net_keeps_the_deadline_even_when_the_policy_always_waits(split):
    """'wait' forever would miss every deadline; the masked safety net forces on-demand."""
    cell = split.train[0]
    env = SlowEnv([cell])
    _, _, info = _episode(env, [4, 0])
    assert info["deadline_met"], "safety net failed: deadline missed"
    env.close()


def test_apply_slow_choice_refuses_out_of_range_actions(split):
    env = SlowEnv(split.train[:1])
    env.reset(seed=0)
    with pytest.raises(ValueError, match="out of range"):
        apply_slow_choice(env._obs, env._heuristic_action, 9, 0)
    assert safety_net(env._obs) is None  # the first tick has slack
    env.close()


def test_fast_env_is_seeded_and_measures_steps_per_second():
    env = FastEnv(episode_ticks=50)
    start = time.perf_counter()
    a = _episode(env, [0, 0, 0], seed=5)
    steps_per_s = a[1] / (time.perf_counter() - start)
    b = _episode(env, [0, 0, 0], seed=5)
    assert a[0] == b[0] and a[1] == 50
    assert steps_per_s > 500, f"{steps_per_s:.0f} steps/s"
    # Doubling the batch every tick past the noise scale wastes examples: a worse return.
    assert _episode(env, [0, 2, 0], seed=5)[0] < a[0]
