"""Telemetry ingestion throughput: events/s from segments on disk into DuckDB, the real path.

A run's telemetry is written by `telemetry.writer.SegmentWriter` (the trainer's writer, 1000
events per segment as the trainer's default) for several ranks, with the mix a run produces: a
run_start, one step event per step, an eval every 50 steps, a decision every 10 steps and a
checkpoint every 100 (rank 0), a resume that replays the last 20 steps (so the replay marking
does real work) and a run_end. Lines come from `telemetry.events.to_record` templates varied per
event, so their format and size are the trainer's.

Each repeat runs in a fresh (spawned) process, so its peak RSS is its own: it ingests the run
into a new DuckDB file with `telemetry.store.ingest`, then ingests it again (idempotent: must
add no rows) and counts the stored rows. Wall (perf_counter) and CPU time (process_time: every
thread, DuckDB's included) are measured around each call; the first repeat also times reading,
checking and decoding the files alone (`store.decoded_batches`), which splits ingestion into
files and database. Medians over repeats.

Goal (issue 29): at least GOAL_CPU_EVENTS_PER_S events per CPU-second (the 200K events/s the
seed's author cites, per CPU-second: other processes on a shared machine stretch wall time,
not CPU time) with a peak RSS of at most GOAL_PEAK_RSS_MIB, for 1M events (`--full`). The
report's verdict line says whether both are met; the process exits 1 only when the ingest is
not idempotent (a wrong result, not a slow one).

    python -m benchmarks.ingestion            # 200K events, 3 repeats (~40 s idle, 2 cores)
    python -m benchmarks.ingestion --full     # 1M events, 5 repeats (~2.5 min idle)

Writes benchmarks/results/ingestion.json and .md (through `benchmarks.results_io`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.results_io import provenance, write_results
from telemetry import events
from telemetry.writer import SegmentWriter

RESULTS_DIR = Path(__file__).resolve().parent / "results"
NAME = "ingestion"
RUN_ID = "bench-ingest"
GOAL_CPU_EVENTS_PER_S = 200_000  # the figure the seed's author cites, per CPU-second
GOAL_PEAK_RSS_MIB = 300.0  # peak RSS of the whole ingesting process (issue 29)
GOAL_EVENTS = 1_000_000  # the goal holds for `--full`
EVAL_EVERY, DECIDE_EVERY, CHECKPOINT_EVERY, REPLAYED_STEPS = 50, 10, 100, 20
START_WALL_S = 1.7e9


def _templates(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    """One record of each type, as the trainer writes it (varied per event by `write_run`)."""
    base = {"run_id": RUN_ID, "rank": rank, "step": 0, "wall_time_s": START_WALL_S}
    return {
        "run_start": events.to_record(events.RunStartEvent(
            **base, model_kind="gpt", model_config={"n_layer": 4, "n_embd": 128},
            model_fingerprint="f" * 16, train_config={"micro_batch_size": 16, "lr": 1e-3},
            data_fingerprint="d" * 16, curriculum_version="v0001", instance_type="g5.xlarge",
            price_usd_per_hour=1.006)),
        "step": events.to_record(events.StepEvent(
            **base, train_loss=2.0, learning_rate=1e-3, grad_norm=1.0, grad_noise_scale=64.0,
            micro_batch_size=16, grad_accum_steps=2, step_time_ms=100.0, samples_seen=0,
            tokens_seen=0, elapsed_s=0.0, cost_usd=0.0, world_size=world_size,
            share=1.0 / world_size, micro_batches=1, compute_ms=80.0, allreduce_wait_ms=10.0,
            allreduce_ms=5.0)),
        "eval": events.to_record(events.EvalEvent(
            **base, eval_loss=2.0, eval_accuracy=None, eval_examples=512, eval_ms=300.0)),
        "decision": events.to_record(events.DecisionEvent(
            **base, layer="fast", policy="heuristic", action={"micro_batch_size": 16,
                                                              "grad_accum_steps": 2},
            reason="noise scale within band; batch kept", numbers={"noise_scale": 64.0,
                                                                    "batch": 32.0},
            observation={"step_time_ms": 100.0, "queue_depth": 4})),
        "checkpoint": events.to_record(events.CheckpointEvent(
            **base, path="/state/runs/x/checkpoints/step-000100.pt", sha256="a" * 64,
            size_bytes=12_345_678, save_ms=250.0, reason="interval")),
        "run_end": events.to_record(events.RunEndEvent(
            **base, status="completed", elapsed_s=0.0, cost_usd=0.0, samples_seen=0,
            tokens_seen=0, final_eval_loss=1.5, final_eval_accuracy=None,
            checkpoint_path=None, checkpoint_sha256=None)),
    }


def _rank_records(rank: int, world_size: int, budget: int):
    """`budget` records of one rank, in order; yields (record, new_process) pairs."""
    t = _templates(rank, world_size)
    written, step = 0, 0
    resumed = False

    def emit(kind: str, **fields: Any) -> dict[str, Any]:
        record = dict(t[kind])
        # wall time moves on with every event, replays included (they happen later)
        record.update(step=step, wall_time_s=START_WALL_S + 0.1 * written, **fields)
        return record

    yield emit("run_start"), False
    written += 1
    while written < budget - 1:
        if not resumed and written >= budget // 2 and step > REPLAYED_STEPS:
            resumed = True  # killed; the resume replays the steps after its checkpoint
            step -= REPLAYED_STEPS
            yield emit("run_start", resumed_from="ckpt", replay_from_step=step,
                       replay_to_step=step + REPLAYED_STEPS, lost_s=2.0), True
            written += 1
            continue
        step += 1
        yield emit("step", train_loss=4.0 / (1.0 + 0.01 * step), samples_seen=32 * step,
                   tokens_seen=8192 * step, elapsed_s=0.1 * step, cost_usd=2.8e-5 * step,
                   step_time_ms=100.0 + (step % 7)), False
        written += 1
        for kind, every, only_rank0 in (("eval", EVAL_EVERY, False),
                                        ("decision", DECIDE_EVERY, True),
                                        ("checkpoint", CHECKPOINT_EVERY, True)):
            if step % every == 0 and (rank == 0 or not only_rank0) and written < budget - 1:
                yield emit(kind), False
                written += 1
    yield emit("run_end", elapsed_s=0.1 * step, cost_usd=2.8e-5 * step), False


def write_run(telemetry_dir: Path, total_events: int, ranks: int,
              events_per_segment: int = 1000) -> dict[str, Any]:
    """Writes `total_events` events of one run over `ranks` ranks; returns what it wrote."""
    began = time.perf_counter()
    per_rank = [total_events // ranks + (1 if r < total_events % ranks else 0)
                for r in range(ranks)]
    written = 0
    for rank, budget in enumerate(per_rank):
        writer = SegmentWriter(telemetry_dir, RUN_ID, rank=rank,
                               events_per_segment=events_per_segment)
        try:
            for record, new_process in _rank_records(rank, ranks, budget):
                if new_process:  # a resumed process: a new writer seals the old segment
                    writer.close()
                    writer = SegmentWriter(telemetry_dir, RUN_ID, rank=rank,
                                           events_per_segment=events_per_segment)
                writer.write(record)
                written += 1
        finally:
            writer.close()
    seconds = time.perf_counter() - began
    run_dir = telemetry_dir / RUN_ID
    files = list(run_dir.glob("rank*/segment-*.jsonl"))
    return {"events": written, "segments": len(files),
            "bytes": sum(f.stat().st_size for f in files), "write_s": seconds,
            "write_events_per_s": written / seconds}


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def measure_once(run_dir: str, db_path: str, split_phases: bool) -> dict[str, Any]:
    """One repeat, in a fresh process: ingest, ingest again, count rows (see the module doc)."""
    import duckdb

    from telemetry import store

    baseline_rss = _peak_rss_mib()
    clocks = []
    added = []
    for _ in range(2):  # first ingest, then the idempotent re-ingestion
        wall, cpu = time.perf_counter(), time.process_time()
        added.append(store.ingest(run_dir, db_path))
        clocks.append((time.perf_counter() - wall, time.process_time() - cpu))
        if len(clocks) == 1:
            ingest_rss = _peak_rss_mib()
    with duckdb.connect(db_path, read_only=True) as con:
        stored = con.execute(f"SELECT count(*), count(*) FILTER (WHERE is_replay) "
                             f"FROM {store.TABLE}").fetchone()
    result = {
        "ingest_wall_s": clocks[0][0], "ingest_cpu_s": clocks[0][1], "rows_added": added[0],
        "reingest_wall_s": clocks[1][0], "reingest_cpu_s": clocks[1][1],
        "reingest_rows_added": added[1], "rows_stored": stored[0], "replay_rows": stored[1],
        "baseline_rss_mib": baseline_rss, "ingest_peak_rss_mib": ingest_rss,
        "peak_rss_mib": _peak_rss_mib(),
    }
    if split_phases:  # reading, checking and decoding the files, without the database
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in store.decoded_batches(run_dir):
            pass
        result["files_only_s"] = time.perf_counter() - wall
        result["files_only_cpu_s"] = time.process_time() - cpu
    return result


def _in_fresh_process(run_dir: Path, db_path: Path, split_phases: bool) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(measure_once, str(run_dir), str(db_path), split_phases).result()


def run(total_events: int, repeats: int, ranks: int, argv: list[str]) -> dict[str, Any]:
    import duckdb

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="trainwise-bench-ingest-") as scratch:
        telemetry_dir = Path(scratch) / "telemetry"
        written = write_run(telemetry_dir, total_events, ranks)
        repeats_out = []
        for index in range(repeats):
            repeats_out.append(_in_fresh_process(telemetry_dir / RUN_ID,
                                                 Path(scratch) / f"repeat-{index}.duckdb",
                                                 split_phases=index == 0))
            print(f"repeat {index + 1}/{repeats}: ingest {repeats_out[-1]['ingest_wall_s']:.2f} s,"
                  f" re-ingest {repeats_out[-1]['reingest_wall_s']:.2f} s", flush=True)
    n = written["events"]

    def median(key: str) -> float:
        return statistics.median(r[key] for r in repeats_out)

    ingest_wall_s, reingest_wall_s = median("ingest_wall_s"), median("reingest_wall_s")
    events_per_s = n / ingest_wall_s
    cpu_events_per_s = n / median("ingest_cpu_s")
    peak_rss_mib = max(r["peak_rss_mib"] for r in repeats_out)
    files_s, files_cpu_s = repeats_out[0]["files_only_s"], repeats_out[0]["files_only_cpu_s"]
    return {
        "meta": provenance([Path(sys.executable).name, "-m", "benchmarks.ingestion", *argv]),
        "benchmark": NAME,
        "duckdb_version": duckdb.__version__,
        "events": n, "ranks": ranks, "segments": written["segments"],
        "bytes": written["bytes"], "repeats": repeats,
        "write": {"wall_s": written["write_s"], "events_per_s": written["write_events_per_s"]},
        "ingest": {
            "wall_s": ingest_wall_s, "cpu_s": median("ingest_cpu_s"),
            "events_per_s": events_per_s, "cpu_events_per_s": cpu_events_per_s,
            "cpu_s_each": [r["ingest_cpu_s"] for r in repeats_out],
            "mib_per_s": written["bytes"] / 2**20 / ingest_wall_s,
            "wall_s_each": [r["ingest_wall_s"] for r in repeats_out],
            "files_only_s": files_s, "files_only_cpu_s": files_cpu_s,
            # Of CPU time: other processes on a busy machine stretch wall time unevenly.
            "files_share": min(1.0, files_cpu_s / repeats_out[0]["ingest_cpu_s"]),
        },
        "reingest": {
            "wall_s": reingest_wall_s, "cpu_s": median("reingest_cpu_s"),
            "events_per_s": n / reingest_wall_s,
            "cpu_events_per_s": n / max(median("reingest_cpu_s"), 1e-9),
            "share_of_ingest": reingest_wall_s / ingest_wall_s,
            "rows_added": max(r["reingest_rows_added"] for r in repeats_out),
            "wall_s_each": [r["reingest_wall_s"] for r in repeats_out],
        },
        "rows_added": min(r["rows_added"] for r in repeats_out),
        "rows_stored": min(r["rows_stored"] for r in repeats_out),
        "replay_rows": min(r["replay_rows"] for r in repeats_out),
        "memory": {"baseline_rss_mib": median("baseline_rss_mib"),
                   "ingest_peak_rss_mib": median("ingest_peak_rss_mib"),
                   "peak_rss_mib": peak_rss_mib},
        "goal": {"cpu_events_per_s": GOAL_CPU_EVENTS_PER_S, "peak_rss_mib": GOAL_PEAK_RSS_MIB,
                 "events": GOAL_EVENTS},
        "meets_cpu_goal": cpu_events_per_s >= GOAL_CPU_EVENTS_PER_S,
        "meets_memory_goal": peak_rss_mib <= GOAL_PEAK_RSS_MIB,
        "meets_goal": (n >= GOAL_EVENTS and cpu_events_per_s >= GOAL_CPU_EVENTS_PER_S
                       and peak_rss_mib <= GOAL_PEAK_RSS_MIB),
        # Other processes on the machine slow wall time, not CPU time: say how busy it was.
        "load_average_1m": {"before": load_before, "after": os.getloadavg()[0]},
    }


def to_markdown(result: dict[str, Any]) -> str:
    m = result["meta"]["machine"]
    ing, re_, mem = result["ingest"], result["reingest"], result["memory"]
    goal = result["goal"]
    measured = (f"{ing['cpu_events_per_s']:,.0f} events per CPU-second (goal "
                f"{goal['cpu_events_per_s']:,}: {'met' if result['meets_cpu_goal'] else 'not met'})"
                f", peak RSS {mem['peak_rss_mib']:.0f} MiB (goal at most "
                f"{goal['peak_rss_mib']:.0f}: {'met' if result['meets_memory_goal'] else 'not met'})")
    if result["meets_goal"]:
        verdict = f"**Goal met** for {result['events']:,} events: {measured}."
    elif result["events"] < goal["events"]:
        verdict = (f"**Goal not judged** (it is set for {goal['events']:,} events, `--full`; this "
                   f"run has {result['events']:,}): {measured}.")
    else:
        verdict = f"**Goal not met** for {result['events']:,} events: {measured}."
    verdict += (f" Wall clock: {ing['events_per_s']:,.0f} events/s. Reading, checking and "
                f"decoding the files (marker sha256, one msgspec decode per sealed segment, its "
                f"line texts as one Arrow array) takes {ing['files_share']:.0%} of the ingest's "
                "CPU time; the DuckDB insert (zstd; replay flags set as the rows go in) the "
                "rest.")
    lines = [
        "# Telemetry ingestion throughput",
        "",
        f"Command: `{result['meta']['command']}`  ",
        f"Machine: {m['platform']}, Python {m['python']}, {m['cpu_count']} CPUs, "
        f"DuckDB {result['duckdb_version']}  ",
        f"Input: {result['events']:,} events of one run, {result['ranks']} ranks, "
        f"{result['segments']} segments, {result['bytes'] / 2**20:.1f} MiB "
        f"(written by SegmentWriter at {result['write']['events_per_s']:,.0f} events/s)  ",
        f"Medians over {result['repeats']} repeats, each in a fresh process; load average "
        f"{result['load_average_1m']['before']:.1f} before, {result['load_average_1m']['after']:.1f}"
        f" after (wall time suffers from other processes, CPU time much less).",
        "",
        verdict,
        "",
        "| path | wall s | CPU s | events/s (wall) | events/s (CPU) | rows added |",
        "|---|---:|---:|---:|---:|---:|",
        f"| ingest into a new store | {ing['wall_s']:.2f} | {ing['cpu_s']:.2f} | "
        f"{ing['events_per_s']:,.0f} | {ing['cpu_events_per_s']:,.0f} | {result['rows_added']:,} |",
        f"| re-ingest (idempotent) | {re_['wall_s']:.2f} | {re_['cpu_s']:.2f} | "
        f"{re_['events_per_s']:,.0f} | {result['events'] / max(re_['cpu_s'], 1e-9):,.0f} | "
        f"{re_['rows_added']:,} |",
        "",
        f"- Files only (read, marker check, decode, Arrow columns; no database): "
        f"{ing['files_only_s']:.2f} s wall, {ing['files_only_cpu_s']:.2f} s CPU, "
        f"{ing['files_share']:.0%} of the first repeat's ingest CPU time.",
        f"- Re-ingestion costs {re_['share_of_ingest']:.0%} of a first ingestion: a stored sealed "
        "segment is checked against its marker (sha256) and only its first line parsed.",
        f"- Ingest CPU s per repeat: {', '.join(f'{s:.2f}' for s in ing['cpu_s_each'])}.",
        f"- Rows stored: {result['rows_stored']:,} ({result['replay_rows']:,} marked as replays).",
        f"- Peak RSS: {mem['ingest_peak_rss_mib']:.0f} MiB after the ingest, "
        f"{mem['peak_rss_mib']:.0f} MiB at most (process baseline after imports "
        f"{mem['baseline_rss_mib']:.0f} MiB).",
        f"- Ingest wall s per repeat: {', '.join(f'{s:.2f}' for s in ing['wall_s_each'])}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ingestion", description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=None,
                        help="events to write and ingest (default 200000; 1000000 with --full)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="repeats, each in a fresh process (default 3; 5 with --full)")
    parser.add_argument("--ranks", type=int, default=4, help="ranks writing the run")
    parser.add_argument("--full", action="store_true", help="1M events, 5 repeats")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    total = args.events if args.events is not None else (1_000_000 if args.full else 200_000)
    repeats = args.repeats if args.repeats is not None else (5 if args.full else 3)
    if args.ranks < 1:
        parser.error(f"--ranks {args.ranks}: must be >= 1")
    if total < 100 * args.ranks:
        parser.error(f"--events {total}: use at least 100 per rank ({100 * args.ranks}) so "
                     "every rank has steps, a resume and a run_end")
    if repeats < 1:
        parser.error(f"--repeats {repeats}: must be >= 1")
    result = run(total, repeats, args.ranks, argv)
    markdown = to_markdown(result)
    meta = result.pop("meta")
    write_results(args.out_dir, NAME, result, markdown, meta)
    print(markdown)
    if result["reingest"]["rows_added"] or result["rows_stored"] != result["events"]:
        print(f"re-ingestion added {result['reingest']['rows_added']} rows or the store holds "
              f"{result['rows_stored']} of {result['events']} events: ingestion is not idempotent",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
