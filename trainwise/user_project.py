"""A team's project file: its own data sets (and, later, jobs) declared for trainwise.

The file is TOML, kept in the team's repository and named by TRAINWISE_PROJECT_FILE:

    [datasets.reviews]                  # the partition's name: [a-z0-9][a-z0-9_-]{0,62}
    path = "data/reviews.jsonl"         # relative to this file's folder (a file or a folder)
    format = "jsonl"                    # json jsonl parquet csv text arrow saved; default: suffix
    id_column = "review_id"             # required; or "row_content_sha256" (a hash of each row)
    text_column = "body"                # optional
    eval_fraction = 0.1                 # optional, in (0, 1)

    [jobs.finetune]                     # parsed and checked; not launched yet (issue 26 item 4)
    entry = "reviews.train:main"        # package.module:function, or path/to/script.py
    dataset = "reviews"                 # a declared dataset
    args = ["--epochs", "3"]            # optional, strings
    framework = "hf_trainer"            # plain (default) | hf_trainer | lightning

Every mistake (an unknown key, a bad or built-in name, a missing path, an unknown format, a wrong
type) is a ValueError naming the file, the key and the fix, raised when the code location loads,
so a broken file shows there rather than as a failed run later. Nothing here reads the data: the
data is read when `data_shards` is materialized (`training.user_datasets`).
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from training.shards import SOURCES
from training.user_datasets import FORMATS, ROW_HASH_ID, DatasetSpec, infer_format
from trainwise import settings

__all__ = ["DatasetSpec", "JobSpec", "Project", "EMPTY_PROJECT", "load_project",
           "load_project_file", "parse_project", "FRAMEWORKS"]

NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")  # fullmatch: a folder name, a partition key
FRAMEWORKS = ("plain", "hf_trainer", "lightning")
DEFAULT_EVAL_FRACTION = 0.1
_SECTIONS = ("datasets", "jobs")
_DATASET_KEYS = ("path", "format", "id_column", "text_column", "eval_fraction")
_JOB_KEYS = ("entry", "dataset", "args", "framework")
_MODULE_ENTRY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


@dataclass(frozen=True)
class JobSpec:
    """One `[jobs.NAME]`: a user's training entry point and its dataset (not launched yet)."""

    name: str
    entry: str  # as written
    entry_kind: str  # "module" (package.module:function) or "script" (a .py file)
    script: Path | None  # the script's absolute path, for a script entry
    dataset: str
    args: tuple[str, ...] = ()
    framework: str = "plain"


@dataclass(frozen=True)
class Project:
    """A parsed project file; `path` None is no file (the built-in partitions only)."""

    path: Path | None
    datasets: Mapping[str, DatasetSpec] = field(default_factory=lambda: MappingProxyType({}))
    jobs: Mapping[str, JobSpec] = field(default_factory=lambda: MappingProxyType({}))


EMPTY_PROJECT = Project(None)


class _Where:
    """Builds the messages: file, section, key, problem, fix."""

    def __init__(self, path: Path):
        self.path = path

    def error(self, key: str, problem: str, fix: str) -> ValueError:
        return ValueError(f"project file {self.path}: {key}: {problem}; {fix}")


def load_project() -> Project:
    """The project file TRAINWISE_PROJECT_FILE names, parsed; EMPTY_PROJECT when unset."""
    path = settings.project_file()
    return EMPTY_PROJECT if path is None else load_project_file(path)


def load_project_file(path: Path) -> Project:
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"project file {path} (TRAINWISE_PROJECT_FILE) does not exist or is not "
                         "a file; point TRAINWISE_PROJECT_FILE at your project's TOML file, or "
                         "unset it for the built-in partitions only")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"project file {path} is not valid TOML ({error}); fix the syntax "
                         "(see docs/user_datasets.md for an example)") from error
    return parse_project(data, path)


def parse_project(data: Mapping[str, Any], path: Path) -> Project:
    """Validate a decoded project file; `path` is where it lies (paths are relative to its folder)."""
    where = _Where(path)
    for key in data:
        if key not in _SECTIONS:
            raise where.error(key, "unknown section", "use only [datasets.NAME] and [jobs.NAME] "
                              "(a typo? see docs/user_datasets.md)")
    datasets = {}
    for name, body in _section(where, data, "datasets").items():
        _check_name(where, "datasets", name)
        datasets[name] = _dataset(where, name, body, path.parent)
    jobs = {}
    for name, body in _section(where, data, "jobs").items():
        _check_name(where, "jobs", name)
        jobs[name] = _job(where, name, body, path.parent, datasets)
    return Project(path, MappingProxyType(datasets), MappingProxyType(jobs))


def _section(where: _Where, data: Mapping[str, Any], section: str) -> Mapping[str, Any]:
    body = data.get(section, {})
    if not isinstance(body, dict):
        raise where.error(section, f"is a {type(body).__name__}, not a table",
                          f"write it as [{section}.NAME] sections")
    for name, entry in body.items():
        if not isinstance(entry, dict):
            raise where.error(f"{section}.{name}", f"is a {type(entry).__name__}, not a table",
                              f"write it as a [{section}.{name}] section with its keys")
    return body


def _check_name(where: _Where, section: str, name: str) -> None:
    if not NAME_PATTERN.fullmatch(name):
        raise where.error(f"[{section}.{name}]", "the name is not 1 to 63 of a-z, 0-9, '_' or "
                          "'-' starting with a letter or digit",
                          "rename it (it becomes a folder and a partition key)")
    if section == "datasets" and name in SOURCES:
        raise where.error(f"[datasets.{name}]", "the name is a built-in partition's",
                          f"choose another name (built-in: {', '.join(sorted(SOURCES))})")


def _unknown_keys(where: _Where, prefix: str, body: Mapping[str, Any], allowed: tuple) -> None:
    for key in body:
        if key not in allowed:
            raise where.error(f"{prefix}.{key}", "unknown key", f"use only {', '.join(allowed)}")


def _string(where: _Where, key: str, value: Any, fix: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise where.error(key, f"must be a non-empty string, got {value!r}", fix)
    return value


def _dataset(where: _Where, name: str, body: Mapping[str, Any], folder: Path) -> DatasetSpec:
    prefix = f"datasets.{name}"
    _unknown_keys(where, prefix, body, _DATASET_KEYS)
    if "path" not in body:
        raise where.error(f"{prefix}.path", "missing", "add path = \"...\" (relative to the "
                          "project file's folder)")
    raw_path = _string(where, f"{prefix}.path", body["path"], "set it to the data's file or folder")
    data_path = (folder / raw_path).resolve()
    if not data_path.exists():
        raise where.error(f"{prefix}.path", f"{data_path} does not exist",
                          "fix the path (relative to the project file's folder) or add the data")
    if "format" in body:
        fmt = body["format"]
        if fmt not in FORMATS:
            raise where.error(f"{prefix}.format", f"unknown format {fmt!r}",
                              f"use one of {', '.join(FORMATS)}")
    else:
        fmt = infer_format(data_path)
        if fmt is None:
            raise where.error(f"{prefix}.format", f"cannot be told from {data_path.name!r}",
                              f"add format = one of {', '.join(FORMATS)}")
    if fmt == "saved" and not data_path.is_dir():
        raise where.error(f"{prefix}.format", "'saved' needs the folder Dataset.save_to_disk "
                          f"wrote, and {data_path} is a file", "fix path, or set the file's format")
    if "id_column" not in body:
        raise where.error(f"{prefix}.id_column", "missing (a stable id per row keeps examples, "
                          "scores and the eval split stable when the data changes)",
                          f"add id_column = \"<a column of unique ids>\", or \"{ROW_HASH_ID}\" to "
                          "hash each row's content")
    id_column = _string(where, f"{prefix}.id_column", body["id_column"],
                        f"name a column of unique ids, or \"{ROW_HASH_ID}\"")
    text_column = None
    if "text_column" in body:
        text_column = _string(where, f"{prefix}.text_column", body["text_column"],
                              "name a column of strings, or remove the key")
    eval_fraction = body.get("eval_fraction", DEFAULT_EVAL_FRACTION)
    if (isinstance(eval_fraction, bool) or not isinstance(eval_fraction, (int, float))
            or not 0.0 < float(eval_fraction) < 1.0):
        raise where.error(f"{prefix}.eval_fraction", f"must be a number in (0, 1), got "
                          f"{eval_fraction!r}", "set it to e.g. 0.1, or remove it for 0.1")
    return DatasetSpec(name=name, path=data_path, format=fmt, id_column=id_column,
                       text_column=text_column, eval_fraction=float(eval_fraction),
                       declared_in=where.path)


def _job(where: _Where, name: str, body: Mapping[str, Any], folder: Path,
         datasets: Mapping[str, DatasetSpec]) -> JobSpec:
    prefix = f"jobs.{name}"
    _unknown_keys(where, prefix, body, _JOB_KEYS)
    if "entry" not in body:
        raise where.error(f"{prefix}.entry", "missing",
                          "add entry = \"package.module:function\" or \"path/to/script.py\"")
    entry = _string(where, f"{prefix}.entry", body["entry"],
                    "set it to \"package.module:function\" or \"path/to/script.py\"")
    script = None
    if entry.endswith(".py"):
        script = (folder / entry).resolve()
        if not script.is_file():
            raise where.error(f"{prefix}.entry", f"script {script} does not exist",
                              "fix the path (relative to the project file's folder)")
        kind = "script"
    elif _MODULE_ENTRY.fullmatch(entry):
        kind = "module"  # not imported here: importing user code at load would run it
    else:
        raise where.error(f"{prefix}.entry", f"{entry!r} is neither package.module:function nor "
                          "a .py script", "write e.g. \"myteam.train:main\" or \"scripts/train.py\"")
    if "dataset" not in body:
        raise where.error(f"{prefix}.dataset", "missing", "add dataset = \"<a [datasets.NAME]>\"")
    dataset = body["dataset"]
    if dataset not in datasets:
        declared = ", ".join(sorted(datasets)) or "none"
        raise where.error(f"{prefix}.dataset", f"{dataset!r} is not a declared dataset",
                          f"name one of the [datasets.NAME] of this file (declared: {declared})")
    args = body.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise where.error(f"{prefix}.args", f"must be a list of strings, got {args!r}",
                          "write e.g. args = [\"--epochs\", \"3\"]")
    framework = body.get("framework", "plain")
    if framework not in FRAMEWORKS:
        raise where.error(f"{prefix}.framework", f"unknown framework {framework!r}",
                          f"use one of {', '.join(FRAMEWORKS)}")
    return JobSpec(name=name, entry=entry, entry_kind=kind, script=script, dataset=dataset,
                   args=tuple(args), framework=framework)
