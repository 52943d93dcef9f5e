"""Per-rank telemetry of a torchrun run, without starting one: two ranks' segments as the
trainer writes them (rank fields on StepEvent, rank 0's fast decisions), then what
`trainwise explain`, the DuckDB store and the Prometheus exporter make of them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from telemetry import store
from telemetry.events import DecisionEvent, StepEvent, event_from_record, share_changes, to_record
from telemetry.prometheus import TelemetryCollector
from telemetry.writer import SegmentWriter
from trainwise.explain import timeline

RUN_ID = "ddp-telemetry"
REASON = "re-balance: predicted step 550->470 ms (-15% > 2%), slowest rank 1"


def rank_step(rank: int, step: int, share: float, compute_ms: float, wait_ms: float
              ) -> StepEvent:
    return StepEvent(
        run_id=RUN_ID, rank=rank, step=step, wall_time_s=1000.0 + step + rank / 10,
        train_loss=1.0, learning_rate=1e-3, grad_norm=0.5, grad_noise_scale=float("nan"),
        micro_batch_size=2, grad_accum_steps=10, step_time_ms=compute_ms + wait_ms + 5.0,
        samples_seen=20 * step, tokens_seen=320 * step, elapsed_s=float(step), cost_usd=0.0,
        world_size=2, share=share, micro_batches=round(share * 10), compute_ms=compute_ms,
        allreduce_wait_ms=wait_ms, allreduce_ms=1.0,
    )


def shares_decision(step: int, shares: list[float], times: list[float], reason: str
                    ) -> DecisionEvent:
    return DecisionEvent(
        run_id=RUN_ID, rank=0, step=step, wall_time_s=1000.0 + step + 0.5, layer="fast",
        policy="stragglers", action={"rank_work_shares": shares, "micro_batch_size": 2},
        reason=reason, numbers={"predicted_gain": 0.15},
        observation={"rank_step_time_ms": times},
    )


@pytest.fixture
def runs_root(tmp_path: Path) -> Path:
    """Rank 1 is 1.5x slower; at step 2 the straggler policy moves it from 0.5 to 0.4."""
    telemetry = tmp_path / "runs" / RUN_ID / "telemetry"
    with SegmentWriter(telemetry, RUN_ID, rank=0, events_per_segment=3) as zero, \
            SegmentWriter(telemetry, RUN_ID, rank=1, events_per_segment=3) as one:
        for step, (share0, share1) in enumerate([(0.5, 0.5), (0.5, 0.5), (0.6, 0.4),
                                                 (0.6, 0.4)], start=1):
            zero.write(rank_step(0, step, share0, 300.0 * share0 / 0.5, 150.0 if step < 3 else 10))
            one.write(rank_step(1, step, share1, 450.0 * share1 / 0.5, 0.0))
            if step == 2:
                zero.write(shares_decision(2, [0.6, 0.4], [305.0, 455.0], REASON))
            if step == 4:  # kept shares: nobody re-balanced
                zero.write(shares_decision(4, [0.6, 0.4], [365.0, 365.0], "keep shares"))
    return tmp_path / "runs"


def test_step_event_rank_fields_round_trip_and_default_for_one_process() -> None:
    event = rank_step(1, 3, 0.4, 360.0, 0.0)
    record = to_record(event)
    assert (record["rank"], record["world_size"], record["share"]) == (1, 2, 0.4)
    assert record["allreduce_wait_ms"] == 0.0 and record["micro_batches"] == 4
    assert event_from_record(record) == dataclasses.replace(event, grad_noise_scale=None)
    old = {k: v for k, v in record.items() if k not in ("world_size", "share", "micro_batches",
                                                         "compute_ms", "allreduce_wait_ms",
                                                         "allreduce_ms")}
    single = event_from_record(old)  # written before the rank fields: one process
    assert (single.world_size, single.share, single.allreduce_wait_ms) == (1, 1.0, 0.0)


def test_share_changes_name_the_moved_ranks() -> None:
    assert share_changes([0.5, 0.5], [0.6, 0.4]) == [(0, 0.5, 0.6), (1, 0.5, 0.4)]
    assert share_changes([0.6, 0.4], [0.6, 0.4]) == []
    assert [rank for rank, _, _ in share_changes([0.5, 0.5], [1 / 3] * 3)] == [0, 1, 2]


def test_explain_shows_step_time_per_rank_and_who_was_rebalanced(runs_root: Path) -> None:
    text = timeline(RUN_ID, runs_root)
    table = text[text.index("ranks (2)"):text.index("re-balanced:")].splitlines()
    rows = {int(line.split()[0]): line.split() for line in table[2:] if line.strip()}
    assert set(rows) == {0, 1}
    assert rows[1][1] == "4" and float(rows[1][3]) == pytest.approx(405.0)  # mean compute
    assert float(rows[0][4]) == pytest.approx(80.0)  # rank 0 waited for rank 1
    assert (rows[0][5], rows[1][5]) == ("0.600", "0.400")
    moved = text[text.index("re-balanced:"):].splitlines()[1:]
    assert len(moved) == 2  # one decision moved both ranks; the "keep" decision none
    assert moved[1].startswith("step 2: rank 1 share 0.500 -> 0.400, its step 455 ms vs 305 ms")
    assert REASON in moved[1]


def test_single_process_explain_has_no_rank_section(tmp_path: Path) -> None:
    with SegmentWriter(tmp_path / "runs" / "one" / "telemetry", "one") as writer:
        writer.write(StepEvent(
            run_id="one", step=1, train_loss=1.0, learning_rate=1e-3, grad_norm=0.5,
            grad_noise_scale=0.0, micro_batch_size=2, grad_accum_steps=1, step_time_ms=10.0,
            samples_seen=2, tokens_seen=32, elapsed_s=1.0, cost_usd=0.0))
    assert "re-balanced" not in timeline("one", tmp_path / "runs")


def test_store_ingests_both_ranks_idempotently_with_the_rank_fields(runs_root: Path,
                                                                    tmp_path: Path) -> None:
    db = tmp_path / "t.duckdb"
    run_dir = runs_root / RUN_ID / "telemetry" / RUN_ID
    first = store.ingest(run_dir, db)
    assert first == 10 and store.ingest(run_dir, db) == 0  # again: nothing new
    steps = store.run_events(db, RUN_ID, event_type="step")
    assert sorted({r["rank"] for r in steps}) == [0, 1]
    late = [r for r in steps if r["step"] == 4]
    assert sorted((r["rank"], r["share"], r["allreduce_wait_ms"]) for r in late) == [
        (0, 0.6, 10.0), (1, 0.4, 0.0)]


def test_prometheus_exports_per_rank_figures_and_rebalances(runs_root: Path) -> None:
    collector = TelemetryCollector(runs_root)
    samples = {(s.name, s.labels.get("rank"), s.labels.get("direction"),
                s.labels.get("reason")): s.value
               for family in collector.collect() for s in family.samples}
    assert samples[("trainwise_rank_compute_seconds", "1", None, None)] == pytest.approx(0.36)
    assert samples[("trainwise_rank_step_time_seconds", "0", None, None)] == pytest.approx(0.375)
    assert samples[("trainwise_rank_allreduce_wait_seconds", "0", None, None)] == \
        pytest.approx(0.010)
    assert samples[("trainwise_rank_share", "1", None, None)] == pytest.approx(0.4)
    assert samples[("trainwise_rank_rebalances_total", "1", "down", None)] == 1
    assert samples[("trainwise_rank_rebalances_total", "0", "up", None)] == 1
    assert samples[("trainwise_rank_last_rebalance_step", "1", None, REASON)] == 2
    # A second scrape reads nothing new and counts nothing twice.
    again = {(s.name, s.labels.get("rank"), s.labels.get("direction"),
              s.labels.get("reason")): s.value
             for family in collector.collect() for s in family.samples}
    assert again == samples
