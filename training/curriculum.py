"""curriculum: which train examples to keep this epoch and the loss weight of each.

InfoBatch-style unbiased pruning (Qin et al., "InfoBatch: Lossless Training Speed Up by Unbiased
Dynamic Data Pruning", ICLR'24, Alg. 1): among train examples whose score is below the mean score,
drop each independently with probability r (the pruning rate); a kept below-mean example gets
weight 1 / (1 - r), every other kept example weight 1. The expected weighted loss then equals the
full-data loss: E[sum of weights] = n_above + n_below (1 - r) / (1 - r) = n_train.
The last `anneal_fraction` of training uses full data with weight 1 (the trainer applies it).
Eval examples are never in a curriculum.

Refused: a rate outside [0, 1) (names TRAINWISE_PRUNING_RATE), scores from other shards or with
NaN, scores that miss a train example, and a draw that drops every train example of a class
(images) or of a shard: a curriculum must not silently remove a part of the data.

Published as `curriculum-<version>.parquet` (example_id, weight) + `curriculum-<version>.json`
(summary, checksum) and a `LATEST` pointer file, each written atomically, pointer last.

Write, audit, publish: the Dagster asset writes a version as a *candidate* (`propose_curriculum`,
a `CANDIDATE` file; `LATEST` untouched, so training never reads it), the blocking check audits it
and only a passing check moves `LATEST` (`promote_candidate`). A failed candidate stays on disk
for inspection (`reject_candidate` records why). A rollback proposes a stored version again and
goes through the same check. Every publish, rejection and rollback is a line of `history.jsonl`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from pathlib import Path

import numpy as np

from training._data_io import atomic_write_bytes, atomic_write_json, read_json, sha256_file
from training.data_types import Curriculum, ExampleSet
from training.safe_files import append_bytes
from training.scoring import ScoreTable

LATEST_NAME = "LATEST"
CANDIDATE_NAME = "CANDIDATE"
HISTORY_NAME = "history.jsonl"
CURRICULUM_FORMAT = "trainwise.curriculum/1"
REMATERIALIZE = "re-materialize curriculum"
VERSION_HEX = 12
_VERSION_RE = re.compile(f"[0-9a-f]{{{VERSION_HEX}}}")


def validate_pruning_rate(pruning_rate: float) -> float:
    """The rate as a float in [0, 1); otherwise a ValueError naming TRAINWISE_PRUNING_RATE."""
    try:
        rate = float(pruning_rate)
    except (TypeError, ValueError):
        rate = math.nan
    if isinstance(pruning_rate, bool) or not (0.0 <= rate < 1.0):
        raise ValueError(f"pruning rate {pruning_rate!r} is outside [0, 1): set "
                         "TRAINWISE_PRUNING_RATE to a number such as 0.3 (0 keeps all examples; "
                         "1 would drop every below-mean example and leave weights infinite)")
    return rate


def curriculum_version(partition: str, example_ids: np.ndarray, weights: np.ndarray,
                       pruning_rate: float, data_fingerprint: str, scores_step: int | None,
                       anneal_fraction: float) -> str:
    """Short sha256 of the curriculum's content: equal content, equal version."""
    digest = hashlib.sha256()
    header = [partition, repr(float(pruning_rate)), data_fingerprint, scores_step,
              repr(float(anneal_fraction))]
    digest.update(json.dumps(header).encode("utf-8"))
    digest.update(np.ascontiguousarray(example_ids, dtype="<i8").tobytes())
    digest.update(np.ascontiguousarray(weights, dtype="<f8").tobytes())
    return digest.hexdigest()[:VERSION_HEX]


def keep_everything(partition: str, examples: ExampleSet, *, pruning_rate: float = 0.0,
                    anneal_fraction: float = 0.0) -> Curriculum:
    """Every train example at weight 1 (no pruning by the curriculum itself): the curriculum a
    benchmark compares strategies on, and a test's baseline. `pruning_rate` is what the run's
    dynamic selection starts from (the curriculum keeps everything whatever it says)."""
    train_ids = examples.example_ids[examples.train_positions]
    weights = np.ones(len(train_ids))
    version = curriculum_version(partition, train_ids, weights, pruning_rate,
                                 examples.fingerprint, None, anneal_fraction)
    return Curriculum(partition=partition, version=version, example_ids=train_ids,
                      weights=weights, pruning_rate=pruning_rate,
                      data_fingerprint=examples.fingerprint, scores_step=None,
                      anneal_fraction=anneal_fraction)


def _train_scores(examples: ExampleSet, scores: ScoreTable) -> np.ndarray:
    """Score of every train example, in train_positions order."""
    if scores.data_fingerprint != examples.fingerprint:
        raise ValueError(
            f"difficulty scores were taken on shards {scores.data_fingerprint[:12]}, the current "
            f"shards of {examples.partition!r} are {examples.fingerprint[:12]}: re-materialize "
            "difficulty_scores, then the curriculum")
    by_position = np.full(len(examples.example_ids), np.nan)
    by_position[examples.positions_of(scores.example_ids)] = scores.loss
    train_scores = by_position[examples.train_positions]
    if np.isnan(train_scores).any():
        missing = examples.example_ids[examples.train_positions[np.isnan(train_scores)]]
        raise ValueError(f"difficulty scores miss {len(missing)} train examples (first id "
                         f"{int(missing[0])}): re-materialize difficulty_scores")
    return train_scores


def build_curriculum(
    examples: ExampleSet,
    scores: ScoreTable,
    pruning_rate: float,
    *,
    seed: int = 0,
    anneal_fraction: float = 0.125,
) -> Curriculum:
    """One seeded InfoBatch draw over the train split (see the module docstring)."""
    rate = validate_pruning_rate(pruning_rate)
    if not 0.0 <= float(anneal_fraction) <= 1.0:
        raise ValueError(f"anneal_fraction must be in [0, 1], got {anneal_fraction!r}")
    train = examples.train_positions
    if len(train) == 0:
        raise ValueError(f"partition {examples.partition!r} has no train examples")
    train_scores = _train_scores(examples, scores)
    below_mean = train_scores < train_scores.mean()
    draws = np.random.default_rng(seed).random(len(train))
    dropped = below_mean & (draws < rate)
    kept = train[~dropped]
    _refuse_lost_groups(examples, train, kept, rate, seed)
    weights = np.where(below_mean[~dropped], 1.0 / (1.0 - rate), 1.0)
    example_ids = examples.example_ids[kept].astype(np.int64)
    version = curriculum_version(examples.partition, example_ids, weights, rate,
                                 examples.fingerprint, scores.step, anneal_fraction)
    return Curriculum(
        partition=examples.partition, version=version, example_ids=example_ids, weights=weights,
        pruning_rate=rate, data_fingerprint=examples.fingerprint, scores_step=scores.step,
        anneal_fraction=float(anneal_fraction),
    )


def _refuse_lost_groups(examples: ExampleSet, train: np.ndarray, kept: np.ndarray,
                        rate: float, seed: int) -> None:
    groups = [("shard", examples.shard_index)]
    if examples.kind == "image" and examples.labels is not None:
        groups.append(("class", examples.labels))
    for name, values in groups:
        lost = np.setdiff1d(np.unique(values[train]), np.unique(values[kept]))
        if len(lost):
            raise ValueError(
                f"pruning rate {rate} with seed {seed} would drop every train example of {name} "
                f"{int(lost[0])} of {examples.partition!r}: lower TRAINWISE_PRUNING_RATE or use "
                "another seed")


def summarize_curriculum(c: Curriculum, examples: ExampleSet,
                         scores: ScoreTable | None = None) -> dict:
    """Counts and a one-line reason for the versioned manifest and asset metadata."""
    n_train = len(examples.train_positions)
    n_kept = len(c.example_ids)
    upweighted = int((c.weights > 1.0).sum())
    scorer = f" under {scores.scorer}" if scores is not None else ""
    why = (f"InfoBatch-style: {n_train - n_kept} of {n_train} train examples pruned, each "
           f"below-mean-loss example{scorer} dropped with probability {c.pruning_rate}; the "
           f"{upweighted} kept below-mean examples weigh {1.0 / (1.0 - c.pruning_rate):.4g} so "
           f"the expected loss is unbiased; last {c.anneal_fraction:.3g} of training on full data")
    if c.pruning_rate == 0.0:
        why = f"pruning rate 0: all {n_train} train examples kept with weight 1"
    return {"n_train": n_train, "kept": n_kept, "pruned": n_train - n_kept,
            "upweighted": upweighted, "weight_sum": float(c.weights.sum()),
            "scorer": scores.scorer if scores is not None else None, "why": why}


def coverage_report(examples: ExampleSet, c: Curriculum) -> dict:
    """The curriculum gate: does `c` fit these shards, keep every shard (and class) and a sane
    share of the train split? Returns {"passed": bool, "failures": [...], counts...}.

    Sane share: at least 1 - rate, less 3 binomial standard deviations (InfoBatch prunes at most
    `rate` of the below-mean examples, so the expected kept share is >= 1 - rate).
    """
    failures: list[str] = []
    train = examples.train_positions
    n_train = len(train)
    if c.partition != examples.partition:
        failures.append(f"curriculum is for partition {c.partition!r}, shards are "
                        f"{examples.partition!r}")
    if c.data_fingerprint != examples.fingerprint:
        failures.append("curriculum was built from other shards (fingerprint "
                        f"{c.data_fingerprint[:12]} != {examples.fingerprint[:12]}): {REMATERIALIZE}")
    if len(np.unique(c.example_ids)) != len(c.example_ids):
        failures.append("curriculum repeats example ids")
    if not (np.isfinite(c.weights).all() and (c.weights >= 1.0).all()):
        failures.append("curriculum has weights below 1 or not finite")
    try:
        kept = examples.positions_of(c.example_ids)
    except KeyError as exc:
        failures.append(str(exc.args[0]))
        kept = np.zeros(0, dtype=np.int64)
    if examples.is_eval[kept].any():
        failures.append(f"{int(examples.is_eval[kept].sum())} eval examples are in the curriculum")
    report: dict = {"partition": c.partition, "version": c.version, "kept": len(kept),
                    "train_examples": int(n_train), "pruning_rate": c.pruning_rate}
    groups = [("shards", examples.shard_index)]
    if examples.kind == "image" and examples.labels is not None:
        groups.append(("classes", examples.labels))
    for name, values in groups:
        needed = np.unique(values[train])
        lost = np.setdiff1d(needed, np.unique(values[kept]))
        report[f"{name}_covered"] = int(len(needed) - len(lost))
        report[f"{name}_with_train_examples"] = len(needed)
        if len(lost):
            failures.append(f"curriculum keeps no example of {name} {lost.tolist()[:10]}")
    kept_share = len(kept) / max(1, n_train)
    rate = c.pruning_rate
    min_share = max(0.0, 1.0 - rate - 3.0 * math.sqrt(rate * (1.0 - rate) / max(1, n_train)))
    if kept_share < min_share:
        failures.append(f"keeps {kept_share:.3f} of the train split, below {min_share:.3f} "
                        f"for pruning rate {rate}")
    report.update({"kept_share": round(kept_share, 6), "min_kept_share": round(min_share, 6),
                   "passed": not failures, "failures": failures,
                   "reason": "; ".join(failures) if failures else
                   f"keeps {len(kept)} of {n_train} train examples from every shard"
                   + (" and class" if len(groups) > 1 else "")})
    return report


def write_curriculum(c: Curriculum, out_dir: Path, *, summary: dict | None = None,
                     publish: bool = True) -> Path:
    """Write `c` under `out_dir` and (publish=True) point LATEST at it; returns the .json
    manifest path. publish=False leaves LATEST alone: see `propose_curriculum`.

    Order: parquet, then json (naming the parquet's sha256), then LATEST, each atomic: a crash
    leaves LATEST on the previous complete version. `summary`: from summarize_curriculum.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if curriculum_version(c.partition, c.example_ids, c.weights, c.pruning_rate,
                          c.data_fingerprint, c.scores_step, c.anneal_fraction) != c.version:
        raise ValueError(f"curriculum {c.version} does not match its content: build it with "
                         "build_curriculum")
    validate_pruning_rate(c.pruning_rate)
    parquet_path = out_dir / f"curriculum-{c.version}.parquet"
    table = pa.table({"example_id": pa.array(c.example_ids, pa.int64()),
                      "weight": pa.array(c.weights, pa.float64())})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    atomic_write_bytes(parquet_path, sink.getvalue().to_pybytes())
    summary = summary if summary is not None else {"kept": len(c.example_ids),
                                                   "pruned": None, "why": "no summary given"}
    manifest = {
        **summary,
        "format": CURRICULUM_FORMAT, "partition": c.partition, "version": c.version,
        "pruning_rate": c.pruning_rate, "data_fingerprint": c.data_fingerprint,
        "scores_step": c.scores_step, "anneal_fraction": c.anneal_fraction,
        "file": parquet_path.name, "sha256": sha256_file(parquet_path),
        "rate": c.pruning_rate,
    }
    json_path = out_dir / f"curriculum-{c.version}.json"
    atomic_write_json(json_path, manifest)
    if publish:
        atomic_write_bytes(out_dir / LATEST_NAME, (c.version + "\n").encode("ascii"))
    return json_path


def _resolve(path_or_dir: Path, version: str | None) -> Path:
    path = Path(path_or_dir)
    if path.is_file():
        if version is not None:
            raise ValueError(f"give a folder or a version, not both ({path}, {version!r})")
        if path.name == LATEST_NAME:
            return _resolve(path.parent, None)
        return path.with_suffix(".json")
    if not path.is_dir():
        raise FileNotFoundError(f"no curriculum at {path}: materialize curriculum")
    if version is None:
        latest = path / LATEST_NAME
        if not latest.is_file():
            raise FileNotFoundError(f"no {LATEST_NAME} in {path}: materialize curriculum")
        version = latest.read_text(encoding="ascii", errors="replace").strip()
    if not _VERSION_RE.fullmatch(version):
        raise ValueError(f"curriculum version {version!r} is not {VERSION_HEX} hex digits: "
                         f"{REMATERIALIZE}")
    return path / f"curriculum-{version}.json"


def load_curriculum(path_or_dir: Path, version: str | None = None) -> Curriculum:
    """A published curriculum: the folder's LATEST, a given version, or a .json/.parquet path.

    Verifies the parquet's sha256 and that the content hashes to the recorded version.
    """
    import pyarrow.parquet as pq

    json_path = _resolve(Path(path_or_dir), version)
    manifest = read_json(json_path, what="curriculum manifest", fix=REMATERIALIZE)
    if manifest.get("format") != CURRICULUM_FORMAT:
        raise ValueError(f"{json_path} has format {manifest.get('format')!r}, expected "
                         f"{CURRICULUM_FORMAT!r}: {REMATERIALIZE}")
    parquet_path = json_path.parent / manifest["file"]
    if not parquet_path.is_file():
        raise FileNotFoundError(f"curriculum file {parquet_path} is missing: {REMATERIALIZE}")
    if sha256_file(parquet_path) != manifest["sha256"]:
        raise ValueError(f"curriculum file {parquet_path} fails its sha256 checksum (corrupt or "
                         f"modified on disk): {REMATERIALIZE}")
    table = pq.read_table(parquet_path)
    c = Curriculum(
        partition=manifest["partition"], version=manifest["version"],
        example_ids=table.column("example_id").to_numpy().astype(np.int64),
        weights=table.column("weight").to_numpy().astype(np.float64),
        pruning_rate=float(manifest["pruning_rate"]), data_fingerprint=manifest["data_fingerprint"],
        scores_step=manifest["scores_step"], anneal_fraction=float(manifest["anneal_fraction"]),
    )
    if curriculum_version(c.partition, c.example_ids, c.weights, c.pruning_rate,
                          c.data_fingerprint, c.scores_step, c.anneal_fraction) != c.version:
        raise ValueError(f"curriculum {json_path} does not hash to its version {c.version}: "
                         f"{REMATERIALIZE}")
    return c


# ---- write, audit, publish ---------------------------------------------------------------------

def current_version(out_dir: Path) -> str | None:
    """The published (LATEST) version of a folder, or None when nothing is published yet."""
    latest = Path(out_dir) / LATEST_NAME
    if not latest.is_file():
        return None
    return latest.read_text(encoding="ascii", errors="replace").strip() or None


def read_candidate(out_dir: Path) -> dict | None:
    """The pending proposal of a folder ({"version", "source", "reason", ...}) or None."""
    path = Path(out_dir) / CANDIDATE_NAME
    if not path.is_file():
        return None
    return read_json(path, what="curriculum candidate", fix=REMATERIALIZE)


def _propose(out_dir: Path, version: str, source: str, reason: str, requested_by: str,
             live_change: dict | None) -> dict:
    proposal = {"version": version, "source": source, "reason": reason,
                "requested_by": requested_by, "proposed_at_s": time.time(),
                "previous": current_version(out_dir), "live_change": live_change}
    atomic_write_json(Path(out_dir) / CANDIDATE_NAME, proposal)
    return proposal


def propose_curriculum(c: Curriculum, out_dir: Path, *, summary: dict | None = None,
                       reason: str = "", requested_by: str = "",
                       live_change: dict | None = None) -> Path:
    """Write `c` as the folder's candidate (LATEST unchanged); returns its .json manifest.
    `live_change`: a change of a running job ({"run_id", "pruning_rate", "reason"}) that goes
    live only when this candidate is published."""
    json_path = write_curriculum(c, out_dir, summary=summary, publish=False)
    _propose(out_dir, c.version, "build", reason, requested_by, live_change)
    return json_path


def propose_rollback(out_dir: Path, version: str, *, reason: str, requested_by: str) -> Curriculum:
    """Propose a stored version again (a rollback); it is verified (checksum, content hash) now
    and published only when the gate passes. A version never written is a FileNotFoundError
    listing the stored ones."""
    out_dir = Path(out_dir)
    try:
        restored = load_curriculum(out_dir, version)
    except FileNotFoundError as error:
        stored = sorted(p.stem.removeprefix("curriculum-") for p in
                        out_dir.glob("curriculum-*.json"))
        raise FileNotFoundError(f"no curriculum version {version!r} in {out_dir} to roll back to;"
                                f" stored versions: {', '.join(stored) or 'none'}") from error
    if not reason.strip():
        raise ValueError("a rollback needs a reason (run config `reason`): it is recorded in "
                         "the curriculum history")
    _propose(out_dir, version, "rollback", reason, requested_by, None)
    return restored


def append_history(out_dir: Path, record: dict) -> dict:
    """One line of the folder's history (publish, rejection, rollback, live change)."""
    record = {"at_s": time.time(), **record}
    # A link, hard link or FIFO planted at this predictable name is refused, never appended
    # through (issue 31, class 2).
    append_bytes(Path(out_dir) / HISTORY_NAME,
                 (json.dumps(record, sort_keys=True) + "\n").encode("utf-8"))
    return record


def read_history(out_dir: Path) -> list[dict]:
    path = Path(out_dir) / HISTORY_NAME
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def promote_candidate(out_dir: Path, version: str, *, approved_by: str) -> dict:
    """Publish the checked candidate `version` (LATEST -> version) and record it.

    Refused (ValueError) when the folder's candidate is no longer `version` (another proposal
    came in after the check: check that one) or when its files fail their checksum."""
    out_dir = Path(out_dir)
    candidate = read_candidate(out_dir)
    if candidate is None or candidate.get("version") != version:
        raise ValueError(f"candidate of {out_dir} is {candidate and candidate.get('version')!r}, "
                         f"not the checked version {version!r}: run curriculum_coverage again")
    load_curriculum(out_dir, version)  # checksum and content hash, before it goes live
    previous = current_version(out_dir)
    atomic_write_bytes(out_dir / LATEST_NAME, (version + "\n").encode("ascii"))
    (out_dir / CANDIDATE_NAME).unlink(missing_ok=True)
    return append_history(out_dir, {
        "event": "rollback" if candidate.get("source") == "rollback" else "published",
        "from": previous, "to": version, "approved_by": approved_by,
        "requested_by": candidate.get("requested_by", ""), "why": candidate.get("reason", ""),
        "live_change": candidate.get("live_change")})


def reject_candidate(out_dir: Path, version: str, failures: list[str]) -> dict:
    """Record that the candidate failed its gate; its files and the CANDIDATE pointer stay for
    inspection, LATEST stays where it was."""
    candidate = read_candidate(out_dir) or {}
    return append_history(out_dir, {"event": "rejected", "version": version,
                                    "current": current_version(out_dir), "failures": failures,
                                    "source": candidate.get("source", ""),
                                    "why": candidate.get("reason", "")})
