"""Checkpoints: round trip, atomic payload + commit manifest, checksum, refusal of another model
config, fallback to the newest good checkpoint, orphaned temp files, pruning."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_data_pruning_draw import FINGERPRINT, synthetic_examples
from tests.test_data_pruning_inputs import scores_for
from training import checkpoint as checkpoint_module
from training.checkpoint import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    arrays_from_tensors,
    checkpoint_name,
    clean_orphaned_temp_files,
    latest_checkpoint,
    latest_good_checkpoint,
    load_checkpoint,
    manifest_path,
    prune_checkpoints,
    read_checksum,
    save_checkpoint,
    to_checkpoint_types,
)
from training.curriculum import build_curriculum
from training.dynamic_pruning import DynamicPruningConfig
from training.model import GPTConfig, build_model, config_dict, model_fingerprint
from training.sampler import DynamicPruningSampler

torch.set_num_threads(1)

CONFIG = GPTConfig(vocab_size=7, block_size=8, n_layer=1, n_head=2, n_embd=16)
REPO = Path(__file__).resolve().parents[1]


def _state(seed: int = 0, step: int = 42) -> dict:
    torch.manual_seed(seed)
    model = build_model("gpt", CONFIG)
    return {
        "model": model.state_dict(),
        "model_kind": "gpt",
        "model_config": config_dict(CONFIG),
        "model_fingerprint": model_fingerprint("gpt", CONFIG),
        "step": step,
        "rng": to_checkpoint_types({
            "numpy": np.random.get_state(legacy=False), "python": random.getstate(),
            "torch": torch.get_rng_state()}),
        "sampler": to_checkpoint_types({
            "rng_state": np.random.default_rng(3).bit_generator.state,
            "order": np.arange(5), "scores": np.linspace(0.1, 2.0, 7),
            "rate": np.float64(0.25)}),
    }


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_round_trip_keeps_tensors_rng_states_and_numbers_bit_exactly(tmp_path):
    path = tmp_path / "ckpt.pt"
    state = _state()
    checksum = save_checkpoint(path, state)
    assert read_checksum(path) == checksum and len(checksum) == 64
    manifest = json.loads(manifest_path(path).read_text())
    assert manifest["sha256"] == checksum == hashlib.sha256(path.read_bytes()).hexdigest()
    assert manifest["bytes"] == path.stat().st_size and manifest["step"] == 42
    loaded = load_checkpoint(path, expected_model_fingerprint=state["model_fingerprint"])
    assert loaded["step"] == 42
    for name, tensor in state["model"].items():
        assert torch.equal(loaded["model"][name], tensor)
    assert loaded["rng"]["python"] == random.getstate()
    numpy_rng = arrays_from_tensors(loaded["rng"]["numpy"])
    assert numpy_rng["state"]["key"].dtype == np.uint32
    assert np.array_equal(numpy_rng["state"]["key"], np.random.get_state()[1])
    sampler = arrays_from_tensors(loaded["sampler"])
    assert sampler["rng_state"] == np.random.default_rng(3).bit_generator.state
    assert sampler["scores"].dtype == np.float64
    assert np.array_equal(sampler["scores"], np.linspace(0.1, 2.0, 7))
    assert sampler["rate"] == 0.25 and type(sampler["rate"]) is float


def test_save_refuses_objects_a_weights_only_load_would_refuse_naming_the_key(tmp_path):
    path = tmp_path / "step-0000001.pt"
    with pytest.raises(TypeError, match=r"state\['sampler'\]\['order'\] is a numpy.ndarray"):
        save_checkpoint(path, {"step": 1, "sampler": {"order": np.arange(3)}})
    with pytest.raises(TypeError, match=r"state\['config'\] is a .*GPTConfig"):
        save_checkpoint(path, {"step": 1, "config": CONFIG})
    assert _names(tmp_path) == []  # nothing written


def test_a_pending_curriculum_of_the_pruning_sampler_survives_a_weights_only_checkpoint(tmp_path):
    examples = synthetic_examples()
    curriculum = build_curriculum(examples, scores_for(examples), 0.5, seed=0)

    def sampler():
        return DynamicPruningSampler(
            examples, None, config=DynamicPruningConfig(pruning_rate=0.3), seed=0,
            max_steps=100, samples_per_step=10, model_fingerprint=FINGERPRINT)

    before = sampler()
    before.set_curriculum(curriculum)  # pending until the next epoch draw
    path = tmp_path / "step-0000000.pt"
    save_checkpoint(path, {"step": 0, "sampler": to_checkpoint_types(before.state_dict())})
    after = sampler()
    after.load_state_dict(arrays_from_tensors(load_checkpoint(path)["sampler"]))
    pending = after._pending
    assert pending is not None and pending.version == curriculum.version
    assert np.array_equal(pending.example_ids, curriculum.example_ids)
    assert np.array_equal(pending.weights, curriculum.weights)
    first, second = before.next_batch(10, 0), after.next_batch(10, 0)
    assert first[0].tolist() == second[0].tolist() and np.array_equal(first[1], second[1])
    assert after._pool_version == curriculum.version  # the draw took the pending curriculum


def test_save_replaces_atomically_and_leaves_no_temporary_files(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"step": 1})
    save_checkpoint(path, {"step": 2})
    assert load_checkpoint(path)["step"] == 2
    assert _names(tmp_path) == ["ckpt.pt", "ckpt.pt.manifest.json"]


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
    assert _names(tmp_path) == ["ckpt.pt", "ckpt.pt.manifest.json"]


def test_a_kill_between_payload_and_manifest_leaves_an_uncommitted_file(tmp_path, monkeypatch):
    save_checkpoint(tmp_path / checkpoint_name(5), {"step": 5})
    real_replace = os.replace

    def crash_on_the_manifest(src, dst):
        if str(dst).endswith(".manifest.json"):
            raise OSError("killed before the commit")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_the_manifest)
    with pytest.raises(OSError, match="commit"):
        save_checkpoint(tmp_path / checkpoint_name(10), {"step": 10})
    monkeypatch.undo()
    newest = tmp_path / checkpoint_name(10)
    assert newest.is_file() and not manifest_path(newest).exists()
    with pytest.raises(CheckpointCorruptError, match="no commit manifest.*uncommitted"):
        load_checkpoint(newest)
    assert latest_checkpoint(tmp_path) == tmp_path / checkpoint_name(5)
    good = latest_good_checkpoint(tmp_path)
    assert good is not None and good.step == 5
    assert [(p.name, "uncommitted" in why) for p, why in good.skipped] == [(newest.name, True)]


def test_a_flipped_byte_fails_the_checksum(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, _state())
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="ckpt.pt fails its checksum.*start fresh"):
        load_checkpoint(path)


def test_truncated_foreign_missing_and_folder_paths_are_refused(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, _state())
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointCorruptError, match="truncated"):
        load_checkpoint(path)
    foreign = tmp_path / "foreign.pt"
    torch.save({"step": 1}, foreign)
    with pytest.raises(CheckpointCorruptError, match="foreign.pt has no commit manifest"):
        load_checkpoint(foreign)
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        load_checkpoint(tmp_path / "missing.pt")
    with pytest.raises(FileNotFoundError, match="is a folder.*latest_good_checkpoint"):
        load_checkpoint(tmp_path)


def test_a_bad_manifest_is_refused_naming_it(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"step": 1})
    manifest_path(path).write_text("[1, 2]")
    with pytest.raises(CheckpointCorruptError, match="ckpt.pt.manifest.json is unreadable"):
        load_checkpoint(path)
    manifest_path(path).write_text(json.dumps(
        {"format": "trainwise-checkpoint-manifest", "version": 2, "sha256": "x", "bytes": 1}))
    with pytest.raises(CheckpointCorruptError, match="invalid sha256"):
        load_checkpoint(path)


def test_a_format_1_checkpoint_is_refused_as_predating_the_safe_format(tmp_path):
    path = tmp_path / checkpoint_name(3)
    payload = b"not unpickled"
    path.write_bytes(b"TRAINWISE-CHECKPOINT 1 sha256=%s bytes=%d\n%s" % (
        hashlib.sha256(payload).hexdigest().encode(), len(payload), payload))
    with pytest.raises(CheckpointCorruptError, match="predates the safe checkpoint format.*start"):
        load_checkpoint(path)


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


def test_latest_and_prune_remove_payloads_with_their_manifests(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    for step in (5, 10, 15):
        save_checkpoint(tmp_path / checkpoint_name(step), {"step": step})
    assert latest_checkpoint(tmp_path) == tmp_path / "step-0000015.pt"
    deleted = prune_checkpoints(tmp_path, keep=2)
    assert [Path(p).name for p in deleted] == ["step-0000005.pt"]
    assert _names(tmp_path) == ["step-0000010.pt", "step-0000010.pt.manifest.json",
                                "step-0000015.pt", "step-0000015.pt.manifest.json"]
    with pytest.raises(ValueError, match="keep"):
        prune_checkpoints(tmp_path, keep=0)


def test_prune_counts_only_committed_checkpoints(tmp_path):
    for step in (5, 10):
        save_checkpoint(tmp_path / checkpoint_name(step), {"step": step})
    torch.save({"step": 20}, tmp_path / checkpoint_name(20))  # uncommitted, newest
    torch.save({"step": 1}, tmp_path / checkpoint_name(1))  # uncommitted, oldest
    assert prune_checkpoints(tmp_path, keep=2) == [tmp_path / checkpoint_name(1)]
    # The two committed ones stay, the newer uncommitted one too (it may be being committed).
    assert _names(tmp_path) == ["step-0000005.pt", "step-0000005.pt.manifest.json",
                                "step-0000010.pt", "step-0000010.pt.manifest.json",
                                "step-0000020.pt"]


def _corrupt_newest(folder: Path, how: str) -> None:
    newest = folder / checkpoint_name(20)
    if how == "flipped byte":
        data = bytearray(newest.read_bytes())
        data[len(data) // 2] ^= 0x01
        newest.write_bytes(bytes(data))
    elif how == "missing manifest":
        manifest_path(newest).unlink()
    elif how == "truncated":
        newest.write_bytes(newest.read_bytes()[:100])
    elif how == "missing payload":
        newest.unlink()


@pytest.mark.parametrize("how, reason", [
    ("flipped byte", "fails its checksum"),
    ("missing manifest", "no commit manifest"),
    ("truncated", "truncated"),
    ("missing payload", "is missing but its manifest exists"),
])
def test_resume_falls_back_to_the_previous_good_checkpoint_and_says_why(tmp_path, how, reason):
    for step in (10, 20):
        save_checkpoint(tmp_path / checkpoint_name(step), _state(step=step))
    good = latest_good_checkpoint(tmp_path)
    assert good is not None and good.step == 20 and good.skipped == []
    _corrupt_newest(tmp_path, how)
    good = latest_good_checkpoint(tmp_path)
    assert good is not None
    assert good.path == tmp_path / checkpoint_name(10) and good.step == 10
    assert good.sha256 == read_checksum(good.path)
    assert len(good.skipped) == 1
    skipped_path, why = good.skipped[0]
    assert skipped_path == tmp_path / checkpoint_name(20)
    assert reason in why and "step-0000020.pt" in why
    assert load_checkpoint(good.path)["step"] == 10


def test_no_good_checkpoint_gives_none(tmp_path):
    assert latest_good_checkpoint(tmp_path / "absent") is None
    assert latest_good_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path / checkpoint_name(1), {"step": 1})
    manifest_path(tmp_path / checkpoint_name(1)).unlink()
    assert latest_good_checkpoint(tmp_path) is None


def test_clean_removes_only_orphaned_temp_files(tmp_path):
    save_checkpoint(tmp_path / checkpoint_name(5), {"step": 5})
    orphans = [tmp_path / ".step-0000010.pt.tmp-4242",
               tmp_path / ".step-0000010.pt.manifest.json.tmp-4242"]
    for orphan in orphans:
        orphan.write_bytes(b"x" * 1000)
    (tmp_path / ".keep").write_text("not ours")
    assert clean_orphaned_temp_files(tmp_path) == sorted(orphans)
    assert _names(tmp_path) == [".keep", "step-0000005.pt", "step-0000005.pt.manifest.json"]
    assert clean_orphaned_temp_files(tmp_path / "absent") == []


def test_a_writer_killed_mid_save_leaves_a_temp_file_that_clean_removes(tmp_path):
    # A real SIGKILL inside the write: no `finally` runs, the temp file stays (defect 4).
    script = (
        "import os, signal, sys, torch\n"
        "from training import checkpoint\n"
        "os.replace = lambda src, dst: os.kill(os.getpid(), signal.SIGKILL)\n"
        "checkpoint.save_checkpoint(sys.argv[1], {'step': 7, 'w': torch.zeros(1000)})\n"
    )
    target = tmp_path / checkpoint_name(7)
    done = subprocess.run([sys.executable, "-c", script, str(target)], cwd=REPO, timeout=120,
                          check=False)
    assert done.returncode == -9
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].startswith(".step-0000007.pt.tmp-")
    assert latest_good_checkpoint(tmp_path) is None
    assert [p.name for p in clean_orphaned_temp_files(tmp_path)] == left
    assert _names(tmp_path) == []


def test_temp_names_match_what_clean_removes(tmp_path, monkeypatch):
    seen = []
    real_replace = os.replace

    def spy(src, dst):
        seen.append(Path(src).name)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    save_checkpoint(tmp_path / checkpoint_name(3), {"step": 3})
    assert len(seen) == 2
    assert all(checkpoint_module._TEMP_FILE.match(name) for name in seen)


def test_a_failed_write_names_the_checkpoint_and_keeps_the_errno(tmp_path, monkeypatch):
    save_checkpoint(tmp_path / checkpoint_name(5), {"step": 5})

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match=r"cannot write checkpoint .*step-0000010.pt.*free space") \
            as error:
        save_checkpoint(tmp_path / checkpoint_name(10), {"step": 10})
    monkeypatch.undo()
    assert error.value.errno == errno.ENOSPC
    assert _names(tmp_path) == ["step-0000005.pt", "step-0000005.pt.manifest.json"]
