"""What an SDK checkpoint holds besides the user's objects: random states and a model's shape.

A resumed run continues bit for bit only if every random stream continues where it stopped:
Python's `random`, numpy's global generator, torch's CPU generator (dropout, `randperm`) and, on
a GPU, each CUDA generator. All four go into the checkpoint as tensors and plain data, so the
weights-only load can read them back.

The model fingerprint is over the parameters' and buffers' names, shapes and dtypes plus the
module's class, not their values: it says "the same architecture", which is what a resume must
check before it loads weights into a model.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch

from training.checkpoint import arrays_from_tensors, check_checkpoint_types, to_checkpoint_types


class StateNotSaveableError(TypeError):
    """A tracked object's state holds something a weights-only load would refuse."""


def model_fingerprint(model: torch.nn.Module) -> str:
    digest = hashlib.sha256(type(model).__qualname__.encode())
    for name, tensor in list(model.state_dict().items()):
        digest.update(f"|{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
    return digest.hexdigest()


def model_summary(model: torch.nn.Module) -> dict[str, Any]:
    parameters = sum(p.numel() for p in model.parameters())
    return {"class": f"{type(model).__module__}.{type(model).__qualname__}",
            "parameters": int(parameters)}


def check_saveable(name: str, state: Any) -> None:
    """StateNotSaveableError naming the tracked object and the key, before any training."""
    try:
        check_checkpoint_types(state, name)
    except TypeError as error:
        raise StateNotSaveableError(
            f"{error}. trainwise checkpoints load with torch.load(weights_only=True), which never "
            f"runs code from a file: keep {name.split('[')[0]} to tensors and plain data (put a "
            "custom object's numbers in a dict, or pass it as run.track(..., extra=...) as "
            "plain data)") from error


def capture_rng() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": to_checkpoint_types(list(np.random.get_state())),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, cached = arrays_from_tensors(state["numpy"])
    np.random.set_state((kind, keys, position, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
