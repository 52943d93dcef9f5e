"""Prometheus exporter of live training figures, read from the runs' telemetry segments.

Each scrape of `/metrics` reads only the bytes appended since the last scrape: the collector
keeps a byte offset per segment, consumes complete (newline-terminated) lines and leaves a torn
trailing fragment for the next scrape (the same rule as `telemetry.reader`). A sealed segment
that has been read to its marker's byte count is never opened again.

Layouts found under `runs_root` (both at once are fine):
- `<runs_root>/<run folder>/telemetry/<run_id>/rank<R>/segment-*.jsonl` (the trainer's layout,
  `$TRAINWISE_HOME/runs`), with the partition read once from `<run folder>/request.json`;
- `<runs_root>/<run_id>/rank<R>/segment-*.jsonl` (a bare telemetry folder; partition "").

"Last" gauges (step, losses, cost, tokens, step time, micro batch) follow the record with the
latest `wall_time_s`, so a resumed run that restarts from an earlier checkpoint step shows its
current step, not the highest one ever reached.

Per rank (torchrun: every rank writes its own step events, label `rank`): its last step time,
compute time, wait at the gradient all-reduce and work share; re-balancing counted per rank and
direction (`trainwise_rank_rebalances`, from the fast decisions that changed a share), and the
reason of the latest one as the `reason` label of `trainwise_rank_last_rebalance_step` (one
series per rank: the label changes, the count of series does not).

References: Prometheus custom collectors,
https://prometheus.github.io/client_python/collector/custom/ ; metric naming,
https://prometheus.io/docs/practices/naming/ .

Run: `python -m telemetry.prometheus --runs-root $TRAINWISE_HOME/runs --port 9464`.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from telemetry.events import share_changes

log = logging.getLogger(__name__)

# `\Z`, not `$`: `$` also matches before a final newline ("rank0\n" would pass).
_SEGMENT_PATTERN = re.compile(r"^segment-(\d{5})\.jsonl\Z")  # as telemetry.writer writes them
_RANK_PATTERN = re.compile(r"^rank(\d+)\Z")
_FINISHED_STATUSES = frozenset({"completed", "failed"})
_LABELS = ("run_id", "partition")


@dataclass
class _SegmentCursor:
    """How far one segment file has been consumed."""

    path: Path
    offset_bytes: int = 0
    done: bool = False  # sealed and read to its marker: never opened again


@dataclass
class _RunFigures:
    """Running figures of one run, updated line by line."""

    run_id: str
    partition: str
    cursors: dict[Path, _SegmentCursor] = field(default_factory=dict)
    last_step_wall_s: float = float("-inf")
    # The compute estimate, tokens and samples are set by steps and by the run_end; ranks'
    # segments are read one after another, so a step older than the run_end may arrive after it
    # and must not win.
    totals_wall_s: float = float("-inf")
    step: int | None = None
    train_loss: float | None = None
    # The provider's bill so far: the newest bill record (telemetry.bill), the run's cost.
    cost_usd: float | None = None
    bill_wall_s: float = float("-inf")
    spot_share: float | None = None
    # The trainer's wall time x the list price (step and run_end records): not the bill.
    compute_estimate_usd: float | None = None
    tokens_seen: int | None = None
    samples_seen: int | None = None
    step_time_s: float | None = None
    micro_batch_size: int | None = None
    last_eval_wall_s: float = float("-inf")
    eval_loss: float | None = None
    decisions_by_layer: Counter[str] = field(default_factory=Counter)
    checkpoints_by_reason: Counter[str] = field(default_factory=Counter)
    preemptions: int = 0
    last_start_wall_s: float = float("-inf")
    last_end_wall_s: float = float("-inf")
    last_end_status: str | None = None
    bad_lines: int = 0
    # rank -> its last step's figures (wall_time_s, step_time_s, compute_s, wait_s, share)
    ranks: dict[int, dict[str, float | None]] = field(default_factory=dict)
    shares: list[float] = field(default_factory=list)  # the latest fast decision's shares
    rebalances: Counter[tuple[int, str]] = field(default_factory=Counter)  # (rank, up/down)
    last_rebalance: dict[int, tuple[int, str]] = field(default_factory=dict)  # rank: (step, why)
    # The published schedule in force (trainwise.schedule): the run's request names the one it
    # started on; the newest decision that names one (a live switch) wins after that.
    schedule_version: str = ""
    schedule_wall_s: float = float("-inf")

    def _apply_rank_step(self, record: dict[str, Any], wall_s: float) -> None:
        rank = _int(record.get("rank"))
        if rank is None:
            return
        previous = self.ranks.get(rank)
        if previous is not None and wall_s < (previous["wall_time_s"] or float("-inf")):
            return
        seconds = {key: (None if (ms := _number(record.get(key))) is None else ms / 1000.0)
                   for key in ("step_time_ms", "compute_ms", "allreduce_wait_ms")}
        share = _number(record.get("share"))
        self.ranks[rank] = {"wall_time_s": wall_s, "step_time_s": seconds["step_time_ms"],
                            "compute_s": seconds["compute_ms"],
                            "wait_s": seconds["allreduce_wait_ms"],
                            "share": 1.0 if share is None else share}

    def _apply_shares(self, record: dict[str, Any]) -> None:
        action = record.get("action")
        shares = action.get("rank_work_shares") if isinstance(action, dict) else None
        if not isinstance(shares, list) or len(shares) < 2:
            return
        new = [float(x) for x in shares if _number(x) is not None]
        if len(new) != len(shares):
            return
        before = self.shares or [1.0 / len(new)] * len(new)
        for rank, old, after in share_changes(before, new):
            self.rebalances[(rank, "down" if after < old else "up")] += 1
            self.last_rebalance[rank] = (_int(record.get("step")) or 0,
                                         str(record.get("reason", "")))
        self.shares = new

    @property
    def finished(self) -> bool:
        # A run_end with "stopped"/"preempted" may be followed by a resume; only
        # completed/failed end a run, and a later run_start reopens it.
        return (self.last_end_status in _FINISHED_STATUSES
                and self.last_end_wall_s >= self.last_start_wall_s)

    def apply(self, record: dict[str, Any]) -> None:
        kind = record.get("type")
        wall_s = _number(record.get("wall_time_s"))
        wall_s = float("-inf") if wall_s is None else wall_s
        if kind == "step":
            self._apply_rank_step(record, wall_s)
            if wall_s < self.last_step_wall_s:
                return  # an older rank's line read after a newer one
            self.last_step_wall_s = wall_s
            self.step = _int(record.get("step"))
            self.train_loss = _number(record.get("train_loss"))
            if wall_s >= self.totals_wall_s:
                self.totals_wall_s = wall_s
                self.compute_estimate_usd = _number(record.get("cost_usd"))
                self.tokens_seen = _int(record.get("tokens_seen"))
                self.samples_seen = _int(record.get("samples_seen"))
            step_time_ms = _number(record.get("step_time_ms"))
            self.step_time_s = None if step_time_ms is None else step_time_ms / 1000.0
            self.micro_batch_size = _int(record.get("micro_batch_size"))
        elif kind == "bill":
            if wall_s >= self.bill_wall_s and _number(record.get("bill_usd")) is not None:
                self.bill_wall_s = wall_s
                self.cost_usd = _number(record.get("bill_usd"))
                self.spot_share = _number(record.get("spot_share"))
        elif kind == "eval":
            if wall_s >= self.last_eval_wall_s:
                self.last_eval_wall_s = wall_s
                self.eval_loss = _number(record.get("eval_loss"))
        elif kind == "decision":
            version = record.get("schedule_version")
            if isinstance(version, str) and version and wall_s >= self.schedule_wall_s:
                self.schedule_wall_s, self.schedule_version = wall_s, version
            self.decisions_by_layer[str(record.get("layer", ""))] += 1
            if record.get("layer") == "fast":
                self._apply_shares(record)
        elif kind == "checkpoint":
            self.checkpoints_by_reason[str(record.get("reason", ""))] += 1
        elif kind == "preemption":
            self.preemptions += 1
        elif kind == "run_start":
            self.last_start_wall_s = max(self.last_start_wall_s, wall_s)
        elif kind == "run_end":
            if wall_s >= self.last_end_wall_s:
                self.last_end_wall_s = wall_s
                self.last_end_status = str(record.get("status"))
                # The run_end carries the final totals; a step event may not follow it.
                if wall_s >= self.totals_wall_s:
                    self.totals_wall_s = wall_s
                    cost_usd = _number(record.get("cost_usd"))
                    tokens_seen = _int(record.get("tokens_seen"))
                    samples_seen = _int(record.get("samples_seen"))
                    self.compute_estimate_usd = (self.compute_estimate_usd if cost_usd is None
                                                 else cost_usd)
                    self.tokens_seen = self.tokens_seen if tokens_seen is None else tokens_seen
                    self.samples_seen = (self.samples_seen if samples_seen is None
                                         else samples_seen)


def _number(value: Any) -> float | None:
    # JSON null stands for a non-finite float (telemetry.events); bools are not figures.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _int(value: Any) -> int | None:
    number = _number(value)
    return None if number is None else int(number)


def _read_request(run_folder: Path) -> tuple[str, str]:
    """(partition, schedule version the run started on) from its request.json, "" if unknown."""
    try:
        request = json.loads((run_folder / "request.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "", ""
    if not isinstance(request, dict):
        return "", ""
    partition, version = request.get("partition"), request.get("schedule_version")
    return (str(partition) if partition is not None else "",
            version if isinstance(version, str) else "")


def _marker_bytes(segment_path: Path) -> int | None:
    """Byte count of a sealed segment's body, or None while the segment is open."""
    try:
        marker = json.loads(segment_path.with_suffix(".complete").read_text(encoding="utf-8"))
        return int(marker["bytes"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a marker being replaced right now; read as open, seal next scrape


class TelemetryCollector(Collector):
    """Reads new telemetry lines of every run under `runs_root` on each `collect()`."""

    def __init__(self, runs_root: str | Path) -> None:
        self.runs_root = Path(runs_root)
        self._runs: dict[Path, _RunFigures] = {}  # key: the telemetry run folder
        self._lock = threading.Lock()  # scrapes arrive on the server's worker threads

    # -- discovery and incremental reading ---------------------------------------------------

    def _telemetry_run_dirs(self) -> list[tuple[Path, Path | None]]:
        """(telemetry run folder, run folder holding request.json or None)."""
        found: list[tuple[Path, Path | None]] = []
        if not self.runs_root.is_dir():
            return found
        for child in sorted(self.runs_root.iterdir()):
            if not child.is_dir():
                continue
            telemetry_dir = child / "telemetry"
            if telemetry_dir.is_dir():
                found.extend((d, child) for d in sorted(telemetry_dir.iterdir()) if d.is_dir())
            elif any(_RANK_PATTERN.match(p.name) for p in child.iterdir()):
                found.append((child, None))
        return found

    def refresh(self) -> None:
        """Reads whatever was appended since the last call; safe to call from many threads."""
        with self._lock:
            seen = set()
            for run_dir, run_folder in self._telemetry_run_dirs():
                seen.add(run_dir)
                figures = self._runs.get(run_dir)
                if figures is None:
                    partition, version = _read_request(run_folder) if run_folder else ("", "")
                    figures = _RunFigures(run_id=run_dir.name, partition=partition,
                                          schedule_version=version)
                    self._runs[run_dir] = figures
                self._read_new_lines(run_dir, figures)
            for gone in set(self._runs) - seen:  # a deleted run stops being exported
                del self._runs[gone]

    def _read_new_lines(self, run_dir: Path, figures: _RunFigures) -> None:
        segments = []
        for rank_path in run_dir.iterdir():
            if not (_RANK_PATTERN.match(rank_path.name) and rank_path.is_dir()):
                continue
            for path in rank_path.iterdir():
                match = _SEGMENT_PATTERN.match(path.name)
                if match:
                    segments.append((rank_path.name, int(match.group(1)), path))
        for _, _, path in sorted(segments):
            cursor = figures.cursors.setdefault(path, _SegmentCursor(path))
            if not cursor.done:
                self._consume(cursor, figures)

    @staticmethod
    def _consume(cursor: _SegmentCursor, figures: _RunFigures) -> None:
        # The marker is read before the data: if it exists, the body is final up to its bytes.
        sealed_bytes = _marker_bytes(cursor.path)
        try:
            with open(cursor.path, "rb") as handle:
                handle.seek(cursor.offset_bytes)
                if sealed_bytes is None:
                    data = handle.read()
                else:
                    data = handle.read(max(0, sealed_bytes - cursor.offset_bytes))
        except FileNotFoundError:
            return
        body = data[: data.rfind(b"\n") + 1]  # a torn trailing fragment waits for its newline
        cursor.offset_bytes += len(body)
        if sealed_bytes is not None and cursor.offset_bytes >= sealed_bytes:
            cursor.done = True
        for raw in body.splitlines():
            try:
                record = json.loads(raw)
            except ValueError:
                # A scrape must not fail for one bad line; the count shows it (the reader and
                # the DuckDB ingestion refuse such a segment with the details).
                figures.bad_lines += 1
                log.warning("telemetry segment %s has a line that is not JSON", cursor.path)
                continue
            if isinstance(record, dict):
                figures.apply(record)
            else:
                figures.bad_lines += 1

    # -- exposition ---------------------------------------------------------------------------

    def describe(self) -> Iterator[Metric]:
        # Names without samples: lets the registry detect clashes without reading any file.
        yield from self._families([])

    def collect(self) -> Iterator[Metric]:
        self.refresh()
        with self._lock:
            runs = list(self._runs.values())
        yield from self._families(runs)

    @staticmethod
    def _families(runs: list[_RunFigures]) -> Iterator[Metric]:
        gauges = {
            "step": ("trainwise_step", "Optimizer steps completed (last step event)."),
            "train_loss": ("trainwise_train_loss", "Training loss of the last step."),
            "eval_loss": ("trainwise_eval_loss", "Loss on the held-out batches, last eval."),
            "cost_usd": ("trainwise_cost_usd", "The provider's bill for the run so far (node-"
                         "seconds at the price paid, boot, changeover, notice and idle time "
                         "included), US dollars."),
            "compute_estimate_usd": ("trainwise_compute_estimate_usd",
                                     "The trainer's own compute estimate (its wall time x the "
                                     "list price), US dollars: not the bill."),
            "spot_share": ("trainwise_spot_share", "Share of the billed node-seconds on spot."),
            "step_time_s": ("trainwise_step_time_seconds", "Wall time of the last step."),
            "micro_batch_size": ("trainwise_micro_batch_size", "Micro batch size, last step."),
        }
        for attribute, (name, documentation) in gauges.items():
            family = GaugeMetricFamily(name, documentation, labels=_LABELS)
            for run in runs:
                value = getattr(run, attribute)
                if value is not None:  # no sample rather than a made-up zero
                    family.add_metric([run.run_id, run.partition], float(value))
            yield family
        counters = {
            "tokens_seen": ("trainwise_tokens_seen", "Tokens trained on so far."),
            "samples_seen": ("trainwise_samples_seen", "Samples trained on so far."),
        }
        for attribute, (name, documentation) in counters.items():
            family = CounterMetricFamily(name, documentation, labels=_LABELS)
            for run in runs:
                value = getattr(run, attribute)
                if value is not None:
                    family.add_metric([run.run_id, run.partition], float(value))
            yield family
        decisions = CounterMetricFamily(
            "trainwise_decisions", "Policy decisions recorded, by layer (fast/slow).",
            labels=(*_LABELS, "layer"))
        checkpoints = CounterMetricFamily(
            "trainwise_checkpoints", "Checkpoints written, by reason.",
            labels=(*_LABELS, "reason"))
        preemptions = CounterMetricFamily(
            "trainwise_preemptions", "Preemption notices received.", labels=_LABELS)
        finished = GaugeMetricFamily(
            "trainwise_run_finished", "1 once the run ended completed or failed.", labels=_LABELS)
        bad_lines = CounterMetricFamily(
            "trainwise_telemetry_bad_lines", "Telemetry lines that were not JSON objects.",
            labels=_LABELS)
        for run in runs:
            labels = [run.run_id, run.partition]
            for layer, count in sorted(run.decisions_by_layer.items()):
                decisions.add_metric([*labels, layer], count)
            for reason, count in sorted(run.checkpoints_by_reason.items()):
                checkpoints.add_metric([*labels, reason], count)
            preemptions.add_metric(labels, run.preemptions)
            finished.add_metric(labels, 1.0 if run.finished else 0.0)
            bad_lines.add_metric(labels, run.bad_lines)
        # The info-metric pattern: join it (`* on(run_id, partition) group_left(schedule_version)`)
        # to colour any figure by the schedule in force, as the dashboard's bill-vs-loss panel does.
        schedule = GaugeMetricFamily(
            "trainwise_run_schedule_info", "1 for the published schedule version in force "
            "(trainwise.schedule); \"none\" for a run not started on one.",
            labels=(*_LABELS, "schedule_version"))
        for run in runs:
            schedule.add_metric([run.run_id, run.partition, run.schedule_version or "none"], 1.0)
        yield from (decisions, checkpoints, preemptions, finished, bad_lines, schedule)
        yield from TelemetryCollector._rank_families(runs)

    @staticmethod
    def _rank_families(runs: list[_RunFigures]) -> Iterator[Metric]:
        labels = (*_LABELS, "rank")
        gauges = {
            "step_time_s": ("trainwise_rank_step_time_seconds",
                            "Wall time of the rank's last step (waits included)."),
            "compute_s": ("trainwise_rank_compute_seconds",
                          "Forward/backward time of the rank's micro batches, last step."),
            "wait_s": ("trainwise_rank_allreduce_wait_seconds",
                       "Time the rank waited for the slowest rank at the all-reduce, last step."),
            "share": ("trainwise_rank_share", "The rank's share of the global batch, last step."),
        }
        for key, (name, documentation) in gauges.items():
            family = GaugeMetricFamily(name, documentation, labels=labels)
            for run in runs:
                for rank, figures in sorted(run.ranks.items()):
                    if figures[key] is not None:
                        family.add_metric([run.run_id, run.partition, str(rank)],
                                          float(figures[key]))  # type: ignore[arg-type]
            yield family
        moved = CounterMetricFamily(
            "trainwise_rank_rebalances", "Fast decisions that changed the rank's work share.",
            labels=(*labels, "direction"))
        last = GaugeMetricFamily(
            "trainwise_rank_last_rebalance_step",
            "Step of the latest decision that changed the rank's share; reason in the label.",
            labels=(*labels, "reason"))
        for run in runs:
            for (rank, direction), count in sorted(run.rebalances.items()):
                moved.add_metric([run.run_id, run.partition, str(rank), direction], count)
            for rank, (step, reason) in sorted(run.last_rebalance.items()):
                last.add_metric([run.run_id, run.partition, str(rank), reason], step)
        yield from (moved, last)


def serve(
    runs_root: str | Path, port: int, addr: str = "127.0.0.1"
) -> tuple[Any, threading.Thread]:
    """Serves `/metrics` for the runs under `runs_root` on `addr:port` (port 0: any free one).

    Returns prometheus_client's (server, daemon thread); stop with `server.shutdown()` and
    `server.server_close()`. The actual port is `server.server_port`.
    """
    if not 0 <= int(port) <= 65535:
        raise ValueError(f"port {port} must be in 0..65535 (0 picks a free port)")
    runs_root = Path(runs_root)
    if runs_root.exists() and not runs_root.is_dir():
        raise ValueError(f"runs_root {runs_root} is a file; pass the folder that holds the runs")
    registry = CollectorRegistry()
    registry.register(TelemetryCollector(runs_root))
    return start_http_server(int(port), addr=addr, registry=registry)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m telemetry.prometheus",
        description="Serve live trainwise figures from telemetry files for Prometheus.")
    parser.add_argument("--runs-root", type=Path, required=True,
                        help="folder of runs, e.g. $TRAINWISE_HOME/runs")
    parser.add_argument("--port", type=int, default=9464, help="port to listen on (0: any)")
    parser.add_argument("--addr", default="127.0.0.1",
                        help="address to bind; 0.0.0.0 exposes it beyond this machine")
    args = parser.parse_args(argv)
    server, thread = serve(args.runs_root, args.port, args.addr)
    print(f"serving http://{args.addr}:{server.server_port}/metrics for {args.runs_root}",
          flush=True)
    try:
        thread.join()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        server.server_close()


if __name__ == "__main__":
    main()
