"""The bill dbt reports comes from the trainer's run ledger, not from forgeable telemetry
(issue 31, class 4): a planted, self-consistent sealed segment claiming a huge clock and cost is
ingested as the product ingests (`trainwise ingest`), and cost_per_token still bills exactly
the trainer's committed clock at the run's price."""

from __future__ import annotations

import json

import duckdb
import pytest

from telemetry.reader import read_run_events
from telemetry.writer import seal_segment
from tests.test_billing_trust import HUGE_S, plant_sealed_segment
from tests.test_dbt_models import _dbt_build
from tests.test_training_loop import text_examples, tiny_config
from training.loop import train
from trainwise import runs
from trainwise.ledger_bill import ledger_bills

pytestmark = pytest.mark.integration


def plant_price(telemetry_dir, *, price_usd_per_hour: float):
    """A sealed segment holding a copy of the run's run_start with another hourly price."""
    start = next(e for e in read_run_events(telemetry_dir) if e["type"] == "run_start")
    path = telemetry_dir / "rank0" / "segment-00098.jsonl"
    path.write_text(json.dumps({**start, "price_usd_per_hour": price_usd_per_hour},
                               separators=(",", ":")) + "\n")
    seal_segment(path)


def test_a_planted_sealed_segment_does_not_change_the_bill_dbt_reports(tmp_path):
    state = tmp_path / "state"
    out_dir = state / "runs" / "tiny"
    result = train(tiny_config(), text_examples(), None, out_dir, stop_after_steps=8)
    telemetry_dir = out_dir / "telemetry" / "tiny"
    price = next(e["price_usd_per_hour"] for e in read_run_events(telemetry_dir)
                 if e["type"] == "run_start")
    committed_usd = result.elapsed_s * price / 3600.0
    plant_sealed_segment(out_dir)  # step 10,000,000 at 10,000,000 s: about 8,500 USD
    plant_price(telemetry_dir, price_usd_per_hour=1e6)  # a run_start claiming a dearer node
    assert max(e["cost_usd"] for e in read_run_events(telemetry_dir)
               if e["type"] == "step") > 1000  # telemetry alone would bill the forgery

    [bill] = ledger_bills(telemetry_dir)
    assert (bill.rank, bill.max_step, bill.keyed) == (0, 8, True)
    assert bill.elapsed_s == pytest.approx(result.elapsed_s, abs=1e-9)
    assert bill.price_usd_per_hour == price  # the price the trainer committed, under the mac

    db = tmp_path / "t.duckdb"
    assert runs.reingest(state, "tiny", db) > 0
    assert runs.reingest(state, "tiny", db) == 0  # idempotent: still one ledger row
    _dbt_build(tmp_path, db)
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("select count(*) from ledger_bills").fetchone() == (1,)
        [(cost, steps)] = con.execute(
            "select cost_usd, steps from cost_per_token where run_id = 'tiny'").fetchall()
        assert cost == pytest.approx(committed_usd, rel=1e-9)  # not 8,500 USD
        billed_s, basis = con.execute(
            "select billed_elapsed_s, billing_basis from cost_per_token "
            "where run_id = 'tiny'").fetchone()
    assert basis == "ledger"
    assert billed_s == pytest.approx(result.elapsed_s, abs=1e-9) and billed_s < HUGE_S
    assert cost == pytest.approx(result.cost_usd, rel=1e-9) and cost < 0.1
    assert steps == 8  # the planted step is beyond the ledger: not counted either
