"""benchmarks.fidelity's three kinds of window: single-zone, multi-zone and a 4-node gang; the
simulator side is simulated with the same zones, node count and policy as the emulated run."""

from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks import fidelity
from benchmarks.fidelity_calibrate import Calibration
from cloud.simulator import SimResult
from tests.shared_data import needs_spot_data


def _calibration():
    return Calibration(method="test", steps=20, checkpoint_every_steps=5,
                       emulated_per_wall_s=975.0, step_s=100.0, save_s=10.0,
                       changeover_s=360.0, tail_s=500.0, emulated_changeover_s=360.0,
                       emulated_save_s=60.0, emulated_interval_s=3600.0)


def _emulated(cal):
    return SimpleNamespace(deadline_s=2 * (cal.pure_step_s * cal.steps + 360.0))


@needs_spot_data
def test_multi_zone_and_gang_windows_are_real_and_distinct():
    multi = fidelity.pick_multi_zone_windows(3)
    assert len(multi) == 3 and all(w.kind == "multi-zone" for w in multi)
    assert all(len(w.zone_files) == 9 and len(set(w.zone_files)) == 9 for w in multi)
    gangs = fidelity.pick_gang_windows(3)
    assert len(gangs) == 3 and all(w.kind == "gang-4" and w.nodes == 4 for w in gangs)
    assert len({(w.zone_file, w.start_tick) for w in gangs}) == 3
    singles = fidelity.pick_windows(12)
    assert {w.kind for w in singles} == {"single-zone"}


@needs_spot_data
def test_the_simulator_sees_every_zone_of_a_multi_zone_window(monkeypatch):
    cal = _calibration()
    window = fidelity.pick_multi_zone_windows(1)[0]
    market, home = fidelity.sim_market(_emulated(cal), window)
    assert market.zones[0] == home.zone == "us-east-1a" and len(market.zones) == 9
    assert market.spot_available.shape[0] == 9
    seen, inner = [], fidelity.make_policy("on_demand")

    class Spy:
        name = "spy"

        def act(self, obs):
            seen.append(obs)
            return inner.act(obs)

    monkeypatch.setattr(fidelity, "make_policy", lambda name, **kw: Spy())
    fidelity.predict(_emulated(cal), window, cal, "on_demand")
    assert seen[0].zones == market.zones and len(seen[0].spot_available_by_zone) == 9


@needs_spot_data
def test_a_gang_window_is_simulated_as_four_nodes_and_billed_for_four():
    cal = _calibration()
    window = fidelity.pick_gang_windows(1)[0]
    single = fidelity.Window(window.folder, window.zone_file, window.start_tick, "single-zone",
                             "same window, one node")
    gang = fidelity.prediction(_emulated(cal), window, cal, "on_demand",
                               {"cost_usd": 1.0, "completion_s": 1.0, "preemptions": 0})
    one = fidelity.prediction(_emulated(cal), single, cal, "on_demand",
                              {"cost_usd": 1.0, "completion_s": 1.0, "preemptions": 0})
    # Same work per node, same time: four nodes cost four times one (tail included).
    assert gang["predicted"]["completion_s"] == pytest.approx(one["predicted"]["completion_s"])
    assert gang["predicted"]["cost_usd"] == pytest.approx(4 * one["predicted"]["cost_usd"])
    assert gang["emulated_rules_adjustment"]["tail_usd"] == pytest.approx(
        4 * one["emulated_rules_adjustment"]["tail_usd"])


def _sim(events, finish_s=1000.0):
    return SimResult("p", 0.0, 0.0, 0.0, finish_s is not None, finish_s, 0.0, 0.0, 0.0, 0.0, 0.0,
                     0.0, 1, 0, 0, 0, 0, events)


def test_a_reclaimed_gang_and_a_zone_move_are_billed_as_the_emulated_provider_bills():
    market = fidelity.Market(("a", "b"), 100, np.ones((2, 50), dtype=np.int64) * 4,
                             (1.0, 2.0), (3.0, 4.0))
    cal = _calibration()
    events = [(0.0, "launch", "a: 4 spot + 0 on-demand; x"),
              (300.0, "preempted", "a: 3 spot left, held 4"),
              (400.0, "launch", "b: 0 spot + 4 on-demand; y"),
              (600.0, "launch", "a: 2 spot + 2 on-demand; z")]
    extra = fidelity.emulated_rules_adjustment(_sim(events), market, cal, nodes=4)
    # The reclaim: every node of the gang billed for the notice at its zone's spot price.
    assert extra["notice_billing_usd"] == pytest.approx(120 * 4 * 1.0 / 3600)
    # The move b -> a: the old set (4 on-demand in b) billed for the notice, less the save the
    # simulator already bills.
    assert extra["switch_billing_usd"] == pytest.approx((120 - 10) * 4 * 4.0 / 3600)
    # The tail on the final, mixed set in a.
    assert extra["tail_usd"] == pytest.approx(500 * (2 * 1.0 + 2 * 3.0) / 3600)


def test_summary_and_table_are_per_kind():
    def row(kind, err):
        return {"window": {"kind": kind, "folder": "f", "zone_file": "z.json", "start_tick": 1,
                           "other_zone_files": ["y.json"] if kind == "multi-zone" else []},
                "rel_err": {"cost": err, "completion": err}, "preemptions_diff": 0,
                "predicted": {"cost_usd": 1.0, "completion_s": 1.0, "preemptions": 0},
                "measured": {"cost_usd": 1.0, "completion_s": 1.0, "preemptions": 0}}

    rows = [row("single-zone", 0.01), row("multi-zone", 0.2), row("gang-4", 0.03)]
    by_kind = fidelity.summarise_by_kind(rows)
    assert list(by_kind) == ["single-zone", "multi-zone", "gang-4"]
    assert by_kind["multi-zone"]["goal_met"] is False and by_kind["gang-4"]["goal_met"] is True
    cal = _calibration().record()
    cal["runs"] = [{"finish_s": 1.0}]
    payload = {"summary": fidelity.summarise(rows), "calibration": cal, "policy": "p",
               "steps": 20, "windows": rows, "seconds_per_tick": 0.2,
               "summary_same_run": fidelity.summarise(rows), "summary_by_kind": by_kind,
               "summary_previous_run": fidelity.summarise(rows), "rule_differences": "r"}
    md = fidelity.to_markdown(payload)
    assert "| kind | window |" in md and "| multi-zone | f/z.json +1 zones @1 |" in md
    assert "| cost, previous-run calibration |" in md
    assert "| gang-4 | +3.0% |" in md
    assert "multi-zone windows and a 4-node gang: `trainwise" not in md  # old "not covered"


def test_a_frozen_tail_is_a_rule_on_both_sides_not_a_fit():
    """With the clock frozen after the last step (the default), the prediction adds the notice's
    bill on the final set and nothing to completion, whatever tail was measured."""
    import dataclasses

    market = fidelity.Market(("a",), 100, np.ones((1, 50), dtype=np.int64), (1.0,), (3.0,))
    cal = dataclasses.replace(_calibration(), tail_s=0.0, tail_frozen=True)
    events = [(0.0, "launch", "a: 0 spot + 1 on-demand; x")]
    extra = fidelity.emulated_rules_adjustment(_sim(events), market, cal)
    assert extra["tail_billed_s"] == 120 and extra["tail_completion_s"] == 0.0
    assert extra["tail_usd"] == pytest.approx(120 * 3.0 / 3600)
    on_clock = fidelity.emulated_rules_adjustment(_sim(events), market, _calibration())
    assert on_clock["tail_completion_s"] == 500.0


@pytest.mark.slow
@needs_spot_data
def test_quick_run_scores_one_window_of_each_kind(tmp_path):
    """--quick: one calibration run and one window per kind, real trainers (45-90 s)."""
    import json

    assert fidelity.main(["--quick", "--out-dir", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "fidelity.json").read_text())
    assert [r["window"]["kind"] for r in payload["windows"]] == list(fidelity.KINDS)
    assert list(payload["summary_by_kind"]) == list(fidelity.KINDS)
    multi, gang = payload["windows"][1], payload["windows"][2]
    assert multi["emulated"]["zones_held"] and gang["emulated"]["node_launches"] % 4 == 0
    assert payload["calibration"]["tail_frozen"] is True
    md = (tmp_path / "fidelity.md").read_text()
    assert "| gang-4 |" in md and "| multi-zone |" in md
