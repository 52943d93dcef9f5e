"""Issue 31, class 1 (policy files): whatever a champion.npz holds, `load_policy` and `read_header`
raise only PolicyFileError, and the trainer and the slow tick keep the heuristic in charge.

Before the fix a header that is a JSON list raised AttributeError, a deeply nested one
RecursionError, a header field of the wrong type ValueError/TypeError, and a string weight array
ValueError from the hash: each escaped the fallback of `trainwise.champion`."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from controllers.allocation_heuristic import TrainwiseAllocationPolicy
from controllers.fast_heuristic import HeuristicFastPolicy
from rl.fast_obs import FAST_OBS_LAYOUT
from rl.policy_file import (
    MAX_HEADER_BYTES,
    MAX_POLICY_FILE_BYTES,
    PolicyFileError,
    load_policy,
    read_header,
    save_policy,
)
from rl.retrain import policy_dir
from tests.policy_support import tiny_policy
from trainwise import champion, runs, slow_tick

REGION = "us-west-2"


def _valid(path: Path, kind: str = "fast") -> dict[str, np.ndarray]:
    save_policy(tiny_policy(kind, 3, REGION, "w"), path)
    with np.load(path, allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


def _with_header(path: Path, header_bytes: bytes, kind: str = "fast", **extra) -> None:
    arrays = _valid(path, kind)
    arrays["header"] = np.frombuffer(header_bytes, dtype=np.uint8)
    arrays.update(extra)
    with open(path, "wb") as handle:
        np.savez(handle, **arrays)


def _edited_header(path: Path, kind: str = "fast", **changes) -> None:
    arrays = _valid(path, kind)
    header = json.loads(arrays["header"].tobytes())
    header.update(changes)
    _with_header(path, json.dumps(header).encode(), kind)


def _damage(path: Path, how: str, kind: str = "fast") -> None:
    deep = 100_000
    if how == "list_header":
        _with_header(path, b"[1, 2, 3]", kind)
    elif how == "string_header":
        _with_header(path, b'"a string"', kind)
    elif how == "nested_header":
        _with_header(path, b"[" * deep + b"]" * deep, kind)
    elif how == "nested_figures":
        _edited_header(path, kind, figures={"x": json.loads("[" * 40 + "]" * 40)})
    elif how == "huge_header":
        _with_header(path, b'{"pad": "' + b"x" * (MAX_HEADER_BYTES + 10) + b'"}', kind)
    elif how == "nvec_string":
        _edited_header(path, kind, nvec="abc")
    elif how == "hidden_layers_string":
        _edited_header(path, kind, hidden_layers="2")
    elif how == "hidden_layers_huge":
        _edited_header(path, kind, hidden_layers=10**18)
    elif how == "version_string":
        _edited_header(path, kind, version="x" * 5000)
    elif how == "layout_object":
        _edited_header(path, kind, layout={"a": 1})
    elif how == "string_weights":
        arrays = _valid(path, kind)
        arrays["w0"] = np.array(["abcd"] * 4)
        with open(path, "wb") as handle:
            np.savez(handle, **arrays)
    elif how == "zip_bomb":
        with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            with archive.open("w0.npy", "w", force_zip64=True) as member:
                chunk = b"\0" * (1 << 20)
                for _ in range(MAX_POLICY_FILE_BYTES // len(chunk) + 2):
                    member.write(chunk)
    elif how == "huge_file":
        _valid(path, kind)
        with open(path, "r+b") as handle:
            handle.truncate(MAX_POLICY_FILE_BYTES + 1)  # sparse
    elif how == "foreign_member":
        _valid(path, kind)
        with zipfile.ZipFile(path, "a") as archive:
            archive.writestr("evil.py", b"import os")
    elif how == "link_to_device":
        path.symlink_to("/dev/zero")
    else:
        raise ValueError(how)


DAMAGES = ["list_header", "string_header", "nested_header", "nested_figures", "huge_header",
           "nvec_string", "hidden_layers_string", "hidden_layers_huge", "version_string",
           "layout_object", "string_weights", "zip_bomb", "huge_file", "foreign_member",
           "link_to_device"]


@pytest.mark.parametrize("how", DAMAGES)
def test_a_hostile_policy_file_raises_only_policy_file_error(tmp_path, how):
    path = tmp_path / "champion.npz"
    _damage(path, how)
    with pytest.raises(PolicyFileError, match="policy file .*champion.npz") as error:
        load_policy(path, "fast", FAST_OBS_LAYOUT, REGION)
    # The bounds hold before the read: nothing huge was inflated or read to find out.
    bound = {"zip_bomb": "before inflating", "huge_file": "more than a policy file can be",
             "huge_header": "inflates to|more than", "link_to_device": "not a regular file"}
    assert how not in bound or any(part in str(error.value) for part in bound[how].split("|"))


@pytest.mark.parametrize("how", ["list_header", "nested_header", "huge_header", "zip_bomb",
                                 "huge_file", "link_to_device"])
def test_read_header_is_bounded_too(tmp_path, how):
    path = tmp_path / "v1.npz"
    _damage(path, how)
    with pytest.raises(PolicyFileError):
        read_header(path)


@pytest.mark.parametrize("how", ["list_header", "nested_header", "nvec_string",
                                 "string_weights", "huge_file"])
def test_the_trainer_and_the_slow_tick_keep_the_heuristic_in_charge(how):
    for kind in ("fast", "slow"):
        path = policy_dir(kind, REGION) / "champion.npz"
        path.parent.mkdir(parents=True, exist_ok=True)
        _damage(path, how, kind)
    policy, reason = runs.fast_policy_in_charge("heuristic", REGION)  # what run_training asks
    assert isinstance(policy, HeuristicFastPolicy) and "refused" in reason
    allocation, reason = champion.slow_policy_in_charge(REGION, TrainwiseAllocationPolicy())
    assert isinstance(allocation, TrainwiseAllocationPolicy) and "refused" in reason
    _, in_charge = slow_tick.slow_policy_for(REGION)  # what the slow tick asks
    assert "refused" in in_charge and "stays in charge" in in_charge


def test_a_valid_file_still_loads(tmp_path):
    path = tmp_path / "champion.npz"
    _valid(path)
    weights = load_policy(path, "fast", FAST_OBS_LAYOUT, REGION)
    assert weights.version == 3 and read_header(path)["kind"] == "fast"
