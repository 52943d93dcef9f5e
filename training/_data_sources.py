"""Readers for the raw data behind each partition: a UTF-8 text file, Python's own standard
library as a text corpus, and MNIST in IDX format.

Each reader validates what it reads and raises ValueError naming the file and the fix, so that a
truncated download or an empty file never becomes a silently tiny data set.

IDX format: LeCun, Cortes, Burges, "THE MNIST DATABASE of handwritten digits",
http://yann.lecun.com/exdb/mnist/ (big-endian magic 0x00000803 = uint8 3-d, 0x00000801 = 1-d).
"""

from __future__ import annotations

import gzip
import hashlib
import os
import sysconfig
import zlib
from pathlib import Path

import numpy as np

PYSTDLIB_CHARS = 1_000_000  # the first million characters of the concatenated .py files
_PYSTDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def read_text_corpus(path: Path) -> str:
    """The whole file as text; refuses a missing, empty, or non-UTF-8 file."""
    if not path.is_file():
        raise FileNotFoundError(f"corpus file {path} is missing")
    raw = path.read_bytes()
    if not raw.strip():
        raise ValueError(f"corpus file {path} is empty: restore it (or point TRAINWISE_DATA_DIR "
                         "at a folder with the data), or use the partition 'pystdlib'")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"corpus file {path} is not valid UTF-8 text (byte {exc.start}): the file is corrupt; "
            "restore it from its source (see the data README) or use the partition 'pystdlib'"
        ) from exc


def pystdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def read_pystdlib_corpus(root: Path | None = None, n_chars: int = PYSTDLIB_CHARS) -> tuple[str, str]:
    """The text of Python's standard library: its .py files sorted by relative path, each after a
    `# ---- path ----` header line, cut at `n_chars` characters.

    Deterministic for a given Python installation (a different patch release gives other text).
    Returns (text, description). Files that are not UTF-8 are skipped.
    """
    root = root or pystdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"Python standard library folder {root} is missing")
    relative_names: list[str] = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in _PYSTDLIB_SKIP_DIRS]  # prune, don't walk
        prefix = Path(folder).relative_to(root)
        relative_names += [(prefix / n).as_posix() for n in names if n.endswith(".py")]
    files = [root / name for name in sorted(relative_names)]
    pieces: list[str] = []
    total = 0
    for path in files:
        try:
            body = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        piece = f"# ---- {path.relative_to(root).as_posix()} ----\n{body}"
        pieces.append(piece)
        total += len(piece)
        if total >= n_chars:
            break
    text = "".join(pieces)[:n_chars]
    if not text:
        raise ValueError(f"no readable .py files under {root}: cannot build the 'pystdlib' corpus")
    return text, f"first {len(text)} characters of the .py files under {root}, sorted by path"


def _read_gzip(path: Path) -> bytes:
    if not path.is_file():
        raise FileNotFoundError(f"image file {path} is missing")
    try:
        with gzip.open(path, "rb") as handle:
            return handle.read()
    except (OSError, EOFError, zlib.error) as exc:
        raise ValueError(f"{path} is not a readable gzip file ({exc}): the file is corrupt or "
                         "truncated; restore it from its source (see the data README)") from exc


def _idx_payload(path: Path, raw: bytes, magic: int, n_dims: int) -> tuple[tuple[int, ...], bytes]:
    header_bytes = 4 + 4 * n_dims
    if len(raw) < header_bytes:
        raise ValueError(f"{path} is too short for an IDX header: the file is corrupt")
    found = int.from_bytes(raw[:4], "big")
    if found != magic:
        raise ValueError(f"{path} has IDX magic {found:#010x}, expected {magic:#010x}: "
                         "not the right MNIST file, or corrupt")
    dims = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(n_dims))
    payload = raw[header_bytes:]
    expected = int(np.prod(dims))
    if len(payload) != expected:
        raise ValueError(f"{path} holds {len(payload)} data bytes, its header says {expected} "
                         f"(dims {dims}): the file is truncated or corrupt")
    return dims, payload


def read_mnist(images_path: Path, labels_path: Path) -> tuple[np.ndarray, np.ndarray, str]:
    """MNIST images uint8 (N, 28, 28) and labels int64 (N,) from gzipped IDX files.

    Returns (images, labels, sha256 of both raw files).
    """
    images_raw = _read_gzip(images_path)
    labels_raw = _read_gzip(labels_path)
    dims, pixels = _idx_payload(images_path, images_raw, 0x00000803, 3)
    if dims[1:] != (28, 28):
        raise ValueError(f"{images_path} holds {dims[1]}x{dims[2]} images, expected 28x28")
    (n_labels,), label_bytes = _idx_payload(labels_path, labels_raw, 0x00000801, 1)
    if n_labels != dims[0]:
        raise ValueError(f"{images_path} has {dims[0]} images but {labels_path} has {n_labels} "
                         "labels: the pair does not match")
    if dims[0] == 0:
        raise ValueError(f"{images_path} holds no images")
    images = np.frombuffer(pixels, dtype=np.uint8).reshape(dims).copy()
    labels = np.frombuffer(label_bytes, dtype=np.uint8).astype(np.int64)
    if labels.max() > 9:
        raise ValueError(f"{labels_path} has label {int(labels.max())}; MNIST labels are 0..9")
    digest = hashlib.sha256(images_raw + labels_raw).hexdigest()
    return images, labels, digest
