"""MLflow while the run trains: the run opens at the start, a tail thread streams the telemetry.

The training loop never talks to MLflow (a slow or dead tracking server must never slow a step):
it writes append-only telemetry segments, the dynamic sampler writes `consumption.jsonl`, the
slow layer writes the run's control file. `LiveRun` opens the MLflow run when training starts
and a background thread follows those three files every `interval_s`:

- telemetry records become metrics with their own wall-clock timestamps and steps (`log_batch`);
- fast-layer decisions, the control file's requested pruning rate, and the rates and curricula
  the sampler applied (consumption "rate"/"curriculum" records) become metrics, tags and rows of
  the decision table;
- whatever MLflow does not take (server down) stays buffered and is sent on a later tick.

`finish` logs the final metrics, the figure, the decision table (decisions.csv), the real end
time and status (FINISHED, KILLED for a preempted/stopped/migrated run, FAILED); for a completed
run it registers the final checkpoint as a version of the model `trainwise-<partition>`.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from telemetry import reader
from training.safe_files import write_atomic
from trainwise import tracking
from trainwise.services import Backoff, ServiceUnreachableError

LOG = logging.getLogger("trainwise.mlflow_live")
DEFAULT_INTERVAL_S = 5.0
# A tick tries MLflow once: the next tick is the retry, so a dead server never blocks the tail.
TICK_BACKOFF = Backoff(tries=1)
# Metrics held while MLflow is down; beyond it the oldest are dropped (and counted).
MAX_BUFFERED_METRICS = 500_000
DECISIONS_NAME = "decisions.csv"
DECISION_COLUMNS = ("wall_time_s", "step", "layer", "policy", "source", "action", "reason")
# telemetry status -> MLflow run status
STATUSES = {"completed": "FINISHED", "preempted": "KILLED", "stopped": "KILLED",
            "migrated": "KILLED", "failed": "FAILED"}
_BATCH_PREFIX = b'{"type":"batch"'  # the bulk of consumption.jsonl: skipped without parsing


def mlflow_status(train_status: str) -> str:
    """MLflow's terminal status of a training status (an unknown one counts as FAILED)."""
    return STATUSES.get(train_status, "FAILED")


def model_name(partition: str) -> str:
    """The registered model a partition's completed runs become versions of."""
    return f"trainwise-{partition}"


def event_metrics(event: Mapping[str, Any]) -> dict[str, float]:
    """MLflow metrics of one telemetry record ({} for records that are not figures)."""
    kind = event["type"]
    if kind == "step":
        values = {
            "losses/train": event.get("train_loss"),
            "charts/tokens": event.get("tokens_seen"),
            "charts/samples": event.get("samples_seen"),
            "charts/learning_rate": event.get("learning_rate"),
            "charts/micro_batch_size": event.get("micro_batch_size"),
            "charts/step_time_ms": event.get("step_time_ms"),
            # The trainer's wall time x the list price: an estimate, not the bill.
            "cost/compute_estimate_usd": event.get("cost_usd"),
        }
    elif kind == "bill":  # the provider's bill so far (telemetry.bill): the run's cost
        values = {"cost/usd": event.get("bill_usd"), "cost/spot_share": event.get("spot_share")}
    elif kind == "eval":
        values = {"losses/eval": event.get("eval_loss"), "eval/accuracy": event.get("eval_accuracy")}
    elif kind == "checkpoint":
        values = {"checkpoint/save_ms": event.get("save_ms")}
    elif kind == "preemption":
        values = {"cloud/preemption_notice_s": event.get("notice_s")}
    else:
        values = {}
    return {k: float(v) for k, v in values.items() if isinstance(v, (int, float))}


# --- following files that are being written ------------------------------------------------------
def segments_now(telemetry_dir: Path) -> set[Path]:
    """The telemetry segments present now: an earlier session's, when listed before this one
    writes (its provider rank writes before the MLflow run opens, so list before launching)."""
    telemetry_dir = Path(telemetry_dir)
    return ({s.path for s in reader.list_segments(telemetry_dir)} if telemetry_dir.is_dir()
            else set())


class TelemetryTail:
    """New records of a run's telemetry segments on each `poll`, each returned once.

    Open segments are read from where the last poll stopped, up to their last newline (a torn
    last line is the line being written: it is read on a later poll, once it is whole). Segments
    present at construction with `skip_existing` belong to earlier sessions of a resumed run.
    A malformed segment is reported in `problems` and not read again; the tail goes on.
    """

    def __init__(self, telemetry_dir: Path, *, skip_existing: bool = False,
                 skip: Iterable[Path] | None = None) -> None:
        self.telemetry_dir = Path(telemetry_dir)
        self._lines: dict[Path, int] = {}  # segment -> complete lines returned
        self._bytes: dict[Path, int] = {}  # segment -> bytes of those lines
        self._done: set[Path] = set()
        self.problems: list[str] = []
        if skip is not None:  # the caller listed the earlier sessions' segments itself
            self._done = set(skip)
        elif skip_existing:
            self._done = segments_now(self.telemetry_dir)

    def poll(self) -> list[dict[str, Any]]:
        if not self.telemetry_dir.is_dir():
            return []
        records: list[dict[str, Any]] = []
        for segment in reader.list_segments(self.telemetry_dir):
            if segment.path in self._done:
                continue
            try:
                records.extend(self._read(segment))
            except (ValueError, OSError) as error:  # TelemetryFormatError is a ValueError
                self._done.add(segment.path)
                self.problems.append(f"{segment.path}: {error}")
                LOG.warning("MLflow tail skips telemetry segment %s: %s", segment.path, error)
        return records

    def _read(self, segment: reader.Segment) -> list[dict[str, Any]]:
        done = self._lines.get(segment.path, 0)
        if segment.complete:  # sealed: checked against its marker, the rest returned once
            self._done.add(segment.path)
            return [record for _, record in reader.read_segment_lines(segment)[done:]]
        offset = self._bytes.get(segment.path, 0)
        with open(segment.path, "rb") as handle:
            handle.seek(offset)
            data = handle.read()
        whole = data[: data.rfind(b"\n") + 1]
        if not whole:
            return []
        lines = whole[:-1].split(b"\n")
        records = [reader.parse_line(segment, done + i, raw) for i, raw in enumerate(lines)]
        self._lines[segment.path] = done + len(lines)
        self._bytes[segment.path] = offset + len(whole)
        return records


class ConsumptionTail:
    """New control records (rate, curriculum, epoch, warning) of a run's consumption.jsonl.

    It starts at the file's size when made (earlier sessions were logged by their own run);
    batch lines, the bulk of the file, are skipped unparsed.
    """

    WANTED = frozenset({"rate", "curriculum", "epoch", "warning"})

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._offset = self.path.stat().st_size if self.path.is_file() else 0

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        whole = data[: data.rfind(b"\n") + 1]
        self._offset += len(whole)
        records = []
        for raw in whole.split(b"\n"):
            if not raw or raw.startswith(_BATCH_PREFIX):
                continue
            try:
                record = json.loads(raw)
            except ValueError:  # a torn line a resumed writer left behind: not a figure
                continue
            if isinstance(record, dict) and record.get("type") in self.WANTED:
                records.append(record)
        return records


class ControlWatch:
    """The slow layer's control file: its content each time it changes (written atomically)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._key: tuple[int, int, int] | None = None

    def poll(self) -> tuple[float, dict[str, Any]] | None:
        """(modification time in Unix seconds, content) when the file changed, else None."""
        if self.path is None:
            return None
        try:
            stat = self.path.stat()
            key = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
            if key == self._key:
                return None
            content = json.loads(self.path.read_text(encoding="utf-8"))
        except (FileNotFoundError, ValueError):
            return None  # absent, or mid-replace: the next tick reads it
        self._key = key
        return stat.st_mtime_ns / 1e9, content if isinstance(content, dict) else {}


# --- the live run ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class LiveRunSpec:
    """What the MLflow run is, and the files the tail follows."""

    tracking_uri: str
    experiment: str
    run_name: str
    params: Mapping[str, Any]
    tags: Mapping[str, str]
    telemetry_dir: Path
    consumption_path: Path | None = None
    control_path: Path | None = None
    # A change the gate holds for approval (the slow layer's proposal; no change to the run yet).
    proposal_path: Path | None = None
    artifact_root: Path | None = None


@dataclass(frozen=True)
class ModelToRegister:
    """A completed run's final checkpoint, registered as a version of `name`."""

    name: str
    checkpoint_path: Path
    tags: Mapping[str, str]


class LiveRun:
    """One MLflow run, open from `start` to `finish`/`abort`; see the module docstring."""

    def __init__(self, spec: LiveRunSpec, *, interval_s: float = DEFAULT_INTERVAL_S,
                 backoff: Backoff | None = None, skip_existing: bool = True,
                 skip_segments: Iterable[Path] | None = None) -> None:
        self.spec = spec
        self.interval_s = interval_s
        self.backoff = backoff  # for start and finish; a tick tries once (TICK_BACKOFF)
        self.run_id: str | None = None
        self.problems: list[str] = []
        self.decisions: list[dict[str, Any]] = []
        self.dropped_metrics = 0
        self._telemetry = TelemetryTail(spec.telemetry_dir, skip_existing=skip_existing,
                                        skip=skip_segments)
        self._consumption = (ConsumptionTail(spec.consumption_path)
                             if spec.consumption_path is not None else None)
        self._control = ControlWatch(spec.control_path)
        self._proposal = ControlWatch(spec.proposal_path)
        self._metrics: list[Any] = []  # mlflow Metric, waiting for MLflow
        self._tags: dict[str, str] = {}
        self._counts: dict[str, int] = {}
        self._step_ms: dict[int, int] = {}  # step -> wall time (ms) of its step record
        self._last_step = 0
        self._start_ms = 0
        self._client: Any = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._env = contextlib.ExitStack()

    # -- life cycle ------------------------------------------------------------------------------
    def start(self, start_time_s: float | None = None) -> LiveRun:
        """Opens the MLflow run (its start time is now) and starts the tail thread. A server
        that does not answer now is tried again on every tick: training starts regardless."""
        from mlflow.tracking import MlflowClient

        self._start_ms = int((start_time_s or time.time()) * 1000)
        self._env.enter_context(tracking.no_inner_http_retries())
        self._client = MlflowClient(tracking_uri=self.spec.tracking_uri)
        try:
            self._open(TICK_BACKOFF)
        except Exception as error:  # noqa: BLE001 - training must start anyway
            self._note(f"opening the MLflow run failed ({error}); retried while training")
        self._thread = threading.Thread(target=self._follow, name="mlflow-live", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stops the tail thread (a tick in flight finishes first)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self._note(f"the MLflow tail did not stop within {timeout_s:.0f} s")

    def finish(self, train_status: str, *, end_time_s: float,
               final_metrics: Mapping[str, float], artifacts: Iterable[Path] = (),
               decisions_path: Path | None = None,
               model: ModelToRegister | None = None) -> str:
        """Catches up, logs the end of the run and closes it; returns the MLflow run id.

        Raises (after bounded retries) when MLflow cannot take it: the caller records it as
        pending. The run is closed with the training's status even when a later step failed."""
        self.stop()
        from mlflow.entities import Metric

        call = tracking.mlflow_caller(self.spec.tracking_uri, self.backoff)
        end_ms = int(end_time_s * 1000)
        try:
            with self._lock:
                self._collect()
                if self.run_id is None:
                    self._open(self.backoff)
                self._metrics += [Metric(k, float(v), end_ms, self._last_step)
                                  for k, v in final_metrics.items()]
                self._metrics += [Metric(k, v, end_ms, self._last_step)
                                  for k, v in self._lever_figures().items()]
                self._tags["trainwise/status"] = train_status
                self._flush(call)
            assert self.run_id is not None
            artifacts = list(artifacts)
            if decisions_path is not None:
                artifacts.append(self.write_decisions(decisions_path))
            for artifact in artifacts:
                call(self._client.log_artifact, self.run_id, str(artifact))
            if model is not None and train_status == "completed":
                self._register(model, call)
        finally:
            if self.run_id is not None:
                with contextlib.suppress(Exception):  # the error above is the one to report
                    call(self._client.set_terminated, self.run_id, mlflow_status(train_status),
                         end_time=end_ms)
            self._env.close()
        return self.run_id

    def abort(self, error: BaseException) -> None:
        """Training raised: send what is buffered, mark the run FAILED; never raises."""
        self.stop(timeout_s=10.0)
        try:
            with self._lock:
                self._collect()
                self._tags["trainwise/error"] = repr(error)[:500]
                if self.run_id is not None:
                    call = tracking.mlflow_caller(self.spec.tracking_uri, TICK_BACKOFF)
                    self._flush(call)
                    call(self._client.set_terminated, self.run_id, "FAILED",
                         end_time=int(time.time() * 1000))
        except Exception as failure:  # noqa: BLE001 - the training error is the one to raise
            LOG.warning("MLflow run %s not closed as FAILED: %s", self.run_id, failure)
        finally:
            self._env.close()

    # -- the tail --------------------------------------------------------------------------------
    def _follow(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.tick()

    def tick(self) -> None:
        """One pass: read what is new, open the run if needed, send what is buffered."""
        with self._lock:
            try:
                self._collect()
                call = tracking.mlflow_caller(self.spec.tracking_uri, TICK_BACKOFF)
                if self.run_id is None:
                    self._open(TICK_BACKOFF)
                self._flush(call)
            except Exception as error:  # noqa: BLE001 - a tick never stops the tail or training
                self._note(f"MLflow tick failed ({type(error).__name__}: {error}); kept for "
                           "the next tick")

    def _note(self, problem: str) -> None:
        if not self.problems or self.problems[-1] != problem:
            LOG.warning("%s", problem)
            self.problems.append(problem)

    def _open(self, backoff: Backoff | None) -> None:
        from mlflow.entities import Param

        call = tracking.mlflow_caller(self.spec.tracking_uri, backoff)
        spec = self.spec
        experiment = tracking.experiment_id(self._client, spec.tracking_uri, spec.experiment,
                                            spec.artifact_root, call)
        run = call(self._client.create_run, experiment, start_time=self._start_ms,
                   run_name=tracking.scrub_value(spec.run_name),
                   tags={**tracking.scrub_params(spec.tags), "trainwise": "1"})
        params = [Param(k, v) for k, v in tracking.scrub_params(spec.params).items()]
        try:
            for start in range(0, len(params), 100):  # log_batch: at most 100 params a call
                call(self._client.log_batch, run.info.run_id, params=params[start:start + 100])
        except BaseException:
            with contextlib.suppress(Exception):  # a half-opened run is not left RUNNING
                self._client.delete_run(run.info.run_id)
            raise
        self.run_id = run.info.run_id

    def _flush(self, call: Callable[..., Any]) -> None:
        """Sends the buffered metrics (1000 a call) and tags; what fails stays buffered, unless
        MLflow refused it as invalid (then it is dropped and noted: retrying cannot help)."""
        from mlflow.entities import RunTag

        if self.run_id is None:
            return
        # Tags first: MLflow's SQL store writes a batch's metrics before its tags, in separate
        # transactions, and a reader that sees a change's metric should see its tag too.
        if self._tags:
            tags = tracking.scrub_params(self._tags)
            call(self._client.log_batch, self.run_id,
                 tags=[RunTag(k, v) for k, v in tags.items()])
            self._tags.clear()
        while self._metrics:
            chunk = self._metrics[:1000]
            try:
                call(self._client.log_batch, self.run_id, metrics=chunk)
            except ServiceUnreachableError:
                raise
            except Exception as error:  # noqa: BLE001 - a refused batch must not block the rest
                self._note(f"MLflow refused {len(chunk)} metrics ({error}); dropped")
            del self._metrics[:len(chunk)]

    # -- from files to metrics, tags and decisions ----------------------------------------------
    def _collect(self) -> None:
        try:
            records = self._telemetry.poll()
        except (ValueError, OSError) as error:
            records = []
            self._note(f"reading telemetry {self.spec.telemetry_dir} failed: {error}")
        for record in records:
            self._from_telemetry(record)
        if self._consumption is not None:
            for record in self._consumption.poll():
                self._from_consumption(record)
        changed = self._control.poll()
        if changed is not None:
            self._from_control(*changed)
        proposed = self._proposal.poll()
        if proposed is not None:
            self._from_control(*proposed, proposal=True)
        if len(self._metrics) > MAX_BUFFERED_METRICS:
            extra = len(self._metrics) - MAX_BUFFERED_METRICS
            del self._metrics[:extra]
            self.dropped_metrics += extra

    def _add(self, values: Mapping[str, float], wall_ms: int, step: int) -> None:
        from mlflow.entities import Metric

        self._metrics += [Metric(k, float(v), wall_ms, int(step)) for k, v in values.items()]

    def _decision(self, wall_s: float, step: int, layer: str, policy: str, source: str,
                  action: Any, reason: str) -> None:
        self._counts[layer] = self._counts.get(layer, 0) + 1
        self._add({f"decisions/{layer}": self._counts[layer]}, int(wall_s * 1000), step)
        action_text = action if isinstance(action, str) else json.dumps(action, sort_keys=True)
        self.decisions.append({"wall_time_s": round(wall_s, 3), "step": step, "layer": layer,
                               "policy": policy, "source": source, "action": action_text,
                               "reason": reason})
        self._tags[f"trainwise/last_{layer}_decision"] = f"step {step}: {action_text} ({reason})"

    def _from_telemetry(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        wall_s = float(record.get("wall_time_s") or time.time())
        self._last_step = max(self._last_step, step)
        if record["type"] == "step":
            self._step_ms[step] = int(wall_s * 1000)
        self._add(event_metrics(record), int(wall_s * 1000), step)
        if record["type"] == "decision" and record.get("policy") == "lever_guard":
            action = record.get("action") or {}
            if action.get("guard") == "switch_off":  # shows while the run trains
                self._add({f"levers/{action.get('lever')}_on": 0.0}, int(wall_s * 1000), step)
                self._tags[f"trainwise/lever_{action.get('lever')}"] = \
                    f"off: {record.get('reason', '')}"[:5000]
        if record["type"] == "decision":
            self._decision(wall_s, step, str(record.get("layer", "fast")),
                           str(record.get("policy", "")), "telemetry", record.get("action", {}),
                           str(record.get("reason", "")))
        elif record["type"] == "run_start":
            self._tags["trainwise/curriculum_version"] = str(record.get("curriculum_version"))
        elif record["type"] == "run_end":
            self._tags["trainwise/status"] = str(record.get("status"))

    def _from_consumption(self, record: Mapping[str, Any]) -> None:
        step = int(record.get("step", self._last_step))
        wall_ms = self._step_ms.get(step, int(time.time() * 1000))
        kind = record["type"]
        if kind == "epoch":
            self._add({"data/epoch_pruning_rate": record.get("rate", 0.0),
                       "data/epoch_kept": record.get("kept", 0)}, wall_ms, step)
        elif kind == "rate":
            self._add({"data/pruning_rate": record["rate"]}, wall_ms, step)
            self._tags["trainwise/pruning_rate"] = str(record["rate"])
            self._decision(wall_ms / 1000, step, "slow", "sampler", str(record.get("source")),
                           {"pruning_rate": record["rate"]}, str(record.get("reason", "")))
        elif kind == "curriculum":
            self._tags["trainwise/curriculum_version"] = str(record.get("version"))
            self._decision(wall_ms / 1000, step, "slow", "sampler", str(record.get("source")),
                           {"curriculum_version": record.get("version")}, "")
        else:  # warning: a refused control file, a clamp
            self._decision(wall_ms / 1000, step, "data", "sampler", "warning", "warning",
                           str(record.get("message", "")))

    def _from_control(self, mtime_s: float, content: Mapping[str, Any], *,
                      proposal: bool = False) -> None:
        """The control file (the change handed to the run) or a proposal held for approval."""
        rate = content.get("pruning_rate")
        action = {k: content.get(k) for k in ("pruning_rate", "curriculum_version")
                  if content.get(k) is not None}
        metric, tag, source = (("control/pruning_rate_proposed", "proposed", "proposal")
                               if proposal else ("control/pruning_rate", "requested",
                                                 "control_file"))
        if isinstance(rate, (int, float)):
            self._add({metric: rate}, int(mtime_s * 1000), self._last_step)
            self._tags[f"trainwise/pruning_rate_{tag}"] = str(rate)
        reason = content.get("status") if proposal else None
        self._decision(mtime_s, self._last_step, "slow", source, source, action,
                       str(reason or content.get("reason", "")))

    # -- end of run ------------------------------------------------------------------------------
    def _lever_figures(self) -> dict[str, float]:
        """What each lever decided and saved or cost over the whole run (trainwise.explain's
        figures, so MLflow and `trainwise explain` agree): metrics levers/*, and a tag per lever
        (trainwise/lever_<name>: on, not used, or off with the guard's reason)."""
        from trainwise.explain import lever_effects, lever_metrics, lever_states

        try:
            records = reader.read_run_events(self.spec.telemetry_dir)
            consumption: list[dict[str, Any]] = []
            if self.spec.consumption_path is not None:
                whole = ConsumptionTail(self.spec.consumption_path)
                whole._offset = 0  # every session's records: the figures are the run's
                consumption = whole.poll()
            effects = lever_effects(records, consumption)
        except (OSError, ValueError, KeyError, TypeError) as error:
            self._note(f"per-lever figures not computed: {error}")
            return {}
        for lever, state in lever_states(effects).items():
            self._tags[f"trainwise/lever_{lever}"] = state[:5000]
        return lever_metrics(effects)

    def write_decisions(self, path: Path) -> Path:
        """The decision table as CSV (one row per decision, in the order seen)."""
        path = Path(path)
        buffer = io.StringIO(newline="")
        writer = csv.DictWriter(buffer, fieldnames=DECISION_COLUMNS)
        writer.writeheader()
        writer.writerows(self.decisions)
        # Written to an unpredictable temp name and renamed: the run folder is shared, and an
        # open(path, "w") would write through a link planted at this name (issue 31, class 2).
        write_atomic(path, buffer.getvalue().encode("utf-8"))
        return path

    def _register(self, model: ModelToRegister, call: Callable[..., Any]) -> None:
        from training.checkpoint import manifest_path

        assert self.run_id is not None
        call(self._client.log_artifact, self.run_id, str(model.checkpoint_path),
             artifact_path="model")
        manifest = manifest_path(model.checkpoint_path)
        if manifest.exists():
            call(self._client.log_artifact, self.run_id, str(manifest), artifact_path="model")
        try:
            call(self._client.create_registered_model, model.name,
                 description="trainwise checkpoints of completed training runs")
        except Exception as error:  # noqa: BLE001 - registered by an earlier run: add a version
            if "already exists" not in str(error).lower():
                raise
        artifact_uri = call(self._client.get_run, self.run_id).info.artifact_uri
        version = call(self._client.create_model_version, model.name,
                       f"{artifact_uri.rstrip('/')}/model", run_id=self.run_id,
                       tags=tracking.scrub_params(model.tags))
        call(self._client.set_tag, self.run_id, "trainwise/model_version",
             f"{model.name}/{version.version}")
