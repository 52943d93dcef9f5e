"""Adversarial cases of issue 31, classes `hostile_state_file` and `foreign_checkpoint`: generated
variants of checkpoints, manifests and policy files, each answered by the real readers.

What is exercised (the functions a resume and a tick really call):
- `training.loop._load_resume` on a run folder (the resume: expected "fell_back", the previous
  good checkpoint is used and the skipped file is named) and on the planted file itself (the
  caller chose it: expected "refused", a CheckpointError or FileNotFoundError naming it);
- `training.checkpoint.latest_good_checkpoint` without an identity (what `trainwise.runs`,
  `training.ddp_worker` and the store restore ask first);
- `rl.policy_file.load_policy` (expected "refused") and `trainwise.champion`'s fast and slow
  loaders (expected "fell_back": the heuristic stays in charge and the reason says why).
"crashed" is any other exception (MemoryError, RecursionError, IndexError, ...), "accepted" a
hostile or foreign file used silently, "warned" one used with a warning.

Checkpoints are small synthetic states saved with the real `save_checkpoint` (bound and signed
as the trainer's are), so `suite` may be None; with a `trials.Suite` three cases more resume
copies of its reference run in-process through `training.loop.train`. Variants: manifests that
claim huge sizes, are huge, nested 17 to 30 000 levels, of the wrong JSON type or field types;
payloads that are garbage, a deep pickle, a FIFO, a folder, links inside and outside the folder
(to another checkpoint, /dev/zero, nowhere, themselves); checkpoints of another run (copied, hard-
or soft-linked), seed, data, model or deployment key, re-labelled as a later step, stripped of
their binding, forged, or of another history of the run; policy files whose header is a list,
a string, nested, huge or mistyped, with string weights, zip bombs, huge sparse files, foreign
members, links to devices and FIFOs. Runs in a few seconds (about 20 s with a suite).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.faults.adversarial import Case

HOSTILE, FOREIGN = "hostile_state_file", "foreign_checkpoint"
RUN_ID, LINEAGE, SEED = "adv-run", "adv-lineage", 7
DATA, MODEL = "d" * 64, "m" * 64
PLANTED_STEP = 12
OWN_STEPS = (4, 8)


# -- synthetic run folders -------------------------------------------------------------------
def _state(step: int, **changes: Any) -> dict[str, Any]:
    import torch

    state = {"step": step, "run_id": RUN_ID, "lineage": LINEAGE, "data_fingerprint": DATA,
             "model_fingerprint": MODEL, "model_kind": "gpt", "model_config": {"n_layer": 1},
             "train_config": {"seed": SEED}, "w": torch.full((8,), float(step))}
    seed = changes.pop("seed", None)
    if seed is not None:
        state["train_config"] = {"seed": seed}
    state.update(changes)
    return state


def _own_folder(root: Path, name: str) -> Path:
    from training.checkpoint import checkpoint_name, save_checkpoint

    folder = root / name / "checkpoints"
    for step in OWN_STEPS:
        save_checkpoint(folder / checkpoint_name(step), _state(step))
    return folder


def _planted(folder: Path) -> Path:
    from training.checkpoint import checkpoint_name

    return folder / checkpoint_name(PLANTED_STEP)


def _signed(path: Path, key: bytes | None = None, **changes: Any) -> Path:
    """A bound checkpoint of the planted step (another run's, key, ... by `changes`)."""
    from training.checkpoint import save_checkpoint

    save_checkpoint(path, _state(PLANTED_STEP, **changes), key=key)
    return path


def _manifest(path: Path) -> Path:
    from training.checkpoint import manifest_path

    return manifest_path(path)


def _edit(path: Path, **changes: Any) -> None:
    manifest = json.loads(_manifest(path).read_text())
    manifest.update(changes)
    _manifest(path).write_text(json.dumps(manifest))


def _unbound_manifest(path: Path, payload: bytes, **changes: Any) -> None:
    manifest = {"format": "trainwise-checkpoint-manifest", "version": 2, "payload": path.name,
                "step": PLANTED_STEP, "sha256": hashlib.sha256(payload).hexdigest(),
                "bytes": len(payload), **changes}
    _manifest(path).write_text(json.dumps(manifest))


def _digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


# -- how trainwise answered ------------------------------------------------------------------
def _short(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error)[:240]}"


def _resume_folder(folder: Path, planted: Path, *, run_id: str | None = RUN_ID
                   ) -> tuple[str, str]:
    """The resume of `folder` (training.loop._load_resume, as `train` calls it)."""
    from training.checkpoint import CheckpointError
    from training.loop import _load_resume

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            resume = _load_resume(folder, MODEL, {"n_layer": 1}, run_id=run_id,
                                  data_fingerprint=DATA, seed=SEED)
        except (CheckpointError, FileNotFoundError) as error:
            return "refused", _short(error)
        except Exception as error:  # noqa: BLE001 - the finding
            return "crashed", _short(error)
    said = "; ".join(str(w.message)[:200] for w in caught)
    if resume.path.name != planted.name:
        named = any(s["path"].endswith(planted.name) for s in resume.skipped)
        return ("fell_back" if named else "accepted"), f"resumed {resume.path.name}; {said}"
    return ("warned" if caught else "accepted"), f"resumed the planted file; {said}"


def _resume_file(planted: Path, *, run_id: str | None = RUN_ID) -> tuple[str, str]:
    """A resume from the planted file itself (the caller named it)."""
    from training.checkpoint import CheckpointError
    from training.loop import _load_resume

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            _load_resume(planted, MODEL, {"n_layer": 1}, run_id=run_id, data_fingerprint=DATA,
                         seed=SEED)
        except (CheckpointError, FileNotFoundError) as error:
            named = planted.name in str(error)
            return ("refused" if named else "crashed"), _short(error)
        except Exception as error:  # noqa: BLE001 - the finding
            return "crashed", _short(error)
    return ("warned" if caught else "accepted"), "loaded"


def _latest_good(folder: Path, planted: Path) -> tuple[str, str]:
    from training.checkpoint import latest_good_checkpoint

    try:
        good = latest_good_checkpoint(folder)
    except Exception as error:  # noqa: BLE001 - the finding
        return "crashed", _short(error)
    if good is None:
        return "refused", "no good checkpoint"
    if good.path.name == planted.name:
        return "accepted", "picked the planted file"
    return "fell_back", f"picked {good.path.name}"


# -- hostile_state_file: checkpoints ---------------------------------------------------------
def _manifest_variants() -> dict[str, Callable[[Path], None]]:
    """name -> what to do to a signed planted checkpoint's manifest."""
    from training.checkpoint import MAX_MANIFEST_BYTES

    variants: dict[str, Callable[[Path], None]] = {}
    for claimed in (2**62, 2**40, 10**13):
        variants[f"manifest_claims_{claimed}_bytes"] = lambda p, c=claimed: _edit(p, bytes=c)
    for name, value in {"bytes_negative": -1, "bytes_string": "12", "bytes_float": 1.5,
                        "bytes_bool": True, "bytes_null": None}.items():
        variants[f"manifest_{name}"] = lambda p, v=value: _edit(p, bytes=v)
    for size in (MAX_MANIFEST_BYTES + 1, 4 << 20):
        variants[f"manifest_of_{size}_bytes"] = lambda p, s=size: _edit(p, pad="x" * s)
    variants["manifest_sparse_2^40_bytes"] = lambda p: os.truncate(_manifest(p), 2**40)
    for depth in (17, 100, 1000, 30_000):
        variants[f"manifest_nested_{depth}"] = lambda p, d=depth: _manifest(p).write_text(
            "[" * d + "]" * d)
    variants["manifest_nested_in_a_field"] = lambda p: _edit(p, extra=json.loads(
        "[" * 15 + "]" * 15))
    for name, text in {"list": "[1, 2]", "string": '"manifest"', "number": "12", "null": "null",
                       "empty": "", "nan": '{"step": NaN}'}.items():
        variants[f"manifest_is_{name}"] = lambda p, t=text: _manifest(p).write_text(t)
    variants["manifest_invalid_utf8"] = lambda p: _manifest(p).write_bytes(b'{"\xff": 1}')
    for name, change in {"sha256_int": {"sha256": 5}, "step_string": {"step": "12"},
                         "binding_list": {"binding": [1]}, "hmac_int": {"hmac": 5},
                         "payload_int": {"payload": 3}}.items():
        variants[f"manifest_{name}"] = lambda p, c=change: _edit(p, **c)
    variants["manifest_run_id_int"] = lambda p: _edit_binding(p, run_id=5)
    variants["manifest_parent_step_string"] = lambda p: _edit_binding(p, parent_step="x")
    variants["manifest_binding_without_hmac"] = lambda p: _drop(p, "hmac")
    return variants


def _edit_binding(path: Path, **changes: Any) -> None:
    manifest = json.loads(_manifest(path).read_text())
    manifest["binding"].update(changes)
    _manifest(path).write_text(json.dumps(manifest))


def _drop(path: Path, *names: str) -> None:
    manifest = json.loads(_manifest(path).read_text())
    for name in names:
        manifest.pop(name, None)
    _manifest(path).write_text(json.dumps(manifest))


def _deep_pickle(depth: int) -> bytes:
    """A pickle of lists nested `depth` deep, built without recursion (EMPTY_LIST, APPEND)."""
    return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."


def _payload_variants(root: Path) -> dict[str, Callable[[Path], Path | None]]:
    """name -> plants a payload (and manifest) at the path; returns an outside file to watch."""
    import torch

    outside = root / "outside-run" / "checkpoints"

    def garbage(p: Path) -> None:
        data = np.random.default_rng(0).bytes(4096)
        p.write_bytes(data)
        _unbound_manifest(p, data)

    def truncated_zip(p: Path) -> None:
        _signed(p)
        data = p.read_bytes()[: len(p.read_bytes()) // 2]
        p.write_bytes(data)
        _unbound_manifest(p, data)

    def deep_pickle(p: Path) -> None:
        data = _deep_pickle(50_000)
        p.write_bytes(data)
        _unbound_manifest(p, data)

    def tensor_list(p: Path) -> None:
        torch.save([torch.zeros(2)], p)
        _unbound_manifest(p, p.read_bytes())

    def link_to(target_of: Callable[[Path], Path], manifest_from_target: bool = True):
        def plant(p: Path) -> Path:
            target = target_of(p)
            p.symlink_to(target)
            if manifest_from_target and target.is_file():
                data = target.read_bytes()
                _unbound_manifest(p, data)
                if _manifest(target).is_file():
                    shutil.copyfile(_manifest(target), _manifest(p))
            else:
                _unbound_manifest(p, b"\0" * (1 << 20))
            return target
        return plant

    def outside_checkpoint(p: Path) -> Path:
        target = outside / p.name
        if not target.exists():
            _signed(target)
        return target

    def fifo(p: Path) -> None:
        os.mkfifo(p)
        _unbound_manifest(p, b"x" * 10)

    def folder(p: Path) -> None:
        p.mkdir()
        _unbound_manifest(p, b"x" * 10)

    def sparse_over_memory(p: Path) -> None:
        from training.checkpoint import max_payload_bytes

        _signed(p)
        os.truncate(p, max_payload_bytes() + 1)
        _edit(p, bytes=max_payload_bytes() + 1)

    return {
        "payload_garbage": garbage, "payload_truncated_zip": truncated_zip,
        "payload_deep_pickle": deep_pickle, "payload_not_a_dict": tensor_list,
        "payload_fifo": fifo, "payload_is_a_folder": folder,
        "payload_sparse_over_memory": sparse_over_memory,
        "payload_link_inside_folder": link_to(lambda p: p.parent / "step-0000008.pt"),
        "payload_link_outside_folder": link_to(outside_checkpoint),
        "payload_link_to_dev_zero": link_to(lambda p: Path("/dev/zero"), False),
        "payload_link_dangling": link_to(lambda p: p.parent / "nowhere.pt", False),
        "payload_link_to_itself": link_to(lambda p: p, False),
        "manifest_link_inside_folder": lambda p: _link_manifest(p, p.parent / "step-0000008.pt"),
        "manifest_link_outside_folder": lambda p: _link_manifest(p, outside_checkpoint(p)),
    }


def _link_manifest(path: Path, target_payload: Path) -> Path:
    shutil.copyfile(target_payload, path)
    _manifest(path).symlink_to(_manifest(target_payload))
    return _manifest(target_payload)


def _checkpoint_cases(root: Path, variants: dict[str, Callable], defect_class: str,
                      prepare: Callable[[Path], None] | None, *, resume_expected: str = "fell_back",
                      file_expected: str = "refused", latest_good: bool = True,
                      run_id: str | None = RUN_ID) -> list[Case]:
    cases = []
    for name, plant in variants.items():
        folder = _own_folder(root, name)
        planted = _planted(folder)
        try:
            if prepare is not None:
                prepare(planted)
            watched = plant(planted)
        except Exception as error:  # noqa: BLE001 - a variant that cannot be built is a finding
            cases.append(Case(defect_class, name, resume_expected, "crashed",
                              detail=f"could not build: {_short(error)}"))
            continue
        watched = watched if isinstance(watched, Path) and watched.is_file() else None
        before = _digest(watched) if watched is not None else None
        observations = [("resume_folder", resume_expected,
                         lambda f=folder, p=planted: _resume_folder(f, p, run_id=run_id)),
                        ("resume_file", file_expected,
                         lambda p=planted: _resume_file(p, run_id=run_id))]
        if latest_good:
            observations.append(("latest_good", "fell_back",
                                 lambda f=folder, p=planted: _latest_good(f, p)))
        for how, expected, call in observations:
            outcome, detail = call()
            changed = watched is not None and _digest(watched) != before
            cases.append(Case(defect_class, f"{name}/{how}", expected, outcome,
                              write_outside=changed, detail=detail))
    return cases


def _hostile_checkpoints(root: Path) -> list[Case]:
    return (_checkpoint_cases(root / "manifests", _manifest_variants(), HOSTILE, _signed)
            + _checkpoint_cases(root / "payloads", _payload_variants(root), HOSTILE, None))


# -- foreign_checkpoint ----------------------------------------------------------------------
def _copy_in(source: Path, planted: Path, how: str = "copy") -> None:
    for src, dst in ((source, planted), (_manifest(source), _manifest(planted))):
        {"copy": shutil.copyfile, "hardlink": os.link,
         "symlink": lambda s, d: os.symlink(s, d)}[how](src, dst)


def _foreign_variants(root: Path) -> dict[str, Callable[[Path], None]]:
    other = root / "other-run" / "checkpoints"

    def other_run(p: Path, how: str) -> None:
        source = other / p.name
        if not source.exists():
            _signed(source, run_id="adv-other", lineage="other-lineage", seed=99)
        _copy_in(source, p, how)

    def relabel(step: int) -> Callable[[Path], None]:
        return lambda p: _copy_in(p.parent / f"step-{step:07d}.pt", p)

    def relabel_edited(p: Path) -> None:
        relabel(4)(p)
        _edit(p, step=PLANTED_STEP, payload=p.name)  # the HMAC no longer matches

    def stripped(p: Path) -> None:
        other_run(p, "copy")
        _drop(p, "binding", "hmac")

    def forged_hmac(p: Path) -> None:
        _signed(p, run_id="adv-other")
        _edit_binding(p, run_id=RUN_ID)
        _edit(p, hmac="0" * 64)

    def fork(p: Path) -> None:
        from training.checkpoint import checkpoint_name, save_checkpoint

        history = root / "other-history" / "checkpoints"
        for step in (8, PLANTED_STEP):  # the same run id, another lineage: its step 8 differs
            save_checkpoint(history / checkpoint_name(step), _state(step, lineage="history-b"))
        _copy_in(history / p.name, p)

    return {
        "other_run_copied": lambda p: other_run(p, "copy"),
        "other_run_hardlinked": lambda p: other_run(p, "hardlink"),
        "other_run_symlinked": lambda p: other_run(p, "symlink"),
        "other_seed": lambda p: _signed(p, seed=99),
        "other_data": lambda p: _signed(p, data_fingerprint="e" * 64),
        "other_model": lambda p: _signed(p, model_fingerprint="f" * 64),
        "other_deployment_key": lambda p: _signed(p, key=b"another deployment's key 32 bytes"),
        "relabelled_step_4": relabel(4), "relabelled_step_8": relabel(8),
        "relabelled_and_edited": relabel_edited, "binding_stripped": stripped,
        "forged_hmac": forged_hmac, "other_history_fork": fork,
    }


def _foreign_checkpoints(root: Path) -> list[Case]:
    variants = _foreign_variants(root)
    fork = {"other_history_fork": variants.pop("other_history_fork")}
    cases = _checkpoint_cases(root / "variants", variants, FOREIGN, None, latest_good=False)
    # Chosen by the caller, a checkpoint of another history of the run is resumed, with a warning.
    cases += _checkpoint_cases(root / "fork", fork, FOREIGN, None, latest_good=False,
                               file_expected="warned|refused")
    # A resumer whose config names no run id cannot tell runs apart: it must at least warn.
    def unknown_origin(p: Path) -> None:
        _signed(p, run_id="adv-other", lineage="other-lineage")

    cases += _checkpoint_cases(root / "no-run-id", {"other_run_resumer_names_no_run_id":
                                                    unknown_origin}, FOREIGN, None,
                               resume_expected="warned|fell_back",
                               file_expected="warned|refused", latest_good=False, run_id=None)
    return cases


# -- hostile_state_file: policy files --------------------------------------------------------
@contextlib.contextmanager
def _state_home(home: Path) -> Iterator[None]:
    """TRAINWISE_HOME at `home` for the champion loaders (they read it), restored after."""
    before = os.environ.get("TRAINWISE_HOME")
    os.environ["TRAINWISE_HOME"] = str(home)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRAINWISE_HOME", None)
        else:
            os.environ["TRAINWISE_HOME"] = before


_REGION = "us-west-2"


def _write_policy(path: Path, kind: str, header_json: bytes | None = None,
                  **arrays_changes: np.ndarray) -> None:
    """A policy file of `kind` as save_policy writes it, with its header bytes or arrays
    replaced."""
    from rl.policy_file import save_policy

    from_save = path.with_name(path.name + ".valid.npz")
    save_policy(_weights(kind), from_save)
    with np.load(from_save, allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    from_save.unlink()
    if header_json is not None:
        arrays["header"] = np.frombuffer(header_json, dtype=np.uint8)
    arrays.update(arrays_changes)
    with open(path, "wb") as handle:
        np.savez(handle, **arrays)


def _weights(kind: str):
    from rl.fast_obs import BATCH_CHOICES, FAST_OBS_LAYOUT, NOTICE_CHOICES, SHARE_CHOICES
    from rl.policy_file import PolicyWeights
    from rl.slow_obs import CHECKPOINT_CHOICES_S, SLOW_CHOICES, SLOW_OBS_LAYOUT

    layout = FAST_OBS_LAYOUT if kind == "fast" else SLOW_OBS_LAYOUT
    nvec = ((len(SHARE_CHOICES), len(BATCH_CHOICES), len(NOTICE_CHOICES)) if kind == "fast"
            else (len(SLOW_CHOICES), len(CHECKPOINT_CHOICES_S)))
    rng = np.random.default_rng(3)
    return PolicyWeights([(rng.normal(size=(8, len(layout))).astype(np.float32),
                           np.zeros(8, np.float32))],
                         (rng.normal(size=(sum(nvec), 8)).astype(np.float32),
                          np.zeros(sum(nvec), np.float32)), nvec, layout, kind, _REGION, "w", 3)


def _edited_policy(path: Path, kind: str, **changes: Any) -> None:
    _write_policy(path, kind)
    with np.load(path, allow_pickle=False) as data:
        header = json.loads(data["header"].tobytes())
    header.update(changes)
    _write_policy(path, kind, json.dumps(header).encode())


def _policy_variants() -> dict[str, Callable[[Path, str], None]]:
    from rl.policy_file import MAX_HEADER_BYTES, MAX_POLICY_FILE_BYTES

    variants: dict[str, Callable[[Path, str], None]] = {
        "header_list": lambda p, k: _write_policy(p, k, b"[1, 2, 3]"),
        "header_string": lambda p, k: _write_policy(p, k, b'"header"'),
        "header_null": lambda p, k: _write_policy(p, k, b"null"),
        "header_invalid_utf8": lambda p, k: _write_policy(p, k, b'{"\xff": 1}'),
        "header_int64_array": lambda p, k: _write_policy(p, k, None,
                                                         header=np.arange(4, dtype=np.int64)),
        "weights_strings": lambda p, k: _write_policy(p, k, None, w0=np.array(["abcd"] * 4)),
        "weights_int": lambda p, k: _write_policy(p, k, None, w0=np.zeros((8, 3), np.int64)),
    }
    for depth in (33, 1000, 100_000):
        variants[f"header_nested_{depth}"] = lambda p, k, d=depth: _write_policy(
            p, k, b"[" * d + b"]" * d)
    variants["figures_nested_40"] = lambda p, k: _edited_policy(
        p, k, figures=json.loads("[" * 40 + "]" * 40))
    for size in (MAX_HEADER_BYTES + 1, 4 * MAX_HEADER_BYTES):
        variants[f"header_of_{size}_bytes"] = lambda p, k, s=size: _write_policy(
            p, k, b'{"pad": "' + b"x" * s + b'"}')
    for name, change in {"nvec_string": {"nvec": "abc"}, "nvec_floats": {"nvec": [1.5]},
                         "nvec_empty": {"nvec": []}, "hidden_layers_string": {"hidden_layers": "2"},
                         "hidden_layers_huge": {"hidden_layers": 10**18},
                         "version_huge_string": {"version": "9" * 5000},
                         "layout_object": {"layout": {"a": 1}}, "region_list": {"region": [1]},
                         "figures_list": {"figures": [1]}}.items():
        variants[f"header_{name}"] = lambda p, k, c=change: _edited_policy(p, k, **c)

    def zip_bomb(p: Path, k: str) -> None:
        with zipfile.ZipFile(p, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            with archive.open("w0.npy", "w", force_zip64=True) as member:
                chunk = b"\0" * (1 << 20)
                for _ in range(MAX_POLICY_FILE_BYTES // len(chunk) + 2):
                    member.write(chunk)

    def huge_sparse(p: Path, k: str) -> None:
        _write_policy(p, k)
        os.truncate(p, MAX_POLICY_FILE_BYTES * 16)

    def foreign_member(p: Path, k: str) -> None:
        _write_policy(p, k)
        with zipfile.ZipFile(p, "a") as archive:
            archive.writestr("payload.py", b"import os")

    variants.update({
        "zip_bomb": zip_bomb, "huge_sparse_file": huge_sparse, "foreign_member": foreign_member,
        "link_to_dev_zero": lambda p, k: p.symlink_to("/dev/zero"),
        "fifo": lambda p, k: os.mkfifo(p),
        "garbage": lambda p, k: p.write_bytes(np.random.default_rng(1).bytes(2048)),
    })
    return variants


def _policy_cases(root: Path) -> list[Case]:
    from controllers.allocation_heuristic import TrainwiseAllocationPolicy
    from controllers.fast_heuristic import HeuristicFastPolicy
    from rl.fast_obs import FAST_OBS_LAYOUT
    from rl.policy_file import PolicyFileError, load_policy
    from rl.slow_obs import SLOW_OBS_LAYOUT
    from trainwise import champion

    loaders = {
        "fast": lambda: champion.fast_policy_in_charge(_REGION, HeuristicFastPolicy()),
        "slow": lambda: champion.slow_policy_in_charge(_REGION, TrainwiseAllocationPolicy()),
    }
    layouts = {"fast": FAST_OBS_LAYOUT, "slow": SLOW_OBS_LAYOUT}
    cases = []
    for index, (name, plant) in enumerate(_policy_variants().items()):
        kind = ("fast", "slow")[index % 2]
        home = root / name
        path = home / "policies" / kind / _REGION / "champion.npz"
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            plant(path, kind)
        except Exception as error:  # noqa: BLE001 - a variant that cannot be built is a finding
            cases.append(Case(HOSTILE, f"policy_{name}", "refused", "crashed",
                              detail=f"could not build: {_short(error)}"))
            continue
        try:
            load_policy(path, kind, layouts[kind], _REGION)
            outcome, detail = "accepted", "loaded"
        except PolicyFileError as error:
            outcome, detail = "refused", _short(error)
        except Exception as error:  # noqa: BLE001 - the finding
            outcome, detail = "crashed", _short(error)
        cases.append(Case(HOSTILE, f"policy_{name}/load_policy", "refused", outcome,
                          detail=detail))
        with _state_home(home):
            try:
                policy, reason = loaders[kind]()
                learned = type(policy).__name__.startswith("Learned")
                outcome, detail = ("accepted" if learned else "fell_back"), reason
            except Exception as error:  # noqa: BLE001 - the finding: the tick/trainer stops
                outcome, detail = "crashed", _short(error)
        cases.append(Case(HOSTILE, f"policy_{name}/champion_{kind}", "fell_back", outcome,
                          detail=detail))
    return cases


# -- with a suite: the trainer itself --------------------------------------------------------
def _trainer_cases(root: Path, suite: Any) -> list[Case]:
    """Copies of the suite's reference run (finished), each with one planted file, resumed
    in-process through `training.loop.train` as a re-executed run would be."""
    from training import loop, shards
    from training.checkpoint import checkpoint_name, load_checkpoint, save_checkpoint
    from training.model import GPTConfig

    donor = suite.work_dir / "reference" / "checkpoints"
    committed = sorted(p for p in donor.glob("step-*.pt") if _manifest(p).is_file())
    if len(committed) < 2:
        return [Case(FOREIGN, "trainer/no_donor_checkpoints", "refused", "crashed",
                     detail=f"{donor} holds {len(committed)} committed checkpoints")]
    examples = shards.load_shards(suite.shards_dir)
    newest_step = int(committed[-1].stem.split("-")[1])

    def config(run_id: str):
        fields = {**suite.base_config, "run_id": run_id}
        fields["model"] = GPTConfig(**fields["model"])
        return loop.TrainConfig(**fields)

    def plant_foreign(folder: Path) -> None:
        state = load_checkpoint(committed[-1])
        state.update(run_id="intruder", lineage="intruder", step=newest_step + 1)
        save_checkpoint(folder / checkpoint_name(newest_step + 1), state)

    def plant_relabelled(folder: Path) -> None:
        _copy_in(folder / committed[0].name, folder / checkpoint_name(newest_step + 1))

    cases = []
    for name, plant, run_id, expected in (
            ("foreign_newest", plant_foreign, "reference", "fell_back"),
            ("relabelled_older_as_newest", plant_relabelled, "reference", "fell_back"),
            ("whole_folder_of_another_run", None, "adv-not-reference", "refused")):
        run_dir = root / name
        shutil.copytree(donor, run_dir / "checkpoints")
        if plant is not None:
            plant(run_dir / "checkpoints")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                result = loop.train(config(run_id), examples, None, run_dir,
                                    resume_from=run_dir / "checkpoints")
            except FileNotFoundError as error:
                cases.append(Case(FOREIGN, f"trainer/{name}", expected, "refused",
                                  detail=_short(error)))
                continue
            except Exception as error:  # noqa: BLE001 - the finding
                cases.append(Case(FOREIGN, f"trainer/{name}", expected, "crashed",
                                  detail=_short(error)))
                continue
        said = [str(w.message) for w in caught if "skipped" in str(w.message)]
        outcome = "fell_back" if said and result.status == "completed" else "accepted"
        cases.append(Case(FOREIGN, f"trainer/{name}", expected, outcome,
                          detail=f"{result.status} at step {result.steps}; "
                                 f"{said[0][:200] if said else 'no warning'}"))
    return cases


def cases(work_dir: Path, suite: Any = None) -> list[Case]:
    """Every generated case (module docstring), each in its own folder under `work_dir`."""
    work_dir = Path(work_dir)
    found = _hostile_checkpoints(work_dir / "checkpoints")
    found += _foreign_checkpoints(work_dir / "foreign")
    if suite is not None:
        found += _trainer_cases(work_dir / "trainer", suite)
    found += _policy_cases(work_dir / "policies")
    return found
