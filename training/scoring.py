"""difficulty_scores: the per-example loss of every example under a small reference model, or under
the latest checkpoint's model when one is given.

Proxies (fitted on the TRAIN split only, so eval scores are honest held-out losses):
  text   character bigram model with add-one (Laplace) smoothing; an example's score is the mean
         NLL (nats) of its block_size next-character predictions, the same targets the GPT sees.
  image  multinomial logistic regression on pixels / 255, full-batch gradient descent from zero
         (100 steps, lr 1.0, L2 1e-4: about 91% eval accuracy on MNIST); score = cross-entropy.
Images also get EL2N, the L2 norm of softmax(p) - onehot(y) (Paul, Ganguli, Dziugaite, "Deep
Learning on a Data Diet", NeurIPS'21).
With a model: text model(x int64 (B, T)) -> logits (B, T, V); image model(x float (B,1,28,28)/255)
-> logits (B, 10); per-example mean cross-entropy. Losses are what InfoBatch (Qin et al., ICLR'24)
prunes on. NaN or infinite scores are refused everywhere: they would make "below the mean" mean
nothing.

Stored per shard (`scores-00000.parquet`, ...) with `scores.json`, published atomically.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from training._data_io import publish_folder, read_json, sha256_file, sha256_json
from training.data_types import ExampleSet

SCORES_NAME = "scores.json"
SCORES_FORMAT = "trainwise.difficulty_scores/1"
REMATERIALIZE = "re-materialize difficulty_scores"
PROXY_STEPS = 100
PROXY_LR = 1.0
PROXY_L2 = 1e-4
N_CLASSES = 10


@dataclass(frozen=True)
class ScoreTable:
    """Per-example difficulty of one partition (train and eval examples)."""

    partition: str
    data_fingerprint: str  # ExampleSet.fingerprint the scores were taken on
    example_ids: np.ndarray  # int64 (N,)
    shard_index: np.ndarray  # int32 (N,)
    loss: np.ndarray  # float64 (N,) mean per-token (text) or per-image NLL, nats
    el2n: np.ndarray | None  # float64 (N,) images; None for text
    step: int | None  # training step of the scoring model; None = proxy
    scorer: str  # e.g. "bigram-add-one-proxy", "logreg-proxy", "model@step=1200"

    def __post_init__(self) -> None:
        n = len(self.example_ids)
        for name in ("shard_index", "loss") + (("el2n",) if self.el2n is not None else ()):
            if len(getattr(self, name)) != n:
                raise ValueError(f"ScoreTable.{name} has {len(getattr(self, name))} rows, "
                                 f"example_ids has {n}")
        _refuse_non_finite(self.loss, self.example_ids, "loss")
        if self.el2n is not None:
            _refuse_non_finite(self.el2n, self.example_ids, "el2n")

    def summary(self) -> dict:
        """Flat scalars for asset metadata."""
        return {"partition": self.partition, "rows": len(self.example_ids),
                "scorer": self.scorer, "step": self.step,
                "mean_loss": float(self.loss.mean()), "std_loss": float(self.loss.std()),
                "mean_el2n": float(self.el2n.mean()) if self.el2n is not None else None,
                "data_fingerprint": self.data_fingerprint}


def score_metadata(table: ScoreTable) -> dict:
    """Asset metadata of a score table: its summary without None values."""
    return {k: v for k, v in table.summary().items() if v is not None}


def _refuse_non_finite(values: np.ndarray, ids: np.ndarray, name: str) -> None:
    bad = ~np.isfinite(np.asarray(values, dtype=np.float64))
    if bad.any():
        raise ValueError(
            f"{int(bad.sum())} of {len(values)} difficulty {name} scores are NaN or infinite "
            f"(first example id {int(ids[np.flatnonzero(bad)[0]])}): the scoring model diverged; "
            f"score with the proxy (model=None) or an earlier checkpoint, then {REMATERIALIZE}")


def difficulty_scores(
    examples: ExampleSet,
    model=None,
    *,
    step: int | None = None,
    batch_size: int = 256,
) -> ScoreTable:
    """Per-example loss of every example: under `model` (a torch callable; `step` = its training
    step, required) or, when model is None, under the proxy fitted on the train split."""
    if len(examples.train_positions) == 0:
        raise ValueError(f"partition {examples.partition!r} has no train examples to fit a proxy on")
    if model is not None:
        if step is None or not isinstance(step, int) or step < 0:
            raise ValueError("difficulty_scores(model=...) needs step=<the checkpoint's training "
                             f"step> (a non-negative int), got {step!r}")
        loss, el2n = _model_scores(examples, model, batch_size)
        scorer = f"model@step={step}"
    elif examples.kind == "text":
        loss, el2n, scorer = _bigram_scores(examples), None, "bigram-add-one-proxy"
        step = None
    else:
        loss, el2n = _logreg_scores(examples)
        scorer, step = "logreg-proxy", None
    return ScoreTable(
        partition=examples.partition, data_fingerprint=examples.fingerprint,
        example_ids=examples.example_ids.copy(), shard_index=examples.shard_index.copy(),
        loss=loss.astype(np.float64), el2n=None if el2n is None else el2n.astype(np.float64),
        step=step, scorer=scorer,
    )


def _bigram_scores(examples: ExampleSet) -> np.ndarray:
    """Mean NLL of each example's next-character predictions under an add-one bigram model.

    Counts are kept sparse (pair code a * V + b) so that a large vocabulary costs no V x V table.
    """
    vocab_size = len(examples.vocab)
    inputs = examples.inputs
    previous, following = inputs[:, :-1], inputs[:, 1:]
    pair_codes = previous * vocab_size + following  # (N, T)
    train = examples.train_positions
    seen_codes, seen_counts = np.unique(pair_codes[train], return_counts=True)
    row_counts = np.bincount(previous[train].ravel(), minlength=vocab_size)
    where = np.clip(np.searchsorted(seen_codes, pair_codes), 0, len(seen_codes) - 1)
    pair_counts = np.where(seen_codes[where] == pair_codes, seen_counts[where], 0)
    log_prob = np.log(pair_counts + 1.0) - np.log(row_counts[previous] + float(vocab_size))
    return -log_prob.mean(axis=1)


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=1, keepdims=True)


def _ce_and_el2n(probs: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    rows = np.arange(len(labels))
    loss = -np.log(np.maximum(probs[rows, labels], np.finfo(np.float64).tiny))
    onehot = np.zeros_like(probs)
    onehot[rows, labels] = 1.0
    return loss, np.linalg.norm(probs - onehot, axis=1)


def _logreg_scores(examples: ExampleSet) -> tuple[np.ndarray, np.ndarray]:
    # The fit runs in torch, on the caller's torch threads: numpy's BLAS starts its own threads
    # (two on a 2-core machine), whose CPU a caller timing its thread (time_to_quality charges
    # these scores to the pruning lever, one thread) would not see: half the fit went uncounted.
    import torch

    features = torch.from_numpy(
        examples.inputs.reshape(len(examples.inputs), -1).astype(np.float32) / 255.0)
    labels = examples.labels
    train = torch.from_numpy(np.asarray(examples.train_positions, dtype=np.int64))
    x_train = features[train]
    targets = torch.from_numpy(np.eye(N_CLASSES, dtype=np.float32)[labels[train.numpy()]])
    weights = torch.zeros((features.shape[1], N_CLASSES))
    bias = torch.zeros(N_CLASSES)
    for _ in range(PROXY_STEPS):
        grad = (torch.softmax(x_train @ weights + bias, dim=1) - targets) / len(train)
        weights -= PROXY_LR * (x_train.T @ grad + PROXY_L2 * weights)
        bias -= PROXY_LR * grad.sum(dim=0)
    probs = _softmax((features @ weights + bias).numpy().astype(np.float64))
    return _ce_and_el2n(probs, labels)


def _model_scores(examples: ExampleSet, model, batch_size: int) -> tuple[np.ndarray, np.ndarray | None]:
    import torch
    import torch.nn.functional as F

    parameters = list(model.parameters()) if hasattr(model, "parameters") else []
    device = parameters[0].device if parameters else torch.device("cpu")
    was_training = bool(getattr(model, "training", False))
    if hasattr(model, "eval"):
        model.eval()
    losses, el2ns = [], []
    try:
        with torch.no_grad():
            for first in range(0, len(examples.inputs), batch_size):
                chunk = examples.inputs[first:first + batch_size]
                if examples.kind == "text":
                    tokens = torch.from_numpy(np.ascontiguousarray(chunk)).to(device)
                    logits = _logits_of(model(tokens[:, :-1]))
                    expected = (len(chunk), chunk.shape[1] - 1, len(examples.vocab))
                    _check_shape(logits, expected, "text")
                    per_token = F.cross_entropy(logits.float().reshape(-1, expected[2]),
                                                tokens[:, 1:].reshape(-1), reduction="none")
                    losses.append(per_token.view(len(chunk), -1).mean(1).cpu().numpy())
                else:
                    pixels = torch.from_numpy(chunk).to(device).float().unsqueeze(1) / 255.0
                    logits = _logits_of(model(pixels))
                    _check_shape(logits, (len(chunk), N_CLASSES), "image")
                    probs = torch.softmax(logits.double(), dim=1).cpu().numpy()
                    loss, el2n = _ce_and_el2n(probs, examples.labels[first:first + len(chunk)])
                    losses.append(loss)
                    el2ns.append(el2n)
    finally:
        if was_training and hasattr(model, "train"):
            model.train()
    loss = np.concatenate(losses).astype(np.float64)
    _refuse_non_finite(loss, examples.example_ids, "loss")
    return loss, (np.concatenate(el2ns) if el2ns else None)


def _logits_of(output):
    # nanoGPT-style forwards return (logits, loss); take the logits.
    return output[0] if isinstance(output, (tuple, list)) else output


def _check_shape(logits, expected: tuple[int, ...], kind: str) -> None:
    if tuple(logits.shape) != expected:
        raise ValueError(
            f"the scoring model returned logits of shape {tuple(logits.shape)} for {kind} "
            f"examples, expected {expected}: the checkpoint is from another model config or "
            "partition; score with the proxy (model=None) or a checkpoint trained on these shards")


def write_scores(table: ScoreTable, out_dir: Path) -> dict:
    """Write one parquet file per shard and scores.json into `out_dir`, atomically; returns the
    manifest. Refuses NaN scores (ScoreTable does on construction)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    _refuse_non_finite(table.loss, table.example_ids, "loss")
    out_dir = Path(out_dir)

    def write_files(staging: Path) -> dict:
        entries = []
        for shard in np.unique(table.shard_index):
            rows = np.flatnonzero(table.shard_index == shard)
            columns = {"example_id": pa.array(table.example_ids[rows], pa.int64()),
                       "loss": pa.array(table.loss[rows], pa.float64())}
            if table.el2n is not None:
                columns["el2n"] = pa.array(table.el2n[rows], pa.float64())
            name = f"scores-{int(shard):05d}.parquet"
            pq.write_table(pa.table(columns), staging / name)
            entries.append({"file": name, "shard": int(shard), "rows": len(rows),
                            "sha256": sha256_file(staging / name)})
        header = {"format": SCORES_FORMAT, "partition": table.partition,
                  "data_fingerprint": table.data_fingerprint, "step": table.step,
                  "scorer": table.scorer, "has_el2n": table.el2n is not None}
        return {**header, "files": entries, "summary": table.summary(),
                "fingerprint": sha256_json({**header, "files": [e["sha256"] for e in entries]})}

    return publish_folder(out_dir, SCORES_NAME, write_files)


def read_scores(out_dir: Path) -> ScoreTable:
    """The published scores of `out_dir`, after verifying each file's sha256."""
    import pyarrow.parquet as pq

    out_dir = Path(out_dir)
    manifest = read_json(out_dir / SCORES_NAME, what="difficulty scores",
                         fix=f"materialize difficulty_scores ({REMATERIALIZE})")
    if manifest.get("format") != SCORES_FORMAT:
        raise ValueError(f"{out_dir / SCORES_NAME} has format {manifest.get('format')!r}, "
                         f"expected {SCORES_FORMAT!r}: {REMATERIALIZE}")
    ids, shards, losses, el2ns = [], [], [], []
    for entry in manifest["files"]:
        path = out_dir / manifest["folder"] / entry["file"]
        if not path.is_file():
            raise FileNotFoundError(f"score file {path} is missing: {REMATERIALIZE}")
        if sha256_file(path) != entry["sha256"]:
            raise ValueError(f"score file {path} fails its sha256 checksum (corrupt or modified "
                             f"on disk): {REMATERIALIZE}")
        table = pq.read_table(path)
        ids.append(table.column("example_id").to_numpy())
        shards.append(np.full(table.num_rows, entry["shard"], dtype=np.int32))
        losses.append(table.column("loss").to_numpy())
        if manifest["has_el2n"]:
            el2ns.append(table.column("el2n").to_numpy())
    return ScoreTable(
        partition=manifest["partition"], data_fingerprint=manifest["data_fingerprint"],
        example_ids=np.concatenate(ids).astype(np.int64), shard_index=np.concatenate(shards),
        loss=np.concatenate(losses).astype(np.float64),
        el2n=np.concatenate(el2ns).astype(np.float64) if el2ns else None,
        step=manifest["step"], scorer=manifest["scorer"],
    )
