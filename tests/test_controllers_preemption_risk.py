"""The preemption-risk model: exact survival maths, and a fit that recovers a known hazard, never
reads past its cutoff, and shrinks sparse zones toward the pool."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cloud.risk_fit import (
    AvailabilityHistory,
    RiskFitConfig,
    fit_risk_model,
    folder_histories,
    log_likelihood,
)
from cloud.traces import default_spot_dir
from controllers.preemption_risk import (
    DOWN,
    POOLED_ZONE,
    UP,
    HazardCurve,
    PreemptionRiskModel,
)

TICK_S = 60.0


def alternating(rng: np.random.Generator, ticks: int, up_rate_per_h, down_rate_per_h,
                tick_s: float = TICK_S) -> np.ndarray:
    """0/1 availability whose runs end with hazard rate(age_s) per hour, tick by tick."""
    out = np.empty(ticks, dtype=np.int64)
    state, age = 1, 0.0
    draws = rng.random(ticks)
    for i in range(ticks):
        out[i] = state
        rate = up_rate_per_h(age) if state else down_rate_per_h(age)
        if draws[i] < -math.expm1(-rate * tick_s / 3600.0):
            state, age = 1 - state, 0.0
        else:
            age += tick_s
    return out


def history(rows, zones=None, tick_s=TICK_S, name="synthetic") -> AvailabilityHistory:
    rows = np.atleast_2d(np.asarray(rows))
    zones = zones or tuple(f"us-test-1{chr(97 + i)}" for i in range(rows.shape[0]))
    return AvailabilityHistory(name, tuple(zones), tick_s, rows, 1)


def young_risky(age_s: float) -> float:
    return 3.0 if age_s < 1800 else 0.3


def test_fit_recovers_a_known_age_dependent_hazard():
    rng = np.random.default_rng(7)
    series = alternating(rng, 300_000, young_risky, lambda age: 2.0)
    config = RiskFitConfig(age_edges_s=(0.0, 1800.0), hour_bins=1)
    model = fit_risk_model(history(series), cutoff_tick=series.size, config=config)
    zone = "us-test-1a"
    up = model.curve(zone, 1, UP).rate_per_h
    down = model.curve(zone, 1, DOWN).rate_per_h
    assert up[0] == pytest.approx(3.0, rel=0.1)
    assert up[1] == pytest.approx(0.3, rel=0.15)
    assert down[0] == pytest.approx(2.0, rel=0.1)
    assert down[1] == pytest.approx(2.0, rel=0.15)
    # The decreasing hazard makes an old run far safer than a fresh one.
    assert model.p_preempt_within(zone, 7200.0, 3600.0) < 0.5 * model.p_preempt_within(
        zone, 0.0, 3600.0)


def test_fit_reads_only_ticks_before_the_cutoff():
    rng = np.random.default_rng(3)
    rows = np.stack([alternating(rng, 20_000, young_risky, lambda a: 1.0) for _ in range(2)])
    cutoff = 12_345
    poisoned = rows.copy()
    poisoned[:, cutoff:] = 1 - poisoned[:, cutoff:]  # a different future
    poisoned[:, cutoff + 100:] = 0  # and then no spot at all
    a = fit_risk_model(history(rows), cutoff).to_dict()
    b = fit_risk_model(history(poisoned), cutoff).to_dict()
    assert a == b
    # The run in progress at the cutoff is read from tick cutoff - 1 and back, not beyond.
    last = rows[0, cutoff - 1]
    start = cutoff - 1
    while start > 0 and rows[0, start - 1] == last:
        start -= 1
    state, age_s = fit_risk_model(history(rows), cutoff).run_at_cutoff[("us-test-1a", 1)]
    assert state == (UP if last else DOWN)
    assert age_s == (cutoff - start) * TICK_S
    # Hours at risk never exceed the ticks before the cutoff.
    model = fit_risk_model(history(rows), cutoff)
    hours = sum(model.curve("us-test-1a", 1, s).exposure_h for s in (UP, DOWN))
    assert hours <= cutoff * TICK_S / 3600.0
    with pytest.raises(ValueError, match="cutoff_tick"):
        fit_risk_model(history(rows), rows.shape[1] + 1)


def test_a_sparse_zone_is_shrunk_toward_the_pool_and_a_rich_one_is_not():
    rng = np.random.default_rng(11)
    rich = alternating(rng, 100_000, lambda a: 1.0, lambda a: 1.0)
    sparse = np.zeros(100_000, dtype=np.int64)
    sparse[10:20:2] = 1  # a few one-tick up runs (raw hazard 60/h), then never again
    config = RiskFitConfig(age_edges_s=(0.0,), hour_bins=1, prior_events=2.0)
    model = fit_risk_model(history([rich, sparse]), 100_000, config=config)
    rich_rate = model.curve("us-test-1a", 1, UP).rate_per_h[0]
    sparse_rate = model.curve("us-test-1b", 1, UP).rate_per_h[0]
    pooled_rate = model.curve(POOLED_ZONE, 1, UP).rate_per_h[0]
    assert rich_rate == pytest.approx(1.0, rel=0.1)
    raw_sparse = 5 / (5 * TICK_S / 3600.0)
    assert raw_sparse == pytest.approx(60.0)
    # Pulled most of the way from its raw 60/h toward the pool.
    assert abs(sparse_rate - pooled_rate) < 0.1 * abs(raw_sparse - pooled_rate)
    # More shrinkage, closer to the pool.
    strong = fit_risk_model(history([rich, sparse]), 100_000,
                            config=RiskFitConfig(age_edges_s=(0.0,), hour_bins=1,
                                                 prior_events=20.0))
    assert abs(strong.curve("us-test-1b", 1, UP).rate_per_h[0] - pooled_rate) < abs(
        sparse_rate - pooled_rate)


def test_no_data_before_the_cutoff_falls_back_to_the_prior_or_a_constant():
    rng = np.random.default_rng(5)
    other = history(alternating(rng, 50_000, lambda a: 4.0, lambda a: 4.0), name="other")
    target = history(alternating(rng, 1_000, lambda a: 0.1, lambda a: 0.1))
    config = RiskFitConfig(age_edges_s=(0.0,), hour_bins=1)
    with_prior = fit_risk_model(target, 0, prior=[other], config=config)
    assert with_prior.curve("us-test-1a", 1, UP).rate_per_h[0] == pytest.approx(4.0, rel=0.15)
    alone = fit_risk_model(target, 0, config=config)
    assert "constant prior" in alone.fitted_on
    assert alone.mean_run_s("us-test-1a") == pytest.approx(7200.0, rel=1e-3)


def runs_series(up_lengths: list[int], down_ticks: int) -> np.ndarray:
    """Up runs of the given lengths (ticks), each followed by `down_ticks` down ticks."""
    return np.concatenate([np.r_[np.ones(n, dtype=np.int64), np.zeros(down_ticks, np.int64)]
                           for n in up_lengths])


def test_an_age_no_run_reached_reads_its_younger_neighbour_not_the_flat_rate():
    # Many 5-tick runs and some 100-tick (100 min) ones: no run reaches 2 h, so the two oldest
    # bins have no exposure at all. Real case: the first half of a flapping market, then a
    # calm spell whose runs are older than any the fit saw.
    series = np.tile(runs_series([5] * 9 + [100], 3), 40)
    edges = (0.0, 1800.0, 7200.0, 14400.0)
    chained = fit_risk_model(history(series), series.size, config=RiskFitConfig(
        age_edges_s=edges, hour_bins=1, age_chained_prior=True))
    flat = fit_risk_model(history(series), series.size, config=RiskFitConfig(
        age_edges_s=edges, hour_bins=1, age_chained_prior=False))
    for model in (chained, flat):
        assert model.curve("us-test-1a", 1, UP).exposure_h > 0
    c = chained.curve(POOLED_ZONE, 1, UP).rate_per_h
    f = flat.curve(POOLED_ZONE, 1, UP).rate_per_h
    # Where there are data the two agree (the pseudo-events are few against 400 runs).
    assert c[0] == pytest.approx(f[0], rel=0.02)
    assert c[1] == pytest.approx(f[1], rel=0.05)
    # The empty old bins: the flat rate of all ages (young runs dominate it) against the rate of
    # the oldest ages seen.
    assert f[2] > 2 * f[1] and f[3] > 2 * f[1]
    assert c[2] == pytest.approx(c[1], rel=0.05) and c[3] == pytest.approx(c[1], rel=0.05)
    # So a run 3 h old is expected to last longer than a fresh one, not shorter.
    zone = "us-test-1a"
    assert chained.expected_run_s(zone, 3 * 3600.0, 24 * 3600.0) > 2 * flat.expected_run_s(
        zone, 3 * 3600.0, 24 * 3600.0)
    assert chained.expected_run_s(zone, 3 * 3600.0, 24 * 3600.0) > chained.expected_run_s(
        zone, 0.0, 24 * 3600.0)


def test_constant_hazard_maths_is_exact():
    model = PreemptionRiskModel.constant(mean_up_s=3600.0, mean_down_s=1800.0)
    zone = "anywhere"  # falls back on the pooled curve
    assert model.hazard_per_h(zone, 5000.0) == pytest.approx(1.0)
    assert model.survival(zone, 0.0, 1800.0) == pytest.approx(math.exp(-0.5))
    assert model.p_preempt_within(zone, 9e4, 3600.0) == pytest.approx(1 - math.exp(-1.0))
    assert model.p_return_within(zone, 0.0, 1800.0) == pytest.approx(1 - math.exp(-1.0))
    assert model.expected_run_s(zone, 0.0, 7200.0) == pytest.approx(3600.0 * (1 - math.exp(-2)))
    assert model.availability_share(zone) == pytest.approx(2 / 3, rel=1e-3)


def test_piecewise_age_and_time_of_day_integrate_exactly():
    curve = HazardCurve((0.0, 3600.0), (2.0, 0.5), (1.0, 3.0))  # 12 h halves of the day
    model = PreemptionRiskModel({(UP, "z", 1): curve, (DOWN, "z", 1): curve})
    # From age 0 at 11:00: 1 h at rate 2 (first half-day), then 1 h at 0.5 x 3 (second half).
    cum = 2.0 + 1.5
    assert model.survival("z", 0.0, 7200.0, trace_time_s=11 * 3600.0) == pytest.approx(
        math.exp(-cum))
    expected = (1 - math.exp(-2.0)) / 2.0 + math.exp(-2.0) * (1 - math.exp(-1.5)) / 1.5
    assert model.expected_run_s("z", 0.0, 7200.0, trace_time_s=11 * 3600.0) == pytest.approx(
        expected * 3600.0)
    assert model.hazard_per_h("z", 4000.0, trace_time_s=13 * 3600.0) == pytest.approx(1.5)


def test_round_trip_and_lookup_fallbacks():
    rng = np.random.default_rng(2)
    rows = np.stack([alternating(rng, 5_000, young_risky, lambda a: 1.0) for _ in range(2)])
    model = fit_risk_model(history(rows), 4_000)
    again = PreemptionRiskModel.from_dict(model.to_dict())
    assert again.to_dict() == model.to_dict()
    assert again.survival("us-test-1b", 600.0, 3600.0, 7e4) == model.survival(
        "us-test-1b", 600.0, 3600.0, 7e4)
    # An unknown zone reads the pooled curve; a level above the fitted ones reads the largest.
    assert model.curve("eu-nowhere-1z", 1, UP) is model.curve(POOLED_ZONE, 1, UP)
    assert model.curve("us-test-1a", 4, UP) is model.curve("us-test-1a", 1, UP)


@pytest.mark.parametrize("call, match", [
    (lambda m: m.survival("z", -1.0, 60.0), "age_s"),
    (lambda m: m.survival("z", 0.0, math.nan), "horizon_s"),
    (lambda m: m.curve("z", 1, "sideways"), "state"),
    (lambda m: m.curve("z", 0, UP), "spot_nodes"),
])
def test_bad_questions_raise_clear_errors(call, match):
    curve = HazardCurve((0.0,), (1.0,))
    model = PreemptionRiskModel({(UP, "z", 1): curve, (DOWN, "z", 1): curve})
    with pytest.raises(ValueError, match=match):
        call(model)


def test_bad_curves_are_refused():
    with pytest.raises(ValueError, match="start at 0"):
        HazardCurve((10.0,), (1.0,))
    with pytest.raises(ValueError, match="last age bin"):
        HazardCurve((0.0, 60.0), (1.0, 0.0))
    with pytest.raises(ValueError, match="at least one"):
        PreemptionRiskModel({})


@pytest.mark.skipif(not default_spot_dir().is_dir(), reason="shared spot data missing")
def test_on_real_traces_the_fitted_model_predicts_held_out_ticks_better_than_a_constant():
    target = folder_histories("availability-1node-aws-2023-02")[0]
    prior = folder_histories("preemption-1node-aws-2023-04")
    cutoff = 10_000
    fitted = fit_risk_model(target, cutoff, prior)
    zone_only = AvailabilityHistory(target.name, target.zones[-1:], target.tick_s,
                                    target.available[-1:], 1)
    constant = PreemptionRiskModel.constant(
        fitted.mean_run_s(zone_only.zones[0]), fitted.mean_run_s(zone_only.zones[0], state=DOWN))
    held_out = (cutoff, cutoff + 3_000)
    fitted_ll, hours = log_likelihood(fitted, zone_only, *held_out)
    constant_ll, _ = log_likelihood(constant, zone_only, *held_out)
    assert hours == pytest.approx(3_000 * target.tick_s / 3600.0)
    assert fitted_ll > constant_ll


def test_a_gang_level_without_ticks_of_its_own_reads_a_gang_scaled_prior_when_asked():
    """Leave-one-collection-out gives a 16-node market no ticks of its own: with the gang prior
    on, its whole-gang level is priced as 16 ** 0.23 independent nodes (shorter, rarer runs);
    off (default), every level reads the one-node global curve."""
    rng = np.random.default_rng(11)
    other = history(alternating(rng, 40_000, lambda a: 0.5, lambda a: 1.0), name="other")
    zones = ("us-test-1a",)
    target = AvailabilityHistory("gang16", zones, TICK_S, np.full((1, 10), 16), 16)
    base = RiskFitConfig(age_edges_s=(0.0,), hour_bins=1)
    off = fit_risk_model(target, 0, prior=[other], spot_levels=[1, 16], config=base)
    assert off.mean_run_s("us-test-1a", 16) == pytest.approx(off.mean_run_s("us-test-1a", 1))
    on = fit_risk_model(target, 0, prior=[other], spot_levels=[1, 16],
                        config=RiskFitConfig(age_edges_s=(0.0,), hour_bins=1,
                                             gang_hazard_exponent=0.23))
    k = 16 ** 0.23
    one_up = on.curve("us-test-1a", 1, UP).rate_per_h[0]
    assert one_up == pytest.approx(off.curve("us-test-1a", 1, UP).rate_per_h[0])
    assert on.curve("us-test-1a", 16, UP).rate_per_h[0] == pytest.approx(one_up * k, rel=1e-6)
    share_one = on.availability_share("us-test-1a", 1)
    assert on.availability_share("us-test-1a", 16) == pytest.approx(share_one ** k, rel=1e-3)
    # With ticks of its own, the level's own runs outweigh the scaled prior.
    own = AvailabilityHistory("gang16", zones, TICK_S, 16 * alternating(
        rng, 40_000, lambda a: 0.2, lambda a: 2.0)[None, :], 16)
    fitted = fit_risk_model(own, 40_000, prior=[other], spot_levels=[16],
                            config=RiskFitConfig(age_edges_s=(0.0,), hour_bins=1,
                                                 gang_hazard_exponent=0.23))
    assert fitted.curve("us-test-1a", 16, UP).rate_per_h[0] == pytest.approx(0.2, rel=0.2)


def test_the_gang_exponent_must_be_a_share():
    with pytest.raises(ValueError, match="gang_hazard_exponent"):
        RiskFitConfig(gang_hazard_exponent=1.5)


def test_a_market_that_never_ended_a_run_reads_as_safe_not_as_the_prior():
    """A gang never down in the fitted ticks is one left- and right-censored run: its hours
    count (no event), so its hazard falls well below a risky prior's instead of inheriting it
    (found on a calm 16-node market: trainwise paid the whole on-demand bill)."""
    rng = np.random.default_rng(3)
    risky = history(alternating(rng, 50_000, lambda a: 2.0, lambda a: 2.0), name="risky")
    calm = history([np.ones(3_000, dtype=np.int64), np.ones(3_000, dtype=np.int64)])
    config = RiskFitConfig(age_edges_s=(0.0,), hour_bins=1)
    model = fit_risk_model(calm, 3_000, prior=[risky], config=config)
    prior_rate = fit_risk_model(calm, 0, prior=[risky], config=config).curve(
        "us-test-1a", 1, UP).rate_per_h[0]
    assert prior_rate == pytest.approx(2.0, rel=0.15)
    calm_rate = model.curve("us-test-1a", 1, UP).rate_per_h[0]
    # 50 h up in each zone, no end: k / (hours + k / prior) with k = 2 pseudo-events.
    assert calm_rate < 0.1 * prior_rate
    assert model.curve(POOLED_ZONE, 1, UP).rate_per_h[0] < 0.1 * prior_rate
    assert model.mean_run_s("us-test-1a") > 10 * 3600.0


def test_the_first_run_of_a_series_that_changes_is_still_skipped():
    """Its start is unknown: a series with a change counts only the runs after the first."""
    config = RiskFitConfig(age_edges_s=(0.0,), hour_bins=1)
    series = np.r_[np.ones(500, dtype=np.int64), np.zeros(100, np.int64),
                   np.ones(200, np.int64)]
    from cloud.risk_fit import count_runs

    counts, at_end = count_runs(series.astype(bool), TICK_S, 0.0, config)
    assert counts.hours.sum() == pytest.approx(300 * TICK_S / 3600.0)  # not the first 500
    assert counts.events.sum() == 1  # the down run's end
    assert at_end == (UP, 200 * TICK_S)
