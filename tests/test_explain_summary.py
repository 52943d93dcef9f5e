# ruff: noqa: F811  (the imported pytest fixtures are used as test arguments)
"""`trainwise explain RUN --summary` (issue 28 item 3): where every dollar of a run's bill went.

The run folders are real: the train job's driver (`trainwise.runs.run_training`) runs on the
small pystdlib state of tests/test_run_path_faults.py, once under the supervised engine on the
real 2023-02 us-east-1a spot window (reclaims, resumes; tests/test_train_job_supervised.py) and
once on the in-process engine with a one-zone market whose spot goes at tick 3
(tests/test_train_job_provider.py). The summary is read from the folder alone and checked
against the engine's own record of the bill.
"""

from __future__ import annotations

import json
import shutil

import pytest

from telemetry.reader import read_run_events
from tests.test_lever_explain import runs_root  # noqa: F401 - fixture
from tests.test_run_path_faults import built_state, request, run  # noqa: F401 - fixture
from tests.test_train_job_provider import market, provider
from tests.test_train_job_supervised import replay_spec
from trainwise import cli, cost_summary

STEPS = 20  # the supervised run: the window reclaims spot within the first few steps
CENT = 0.01


@pytest.fixture(scope="module")
def supervised_state(built_state, tmp_path_factory):
    """The train job under trainwise_heuristic on the real trace window (about 30 s)."""
    state = tmp_path_factory.mktemp("summary_supervised") / "state"
    shutil.copytree(built_state, state)
    summary = run(state, request(max_steps=STEPS, eval_every_steps=10, fast_policy="heuristic",
                                 allocation_policy="trainwise_heuristic"),
                  replay=replay_spec())
    return state, summary


@pytest.fixture(scope="module")
def in_process_state(built_state, tmp_path_factory):
    """The in-process engine: spot for three ticks, reclaimed, an on-demand fallback (6 s)."""
    state = tmp_path_factory.mktemp("summary_in_process") / "state"
    shutil.copytree(built_state, state)
    cloud = provider(market("us-east-1a", [1, 1, 1] + [0] * 100_000), seconds_per_tick=0.01)
    summary = run(state, request(market="spot", zone="us-east-1a", max_steps=8), provider=cloud)
    return state, summary


@pytest.fixture(params=["supervised", "in_process"])
def engine_run(request):
    state, summary = request.getfixturevalue(f"{request.param}_state")
    run_dir = state / "runs" / "run-a"
    record_file = "supervised.json" if request.param == "supervised" else "gang.json"
    record = json.loads((run_dir / record_file).read_text())
    return request.param, run_dir, record, summary


def test_the_money_rows_add_up_to_the_providers_bill(engine_run):
    _, run_dir, record, run_summary = engine_run
    summary = cost_summary.summarize(run_dir)
    bill = record["cost_usd"]
    assert summary.bill_usd == pytest.approx(bill) == pytest.approx(run_summary.cost_usd)
    for section in (cost_summary.MARKET, cost_summary.USE):
        rows = summary.money_rows(section)
        assert all(r.usd is not None for r in rows), [r.name for r in rows if r.usd is None]
        assert sum(r.usd for r in rows) == pytest.approx(bill, abs=CENT)
        assert sum(r.share_of_bill for r in rows) == pytest.approx(1.0, abs=1e-6)
    # The shown cents add up too (the closing row takes the rounding).
    shown = dict(zip([r.key for r in summary.rows], summary._shown_cents(), strict=True))
    assert sum(shown[r.key] for r in summary.money_rows(cost_summary.USE)) == round(bill * 100)
    market = summary.money_rows(cost_summary.MARKET)
    assert sum(r.node_s for r in market) == pytest.approx(
        record["figures"]["spot_node_s"] + record["figures"]["on_demand_node_s"]
        if "figures" in record else record["train_provider_s"]
        + record["preemption_waste_node_s"] + 360.0)
    assert summary.row("spot").node_s / sum(r.node_s for r in market) == pytest.approx(
        record["spot_share"])
    productive = summary.row("productive")
    assert 0 < productive.usd < bill and productive.share_of_bill == summary.productive_share


def test_the_waste_row_is_the_bills_preemption_waste_at_the_price_paid(engine_run):
    engine, run_dir, record, _ = engine_run
    waste = cost_summary.summarize(run_dir).row("waste")
    assert waste.node_s == pytest.approx(record["preemption_waste_node_s"], abs=1e-6)
    assert record["preemption_waste_node_s"] > 0, "the run was reclaimed at least once"
    if engine == "supervised":
        # Every changeover after the first set's and every notice-to-down stretch, each at its
        # own node's price (spot or on-demand): the holdings the engine billed.
        holdings = sorted(record["figures"]["holdings"], key=lambda h: h["launch_s"])
        usd = 0.0
        for h in holdings:
            stop = h["notice_at_s"] if h["notice_at_s"] is not None else h["end_s"]
            boot = min(360.0, stop - h["launch_s"]) if h["launch_s"] > 0 else 0.0
            after = h["end_s"] - h["notice_at_s"] if h["notice_at_s"] is not None else 0.0
            usd += (boot + after) * h["price_usd_per_hour"] / 3600.0
        usd += record["figures"]["preemption_waste_usd"]
    else:
        # The replacement's changeover at its on-demand price, the reclaimed spot node's
        # seconds after its notice at the spot price.
        spot, on_demand = (n["price_usd_per_hour"] for n in record["launched"])
        usd = (360.0 * on_demand + (record["preemption_waste_node_s"] - 360.0) * spot) / 3600.0
    assert waste.usd == pytest.approx(usd, abs=1e-9)


def test_the_saving_row_is_the_fixed_on_demand_schedule_less_the_bill(engine_run):
    _, run_dir, record, run_summary = engine_run
    saving = cost_summary.summarize(run_dir).row("saving")
    expected = record["fixed_on_demand_usd"] - record["cost_usd"]
    assert saving.usd == pytest.approx(expected, abs=1e-9)
    assert saving.usd == pytest.approx(run_summary.fixed_on_demand_usd
                                       - run_summary.cost_usd)
    assert saving.share_of_fixed == pytest.approx(expected / record["fixed_on_demand_usd"])


def test_the_notices_in_the_table_are_the_telemetrys_preemption_events(engine_run):
    engine, run_dir, record, _ = engine_run
    events = read_run_events(run_dir / "telemetry" / "run-a", rank=0)
    preemptions = [e for e in events if e["type"] == "preemption"]
    summary = cost_summary.summarize(run_dir)
    assert summary.preemptions == len(preemptions) >= 1
    notice = summary.row("notice")
    assert f"the trainer's {len(preemptions)} preemption event(s)" in notice.caused_by
    reclaims = record["figures"]["preemptions"] if engine == "supervised" else record["reclaims"]
    assert f"{reclaims} reclaim(s)" in notice.caused_by
    assert summary.metadata()["cost/preemptions"] == float(len(preemptions))
    assert notice.node_s > 0 and notice.usd > 0, "a reclaimed node is billed after its notice"
    if engine == "supervised":
        assert "trainwise_heuristic" in summary.row("changeovers").caused_by
        assert notice.node_s == pytest.approx(record["figures"]["stopping_node_s"])


def test_the_cli_prints_the_summary_and_exits_0(supervised_state, monkeypatch, capsys):
    state, run_summary = supervised_state
    monkeypatch.setenv("TRAINWISE_HOME", str(state))
    assert cli.main(["explain", "run-a", "--summary"]) == 0
    out = capsys.readouterr().out
    assert f"{run_summary.cost_usd:,.2f} USD" in out
    for text in ("by market (adds up to the bill)", "by use (adds up to the bill)",
                 "of which preemption waste", "saving", "productive training:"):
        assert text in out, text
    print(out)  # the screen, for the record of a test run (pytest -s)


def test_an_unknown_run_names_the_run_and_the_fix(supervised_state, monkeypatch, capsys):
    state, _ = supervised_state
    monkeypatch.setenv("TRAINWISE_HOME", str(state))
    assert cli.main(["explain", "no-such-run", "--summary"]) != 0
    err = capsys.readouterr().err
    assert "'no-such-run'" in err and "known runs: run-a" in err and "TRAINWISE_HOME" in err


def test_a_run_folder_without_a_bill_says_so_and_prints_what_is_known(in_process_state,
                                                                      tmp_path, monkeypatch,
                                                                      capsys):
    state, _ = in_process_state
    old = tmp_path / "state"
    shutil.copytree(state / "runs", old / "runs")
    (old / "runs" / "run-a" / "gang.json").unlink()  # a run from before the bill was recorded
    summary = cost_summary.summarize(old / "runs" / "run-a")
    assert summary.bill_usd is None and summary.engine == ""
    assert "gang.json" in summary.bill_source and "supervised.json" in summary.bill_source
    assert summary.row("bill").usd is None and summary.row("bill").why_missing
    assert summary.row("trainer_estimate").usd > 0
    assert "cost/bill_usd" not in summary.metadata()
    monkeypatch.setenv("TRAINWISE_HOME", str(old))
    assert cli.main(["explain", "run-a", "--summary"]) == 0
    out = capsys.readouterr().out
    assert "NO BILL RECORDED" in out and "1 preemption event(s)" in out


def test_what_dynamic_pruning_skipped_is_the_data_row_of_a_run_without_a_bill(runs_root):
    """A bare `training.loop.train` run folder: no bill, a consumption record (pruning 0.5)."""
    from trainwise import explain

    summary = cost_summary.summarize(runs_root / "pruned")
    assert summary.bill_usd is None and summary.row("trainer_estimate").usd > 0
    telemetry = runs_root / "pruned" / "telemetry" / "pruned"
    skipped = explain.lever_effects(read_run_events(telemetry),
                                    explain.consumption_records(telemetry))["pruning"][
        "skipped_samples"]
    assert skipped > 0
    assert f"dynamic pruning skipped {skipped:,.0f} samples" in summary.row(
        "data_skipped").caused_by
    assert "NO BILL RECORDED" in summary.text()


def test_a_figure_the_folder_lacks_is_not_recorded_and_the_sum_still_closes(supervised_state,
                                                                            tmp_path):
    state, _ = supervised_state
    run_dir = tmp_path / "runs" / "run-a"
    shutil.copytree(state / "runs" / "run-a", run_dir)
    shutil.rmtree(run_dir / "telemetry")  # no telemetry: no replay speed, no end of the job
    summary = cost_summary.summarize(run_dir)
    for key in ("tail", "checkpoint", "straggler"):  # measured from the telemetry: unknown
        assert summary.row(key).usd is None and summary.row(key).why_missing, key
    assert summary.row("spot").usd > 0, "the bill's own figures are still known"
    assert "not recorded" in summary.text()
    assert any("no telemetry" in note for note in summary.notes)
    use = summary.money_rows(cost_summary.USE)
    assert sum(r.usd for r in use if r.usd is not None) == pytest.approx(summary.bill_usd,
                                                                         abs=CENT)
    assert "after the last step" in summary.row("productive").caused_by


def test_markdown_and_metadata_carry_every_row(in_process_state):
    state, _ = in_process_state
    summary = cost_summary.summarize(state / "runs" / "run-a")
    table = summary.markdown()
    assert "| section | item | node-s | USD | share of bill | caused by |" in table
    assert all(f"| {r.name} |" in table for r in summary.rows)
    metadata = summary.metadata()
    assert all(isinstance(v, (float, str)) for v in metadata.values())
    assert metadata["cost/bill_usd"] == pytest.approx(summary.bill_usd)
    use_usd = [metadata[f"cost/{r.key}_usd"] for r in summary.money_rows(cost_summary.USE)]
    assert sum(use_usd) == pytest.approx(summary.bill_usd, abs=CENT)
