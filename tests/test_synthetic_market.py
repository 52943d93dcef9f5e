"""Synthetic markets sampled from a risk model: run lengths follow the model's hazards (constant
and age-dependent), the time-of-day factor acts at the phase the model reads, a seed fixes the
market, and bad arguments are refused with an error naming them."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cloud.simulator import Market
from cloud.synthetic_market import run_lengths_s, sample_availability, synthetic_market
from controllers.preemption_risk import DOWN, UP, HazardCurve, PreemptionRiskModel

TICK_S = 600


def grid_mean_run_s(model: PreemptionRiskModel, zone: str, state: str, tick_s: float) -> float:
    """Mean run on the tick grid: P(a run lasts more than k ticks) = S(k ticks) from age 0."""
    total, k = 0.0, 0
    while True:
        survive = model.survival(zone, 0.0, float(k * tick_s), 0.0, 1, state)
        if survive < 1e-12:
            return total * tick_s
        total += survive
        k += 1


def age_dependent_model() -> PreemptionRiskModel:
    """A decreasing hazard: young runs end fast, a run past 4 h rarely does."""
    edges = (0.0, 3600.0, 14400.0)
    curves = {
        (UP, "z", 1): HazardCurve(edges, (2.0, 0.5, 0.1)),
        (DOWN, "z", 1): HazardCurve(edges, (1.5, 0.4, 0.2)),
    }
    return PreemptionRiskModel(curves)


def assert_mean_matches(lengths: np.ndarray, expected_s: float) -> None:
    standard_error = lengths.std(ddof=1) / math.sqrt(lengths.size)
    assert abs(lengths.mean() - expected_s) < 4 * standard_error, (
        f"mean {lengths.mean():.0f} s vs expected {expected_s:.0f} s (SE {standard_error:.0f})")


@pytest.mark.parametrize("model", [PreemptionRiskModel.constant(7200.0, 3600.0, zones=("z",)),
                                   age_dependent_model()], ids=["constant", "age_dependent"])
def test_mean_run_lengths_match_the_model(model):
    available = sample_availability(model, "z", 300_000, TICK_S, seed=7)
    up_s, down_s = run_lengths_s(available, TICK_S)
    assert up_s.size > 5000 and down_s.size > 5000
    for lengths, state in ((up_s, UP), (down_s, DOWN)):
        grid_mean = grid_mean_run_s(model, "z", state, TICK_S)
        # On the tick grid a run lasts whole ticks: within a tick above the continuous mean.
        continuous = model.mean_run_s("z", 1, state)
        assert continuous < grid_mean < continuous + TICK_S
        assert_mean_matches(lengths, grid_mean)
    share = available.mean()
    expected_share = grid_mean_run_s(model, "z", UP, TICK_S) / (
        grid_mean_run_s(model, "z", UP, TICK_S) + grid_mean_run_s(model, "z", DOWN, TICK_S))
    assert abs(share - expected_share) < 0.02


def test_age_dependence_shapes_the_run_length_distribution():
    """P(an up run outlasts 1 h) is the model's survival over 1 h, not that of a memoryless run
    with the same mean (which would be exp(-1 h / mean))."""
    model = age_dependent_model()
    up_s, _ = run_lengths_s(sample_availability(model, "z", 300_000, TICK_S, seed=3), TICK_S)
    # A run of K ticks outlasts k ticks with probability S(k ticks).
    observed = float(np.mean(up_s > 3600.0))
    expected = model.survival("z", 0.0, 3600.0, 0.0, 1, UP)
    error = math.sqrt(expected * (1 - expected) / up_s.size)
    assert abs(observed - expected) < 4 * error
    memoryless = math.exp(-3600.0 / grid_mean_run_s(model, "z", UP, TICK_S))
    assert abs(memoryless - expected) > 10 * error


@pytest.mark.parametrize("utc_offset_s", [0.0, 43200.0])
def test_time_of_day_factor_acts_at_the_models_phase(utc_offset_s):
    """Up runs cannot end while the hour factor is 0 (the first half of the model's day)."""
    curves = {
        (UP, "z", 1): HazardCurve((0.0,), (1.0,), (0.0, 1.0)),
        (DOWN, "z", 1): HazardCurve((0.0,), (2.0,)),
    }
    model = PreemptionRiskModel(curves, utc_offset_s=utc_offset_s)
    available = sample_availability(model, "z", 50_000, TICK_S, seed=11)
    last_up_tick = np.flatnonzero((available[:-1] == 1) & (available[1:] == 0))
    phase_s = (last_up_tick * TICK_S + utc_offset_s) % 86400.0
    assert last_up_tick.size > 100
    assert (phase_s >= 43200.0).all()


def test_same_seed_same_market_and_zones_are_independent_streams():
    model = PreemptionRiskModel.constant(7200.0, 3600.0)  # pooled: every zone reads it
    prices = dict(spot_usd_per_hour=(1.0, 1.0), on_demand_usd_per_hour=(3.0, 3.0))
    first = synthetic_market(model, ("z", "y"), 5000, TICK_S, 42, **prices)
    again = synthetic_market(model, ("z", "y"), 5000, TICK_S, 42, **prices)
    other = synthetic_market(model, ("z", "y"), 5000, TICK_S, 43, **prices)
    assert isinstance(first, Market) and first.spot_available.shape == (2, 5000)
    assert first.tick_s == TICK_S and first.zones == ("z", "y")
    assert np.array_equal(first.spot_available, again.spot_available)
    assert not np.array_equal(first.spot_available, other.spot_available)
    # Same curves, different streams: the zones do not move together.
    assert not np.array_equal(first.spot_available[0], first.spot_available[1])
    alone = synthetic_market(model, ("z",), 5000, TICK_S, 42, (1.0,), (3.0,))
    assert np.array_equal(alone.spot_available[0], first.spot_available[0])


def test_level_above_one_gives_blocks_of_the_gang():
    model = PreemptionRiskModel.constant(7200.0, 3600.0, zones=("z",), spot_nodes=4)
    available = sample_availability(model, "z", 2000, TICK_S, seed=1, spot_nodes=4)
    assert set(np.unique(available)) == {0, 4}


def test_bad_input_is_refused_with_a_named_error():
    model = PreemptionRiskModel.constant(7200.0, 3600.0, zones=("z",))
    with pytest.raises(ValueError, match="n_ticks"):
        sample_availability(model, "z", 0, TICK_S, seed=1)
    with pytest.raises(ValueError, match="tick_s"):
        sample_availability(model, "z", 10, 0, seed=1)
    with pytest.raises(ValueError, match="spot_nodes"):
        sample_availability(model, "z", 10, TICK_S, seed=1, spot_nodes=0)
    with pytest.raises(ValueError, match="seed"):
        sample_availability(model, "z", 10, TICK_S, seed=-1)
    with pytest.raises(ValueError, match="zone 'elsewhere'"):
        sample_availability(model, "elsewhere", 10, TICK_S, seed=1)
    with pytest.raises(ValueError, match="one spot and one on-demand price per zone"):
        synthetic_market(model, ("z",), 10, TICK_S, 1, (1.0, 1.0), (3.0,))
    with pytest.raises(ValueError, match="tick_s"):
        synthetic_market(model, ("z",), 10, 1.5, 1, (1.0,), (3.0,))
    with pytest.raises(ValueError, match="at least one zone"):
        synthetic_market(model, (), 10, TICK_S, 1, (), ())
