"""Policy files: plain npz of float32 weights plus a JSON header, loaded without unpickling.

One `.npz` holds `header` (the UTF-8 JSON as uint8) and the weight arrays `w0, b0, w1, b1, ...,
wa, ba` (hidden layers, then the action head). Loading uses `np.load(allow_pickle=False)`, so a
file can carry numbers only, never code. The header says:

    format      "trainwise-policy/1"
    kind        "slow" | "fast"
    layout      observation names in order, and layout_sha256 of them
    nvec        the MultiDiscrete action sizes (logits are split in this order)
    activation  "tanh"
    region      the region the policy was trained for (None: all)
    train_window, version, created_utc, figures (free-form evaluation numbers)
    weights_sha256  sha256 over the weight arrays' bytes in name order

`load_policy` refuses, with `PolicyFileError` naming the file and the fix: a file that is not a
readable npz, a missing or malformed header, another format, kind, layout or region, weights of
the wrong shape, NaN or infinite weights, and a weights hash that does not match (corruption).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rl.slow_obs import layout_sha256

FORMAT = "trainwise-policy/1"
KINDS = ("slow", "fast")


class PolicyFileError(ValueError):
    """A policy file that must not be used; the incumbent stays in charge."""


@dataclass
class PolicyWeights:
    hidden: list[tuple[np.ndarray, np.ndarray]]  # (weight [out, in], bias [out]) per layer
    head: tuple[np.ndarray, np.ndarray]
    nvec: tuple[int, ...]
    layout: tuple[str, ...]
    kind: str
    region: str | None
    train_window: str = ""
    version: int = 1
    figures: dict = field(default_factory=dict)
    activation: str = "tanh"

    def arrays(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for i, (w, b) in enumerate(self.hidden):
            out[f"w{i}"], out[f"b{i}"] = w, b
        out["wa"], out["ba"] = self.head
        return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def weights_from_sb3(model, kind: str, layout: tuple[str, ...], region: str | None,
                     train_window: str = "", version: int = 1, figures: dict | None = None
                     ) -> PolicyWeights:
    """The actor of an sb3 PPO MlpPolicy (Linear/Tanh layers, then the action head)."""
    import torch

    policy = model.policy
    if policy.features_extractor.__class__.__name__ != "FlattenExtractor":
        raise PolicyFileError("only MlpPolicy with the flatten extractor can be exported")
    hidden = []
    for layer in policy.mlp_extractor.policy_net:
        if isinstance(layer, torch.nn.Linear):
            hidden.append((layer.weight.detach().cpu().numpy(), layer.bias.detach().cpu().numpy()))
        elif not isinstance(layer, torch.nn.Tanh):
            raise PolicyFileError(f"layer {layer} is not Linear or Tanh; only tanh MLPs export")
    head = policy.action_net
    nvec = tuple(int(n) for n in model.action_space.nvec)
    return PolicyWeights(hidden, (head.weight.detach().cpu().numpy(), head.bias.detach().cpu().numpy()),
                         nvec, tuple(layout), kind, region, train_window, version, figures or {})


def _hash(arrays: dict[str, np.ndarray]) -> str:
    digest = hashlib.sha256()
    for name in sorted(arrays):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(arrays[name], dtype=np.float32).tobytes())
    return digest.hexdigest()


def save_policy(weights: PolicyWeights, path: str | Path) -> dict:
    """Writes the file; returns its header."""
    if weights.kind not in KINDS:
        raise PolicyFileError(f"kind {weights.kind!r} must be one of {KINDS}")
    arrays = weights.arrays()
    for name, value in arrays.items():
        if not np.isfinite(value).all():
            raise PolicyFileError(f"weight {name} has NaN or infinite values; not saving it")
    header = {
        "format": FORMAT, "kind": weights.kind, "layout": list(weights.layout),
        "layout_sha256": layout_sha256(tuple(weights.layout)), "nvec": list(weights.nvec),
        "activation": weights.activation, "region": weights.region,
        "train_window": weights.train_window, "version": weights.version,
        "created_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "figures": weights.figures, "hidden_layers": len(weights.hidden),
        "weights_sha256": _hash(arrays),
    }
    blob = np.frombuffer(json.dumps(header, sort_keys=True).encode(), dtype=np.uint8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    np.savez(buffer, header=blob, **arrays)
    path.write_bytes(buffer.getvalue())
    return header


def load_policy(path: str | Path, kind: str, layout: tuple[str, ...],
                region: str | None = None) -> PolicyWeights:
    """Reads and checks a policy file (see the module doc for what is refused)."""
    path = Path(path)
    where = f"policy file {path}"
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as error:
        raise PolicyFileError(
            f"{where} is not a readable npz of plain arrays ({error}); retrain or restore it "
            "from the registry") from None
    if "header" not in arrays or arrays["header"].dtype != np.uint8:
        raise PolicyFileError(f"{where} has no JSON header; it was not written by rl.policy_file")
    try:
        header = json.loads(arrays.pop("header").tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PolicyFileError(f"{where}: header is not JSON ({error})") from None
    if header.get("format") != FORMAT:
        raise PolicyFileError(f"{where}: format {header.get('format')!r}, expected {FORMAT!r}")
    if header.get("kind") != kind:
        raise PolicyFileError(f"{where} holds a {header.get('kind')!r} policy, expected {kind!r}")
    if header.get("layout_sha256") != layout_sha256(tuple(layout)) or tuple(
            header.get("layout", ())) != tuple(layout):
        raise PolicyFileError(
            f"{where} was trained for another observation layout ({len(header.get('layout', []))} "
            f"features, expected {len(layout)}: {', '.join(layout)}); retrain it on this version")
    if region is not None and header.get("region") != region:
        raise PolicyFileError(
            f"{where} was trained for region {header.get('region')!r}, not {region!r}; load the "
            f"policy of {region!r} or fall back to the heuristic")
    if _hash(arrays) != header.get("weights_sha256"):
        raise PolicyFileError(f"{where}: weights do not match weights_sha256 (corrupt or edited)")
    for name, value in arrays.items():
        if value.dtype != np.float32 or not np.isfinite(value).all():
            raise PolicyFileError(f"{where}: weight {name} is not finite float32")
    n_hidden = int(header.get("hidden_layers", -1))
    try:
        hidden = [(arrays[f"w{i}"], arrays[f"b{i}"]) for i in range(n_hidden)]
        head = (arrays["wa"], arrays["ba"])
    except KeyError as error:
        raise PolicyFileError(f"{where}: missing weight {error}") from None
    nvec = tuple(int(n) for n in header["nvec"])
    width = len(layout)
    for w, b in [*hidden, head]:
        if w.ndim != 2 or w.shape[1] != width or b.shape != (w.shape[0],):
            raise PolicyFileError(f"{where}: layer shapes {w.shape}/{b.shape} do not chain from "
                                  f"{width} inputs")
        width = w.shape[0]
    if width != sum(nvec):
        raise PolicyFileError(f"{where}: head has {width} logits, nvec {nvec} needs {sum(nvec)}")
    return PolicyWeights(hidden, head, nvec, tuple(layout), kind, header.get("region"),
                         header.get("train_window", ""), int(header.get("version", 0)),
                         header.get("figures", {}), header.get("activation", "tanh"))


def read_header(path: str | Path) -> dict:
    """The header only (for listings); the file is not checked."""
    with np.load(Path(path), allow_pickle=False) as data:
        return json.loads(data["header"].tobytes().decode())
