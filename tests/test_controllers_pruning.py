import math

import pytest

from controllers.pruning import PruningConfig, decide_pruning_rate
from controllers.slow_types import DataSummary, LossCurve, Progress

DATA = DataSummary(num_examples=10_000, mean_loss_score=2.0, std_loss_score=1.0,
                   share_below_mean=0.6)  # cv 0.5: full dispersion


def curve(*losses: float) -> LossCurve:
    return LossCurve(eval_losses=tuple(losses), eval_steps=tuple(range(0, 100 * len(losses), 100)),
                     tokens_seen=1_000_000)


def progress(fraction: float) -> Progress:
    return Progress(work_done=fraction * 1e6, work_total=1e6, elapsed_s=600.0, time_left_s=3000.0)


IMPROVING = curve(3.0, 2.6, 2.3, 2.1)


def test_improving_run_with_spread_scores_gets_the_full_rate():
    d = decide_pruning_rate(DATA, IMPROVING, progress(0.3))
    assert d.rate == pytest.approx(0.5)
    assert d.upweight == pytest.approx(2.0)  # unbiased rescaling 1 / (1 - r)
    assert d.numbers["pruned_share_of_data"] == pytest.approx(0.3)


def test_rate_scales_with_score_dispersion():
    narrow = DataSummary(10_000, 2.0, 0.5, 0.5)  # cv 0.25: half of full_dispersion_cv
    assert decide_pruning_rate(narrow, IMPROVING, progress(0.3)).rate == pytest.approx(0.25)


def test_final_anneal_trains_on_full_data():
    d = decide_pruning_rate(DATA, IMPROVING, progress(0.9))
    assert d.rate == 0.0 and d.upweight == 1.0 and "anneal" in d.reason
    assert decide_pruning_rate(DATA, IMPROVING, progress(0.87)).rate > 0.0


def test_regression_beyond_threshold_drops_rate_to_zero():
    d = decide_pruning_rate(DATA, curve(3.0, 2.5, 2.2, 2.3), progress(0.4))  # +4.5% over best
    assert d.rate == 0.0 and "regressed" in d.reason
    assert d.numbers["regression_rel"] == pytest.approx(0.1 / 2.2)


def test_small_regression_lowers_the_rate():
    d = decide_pruning_rate(DATA, curve(3.0, 2.5, 2.2, 2.22), progress(0.4))  # +0.9%
    assert d.rate == pytest.approx(0.25)


def test_flat_curve_lowers_the_rate():
    d = decide_pruning_rate(DATA, curve(2.0, 1.999, 1.998, 1.997), progress(0.4))
    assert d.rate == pytest.approx(0.25) and "flat" in d.reason


def test_empty_history_is_the_documented_fallback_full_data():
    d = decide_pruning_rate(DATA, curve(), progress(0.1))
    assert d.rate == 0.0 and "no eval loss" in d.reason


@pytest.mark.parametrize("data, loss_curve, name", [
    (DataSummary(10, math.nan, 1.0, 0.5), IMPROVING, "mean_loss_score"),
    (DataSummary(10, 2.0, -1.0, 0.5), IMPROVING, "std_loss_score"),
    (DataSummary(10, 2.0, 1.0, 1.5), IMPROVING, "share_below_mean"),
    (DATA, curve(2.0, math.nan), r"eval_losses\[1\]"),
])
def test_bad_inputs_raise_naming_the_field(data, loss_curve, name):
    with pytest.raises(ValueError, match=name):
        decide_pruning_rate(data, loss_curve, progress(0.4))


def test_config_keeps_rate_below_one():
    with pytest.raises(ValueError, match="max_rate"):
        PruningConfig(max_rate=1.0)
