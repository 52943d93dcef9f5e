"""Policy files (npz + JSON header, never unpickled) and the numpy fast path."""

import json
import time

import numpy as np
import pytest

from controllers.fast_heuristic import HeuristicFastPolicy
from rl.envs import FastEnv
from rl.fast_obs import FAST_OBS_LAYOUT
from rl.fast_path import LearnedFastPolicy, NumpyPolicy
from rl.policy_file import PolicyFileError, load_policy, read_header, save_policy, weights_from_sb3
from rl.slow_obs import SLOW_OBS_LAYOUT
from rl.train import train_policy
from tests.shared_data import needs_spot_data

pytestmark = needs_spot_data


@pytest.fixture(scope="module")
def trained():
    model, _ = train_policy(lambda: FastEnv(episode_ticks=32), total_timesteps=256, n_envs=2,
                            n_steps=128, bc_states=128)
    return model


@pytest.fixture
def saved(trained, tmp_path):
    path = tmp_path / "fast.npz"
    header = save_policy(weights_from_sb3(trained, "fast", FAST_OBS_LAYOUT, "us-west-2",
                                          "test window", 3, {"cost": 1.0}), path)
    return path, header


def test_numpy_forward_pass_equals_sb3_predict(trained, saved):
    path, header = saved
    net = NumpyPolicy(load_policy(path, "fast", FAST_OBS_LAYOUT, "us-west-2"))
    rng = np.random.default_rng(0)
    states = rng.normal(0, 2, size=(500, len(FAST_OBS_LAYOUT))).astype(np.float32)
    expected, _ = trained.predict(states, deterministic=True)
    got = np.array([net.predict(s) for s in states])
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(net.predict_batch(states), expected)
    assert header["version"] == 3 and header["train_window"] == "test window"
    assert read_header(path)["weights_sha256"] == header["weights_sha256"]


def test_fast_path_latency_is_microseconds(saved):
    net = NumpyPolicy(load_policy(saved[0], "fast", FAST_OBS_LAYOUT))
    x = np.zeros(len(FAST_OBS_LAYOUT), np.float32)
    times = []
    for _ in range(3000):
        start = time.perf_counter_ns()
        net.predict(x)
        times.append(time.perf_counter_ns() - start)
    p50 = np.percentile(times[500:], 50) / 1000
    # The strict goal (p50 <= 20 us) is measured in benchmarks/rl; here a loose bound that a
    # loaded CI machine still meets, far under sb3's ~160 us.
    assert p50 < 60, f"p50 {p50:.1f} us"


def test_nan_observation_is_refused_and_the_heuristic_answers(saved):
    net = NumpyPolicy(load_policy(saved[0], "fast", FAST_OBS_LAYOUT))
    x = np.zeros(len(FAST_OBS_LAYOUT), np.float32)
    x[2] = np.nan
    with pytest.raises(ValueError, match="max_over_median_step"):
        net.predict(x)
    env = FastEnv(episode_ticks=4)
    env.reset(seed=0)
    obs = env._observation()
    import dataclasses
    bad = dataclasses.replace(obs, rank_step_time_ms=(float("nan"), 1.0, 1.0, 1.0))
    action = LearnedFastPolicy(net, HeuristicFastPolicy()).act(bad)
    assert "refused" in action.reason


@pytest.mark.parametrize("case, match", [
    ("layout", "another observation layout"),
    ("region", "region 'us-west-2', not 'us-east-1'"),
    ("kind", "expected 'slow'"),
    ("corrupt_bytes", "not a readable npz"),
    ("edited_weight", "do not match weights_sha256"),
    ("nan_weight", "do not match weights_sha256|not finite"),
    ("pickle", "not a readable npz|no JSON header"),
])
def test_bad_policy_files_are_refused_with_a_clear_error(saved, tmp_path, case, match):
    path, _ = saved
    kind, layout, region = "fast", FAST_OBS_LAYOUT, None
    if case == "layout":
        layout = FAST_OBS_LAYOUT[:-1] + ("something_else",)
    elif case == "region":
        region = "us-east-1"
    elif case == "kind":
        kind, layout = "slow", SLOW_OBS_LAYOUT
    elif case == "corrupt_bytes":
        data = bytearray(path.read_bytes())
        data[10:200] = b"\x00" * 190
        path.write_bytes(bytes(data))
    elif case in ("edited_weight", "nan_weight"):
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
        arrays["w0"] = arrays["w0"].copy()
        arrays["w0"][0, 0] = np.nan if case == "nan_weight" else arrays["w0"][0, 0] + 1.0
        np.savez(path, **arrays)
    elif case == "pickle":
        # An object array needs pickle to load; allow_pickle=False refuses it before any code runs.
        marker = tmp_path / "ran"
        np.savez(path, header=np.array([{"x": 1}], dtype=object), w0=np.zeros(3))
        assert not marker.exists()
    with pytest.raises(PolicyFileError, match=match):
        load_policy(path, kind, layout, region)


def test_header_is_plain_json(saved):
    header = read_header(saved[0])
    assert json.loads(json.dumps(header)) == header
    assert header["layout"] == list(FAST_OBS_LAYOUT) and header["region"] == "us-west-2"
