import json

import pytest

from benchmarks.time_to_quality import report


def curve(points):
    """[step, samples, cpu_s, loss] rows from (samples, cpu_s, loss)."""
    return [[i, s, c, loss] for i, (s, c, loss) in enumerate(points)]


def run(lever, seed, points, final=None):
    rows = curve(points)
    return {"workload": "w", "lever": lever, "seed": seed, "eval_curve": rows,
            "final_eval_loss": rows[-1][3] if final is None else final}


def test_first_reach_interpolates_between_evaluations():
    rows = curve([(0, 0.0, 4.0), (100, 10.0, 3.0), (200, 20.0, 2.0)])
    assert report.first_reach(rows, 2.5) == pytest.approx((150.0, 15.0))
    assert report.first_reach(rows, 1.0) is None


FIXED = [(0, 0.0, 4.0), (100, 10.0, 3.0), (200, 20.0, 2.0)]
FAST = [(0, 0.0, 4.0), (100, 8.0, 2.0), (200, 16.0, 1.9)]  # reaches 2.0 at 8 CPU-s: 0.4x
BAD = [(0, 0.0, 4.0), (100, 10.0, 3.0), (200, 20.0, 2.5)]  # never reaches 2.0


def test_ratios_to_the_fixed_schedule_and_never_reached():
    runs = [run("fixed", s, FIXED) for s in range(3)] + [run("fast", s, FAST) for s in range(3)]
    runs += [run("bad", s, BAD) for s in range(3)]
    summary = report.summarize(runs, ("fixed", "fast", "bad"), price_usd_per_hour=3.6)
    levers = summary["w"]["levers"]
    # Target 2.0 + 0.002: fixed reaches it at ~19.98 CPU-s, fast at ~8.0 (interpolated).
    assert levers["fast"]["cpu_ratio"]["mean"] == pytest.approx(7.998 / 19.98, rel=1e-3)
    assert levers["fast"]["usd"]["mean"] == pytest.approx(7.998 * 3.6 / 3600, rel=1e-3)
    assert levers["bad"]["cpu_ratio"]["reached"] == 0
    verdicts = {v["lever"]: v for v in summary["w"]["guard_all_seeds"]}
    assert verdicts["bad"]["on"] is False and "costs quality" in verdicts["bad"]["reason"]
    # The fast lever pays on every seed, so the guard's default (leave-one-out) picks it.
    default = levers["default"]
    assert {c["lever"] for c in default["chosen"].values()} == {"fast"}
    assert default["cpu_ratio"]["high"] < 1.0


def test_default_falls_back_to_the_fixed_schedule_when_no_lever_pays():
    runs = [run("fixed", s, FIXED) for s in range(3)] + [run("bad", s, BAD) for s in range(3)]
    default = report.summarize(runs, ("fixed", "bad"), 1.0)["w"]["levers"]["default"]
    assert {c["lever"] for c in default["chosen"].values()} == {"fixed"}
    assert default["cpu_ratio"]["mean"] == 1.0 and default["cpu_ratio"]["high"] == 1.0
    assert "costs quality" in default["chosen"][0]["reasons"]["bad"]


@pytest.mark.slow
def test_quick_suite_writes_results_with_intervals_and_plot(tmp_path):
    from benchmarks.time_to_quality.__main__ import main

    assert main(["--quick", "--out", str(tmp_path), "--workloads", "mnist",
                 "--levers", "fixed,goodput", "--seeds", "2"]) == 0
    document = json.loads((tmp_path / "time_to_quality.json").read_text())
    assert document["meta"]["command"] and "tree_dirty" in document["meta"]
    fixed = document["summary"]["mnist"]["levers"]["fixed"]
    assert fixed["cpu_ratio"]["mean"] == 1.0 and fixed["cpu_ratio"]["seeds"] == 2
    assert "## mnist" in (tmp_path / "time_to_quality.md").read_text()
    assert (tmp_path / "time_to_quality.png").exists()


@pytest.mark.parametrize("eval_every", [8, 24, 25, 30])
def test_every_evaluation_step_gets_a_cpu_reading(eval_every):
    import dataclasses

    from benchmarks.time_to_quality.suite import FULL_WORKLOADS, train_config
    from tests.test_data_pruning_draw import synthetic_examples

    workload = dataclasses.replace(FULL_WORKLOADS[-1], eval_every_steps=eval_every)
    examples = synthetic_examples(kind="image")
    config = train_config(workload, examples, seed=0, run_id="r")
    assert config.eval_every_steps % config.fast_every_steps == 0


def test_runs_are_interleaved_so_no_setting_always_runs_first():
    """Run order biased the CPU measure (the fixed schedule always ran first): levers rotate."""
    from benchmarks.time_to_quality.suite import interleaved

    order = interleaved(("w",), ["fixed", "a", "b"], (0, 1, 2))
    assert sorted((lever, seed) for _, lever, seed in order) == sorted(
        (lever, seed) for lever in ("fixed", "a", "b") for seed in (0, 1, 2))
    firsts = [order[i][1] for i in range(0, 9, 3)]
    assert firsts == ["fixed", "a", "b"]
