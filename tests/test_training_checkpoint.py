"""Checkpoints: round trip, atomic replace, checksum, refusal of another model config."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from training.checkpoint import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    checkpoint_name,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    read_checksum,
    save_checkpoint,
)
from training.model import GPTConfig, build_model, config_dict, model_fingerprint

torch.set_num_threads(1)

CONFIG = GPTConfig(vocab_size=7, block_size=8, n_layer=1, n_head=2, n_embd=16)


def _state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = build_model("gpt", CONFIG)
    return {
        "model": model.state_dict(),
        "model_kind": "gpt",
        "model_config": config_dict(CONFIG),
        "model_fingerprint": model_fingerprint("gpt", CONFIG),
        "step": 42,
        "rng": {"numpy": np.random.get_state(), "python": random.getstate(),
                "torch": torch.get_rng_state()},
        "sampler": {"rng_state": np.random.default_rng(3).bit_generator.state,
                    "order": np.arange(5)},
    }


def test_round_trip_keeps_tensors_rng_states_and_numbers(tmp_path):
    path = tmp_path / "ckpt.pt"
    state = _state()
    checksum = save_checkpoint(path, state)
    assert read_checksum(path) == checksum and len(checksum) == 64
    loaded = load_checkpoint(path, expected_model_fingerprint=state["model_fingerprint"])
    assert loaded["step"] == 42
    for name, tensor in state["model"].items():
        assert torch.equal(loaded["model"][name], tensor)
    assert loaded["rng"]["python"] == state["rng"]["python"]
    assert np.array_equal(loaded["rng"]["numpy"][1], state["rng"]["numpy"][1])
    assert loaded["sampler"]["rng_state"] == state["sampler"]["rng_state"]


def test_save_replaces_atomically_and_leaves_no_temporary_files(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"step": 1})
    save_checkpoint(path, {"step": 2})
    assert load_checkpoint(path)["step"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def test_a_crash_before_the_rename_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"step": 1})

    def crash(src, dst):
        raise OSError("killed before the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="killed"):
        save_checkpoint(path, {"step": 2})
    monkeypatch.undo()
    assert load_checkpoint(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def test_a_flipped_byte_fails_the_checksum(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, _state())
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="checksum.*start fresh"):
        load_checkpoint(path)


def test_truncated_and_foreign_files_are_refused(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, _state())
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointCorruptError, match="truncated"):
        load_checkpoint(path)
    foreign = tmp_path / "foreign.pt"
    torch.save({"step": 1}, foreign)
    with pytest.raises(CheckpointCorruptError, match="not a trainwise checkpoint"):
        load_checkpoint(foreign)
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        load_checkpoint(tmp_path / "missing.pt")


def test_a_checkpoint_of_another_model_config_is_refused_naming_both(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, _state())
    other = GPTConfig(vocab_size=7, block_size=8, n_layer=3, n_head=2, n_embd=16)
    with pytest.raises(CheckpointMismatchError) as error:
        load_checkpoint(
            path,
            expected_model_fingerprint=model_fingerprint("gpt", other),
            expected_model_config=config_dict(other),
        )
    message = str(error.value)
    assert "'n_layer': 1" in message and "'n_layer': 3" in message
    assert "start fresh" in message
    assert "resume with the model config the checkpoint was written with" in message


def test_latest_and_prune(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    for step in (5, 10, 15):
        save_checkpoint(tmp_path / checkpoint_name(step), {"step": step})
    assert latest_checkpoint(tmp_path) == tmp_path / "step-0000015.pt"
    deleted = prune_checkpoints(tmp_path, keep=2)
    assert [Path(p).name for p in deleted] == ["step-0000005.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-0000010.pt", "step-0000015.pt"]
    with pytest.raises(ValueError, match="keep"):
        prune_checkpoints(tmp_path, keep=0)
