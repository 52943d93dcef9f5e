"""The bill dbt reports comes from the trainer's run ledger, not from telemetry (issue 31, class 4).

`training.ledger` is the trainer's own keyed record of its clock. A resume bills from it; the
dbt models (dbt/models/cost_per_token.sql) used to take `max(cost_usd)` over the telemetry's step
rows, so one planted sealed segment still changed the bill dbt reports. Now every place the
product ingests a run's telemetry also writes, with the same connection helper and right after
the telemetry, the run's ledger bills into DuckDB table `ledger_bills`, one row per
(run_id, run_instance, rank): the newest step and clock of the ledger's verified, plausible
lines (`training.ledger.read_ledger` decides both). dbt bills a run with a row there from it,
and only a run without a ledger (one written before the ledger existed) from telemetry.

A run's ledger: `<out_dir>/ledger/<run_id>/rank<R>.jsonl`, beside its telemetry
`<out_dir>/telemetry/<run_id>/rank<R>/`. Its `run_instance` is computed as the telemetry store
computes it (the `segment_key` of the rank's first non-empty segment), so the row joins the
telemetry of this run folder and not that of an unrelated run that reused the id.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

from telemetry import store as telemetry_store
from telemetry.reader import list_segments, parse_line, segment_body
from training.ledger import LEDGER_FOLDER, read_ledger

TABLE = "ledger_bills"
_CREATE = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    run_id VARCHAR NOT NULL,
    run_instance VARCHAR,
    rank INTEGER NOT NULL,
    max_step BIGINT,
    elapsed_s DOUBLE,
    price_usd_per_hour DOUBLE,
    verified_lines BIGINT NOT NULL,
    rejected_lines BIGINT NOT NULL,
    keyed BOOLEAN NOT NULL,
    ingested_at DOUBLE NOT NULL
)"""
_RANK_FILE = re.compile(r"rank(\d+)\.jsonl")


@dataclass(frozen=True)
class LedgerBill:
    """What one rank's ledger commits: its newest plausible step and clock (None: no line)."""

    run_id: str
    run_instance: str | None
    rank: int
    max_step: int | None
    elapsed_s: float | None
    price_usd_per_hour: float | None  # the newest start line's price (under the ledger's mac)
    verified_lines: int
    rejected_lines: int
    keyed: bool


def _instances(telemetry_run_dir: Path) -> dict[int, str]:
    """rank -> run_instance, as `telemetry.store` derives it (first non-empty segment's key)."""
    found: dict[int, str] = {}
    if not telemetry_run_dir.is_dir():
        return found
    for segment in list_segments(telemetry_run_dir):
        if segment.rank in found:
            continue
        body, _ = segment_body(segment, segment.path.read_bytes())
        if body:
            first = parse_line(segment, 0, body[: body.index(b"\n")])
            found[segment.rank] = telemetry_store.segment_key(first)
    return found


def ledger_bills(telemetry_run_dir: str | Path) -> list[LedgerBill]:
    """The committed bill of each rank whose ledger exists, for the run whose telemetry is in
    `telemetry_run_dir` (`<out_dir>/telemetry/<run_id>`); [] when the run has no ledger."""
    telemetry_run_dir = Path(telemetry_run_dir)
    run_id = telemetry_run_dir.name
    folder = telemetry_run_dir.parent.parent / LEDGER_FOLDER / run_id
    if not folder.is_dir() or folder.is_symlink():
        return []
    instances = _instances(telemetry_run_dir)
    bills = []
    for path in sorted(folder.iterdir()):
        match = _RANK_FILE.fullmatch(path.name)
        if match is None:
            continue
        rank = int(match.group(1))
        read = read_ledger(path, run_id=run_id, rank=rank)
        good = [line for line in read.lines if line.plausible]
        bills.append(LedgerBill(
            run_id=run_id, run_instance=instances.get(rank), rank=rank,
            max_step=max((line.step for line in good), default=None),
            elapsed_s=max((line.elapsed_s for line in good), default=None),
            price_usd_per_hour=next((line.price_usd_per_hour for line in reversed(good)
                                     if line.kind == "start"
                                     and line.price_usd_per_hour is not None), None),
            verified_lines=len(good), rejected_lines=len(read.rejected) + len(read.implausible),
            keyed=read.keyed))
    return bills


def store_ledger_bills(telemetry_run_dir: str | Path, db_path: str | Path, *,
                       lock_timeout_s: float = 60.0) -> int:
    """Replaces the run's rows of `ledger_bills` (of this run folder's instances) with what its
    ledger commits now; creates the table even when there is none (the dbt models read it).
    Call it right after `telemetry.store.ingest` of the same folder. Returns the rows written."""
    telemetry_run_dir = Path(telemetry_run_dir)
    bills = ledger_bills(telemetry_run_dir)
    instances = sorted({bill.run_instance for bill in bills if bill.run_instance is not None})
    now = time.time()
    with telemetry_store.connect_with_retry(db_path, lock_timeout_s=lock_timeout_s) as con:
        con.execute("BEGIN TRANSACTION")
        try:
            con.execute(_CREATE)
            columns = {row[0] for row in con.execute(
                f"SELECT column_name FROM information_schema.columns WHERE table_name = '{TABLE}'"
            ).fetchall()}
            if "price_usd_per_hour" not in columns:  # written before the ledger kept the price
                con.execute(f"ALTER TABLE {TABLE} ADD COLUMN price_usd_per_hour DOUBLE")
            con.execute(f"DELETE FROM {TABLE} WHERE run_id = ? AND (run_instance IS NULL "
                        f"OR list_contains(?, run_instance))", [telemetry_run_dir.name, instances])
            if bills:
                con.executemany(
                    f"INSERT INTO {TABLE} VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [(b.run_id, b.run_instance, b.rank, b.max_step, b.elapsed_s,
                      b.price_usd_per_hour, b.verified_lines, b.rejected_lines, b.keyed, now) for b in bills])
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
    return len(bills)
