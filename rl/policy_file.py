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
    train_data  what the version trained on, field by field (`rl.training_data`: region, time
                range, collections and zones, data_sha256, seed; the fast policy's region
                statistics); train_window is its one-line summary. {} in older files
    weights_sha256  sha256 over the weight arrays' bytes in name order

`load_policy` refuses, with `PolicyFileError` naming the file and the fix: a file that is not a
readable npz, a missing or malformed header, another format, kind, layout or region, weights of
the wrong shape, NaN or infinite weights, and a weights hash that does not match (corruption).

Hostile files (issue 31): a champion.npz sits in the state folder, where anything can be put.
Every read is bounded before it is made: the file is a regular file of at most
`MAX_POLICY_FILE_BYTES` (checked with fstat, so a huge or endless file costs nothing), the zip
holds at most `MAX_MEMBERS` members named like ours whose declared sizes sum to at most
`MAX_POLICY_FILE_BYTES` (a zip bomb is refused before it is inflated), the header is at most
`MAX_HEADER_BYTES` and `MAX_HEADER_DEPTH` levels deep (checked before json parses it), must be a
JSON object and every field it is read for has the type it must have. Whatever else a crafted
file makes numpy, zipfile or json raise becomes a `PolicyFileError` too (`load_policy` and
`read_header` raise nothing else but MemoryError, which the bounds prevent), so every caller's
fallback (the heuristic stays in charge) holds for every file.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import json
import os
import re
import stat
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rl._files import write_atomic
from rl.slow_obs import layout_sha256

FORMAT = "trainwise-policy/1"
KINDS = ("slow", "fast")
# A policy is a few small layers (tens of KiB); these bounds are far above any real one.
MAX_POLICY_FILE_BYTES = 64 * 1024 * 1024
MAX_HEADER_BYTES = 1024 * 1024
MAX_HEADER_DEPTH = 32  # the header nests 2 levels; `figures` is free-form, so some room
MAX_MEMBERS = 2 * 64 + 3  # header, wa, ba and (w, b) per hidden layer
MAX_HIDDEN_LAYERS = 64
MAX_NVEC = 64  # action components
# `\Z`, not `$`: `$` also matches before a final newline ("wa.npy\n" would pass).
_MEMBER = re.compile(r"^(header|w\d{1,2}|b\d{1,2}|wa|ba)\.npy\Z")
_JSON_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)


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
    train_data: dict = field(default_factory=dict)

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
        "figures": weights.figures, "train_data": weights.train_data,
        "hidden_layers": len(weights.hidden),
        "weights_sha256": _hash(arrays),
    }
    blob = np.frombuffer(json.dumps(header, sort_keys=True).encode(), dtype=np.uint8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    np.savez(buffer, header=blob, **arrays)
    write_atomic(path, buffer.getvalue())  # a planted link is replaced, never written through
    return header


def _read_bounded(path: Path, where: str) -> bytes:
    """The file's bytes: a regular file (a link is followed: the bound is on what it points at)
    of at most MAX_POLICY_FILE_BYTES, size checked before reading."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        raise PolicyFileError(f"{where} cannot be opened ({error.strerror or error}); retrain "
                              "it or restore it from the registry") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise PolicyFileError(f"{where} is not a regular file; remove it (the heuristic "
                                  "stays in charge) and restore the policy from the registry")
        if info.st_size > MAX_POLICY_FILE_BYTES:
            raise PolicyFileError(f"{where} is {info.st_size} bytes, more than a policy file can "
                                  f"be ({MAX_POLICY_FILE_BYTES}); it was not written by "
                                  "rl.policy_file: remove it")
        data = handle.read(MAX_POLICY_FILE_BYTES + 1)
    if len(data) > MAX_POLICY_FILE_BYTES:
        raise PolicyFileError(f"{where} grew past {MAX_POLICY_FILE_BYTES} bytes while read")
    return data


def _check_members(data: bytes, where: str) -> None:
    """The zip's directory, before any member is inflated: our names only, bounded sizes."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        members = archive.infolist()
    if len(members) > MAX_MEMBERS:
        raise PolicyFileError(f"{where} holds {len(members)} arrays, more than a policy has")
    total = 0
    for member in members:
        if not _MEMBER.match(member.filename):
            raise PolicyFileError(f"{where} holds {member.filename[:80]!r}, which is not one of "
                                  "a policy file's arrays (header, w<i>, b<i>, wa, ba)")
        limit = MAX_HEADER_BYTES + 1024 if member.filename == "header.npy" \
            else MAX_POLICY_FILE_BYTES
        if member.file_size > limit:
            raise PolicyFileError(f"{where}: {member.filename} inflates to {member.file_size} "
                                  f"bytes, more than {limit}: refused before inflating it")
        total += member.file_size
    if total > MAX_POLICY_FILE_BYTES:
        raise PolicyFileError(f"{where} inflates to {total} bytes, more than "
                              f"{MAX_POLICY_FILE_BYTES}: refused before inflating it")


def _read_arrays(path: Path, where: str) -> dict[str, np.ndarray]:
    data = _read_bounded(path, where)
    try:
        _check_members(data, where)
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files}
    except PolicyFileError:
        raise
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, KeyError, NotImplementedError,
            RuntimeError, TypeError, IndexError) as error:
        raise PolicyFileError(
            f"{where} is not a readable npz of plain arrays ({type(error).__name__}: "
            f"{str(error)[:200]}); retrain or restore it from the registry") from None


def _json_depth(raw: bytes) -> int:
    """How deep `raw`'s arrays and objects nest (brackets inside strings do not count)."""
    depth = deepest = 0
    for token in _JSON_TOKENS.finditer(raw):
        if token.group() in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        elif token.group() in (b"]", b"}"):
            depth -= 1
    return deepest


def _parse_header(blob: np.ndarray | None, where: str) -> dict:
    """The header as a dict: uint8 vector, bounded size and depth, a JSON object."""
    if blob is None or blob.dtype != np.uint8 or blob.ndim != 1:
        raise PolicyFileError(f"{where} has no JSON header; it was not written by rl.policy_file")
    raw = blob.tobytes()
    if len(raw) > MAX_HEADER_BYTES:
        raise PolicyFileError(f"{where}: header is {len(raw)} bytes, more than {MAX_HEADER_BYTES}")
    depth = _json_depth(raw)
    if depth > MAX_HEADER_DEPTH:
        raise PolicyFileError(f"{where}: header nests {depth} levels deep, more than "
                              f"{MAX_HEADER_DEPTH}; it was not written by rl.policy_file")
    try:
        header = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise PolicyFileError(f"{where}: header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise PolicyFileError(f"{where}: header is a JSON {type(header).__name__}, not an "
                              "object; it was not written by rl.policy_file")
    return header


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _header_type_problem(header: dict) -> str | None:
    """The first header field that has not the type `load_policy` reads it as."""
    layout, nvec = header.get("layout"), header.get("nvec")
    if not isinstance(layout, list) or not all(isinstance(name, str) for name in layout):
        return "layout is not a list of names"
    if not isinstance(nvec, list) or not 0 < len(nvec) <= MAX_NVEC \
            or not all(_is_int(n) and 0 < n <= 1_000_000 for n in nvec):
        return f"nvec is not 1 to {MAX_NVEC} positive action sizes"
    if not _is_int(header.get("hidden_layers")) \
            or not 0 <= header["hidden_layers"] <= MAX_HIDDEN_LAYERS:
        return f"hidden_layers is not a count in [0, {MAX_HIDDEN_LAYERS}]"
    if not _is_int(header.get("version", 0)) or not 0 <= header.get("version", 0) < 2**63:
        return "version is not a whole number"
    for name in ("region", "train_window", "activation", "layout_sha256", "weights_sha256"):
        if header.get(name) is not None and not isinstance(header.get(name), str):
            return f"{name} is a {type(header.get(name)).__name__}, not a string"
    for name in ("figures", "train_data"):
        if not isinstance(header.get(name, {}), dict):
            return f"{name} is not an object"
    return None


def load_policy(path: str | Path, kind: str, layout: tuple[str, ...],
                region: str | None = None) -> PolicyWeights:
    """Reads and checks a policy file (see the module doc for what is refused). Raises only
    PolicyFileError (naming the file), whatever the file holds."""
    path = Path(path)
    where = f"policy file {path}"
    try:
        return _load_checked(path, where, kind, layout, region)
    except (PolicyFileError, MemoryError):
        raise
    except Exception as error:  # noqa: BLE001 - a crafted file must not escape the fallback
        raise PolicyFileError(f"{where} could not be checked ({type(error).__name__}: "
                              f"{str(error)[:200]}); it was not written by rl.policy_file: "
                              "retrain it or restore it from the registry") from None


def _load_checked(path: Path, where: str, kind: str, layout: tuple[str, ...],
                  region: str | None) -> PolicyWeights:
    arrays = _read_arrays(path, where)
    header = _parse_header(arrays.pop("header", None), where)
    if header.get("format") != FORMAT:
        raise PolicyFileError(f"{where}: format {str(header.get('format'))[:80]!r}, expected "
                              f"{FORMAT!r}")
    if header.get("kind") != kind:
        raise PolicyFileError(f"{where} holds a {str(header.get('kind'))[:40]!r} policy, "
                              f"expected {kind!r}")
    problem = _header_type_problem(header)
    if problem:
        raise PolicyFileError(f"{where}: header field {problem}; it was not written by "
                              "rl.policy_file: retrain it or restore it from the registry")
    if header.get("layout_sha256") != layout_sha256(tuple(layout)) or tuple(
            header["layout"]) != tuple(layout):
        raise PolicyFileError(
            f"{where} was trained for another observation layout ({len(header['layout'])} "
            f"features, expected {len(layout)}: {', '.join(layout)}); retrain it on this version")
    if region is not None and header.get("region") != region:
        raise PolicyFileError(
            f"{where} was trained for region {str(header.get('region'))[:40]!r}, not {region!r}; "
            f"load the policy of {region!r} or fall back to the heuristic")
    for name, value in arrays.items():  # before the hash: it reads them as float32
        if value.dtype != np.float32:
            raise PolicyFileError(f"{where}: weight {name} is {value.dtype}, not float32")
    if _hash(arrays) != header.get("weights_sha256"):
        raise PolicyFileError(f"{where}: weights do not match weights_sha256 (corrupt or edited)")
    for name, value in arrays.items():
        if not np.isfinite(value).all():
            raise PolicyFileError(f"{where}: weight {name} is not finite float32")
    n_hidden = header["hidden_layers"]
    try:
        hidden = [(arrays[f"w{i}"], arrays[f"b{i}"]) for i in range(n_hidden)]
        head = (arrays["wa"], arrays["ba"])
    except KeyError as error:
        raise PolicyFileError(f"{where}: missing weight {error}") from None
    nvec = tuple(header["nvec"])
    width = len(layout)
    for w, b in [*hidden, head]:
        if w.ndim != 2 or w.shape[1] != width or b.shape != (w.shape[0],):
            raise PolicyFileError(f"{where}: layer shapes {w.shape}/{b.shape} do not chain from "
                                  f"{width} inputs")
        width = w.shape[0]
    if width != sum(nvec):
        raise PolicyFileError(f"{where}: head has {width} logits, nvec {nvec} needs {sum(nvec)}")
    return PolicyWeights(hidden, head, nvec, tuple(layout), kind, header.get("region"),
                         header.get("train_window") or "", header.get("version", 0),
                         header.get("figures", {}), header.get("activation") or "tanh",
                         header.get("train_data", {}))


def read_header(path: str | Path) -> dict:
    """The header only (for listings): a JSON object read with the bounds of `load_policy`;
    the weights are not checked. Raises only PolicyFileError (naming the file)."""
    path = Path(path)
    where = f"policy file {path}"
    try:
        return _parse_header(_read_arrays(path, where).get("header"), where)
    except (PolicyFileError, MemoryError):
        raise
    except Exception as error:  # noqa: BLE001 - one error type for every crafted file
        raise PolicyFileError(f"{where}: header could not be read ({type(error).__name__}: "
                              f"{str(error)[:200]})") from None
