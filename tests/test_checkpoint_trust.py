"""Issue 31, classes 1-3 (checkpoint half): hostile files in a checkpoint folder are skipped, never
fatal; writes do not follow planted links; a checkpoint is bound to its run and deployment.

Each test names the pre-fix behaviour it guards against (the old code raised MemoryError,
RecursionError or IndexError, wrote through a planted temp-file link, or resumed foreign or
re-labelled weights)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
import warnings
from pathlib import Path

import pytest
import torch

from tests.test_training_loop import text_examples, tiny_config
from training import checkpoint as checkpoint_module
from training._checkpoint_trust import KEY_FILE_NAME, STATE_KEY_ENV, StateFileError, state_key
from training.checkpoint import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointOriginError,
    RunIdentity,
    bind_legacy_checkpoint,
    checkpoint_name,
    latest_good_checkpoint,
    load_checkpoint,
    manifest_path,
    read_manifest,
    save_checkpoint,
)
from training.loop import train

torch.set_num_threads(1)

DATA, MODEL = "d" * 64, "m" * 64


def _state(step: int, run_id: str = "run-a", lineage: str = "lineage-a", seed: int = 7,
           data: str = DATA) -> dict:
    return {"step": step, "run_id": run_id, "lineage": lineage, "data_fingerprint": data,
            "model_fingerprint": MODEL, "train_config": {"seed": seed},
            "w": torch.full((4,), float(step))}


def _own_folder(tmp_path: Path, steps=(4, 8), **kwargs) -> Path:
    folder = tmp_path / "run-a" / "checkpoints"
    for step in steps:
        save_checkpoint(folder / checkpoint_name(step), _state(step, **kwargs))
    return folder


def _edit_manifest(path: Path, **changes) -> None:
    manifest = json.loads(manifest_path(path).read_text())
    manifest.update(changes)
    manifest_path(path).write_text(json.dumps(manifest))


IDENTITY = RunIdentity(run_id="run-a", data_fingerprint=DATA, model_fingerprint=MODEL, seed=7)


# -- class 1: hostile files ----------------------------------------------------------------------
@pytest.mark.parametrize("claimed", [2**62, 2**40, 10**13])
def test_a_manifest_claiming_a_huge_payload_is_refused_without_reading(tmp_path, claimed):
    # Before: handle.read(manifest["bytes"] + 1) raised MemoryError and stopped every resume.
    folder = _own_folder(tmp_path)
    planted = folder / checkpoint_name(12)
    save_checkpoint(planted, _state(12))
    _edit_manifest(planted, bytes=claimed)
    with pytest.raises(CheckpointCorruptError, match="more than this machine can load"):
        load_checkpoint(planted)
    good = latest_good_checkpoint(folder)
    assert good.step == 8 and [p for p, _ in good.skipped] == [planted]


def test_a_sparse_payload_as_big_as_its_manifest_claims_is_refused(tmp_path):
    folder = _own_folder(tmp_path)
    planted = folder / checkpoint_name(12)
    save_checkpoint(planted, _state(12))
    with open(planted, "r+b") as handle:
        handle.truncate(2**40)  # sparse: costs no disk
    _edit_manifest(planted, bytes=2**40)
    assert latest_good_checkpoint(folder).step == 8


@pytest.mark.parametrize("depth", [17, 1000, 30_000])
def test_a_deeply_nested_manifest_is_refused_before_json_parses_it(tmp_path, depth):
    # Before: json.loads raised RecursionError (30 000 levels fit in the 64 KiB bound).
    folder = _own_folder(tmp_path)
    planted = folder / checkpoint_name(12)
    save_checkpoint(planted, _state(12))
    manifest_path(planted).write_text("[" * depth + "]" * depth)
    with pytest.raises(CheckpointCorruptError, match="nested .* deep"):
        load_checkpoint(planted)
    assert latest_good_checkpoint(folder).step == 8


@pytest.mark.parametrize("change", [{"bytes": "12"}, {"bytes": True}, {"step": "8"},
                                    {"binding": [1]}, {"hmac": 5}, {"payload": 3},
                                    {"binding": {"run_id": 5}}])
def test_manifests_with_wrong_types_are_refused(tmp_path, change):
    folder = _own_folder(tmp_path)
    planted = folder / checkpoint_name(12)
    save_checkpoint(planted, _state(12))
    _edit_manifest(planted, **change)
    with pytest.raises(CheckpointCorruptError):
        load_checkpoint(planted)
    assert latest_good_checkpoint(folder).step == 8


def test_a_symlinked_payload_with_a_matching_manifest_is_refused(tmp_path):
    # Before: the link was followed; a matching manifest beside a link to any file reached the
    # unpickler (IndexError on crafted bytes) or loaded another run's weights.
    folder = _own_folder(tmp_path)
    elsewhere = tmp_path / "other-run" / checkpoint_name(12)
    save_checkpoint(elsewhere, _state(12))
    planted = folder / checkpoint_name(12)
    planted.symlink_to(elsewhere)
    shutil.copyfile(manifest_path(elsewhere), manifest_path(planted))
    with pytest.raises(CheckpointCorruptError, match="symbolic link"):
        load_checkpoint(planted)
    good = latest_good_checkpoint(folder)
    assert good.step == 8 and "symbolic link" in good.skipped[0][1]


def test_a_symlinked_manifest_is_refused(tmp_path):
    folder = _own_folder(tmp_path)
    manifest = manifest_path(folder / checkpoint_name(8))
    target = tmp_path / "elsewhere.json"
    shutil.move(manifest, target)
    manifest.symlink_to(target)
    assert latest_good_checkpoint(folder).step == 4


def test_whatever_the_unpickler_raises_is_a_skip_not_a_crash(tmp_path, monkeypatch):
    # Before: latest_good_checkpoint caught only CheckpointError and OSError.
    folder = _own_folder(tmp_path)
    real_load = torch.load

    calls = []

    def crafted(buffer, *args, **kwargs):  # the newest candidate's bytes break the unpickler
        calls.append(1)
        if len(calls) == 1:
            raise IndexError("list index out of range")
        return real_load(buffer, *args, **kwargs)

    monkeypatch.setattr(torch, "load", crafted)
    good = latest_good_checkpoint(folder)
    assert good.step == 4 and "IndexError" in good.skipped[0][1]


def test_a_checkpoint_write_does_not_follow_a_link_planted_at_the_temp_name(tmp_path):
    # Before: the temp name `.step-0000003.pt.tmp-<pid>` was predictable and opened "wb",
    # following a link planted there: the checkpoint overwrote a file outside the folder.
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me")
    for suffix in ("", ".manifest.json"):
        (folder / f".step-0000003.pt{suffix}.tmp-{os.getpid()}").symlink_to(outside)
    save_checkpoint(folder / checkpoint_name(3), _state(3))
    assert outside.read_text() == "keep me"
    assert load_checkpoint(folder / checkpoint_name(3))["step"] == 3
    assert checkpoint_module.clean_orphaned_temp_files(folder)  # the links, not their target
    assert outside.read_text() == "keep me"


# -- class 3: origin -----------------------------------------------------------------------------
def test_a_checkpoint_of_another_run_is_refused_or_skipped(tmp_path):
    folder = _own_folder(tmp_path)
    foreign = folder / checkpoint_name(12)
    save_checkpoint(foreign, _state(12, run_id="run-b", lineage="lineage-b"))
    with pytest.raises(CheckpointMismatchError, match="belongs to run 'run-b'"):
        load_checkpoint(foreign, identity=IDENTITY)
    good = latest_good_checkpoint(folder, identity=IDENTITY)
    assert good.step == 8 and "run 'run-b'" in good.skipped[0][1]


@pytest.mark.parametrize("field, value, match", [
    ("seed", 8, "seed 8"), ("data", "e" * 64, "same shards")])
def test_another_seed_or_data_is_not_this_runs_checkpoint(tmp_path, field, value, match):
    folder = _own_folder(tmp_path)
    save_checkpoint(folder / checkpoint_name(12), _state(12, **{field: value}))
    good = latest_good_checkpoint(folder, identity=IDENTITY)
    assert good.step == 8 and match in good.skipped[0][1]


def test_a_relabelled_earlier_checkpoint_is_not_accepted_as_a_later_one(tmp_path):
    # Before: step-0000004's files copied as step-0000012 were resumed as the newest.
    folder = _own_folder(tmp_path)
    planted = folder / checkpoint_name(12)
    shutil.copyfile(folder / checkpoint_name(4), planted)
    shutil.copyfile(manifest_path(folder / checkpoint_name(4)), manifest_path(planted))
    with pytest.raises(CheckpointOriginError, match="re-labelled"):
        load_checkpoint(planted)
    assert latest_good_checkpoint(folder).step == 8


def test_an_edited_manifest_fails_its_hmac(tmp_path):
    folder = _own_folder(tmp_path)
    newest = folder / checkpoint_name(8)
    _edit_manifest(newest, step=80)
    with pytest.raises(CheckpointOriginError, match="HMAC does not match"):
        load_checkpoint(newest)
    assert latest_good_checkpoint(folder).step == 4


def test_a_checkpoint_signed_by_another_deployment_is_refused_naming_its_key(tmp_path):
    path = tmp_path / checkpoint_name(8)
    save_checkpoint(path, _state(8), key=b"k" * 32)
    with pytest.raises(CheckpointOriginError, match="another deployment's key"):
        load_checkpoint(path, key=b"j" * 32)
    assert load_checkpoint(path, key=b"k" * 32)["step"] == 8


def test_an_unbound_manifest_is_refused_until_its_owner_binds_it(tmp_path):
    # A stripped binding must not downgrade the checks (accepting unbound manifests would).
    path = tmp_path / checkpoint_name(8)
    save_checkpoint(path, _state(8))
    manifest = json.loads(manifest_path(path).read_text())
    del manifest["binding"], manifest["hmac"]
    manifest_path(path).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointOriginError, match="unbound manifest.*bind_legacy_checkpoint"):
        load_checkpoint(path)
    bind_legacy_checkpoint(path)
    assert load_checkpoint(path, identity=IDENTITY)["step"] == 8


def test_a_checkpoint_of_another_history_of_the_run_is_skipped_as_a_fork(tmp_path):
    folder = _own_folder(tmp_path, steps=(4, 8))
    assert read_manifest(folder / checkpoint_name(8))["binding"]["parent_step"] == 4
    # Another history of run-a (another lineage) whose step 8 differs from ours, planted at 12.
    other = tmp_path / "other" / "checkpoints"
    for step in (8, 12):
        save_checkpoint(other / checkpoint_name(step), _state(step, lineage="lineage-z"))
    for name in (checkpoint_name(12), checkpoint_name(12) + ".manifest.json"):
        shutil.copyfile(other / name, folder / name)
    good = latest_good_checkpoint(folder, identity=IDENTITY)
    assert good.step == 8 and "another history of the run" in good.skipped[0][1]


def test_the_key_file_is_created_once_private_and_refused_when_loosened(tmp_path, monkeypatch):
    monkeypatch.delenv(STATE_KEY_ENV, raising=False)
    home = tmp_path / "home"
    key = state_key(home)
    path = home / KEY_FILE_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and state_key(home) == key
    path.chmod(0o644)
    with pytest.raises(StateFileError, match="chmod 600"):
        state_key(home)
    path.unlink()
    path.symlink_to(tmp_path / "planted")
    with pytest.raises(StateFileError, match="symbolic link"):
        state_key(home)
    monkeypatch.setenv(STATE_KEY_ENV, "ab" * 32)
    assert state_key(home) == bytes.fromhex("ab" * 32)
    monkeypatch.setenv(STATE_KEY_ENV, "short")
    with pytest.raises(StateFileError, match="64 hex"):
        state_key(home)


# -- through the trainer -------------------------------------------------------------------------
def test_a_resume_skips_a_foreign_checkpoint_linked_in_and_says_why(tmp_path):
    # Before: another run's checkpoint (hard-linked, with its manifest) as the newest file of
    # this run's folder was resumed silently: the run finished on foreign weights.
    examples = text_examples()
    own = train(tiny_config(max_steps=4, checkpoint_every_steps=2), examples, None,
                tmp_path / "own")
    other = train(tiny_config(max_steps=8, run_id="other", seed=99), examples, None,
                  tmp_path / "other")
    folder = tmp_path / "own" / "checkpoints"
    for name in (other.checkpoint_path.name, other.checkpoint_path.name + ".manifest.json"):
        os.link(other.checkpoint_path.parent / name, folder / name)
    with pytest.warns(RuntimeWarning, match="belongs to run 'other'"):
        resumed = train(tiny_config(max_steps=6), examples, None, tmp_path / "own",
                        resume_from=folder)
    assert resumed.status == "completed" and resumed.steps == 6
    assert resumed.run_id == own.run_id == "tiny"
    with pytest.raises(CheckpointMismatchError, match="belongs to run 'other'"):
        train(tiny_config(max_steps=10), examples, None, tmp_path / "own",
              resume_from=other.checkpoint_path)


def test_a_resume_without_a_run_id_warns_that_it_cannot_check_whose_checkpoint(tmp_path):
    examples = text_examples()
    first = train(tiny_config(max_steps=2), examples, None, tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(dataclasses.replace(tiny_config(max_steps=4), run_id=""), examples, None,
              tmp_path, resume_from=first.checkpoint_path)
    assert any("names no run_id" in str(w.message) for w in caught)
