"""policy_rollback makes a previously promoted slow or fast policy version the region's champion
again, through a blocking check: the file must load and the version must have been promoted; the
registry alias `champion` and champion.npz move together, and the history records from, to, who,
why and when. A missing version, a corrupt file or a never-promoted version is refused and the
incumbent keeps loading. Runs on a temporary sqlite registry, with policy files written by hand
(no training: the files are what `rl.retrain` writes)."""

import shutil
import types

import dagster as dg
import pytest
from mlflow.tracking import MlflowClient

from assets.policies import (
    POLICY_DEFS,
    _gate,
    _rollback_gate,
    policy_rollback,
    policy_rollback_gate,
)
from controllers.allocation_heuristic import TrainwiseAllocationPolicy
from controllers.fast_heuristic import HeuristicFastPolicy
from pipelines.jobs import policy_rollback_job
from rl import gate as rl_gate
from rl import registry
from rl.fast_path import LearnedFastPolicy
from rl.gate import decide, record_decision
from rl.policy_file import PolicyWeights, save_policy
from rl.retrain import policy_dir
from tests.policy_support import empty_mlflow_db, tiny_policy, use_registry_copy
from trainwise import champion, runs

REGION = "us-west-2"
DEFS = dg.Definitions(assets=[policy_rollback], asset_checks=[policy_rollback_gate],
                      jobs=[policy_rollback_job])


@pytest.fixture(scope="module")
def _empty_db(tmp_path_factory):
    return empty_mlflow_db(tmp_path_factory.mktemp("mlflow"))


@pytest.fixture()
def uri(_empty_db, tmp_path, monkeypatch):
    return use_registry_copy(_empty_db, tmp_path, monkeypatch)


def _weights(kind: str, version: int) -> PolicyWeights:
    return tiny_policy(kind, version, REGION, "train cells")


def _retrained(kind: str, version: int, cheaper: bool) -> None:
    """What one retraining leaves (v<N>.npz, gate_v<N>.json, a registry version), then its gate."""
    folder = policy_dir(kind, REGION)
    path = folder / f"v{version}.npz"
    save_policy(_weights(kind, version), path)
    incumbent = [{"cell": f"c{i}", "cost": 100.0 + i, "missed": False} for i in range(4)]
    candidate = [{**row, "cost": row["cost"] * (0.9 if cheaper else 1.1)} for row in incumbent]
    decision = decide(candidate, incumbent)
    record_decision(decision, folder / f"gate_v{version}.json", {"candidate": path.name})
    registry.register_retrained(kind, REGION, {"path": str(path), "decision": decision.to_dict()})
    _gate(kind, types.SimpleNamespace(partition_key=REGION))


def _rollback(kind: str, **config):
    return DEFS.resolve_job_def("champion_rollback").execute_in_process(
        partition_key=REGION, raise_on_error=False,
        run_config={"ops": {"policy_rollback": {"config": {"kind": kind, **config}}}})


def _champion_alias(uri: str, kind: str) -> str:
    """The policy version (not the registry's version number) holding `champion`."""
    client = MlflowClient(tracking_uri=uri)
    name = registry.model_name(kind, REGION)
    version = client.get_model_version(name, str(client.get_registered_model(name).aliases[
        "champion"]))
    return version.tags["policy_version"]


def _champion_sha(kind: str) -> str:
    return registry.file_sha256(policy_dir(kind, REGION) / "champion.npz")


@pytest.fixture(scope="module")
def _two_champions_template(_empty_db, tmp_path_factory):
    """fast v1 promoted, then v2 promoted over it, built once (registrations take seconds):
    (registry database, state folder)."""
    root = tmp_path_factory.mktemp("two_champions")
    database, home = root / "registry.db", root / "home"
    shutil.copyfile(_empty_db, database)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRAINWISE_HOME", str(home))
        patch.setenv("TRAINWISE_MLFLOW_URI", f"sqlite:///{database}")
        _retrained("fast", 1, cheaper=True)
        _retrained("fast", 2, cheaper=True)
        assert _champion_alias(f"sqlite:///{database}", "fast") == "2"
    return database, home


@pytest.fixture()
def two_champions(_two_champions_template, tmp_path, monkeypatch):
    """A private copy of the template: v2 in charge, v1 promoted before it."""
    from trainwise import settings

    database, home = _two_champions_template
    shutil.copyfile(database, tmp_path / "registry.db")
    shutil.copytree(home / "policies", settings.home_dir() / "policies")
    value = f"sqlite:///{tmp_path / 'registry.db'}"
    monkeypatch.setenv("TRAINWISE_MLFLOW_URI", value)
    return value


def test_rollback_restores_v1_in_file_and_registry_and_the_trainer_loads_it(two_champions):
    uri = two_champions
    result = _rollback("fast", restore_version=1, reason="v2 slowed gang jobs in us-west-2",
                       requested_by="alice")
    assert result.success
    [check] = result.get_asset_check_evaluations()
    assert check.passed and check.partition == REGION
    assert "v2 -> v1" in check.description
    assert _champion_sha("fast") == registry.file_sha256(policy_dir("fast", REGION) / "v1.npz")
    assert _champion_alias(uri, "fast") == "1"
    policy, reason = runs.fast_policy_in_charge("heuristic", REGION)
    assert isinstance(policy, LearnedFastPolicy) and policy.network.weights.version == 1
    assert "fast champion v1" in reason and "matches" in reason
    record = rl_gate.read_history("fast", REGION)[-1]
    assert record["event"] == "rollback" and (record["from"], record["to"]) == ("v2", "v1")
    assert record["requested_by"] == "alice"
    assert record["why"] == "v2 slowed gang jobs in us-west-2"
    assert record["approved_by"] == "policy_rollback_gate" and record["at_utc"]
    assert "gate_status promoted" in record["promoted_before"]
    restored = MlflowClient(tracking_uri=uri).get_model_version(
        registry.model_name("fast", REGION), "1")
    assert restored.tags["rollback_by"] == "alice" and restored.tags["gate_status"] == "restored"
    assert restored.tags["rollback_reason"] == "v2 slowed gang jobs in us-west-2"


def test_executing_the_old_gate_again_does_not_undo_the_rollback(two_champions):
    assert _rollback("fast", restore_version=1, reason="regressed", requested_by="alice").success
    again = _gate("fast", types.SimpleNamespace(partition_key=REGION))
    assert not again.passed and "v2 was rolled back to v1" in again.description
    assert _champion_alias(two_champions, "fast") == "1"
    assert _champion_sha("fast") == registry.file_sha256(policy_dir("fast", REGION) / "v1.npz")
    # Rolling forward to v2 (promoted before) is a rollback like any other.
    assert _rollback("fast", restore_version=2, reason="fixed", requested_by="bob").success
    assert _champion_alias(two_champions, "fast") == "2"
    assert _gate("fast", types.SimpleNamespace(partition_key=REGION)).passed  # v2 in charge again


def test_rollback_to_an_unknown_version_is_refused_and_the_incumbent_keeps_loading(
        two_champions):
    before = _champion_sha("fast")
    result = _rollback("fast", restore_version=7, reason="try", requested_by="alice")
    assert not result.success
    message = result.failure_data_for_node("policy_rollback").error.cause.message
    assert "v7" in message and "stored versions: v1, v2" in message
    assert _champion_sha("fast") == before and _champion_alias(two_champions, "fast") == "2"
    policy, reason = runs.fast_policy_in_charge("heuristic", REGION)
    assert isinstance(policy, LearnedFastPolicy) and policy.network.weights.version == 2
    record = rl_gate.read_history("fast", REGION)[-1]
    assert record["event"] == "rollback_refused" and record["requested_by"] == "alice"
    assert record["to"] == "v7" and record["why"] == "try"


def test_a_corrupt_file_is_refused_by_the_gate_and_the_incumbent_stays(two_champions):
    path = policy_dir("fast", REGION) / "v1.npz"
    path.write_bytes(path.read_bytes()[: 200])  # truncated: not a readable npz any more
    result = _rollback("fast", restore_version=1, reason="regressed", requested_by="alice")
    assert not result.success
    [check] = result.get_asset_check_evaluations()
    assert not check.passed and "does not load" in check.description
    assert "v2 stays in charge" in check.description
    assert _champion_alias(two_champions, "fast") == "2"
    policy, _ = runs.fast_policy_in_charge("heuristic", REGION)
    assert policy.network.weights.version == 2
    record = rl_gate.read_history("fast", REGION)[-1]
    assert record["event"] == "rollback_refused" and "does not load" in record["failure"]


def test_a_never_promoted_version_needs_allow_unpromoted_and_is_recorded(uri):
    _retrained("slow", 1, cheaper=True)
    _retrained("slow", 2, cheaper=False)  # refused by the gate: v1 stays champion
    result = _rollback("slow", restore_version=2, reason="try v2", requested_by="carol")
    assert not result.success
    assert "never promoted" in result.get_asset_check_evaluations()[0].description
    assert _champion_alias(uri, "slow") == "1"
    result = _rollback("slow", restore_version=2, reason="A/B on one region",
                       requested_by="carol", allow_unpromoted=True)
    assert result.success and _champion_alias(uri, "slow") == "2"
    record = rl_gate.read_history("slow", REGION)[-1]
    assert record["promoted_before"].startswith("never promoted; allowed")
    policy, reason = champion.slow_policy_in_charge(REGION, TrainwiseAllocationPolicy())
    assert not isinstance(policy, TrainwiseAllocationPolicy) and "slow champion v2" in reason


def test_a_rollback_the_registry_cannot_record_leaves_the_incumbent(two_champions, monkeypatch):
    from tests.servers import free_port

    before = _champion_sha("fast")
    monkeypatch.setenv("TRAINWISE_MLFLOW_URI", f"http://127.0.0.1:{free_port()}")
    result = _rollback("fast", restore_version=1, reason="regressed", requested_by="alice")
    assert not result.success
    assert "registry not updated" in result.get_asset_check_evaluations()[0].description
    assert _champion_sha("fast") == before
    monkeypatch.setenv("TRAINWISE_MLFLOW_URI", two_champions)
    assert _champion_alias(two_champions, "fast") == "2"


def test_the_check_alone_reports_a_tampered_champion(two_champions):
    context = types.SimpleNamespace(has_partition_key=True, partition_key=REGION)
    assert _rollback_gate(context).passed  # nothing pending, the champion is the registry's
    folder = policy_dir("fast", REGION)
    shutil.copyfile(folder / "v1.npz", folder / "champion.npz")  # outside the gate
    result = _rollback_gate(context)
    assert not result.passed and "fast: refused" in result.description
    assert isinstance(runs.fast_policy_in_charge("heuristic", REGION)[0], HeuristicFastPolicy)


def test_the_rollback_asset_and_check_are_in_the_policy_definitions():
    assert policy_rollback in POLICY_DEFS["assets"]
    assert policy_rollback_gate in POLICY_DEFS["asset_checks"]
