"""Issue 8 defect 1: a crafted checkpoint must never run code, with or without a forged manifest.

The crafted payload's `__reduce__` calls `exec` to create a marker file: if the marker exists
after a load, the file ran code. Every test also checks that the payload is live (an unrestricted
unpickle does create its own marker), so a refusal is not just a broken payload.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import pytest
import torch

from training.checkpoint import (
    CheckpointCorruptError,
    checkpoint_name,
    latest_good_checkpoint,
    load_checkpoint,
    manifest_path,
    save_checkpoint,
)


class _Exploit:
    """Unpickled by an unrestricted loader, it creates `marker` (stands for any code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def _crafted(path: Path, marker: Path, *, container: str) -> bytes:
    """Writes a crafted checkpoint payload; returns its bytes."""
    state = {"step": 99, "model_fingerprint": "x", "model": _Exploit(marker)}
    if container == "torch zip":
        torch.save(state, path)
    else:  # a bare pickle, which torch.load also accepts (legacy format)
        path.write_bytes(pickle.dumps(state, protocol=2))
    return path.read_bytes()


def _forge_manifest(path: Path, payload: bytes, step: int = 99) -> None:
    """What an attacker who can write the folder writes beside the payload."""
    manifest_path(path).write_text(json.dumps({
        "format": "trainwise-checkpoint-manifest", "version": 2, "payload": path.name,
        "step": step, "sha256": hashlib.sha256(payload).hexdigest(), "bytes": len(payload),
    }))


def _assert_live(container: str, tmp_path: Path) -> None:
    """A payload crafted the same way runs code under an unrestricted load (the pre-fix
    `torch.load(weights_only=False)`): the refusals below are not due to a broken payload."""
    proof = tmp_path / "proof"
    scratch = tmp_path / "scratch.pt"
    _crafted(scratch, proof, container=container)
    try:
        torch.load(scratch, weights_only=False)
    except RuntimeError:
        pass  # a bare pickle runs its code while torch reads it as a legacy magic number
    assert proof.exists(), "the crafted payload is not live: the test would prove nothing"
    proof.unlink()
    scratch.unlink()


@pytest.mark.parametrize("container", ["torch zip", "bare pickle"])
def test_a_crafted_checkpoint_without_manifest_is_refused_before_unpickling(tmp_path, container):
    marker = tmp_path / "marker"
    path = tmp_path / checkpoint_name(99)
    _crafted(path, marker, container=container)
    _assert_live(container, tmp_path)
    with pytest.raises(CheckpointCorruptError, match="step-0000099.pt has no commit manifest"):
        load_checkpoint(path)
    assert not marker.exists()


def test_a_crafted_format_1_file_declaring_its_own_checksum_is_refused(tmp_path):
    # Exactly the pre-fix exploit: the header declares the sha256 of the crafted payload.
    marker = tmp_path / "marker"
    path = tmp_path / checkpoint_name(99)
    payload = _crafted(path, marker, container="torch zip")
    path.write_bytes(b"TRAINWISE-CHECKPOINT 1 sha256=%s bytes=%d\n" % (
        hashlib.sha256(payload).hexdigest().encode(), len(payload)) + payload)
    with pytest.raises(CheckpointCorruptError, match="predates the safe checkpoint format"):
        load_checkpoint(path)
    assert not marker.exists()


@pytest.mark.parametrize("container", ["torch zip", "bare pickle"])
def test_a_crafted_checkpoint_with_a_forged_matching_manifest_is_refused(tmp_path, container):
    marker = tmp_path / "marker"
    path = tmp_path / checkpoint_name(99)
    payload = _crafted(path, marker, container=container)
    _forge_manifest(path, payload)
    _assert_live(container, tmp_path)
    with pytest.raises(CheckpointCorruptError) as error:
        load_checkpoint(path)
    message = str(error.value)
    assert "step-0000099.pt holds objects a weights-only load refuses" in message
    assert "NOT deserialised" in message and "untrusted source" in message
    assert not marker.exists()


def test_a_crafted_checkpoint_with_a_stale_manifest_fails_the_digest_first(tmp_path):
    marker = tmp_path / "marker"
    path = tmp_path / checkpoint_name(99)
    _crafted(path, marker, container="torch zip")
    _forge_manifest(path, b"some other content")
    with pytest.raises(CheckpointCorruptError, match="fails its checksum|is longer than"):
        load_checkpoint(path)
    assert not marker.exists()


@pytest.mark.parametrize("forge", [False, True])
def test_latest_good_checkpoint_skips_a_crafted_newest_file_without_running_it(tmp_path, forge):
    marker = tmp_path / "marker"
    folder = tmp_path / "checkpoints"
    save_checkpoint(folder / checkpoint_name(10), {"step": 10, "w": torch.ones(3)})
    crafted = folder / checkpoint_name(99)
    payload = _crafted(crafted, marker, container="torch zip")
    if forge:
        _forge_manifest(crafted, payload)
    good = latest_good_checkpoint(folder)
    assert good is not None and good.step == 10 and good.path == folder / checkpoint_name(10)
    assert [p for p, _ in good.skipped] == [crafted]
    reason = good.skipped[0][1]
    assert ("weights-only load refuses" if forge else "no commit manifest") in reason
    assert not marker.exists()
    assert torch.equal(load_checkpoint(good.path)["w"], torch.ones(3))
