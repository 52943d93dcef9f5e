"""Fault and straggler samplers: empirical distributions that match the files they come from."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cloud.faults import FaultSampler, default_fault_path, load_fault_trace
from cloud.stragglers import StragglerSampler, default_straggler_dir, load_step_inflation

needs_faults = pytest.mark.skipif(not default_fault_path().is_file(), reason="no fault trace")
needs_stragglers = pytest.mark.skipif(
    not default_straggler_dir().is_dir(), reason="no straggler data"
)


@needs_faults
def test_fault_log_pairs_every_start_with_an_end():
    trace = load_fault_trace()
    assert trace.repair_s.size == 584  # the README's 584 fault_start/fault_end pairs
    assert trace.cluster_interarrival_s.size == 583
    assert (trace.repair_s >= 0).all() and (trace.cluster_interarrival_s >= 0).all()
    # 584 faults among 400 nodes over ~345 days: one node faults about every 236 days.
    assert 200 < trace.node_mtbf_s / 86400 < 270


@needs_faults
def test_fault_samplers_match_the_files_mean_and_spread():
    trace = load_fault_trace()
    sampler = FaultSampler(trace, seed=1)
    for sample, observed in (
        (sampler.cluster_interarrival_s(200_000), trace.cluster_interarrival_s),
        (sampler.repair_s(200_000), trace.repair_s),
    ):
        assert sample.mean() == pytest.approx(observed.mean(), rel=0.03)
        assert sample.std() == pytest.approx(observed.std(), rel=0.05)
        assert np.median(sample) == pytest.approx(np.median(observed), rel=0.05)


@needs_faults
def test_a_smaller_group_sees_proportionally_fewer_faults():
    trace = load_fault_trace()
    sampler = FaultSampler(trace, seed=2)
    gaps_16 = sampler.group_interarrival_s(100_000, nodes=16)
    assert gaps_16.mean() == pytest.approx(trace.cluster_interarrival_s.mean() * 400 / 16, rel=0.03)
    horizon_s = 2000 * 86400.0
    times = sampler.fault_times_s(horizon_s, nodes=16)
    assert times == sorted(times) and all(0 <= t < horizon_s for t in times)
    expected = horizon_s / (trace.cluster_interarrival_s.mean() * 400 / 16)
    assert len(times) == pytest.approx(expected, rel=0.25)


@needs_faults
def test_a_short_window_sees_the_long_run_fault_rate():
    # A window starts at an arbitrary instant: no fault at its start just because the log has
    # bursts of simultaneous faults (zero gaps).
    trace = load_fault_trace()
    horizon_s = 52 * 3600.0
    counts = [
        len(FaultSampler(trace, seed=s).fault_times_s(horizon_s, nodes=16)) for s in range(3000)
    ]
    expected = horizon_s / (trace.cluster_interarrival_s.mean() * 400 / 16)
    assert np.mean(counts) == pytest.approx(expected, rel=0.15)


@needs_faults
def test_fault_sampler_is_deterministic_for_a_seed():
    trace = load_fault_trace()
    first = FaultSampler(trace, seed=7).fault_times_s(300 * 86400.0, nodes=16)
    again = FaultSampler(trace, seed=7).fault_times_s(300 * 86400.0, nodes=16)
    other = FaultSampler(trace, seed=8).fault_times_s(300 * 86400.0, nodes=16)
    assert first == again and first != other


def test_bad_fault_logs_are_refused(tmp_path):
    path = tmp_path / "faults.json"
    path.write_text(
        json.dumps(
            [
                {
                    "node_id": "a",
                    "event_time": 1.0,
                    "event_type": "fault_end",
                    "fault_type": {"Desc": "GPU Lost"},
                }
            ]
        )
    )
    with pytest.raises(ValueError, match="ends a fault never started"):
        load_fault_trace(path)
    path.write_text("[]")
    with pytest.raises(ValueError, match="has no events"):
        load_fault_trace(path)
    with pytest.raises(FileNotFoundError, match="TRAINWISE_DATA_DIR"):
        load_fault_trace(tmp_path / "missing.json")


@needs_stragglers
def test_straggler_inflation_matches_the_files():
    inflation = load_step_inflation()
    # 300 + 238 + 248 complete iterations of 10 workers.
    assert inflation.size == 7860
    sampler = StragglerSampler(inflation, seed=3)
    sample = sampler.sample_inflation(200_000)
    assert sample.mean() == pytest.approx(inflation.mean(), rel=0.005)
    assert sample.std() == pytest.approx(inflation.std(), rel=0.03)
    # A worker is at the median of its iteration by construction: the median inflation is ~1.
    assert np.median(inflation) == pytest.approx(1.0, abs=0.01)


@needs_stragglers
def test_the_slowest_rank_slows_a_bigger_gang_more():
    sampler = StragglerSampler(load_step_inflation(), seed=4)
    one, four, sixteen = (sampler.expected_step_slowdown(n) for n in (1, 4, 16))
    assert one == pytest.approx(sampler.inflation.mean(), rel=0.01)
    assert one < four < sixteen
    assert 1.05 < sixteen < 1.4


def test_straggler_bad_input(tmp_path):
    with pytest.raises(FileNotFoundError, match="no job_"):
        load_step_inflation(tmp_path)
    with pytest.raises(ValueError, match="must be at least 1"):
        StragglerSampler(np.array([1.0]), seed=0).sample_step_slowdown(0, 5)
