"""The dbt-duckdb project builds over ingested telemetry and computes cost per token and
utilization."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from telemetry import events, store
from telemetry.writer import SegmentWriter

DBT_DIR = Path(__file__).resolve().parent.parent / "dbt"
pytestmark = pytest.mark.integration


def _step(run_id: str, step: int, cost_usd: float, tokens: int) -> events.StepEvent:
    return events.StepEvent(
        run_id=run_id, step=step, train_loss=2.0, learning_rate=1e-3, grad_norm=1.0,
        grad_noise_scale=float("nan"), micro_batch_size=8, grad_accum_steps=1,
        step_time_ms=100.0, samples_seen=8 * step, tokens_seen=tokens, elapsed_s=0.1 * step,
        cost_usd=cost_usd)


def _dbt_build(tmp_path: Path, db: Path) -> None:
    env = {**os.environ, "TRAINWISE_DUCKDB_PATH": str(db)}
    dbt = Path(sys.executable).parent / "dbt"
    result = subprocess.run(
        [str(dbt), "build", "--project-dir", str(DBT_DIR), "--profiles-dir", str(DBT_DIR),
         "--target-path", str(tmp_path / "target"), "--log-path", str(tmp_path / "logs")],
        env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]


def _run_start(run_id: str) -> events.RunStartEvent:
    return events.RunStartEvent(
        run_id=run_id, step=0, model_kind="gpt", model_config={}, model_fingerprint="f",
        train_config={}, data_fingerprint="d", curriculum_version=None, instance_type="x",
        price_usd_per_hour=3.6)


def test_dbt_build_computes_cost_per_token_and_replays_as_preemption_waste(tmp_path):
    telemetry_dir = tmp_path / "telemetry"
    with SegmentWriter(telemetry_dir, "run-a") as writer:
        writer.write(_step("run-a", 1, 0.5, 1_000_000))
        writer.write(_step("run-a", 2, 1.0, 2_000_000))
        writer.write(events.CheckpointEvent(run_id="run-a", step=2, path="x", sha256="0",
                                            size_bytes=1, save_ms=50.0, reason="final"))
    db = tmp_path / "t.duckdb"
    assert store.ingest(telemetry_dir / "run-a", db) == 3
    # run-b: killed after step 3 with its checkpoint at step 1; the resume replays steps 2-3.
    with SegmentWriter(telemetry_dir, "run-b") as writer:
        writer.write(_run_start("run-b"))
        for step in (1, 2, 3):
            writer.write(_step("run-b", step, 0.1 * step, 1000 * step))
    with SegmentWriter(telemetry_dir, "run-b") as writer:
        writer.write(_run_start("run-b"))
        for step in (2, 3, 4):
            writer.write(_step("run-b", step, 0.1 * (step + 2), 1000 * step))
    assert store.ingest(telemetry_dir / "run-b", db) == 8
    # Another run that reused the id run-a (another state folder): a row of its own.
    with SegmentWriter(tmp_path / "other", "run-a") as writer:
        writer.write(_step("run-a", 1, 0.25, 500_000))
    assert store.ingest(tmp_path / "other" / "run-a", db) == 1
    _dbt_build(tmp_path, db)
    with duckdb.connect(str(db), read_only=True) as con:
        rows = con.execute("select steps, tokens_seen, cost_usd, usd_per_million_tokens "
                           "from cost_per_token where run_id = 'run-a' order by steps").fetchall()
        waste = con.execute("select checkpoint_s, step_s from waste_breakdown "
                            "where run_id = 'run-a' and checkpoint_s > 0").fetchone()
        resumed = con.execute(
            "select steps, tokens_seen, replayed_steps, replay_s, preemption_waste_usd "
            "from cost_per_token where run_id = 'run-b'").fetchone()
        resumed_waste = con.execute(
            "select step_s, preemption_s, replayed_steps, preemption_share from waste_breakdown "
            "where run_id = 'run-b'").fetchone()
    assert rows == [(1, 500_000, 0.25, pytest.approx(0.5)), (2, 2_000_000, 1.0, pytest.approx(0.5))]
    assert waste == (pytest.approx(0.05), pytest.approx(0.2))
    # 4 new steps of 0.1 s train; the 2 replayed ones are waste, priced at 3.6 $/h.
    assert resumed == (4, 4000, 2, pytest.approx(0.2), pytest.approx(0.2 * 3.6 / 3600))
    assert resumed_waste == (pytest.approx(0.4), pytest.approx(0.2), 2, pytest.approx(1 / 3))


T0 = 1.7e9  # a fixed wall clock, so the spans are known


def _rank_step(step: int, rank: int, wall_time_s: float, wait_ms: float) -> events.StepEvent:
    return events.StepEvent(
        run_id="run-d", rank=rank, step=step, wall_time_s=wall_time_s, train_loss=2.0,
        learning_rate=1e-3, grad_norm=1.0, grad_noise_scale=float("nan"), micro_batch_size=8,
        grad_accum_steps=2, step_time_ms=100.0, samples_seen=16 * step, tokens_seen=100 * step,
        elapsed_s=0.1 * step, cost_usd=0.01 * step, world_size=2, share=0.5, micro_batches=1,
        compute_ms=100.0 - wait_ms - 5.0, allreduce_wait_ms=wait_ms, allreduce_ms=5.0)


def _write_two_rank_run(telemetry_dir: Path) -> None:
    """run-d: rank 1 is fast and waits 30 ms a step for rank 0; rank 0 checkpoints once, is
    killed, and its resume replays step 3."""
    start = events.RunStartEvent(
        run_id="run-d", step=0, wall_time_s=T0, model_kind="gpt", model_config={},
        model_fingerprint="f", train_config={}, data_fingerprint="d", curriculum_version=None,
        instance_type="x", price_usd_per_hour=3.6)
    with SegmentWriter(telemetry_dir, "run-d", rank=0) as writer:
        writer.write(start)
        for step in (1, 2, 3):
            writer.write(_rank_step(step, 0, T0 + 0.1 * step, wait_ms=0.0))
        writer.write(events.CheckpointEvent(run_id="run-d", step=2, wall_time_s=T0 + 0.45,
                                            path="x", sha256="0", size_bytes=1, save_ms=50.0,
                                            reason="interval"))
    with SegmentWriter(telemetry_dir, "run-d", rank=0) as writer:  # the resumed process
        writer.write(dataclasses.replace(start, wall_time_s=T0 + 1.0))
        writer.write(_rank_step(3, 0, T0 + 1.1, wait_ms=0.0))
    with SegmentWriter(telemetry_dir, "run-d", rank=1) as writer:
        writer.write(dataclasses.replace(start, rank=1))
        for step in (1, 2, 3):
            writer.write(_rank_step(step, 1, T0 + 0.1 * step, wait_ms=30.0))


def test_utilization_splits_each_ranks_wall_time_and_agrees_with_waste_breakdown(tmp_path):
    from tests.test_training_loop import text_examples, tiny_config
    from training.loop import train

    db = tmp_path / "t.duckdb"
    # A real tiny training run (one process: every step is compute, no waits).
    real = train(tiny_config(max_steps=12, checkpoint_every_steps=6, run_id="tiny"),
                 text_examples(), None, tmp_path / "train")
    assert store.ingest(real.telemetry_dir, db) > 12
    _write_two_rank_run(tmp_path / "telemetry")
    assert store.ingest(tmp_path / "telemetry" / "run-d", db) == 11
    _dbt_build(tmp_path, db)  # also runs the in_range, sum-to-one and agreement tests
    share_columns = ("compute_share", "waiting_share", "checkpoint_share", "eval_share",
                     "preemption_share", "other_share")
    with duckdb.connect(str(db), read_only=True) as con:
        rows = con.execute(
            f"select run_id, rank, wall_s, compute_s, straggler_wait_s, allreduce_s, "
            f"checkpoint_s, preemption_s, other_s, {', '.join(share_columns)} "
            f"from utilization order by run_id, rank").fetchall()
        waste = dict(con.execute(
            "select run_id, sum(step_s) from waste_breakdown group by run_id").fetchall())
        checkpoints = dict(con.execute(
            "select run_id, sum(checkpoint_s) from waste_breakdown group by run_id").fetchall())
    by_key = {(r[0], r[1]): r for r in rows}
    assert set(by_key) == {("run-d", 0), ("run-d", 1), ("tiny", 0)}
    for row in rows:
        shares = row[9:]
        assert all(0.0 <= s <= 1.0 for s in shares), row
        assert sum(shares) == pytest.approx(1.0)
    for run_id in ("tiny", "run-d"):
        mine = [r for r in rows if r[0] == run_id]
        assert sum(r[3] + r[4] + r[5] for r in mine) == pytest.approx(waste[run_id])
        assert sum(r[6] for r in mine) == pytest.approx(checkpoints[run_id])
    tiny = by_key[("tiny", 0)]
    assert tiny[4] == tiny[5] == 0.0 and tiny[6] > 0  # no waits alone; it checkpointed
    # Its wall time starts with the billing clock (set-up is paid): the billed seconds at least.
    assert tiny[2] >= real.elapsed_s - 1e-3 and 0.0 < tiny[9] < 1.0 and tiny[8] > 0
    # rank 0: from T0 to T0 + 1.1; 3 new steps (0.285 s compute + 0.015 s all-reduce), a 50 ms
    # checkpoint, the replayed step 3 (0.1 s), the rest (start-up, the kill) is other.
    assert by_key[("run-d", 0)][2:9] == pytest.approx((1.1, 0.285, 0.0, 0.015, 0.05, 0.1, 0.65))
    # rank 1: 0.3 s, of which it waited 3 x 30 ms for rank 0.
    assert by_key[("run-d", 1)][2:9] == pytest.approx((0.3, 0.195, 0.09, 0.015, 0.0, 0.0, 0.0))
    assert by_key[("run-d", 1)][10] == pytest.approx(0.35)  # waiting_share: (0.09 + 0.015) / 0.3
