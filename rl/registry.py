"""Learned policies in the MLflow Model Registry: one registered model per kind and region.

    trainwise-<kind>-policy-<region>    (kind: slow | fast)

Each candidate (`rl.retrain`) becomes a model version whose source is the npz policy file logged
as an artifact of a run in the `trainwise-policies` experiment (numbers only: MLflow never
pickles or loads it; `rl.policy_file.load_policy` does, without unpickling). Its tags carry the
training window, the file's sha256, and the held-out evaluation figures; it gets the alias
`challenger`. The blocking gate check then calls `record_gate`: a promoted candidate takes the
alias `champion` (MLflow moves an alias, so the previous champion loses it) and drops
`challenger`; a refused one keeps `challenger`, with the gate's reason and figures as tags and
description. The files under `<TRAINWISE_HOME>/policies` stay what the trainer loads; the
registry is the record the loader checks the champion file against (`verify_champion_file`).

mlflow is imported lazily (about 1.2 s); nothing here imports dagster.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rl.policy_file import read_header
from trainwise import settings, tracking
from trainwise.services import ServiceUnreachableError

EXPERIMENT = "trainwise-policies"
CHAMPION = "champion"
CHALLENGER = "challenger"
ARTIFACT_DIR = "policy"  # the npz under the run's artifacts; the version's source
# A loader check must not hold a run's start: one try, short timeout (MLflow's own retries off).
CHECK_TIMEOUT_S = 3.0


class RegistryUnavailable(RuntimeError):
    """The registry could not be asked (no database yet, server down); the message says why."""


def model_name(kind: str, region: str) -> str:
    """The registered model of one kind of policy in one region."""
    return f"trainwise-{kind}-policy-{region}"


def file_sha256(path: str | Path) -> str:
    """sha256 of the file's bytes (champion.npz is a byte copy of the promoted v<N>.npz)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _uri(tracking_uri: str | None) -> str:
    return tracking_uri or settings.mlflow_uri()


def _client(tracking_uri: str | None, *, must_exist: bool) -> tuple[Any, str]:
    """(MlflowClient, uri). `must_exist`: a sqlite database that is not there yet is 'no
    registry' (a read must not create one; creating it runs MLflow's migrations, seconds)."""
    uri = _uri(tracking_uri)
    database = tracking.sqlite_path(uri)
    if must_exist and database is not None and not database.is_file():
        raise RegistryUnavailable(f"no MLflow database at {database} yet")
    try:
        tracking.check_reachable(uri, timeout_s=CHECK_TIMEOUT_S)
    except ServiceUnreachableError as error:
        raise RegistryUnavailable(str(error)) from None
    from mlflow.tracking import MlflowClient  # about 1.2 s: only when a registry answers

    return MlflowClient(tracking_uri=uri), uri


def _is_missing(error: Exception) -> bool:
    return getattr(error, "error_code", "") == "RESOURCE_DOES_NOT_EXIST"


def _ensure_model(client: Any, name: str, kind: str, region: str) -> None:
    try:
        client.get_registered_model(name)
    except Exception as error:  # noqa: BLE001 - MlflowException; anything else is re-raised
        if not _is_missing(error):
            raise
        client.create_registered_model(
            name, tags={"kind": kind, "region": region},
            description=(f"trainwise {kind} policy for {region}: npz policy files (rl.policy_file, "
                         f"no pickle). Alias '{CHAMPION}' = in charge, '{CHALLENGER}' = latest "
                         "candidate the gate has not promoted."))


def _figure_tags(decision: Mapping[str, Any]) -> dict[str, str]:
    low, high = (list(decision.get("cost_ratio_ci95") or ()) + [None, None])[:2]
    figures = {
        "eval_cost_ratio": decision.get("cost_ratio"), "eval_cost_ratio_ci95_low": low,
        "eval_cost_ratio_ci95_high": high, "eval_candidate_total": decision.get("candidate_total"),
        "eval_incumbent_total": decision.get("incumbent_total"),
        "eval_candidate_misses": decision.get("candidate_misses"),
        "eval_incumbent_misses": decision.get("incumbent_misses"),
        "eval_held_out_cells": decision.get("cells"), "eval_unit": decision.get("unit"),
        "gate_margin": decision.get("margin"),
    }
    return {k: str(v) for k, v in figures.items() if v is not None}


def train_data_tags(train_data: Any) -> dict[str, str]:
    """What a version trained on, as tags (header `train_data`, `rl.training_data`): the data's
    sha256, the time range, the collections and zones, the seed, and for a fast policy the
    region's pooled reclaim hazard. Older files without it give none."""
    if not isinstance(train_data, Mapping):
        return {}
    collections = train_data.get("collections") or []
    stats = train_data.get("region_stats") or {}
    tags = {
        "train_data_sha256": train_data.get("data_sha256"),
        "train_start_utc": train_data.get("start_utc"), "train_end_utc": train_data.get("end_utc"),
        "train_seed": train_data.get("seed"),
        "train_collections": "; ".join(
            f"{c.get('collection')} {','.join(c.get('home_zones') or [])}"
            for c in collections if isinstance(c, Mapping)) or None,
        "train_reclaims_per_spot_up_h": (stats.get("pooled_reclaims_per_spot_up_h")
                                         if isinstance(stats, Mapping) else None),
    }
    return {k: str(v) for k, v in tags.items() if v is not None}


def _aliases(client: Any, name: str) -> dict[str, str]:
    """alias -> version as str (the sqlite store answers ints, a server strings)."""
    return {alias: str(v) for alias, v in client.get_registered_model(name).aliases.items()}


def _find_version(client: Any, name: str, policy_version: int) -> Any | None:
    found = client.search_model_versions(
        f"name = '{name}' and tags.policy_version = '{int(policy_version)}'")
    return max(found, key=lambda v: int(v.version)) if found else None


def register_candidate(kind: str, region: str, path: str | Path, decision: Mapping[str, Any],
                       extra: Mapping[str, Any] | None = None,
                       tracking_uri: str | None = None) -> dict[str, Any]:
    """Logs the candidate's file (and its figures) as a run, registers it as a version of
    `model_name(kind, region)` with the alias `challenger`. Idempotent per policy version.
    Returns {model, version, run_id, new (False: already registered, aliases untouched),
    file_sha256}."""
    path = Path(path)
    header = read_header(path)
    if header.get("kind") != kind or header.get("region") != region:
        raise ValueError(f"{path} holds a {header.get('kind')!r} policy for "
                         f"{header.get('region')!r}; register it under its own kind and region")
    client, uri = _client(tracking_uri, must_exist=False)
    name, sha = model_name(kind, region), file_sha256(path)
    call = tracking.mlflow_caller(uri)
    with tracking.no_inner_http_retries():
        _ensure_model(client, name, kind, region)
        existing = _find_version(client, name, int(header["version"]))
        if existing is not None and existing.tags.get("file_sha256") == sha:
            return {"model": name, "version": str(existing.version), "run_id": existing.run_id,
                    "new": False, "file_sha256": sha}
        extra = dict(extra or {})
        experiment = tracking.experiment_id(client, uri, EXPERIMENT, None, call)
        run = client.create_run(experiment, run_name=f"{kind}-policy-{region}-v{header['version']}",
                                tags={"trainwise/kind": kind, "trainwise/region": region})
        run_id = run.info.run_id
        try:
            params = {"kind": kind, "region": region, "policy_version": header["version"],
                      "train_window": header.get("train_window", ""),
                      **{k: v for k, v in extra.items() if not isinstance(v, float)}}
            for key, value in tracking.scrub_params(params).items():
                client.log_param(run_id, key, value)
            numbers = {**{k: v for k, v in decision.items() if isinstance(v, (int, float))
                          and not isinstance(v, bool)},
                       **{k: v for k, v in extra.items() if isinstance(v, float)}}
            for key, value in numbers.items():
                client.log_metric(run_id, key, float(value))
            client.log_artifact(run_id, str(path), artifact_path=ARTIFACT_DIR)
            client.log_text(run_id, json.dumps(dict(decision), indent=2, default=str),
                            f"{ARTIFACT_DIR}/gate_decision.json")
            client.set_terminated(run_id, "FINISHED")
        except BaseException:
            client.set_terminated(run_id, "FAILED")
            raise
        tags = {"kind": kind, "region": region, "policy_version": str(header["version"]),
                "train_window": str(header.get("train_window", "")), "file_sha256": sha,
                "file_name": path.name, "weights_sha256": str(header.get("weights_sha256")),
                "layout_sha256": str(header.get("layout_sha256")),
                "created_utc": str(header.get("created_utc")),
                "incumbent": str(extra.get("incumbent", decision.get("incumbent", ""))),
                "gate_status": "pending", **_figure_tags(decision),
                **train_data_tags(header.get("train_data"))}
        artifact_uri = client.get_run(run_id).info.artifact_uri.rstrip("/")
        version = client.create_model_version(
            name, f"{artifact_uri}/{ARTIFACT_DIR}", run_id=run_id,
            tags=tracking.scrub_params(tags),
            description=(f"Candidate v{header['version']} of the {kind} policy for {region}, "
                         f"trained on {header.get('train_window') or '?'}; held-out evaluation: "
                         f"{decision.get('reason', 'not evaluated')}. Gate pending."))
        client.set_registered_model_alias(name, CHALLENGER, str(version.version))
    return {"model": name, "version": str(version.version), "run_id": run_id, "new": True,
            "file_sha256": sha}


def record_gate(kind: str, region: str, decision: Mapping[str, Any], candidate_path: str | Path,
                tracking_uri: str | None = None) -> dict[str, Any]:
    """Records the gate's decision on the candidate's version (registering it first when the
    asset could not): promoted -> alias `champion` (moved from the previous champion), alias
    `challenger` dropped; refused -> stays `challenger`, the reason and figures as tags and
    description. Returns {model, version, champion_version, promoted}."""
    promoted = bool(decision["promote"])
    registered = register_candidate(kind, region, candidate_path, decision,
                                    tracking_uri=tracking_uri)
    client, _ = _client(tracking_uri, must_exist=True)
    name, version = registered["model"], registered["version"]
    now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    with tracking.no_inner_http_retries():
        tags = {"gate_status": "promoted" if promoted else "refused",
                "gate_reason": str(decision.get("reason", "")), "gate_decided_utc": now,
                **_figure_tags(decision)}
        for key, value in tracking.scrub_params(tags).items():
            client.set_model_version_tag(name, version, key, value)
        client.update_model_version(name, version, description=(
            f"{'Champion' if promoted else 'Refused challenger'}: gate {now}: "
            f"{decision.get('reason', '')} (cost ratio {decision.get('cost_ratio')}, 95 % CI "
            f"{decision.get('cost_ratio_ci95')}, misses {decision.get('candidate_misses')} vs "
            f"{decision.get('incumbent_misses')} over {decision.get('cells')} held-out cells)."))
        if promoted:
            client.set_registered_model_alias(name, CHAMPION, version)
            if _aliases(client, name).get(CHALLENGER) == str(version):
                client.delete_registered_model_alias(name, CHALLENGER)
        champion = _aliases(client, name).get(CHAMPION)
    return {"model": name, "version": version, "champion_version": champion,
            "promoted": promoted}


def champion_version(kind: str, region: str, tracking_uri: str | None = None) -> Any | None:
    """The version with alias `champion`; None when the registry has no such model.
    Raises RegistryUnavailable when it cannot be asked, LookupError when the model exists
    without a champion."""
    client, _ = _client(tracking_uri, must_exist=True)
    name = model_name(kind, region)
    try:
        with tracking.no_inner_http_retries():
            try:
                model = client.get_registered_model(name)
            except Exception as error:  # noqa: BLE001 - MlflowException
                if _is_missing(error):
                    return None
                raise
            if CHAMPION not in model.aliases:
                raise LookupError(f"registered model {name} has no '{CHAMPION}' alias: no "
                                  "candidate passed the gate")
            return client.get_model_version(name, str(model.aliases[CHAMPION]))
    except LookupError:
        raise
    except Exception as error:  # noqa: BLE001 - server gone mid-call, locked database, ...
        raise RegistryUnavailable(f"{type(error).__name__}: {error}") from None


def verify_champion_file(kind: str, region: str, path: str | Path,
                         tracking_uri: str | None = None) -> tuple[bool, str]:
    """(accepted, note) for the champion file the loader is about to use. Refused when the
    registry can be asked and its champion version's file_sha256 differs from the file's (or the
    model exists with no champion); accepted with a note saying why when it cannot be asked or
    holds no model for this kind and region (a fresh registry, runs without MLflow)."""
    try:
        version = champion_version(kind, region, tracking_uri)
    except RegistryUnavailable as error:
        return True, f"registry not checked ({error})"
    except LookupError as error:
        return False, f"{error}; {path} was not promoted through the registry"
    name = model_name(kind, region)
    if version is None:
        return True, f"registry has no model {name}; file not checked against it"
    expected = version.tags.get("file_sha256")
    actual = file_sha256(path)
    if expected != actual:
        return False, (f"{path} sha256 {actual[:12]} does not match {name} v{version.version} "
                       f"@{CHAMPION} file_sha256 {str(expected)[:12]} (replaced or edited "
                       "outside the gate); restore it with the rollback job or retrain")
    return True, f"matches {name} v{version.version} @{CHAMPION}"


# --- for the assets: a registry fault is recorded, never hidden ---------------------------------
def register_retrained(kind: str, region: str, out: Mapping[str, Any]) -> dict[str, str]:
    """Registers a `rl.retrain.retrain_*` result; returns asset metadata. A registry that cannot
    take it does not fail the training (the gate check registers the candidate again)."""
    extra = {k: out[k] for k in ("incumbent", "bc_agreement", "train_seconds", "ppo_timesteps")
             if k in out}
    try:
        got = register_candidate(kind, region, out["path"], out["decision"], extra)
    except Exception as error:  # noqa: BLE001 - recorded in the metadata; the gate retries
        return {"registry": f"not registered ({type(error).__name__}: {error}); the gate check "
                            "registers it again"}
    return {"registry": f"{got['model']} v{got['version']} @{CHALLENGER}",
            "registry_file_sha256": got["file_sha256"]}


def record_gate_outcome(kind: str, region: str, decision: Mapping[str, Any],
                        candidate_path: str | Path) -> tuple[bool, str]:
    """(recorded, note) for the gate check. A promotion the registry did not record would be
    refused by the loader once the registry answers (its champion hash differs), so the check
    reports it as failed; executing the check again retries it."""
    try:
        got = record_gate(kind, region, decision, candidate_path)
    except Exception as error:  # noqa: BLE001 - reported by the check
        return False, (f"registry not updated ({type(error).__name__}: {error}); execute the "
                       "check again once MLflow answers")
    champion = (f"champion v{got['champion_version']}" if got["champion_version"]
                else "no champion (heuristic in charge)")
    return True, (f"registry: {got['model']} v{got['version']} "
                  f"{'@' + CHAMPION if got['promoted'] else '@' + CHALLENGER + ' (refused)'}, "
                  f"{champion}")


# --- rollback: the alias `champion` moves back to a version registered before -----------------
def record_rollback(kind: str, region: str, path: str | Path, decision: Mapping[str, Any], *,
                    requested_by: str, reason: str, tracking_uri: str | None = None
                    ) -> dict[str, Any]:
    """Moves `champion` to the version holding `path` (v<N>.npz; registered first when it never
    was, e.g. promoted before the registry existed) and records who, why and when as tags.
    Refused (ValueError) when the version registered for that policy version holds another
    file (sha256): the file on disk was changed after registration. Returns {model, version,
    champion_version, previous_champion (None: there was none)}; `restore_alias` undoes it."""
    path = Path(path)
    policy_version = int(read_header(path)["version"])
    client, _ = _client(tracking_uri, must_exist=False)
    name, sha = model_name(kind, region), file_sha256(path)
    with tracking.no_inner_http_retries():
        _ensure_model(client, name, kind, region)
        existing = _find_version(client, name, policy_version)
        if existing is not None and existing.tags.get("file_sha256") != sha:
            raise ValueError(
                f"{path} sha256 {sha[:12]} differs from {name} v{existing.version} (policy "
                f"v{policy_version}) file_sha256 {str(existing.tags.get('file_sha256'))[:12]}: the "
                "file was changed after it was registered; restore another version or retrain")
        challenger = _aliases(client, name).get(CHALLENGER)
    registered = register_candidate(kind, region, path, decision, tracking_uri=tracking_uri)
    version = registered["version"]
    now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    with tracking.no_inner_http_retries():
        if challenger is not None and challenger != str(version):
            # A first registration took `challenger`: it stays on the candidate that held it.
            client.set_registered_model_alias(name, CHALLENGER, challenger)
        previous = _aliases(client, name).get(CHAMPION)
        tags = {"gate_status": "restored", "rollback_by": requested_by, "rollback_reason": reason,
                "rollback_utc": now, "rollback_from_version": str(previous)}
        for key, value in tracking.scrub_params(tags).items():
            client.set_model_version_tag(name, version, key, value)
        client.set_registered_model_alias(name, CHAMPION, version)
        if _aliases(client, name).get(CHALLENGER) == str(version):
            client.delete_registered_model_alias(name, CHALLENGER)
        if previous is not None and previous != str(version):
            client.set_model_version_tag(name, previous, "rolled_back_utc", now)
        client.update_model_version(name, version, description=(
            f"Champion again (rollback {now} by {requested_by} from version {previous}): {reason}"))
    return {"model": name, "version": str(version), "champion_version": str(version),
            "previous_champion": previous}


def restore_alias(kind: str, region: str, version: str | None,
                  tracking_uri: str | None = None) -> None:
    """Points `champion` back at `version` (None: removes it) after a publish that failed half
    way, so registry and champion file agree again."""
    client, _ = _client(tracking_uri, must_exist=True)
    name = model_name(kind, region)
    with tracking.no_inner_http_retries():
        if version is None:
            client.delete_registered_model_alias(name, CHAMPION)
        else:
            client.set_registered_model_alias(name, CHAMPION, str(version))


def version_gate_status(kind: str, region: str, policy_version: int,
                        tracking_uri: str | None = None) -> str | None:
    """The registry's `gate_status` tag of a policy version (promoted, restored, refused,
    pending); None when the registry has no such version. Raises RegistryUnavailable."""
    client, _ = _client(tracking_uri, must_exist=True)
    try:
        with tracking.no_inner_http_retries():
            found = _find_version(client, model_name(kind, region), policy_version)
    except Exception as error:  # noqa: BLE001 - server gone mid-call, locked database, ...
        raise RegistryUnavailable(f"{type(error).__name__}: {error}") from None
    return None if found is None else found.tags.get("gate_status")
