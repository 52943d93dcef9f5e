"""Learned policies in the MLflow Model Registry (rl.registry): every candidate is a version with
its training window and held-out figures and the alias `challenger`; the blocking gate check moves
`champion` only for a promoted candidate; the loader refuses a champion file whose sha256 is not
the registry champion's. Runs on a temporary sqlite registry, without training (files by hand)."""

import shutil
import types

import pytest
from mlflow.tracking import MlflowClient

from assets.policies import _gate
from controllers.fast_heuristic import HeuristicFastPolicy
from rl import registry
from rl.fast_path import LearnedFastPolicy
from rl.gate import decide, record_decision
from rl.policy_file import PolicyWeights, load_policy, save_policy
from rl.retrain import policy_dir
from rl.slow_obs import SLOW_OBS_LAYOUT
from tests.policy_support import empty_mlflow_db, tiny_policy, use_registry_copy
from trainwise import champion, runs

REGION = "us-west-2"
WINDOW = "2026-09-01..2026-10-31 (train cells)"


@pytest.fixture(scope="module")
def _empty_db(tmp_path_factory):
    return empty_mlflow_db(tmp_path_factory.mktemp("mlflow"))


@pytest.fixture()
def uri(_empty_db, tmp_path, monkeypatch):
    return use_registry_copy(_empty_db, tmp_path, monkeypatch)


def _weights(kind: str, version: int) -> PolicyWeights:
    return tiny_policy(kind, version, REGION, WINDOW)


def _candidate(kind: str, version: int, cheaper: bool) -> dict:
    """What `rl.retrain.retrain_*` leaves: v<N>.npz, gate_v<N>.json, and its result dict;
    registered as the asset does."""
    folder = policy_dir(kind, REGION)
    path = folder / f"v{version}.npz"
    save_policy(_weights(kind, version), path)
    incumbent = [{"cell": f"c{i}", "cost": 100.0 + i, "missed": False} for i in range(4)]
    candidate = [{**row, "cost": row["cost"] * (0.9 if cheaper else 1.1)} for row in incumbent]
    decision = decide(candidate, incumbent)
    record_decision(decision, folder / f"gate_v{version}.json", {"candidate": path.name})
    out = {"path": str(path), "decision": decision.to_dict(), "incumbent": "trainwise_heuristic",
           "bc_agreement": 1.0, "train_seconds": 2.5, "ppo_timesteps": 256}
    out["metadata"] = registry.register_retrained(kind, REGION, out)
    return out


def _check(kind: str):
    """The blocking asset check, as Dagster runs it for partition REGION."""
    return _gate(kind, types.SimpleNamespace(partition_key=REGION))


def _aliases(uri: str, kind: str = "slow") -> dict:
    aliases = MlflowClient(tracking_uri=uri).get_registered_model(
        registry.model_name(kind, REGION)).aliases
    return {alias: str(version) for alias, version in aliases.items()}


def test_registration_creates_a_challenger_version_with_window_and_figures(uri, tmp_path):
    out = _candidate("slow", 1, cheaper=True)
    name = registry.model_name("slow", REGION)
    assert out["metadata"]["registry"] == f"{name} v1 @challenger"
    client = MlflowClient(tracking_uri=uri)
    version = client.get_model_version(name, "1")
    tags = version.tags
    assert tags["train_window"] == WINDOW and tags["policy_version"] == "1"
    assert tags["file_sha256"] == registry.file_sha256(out["path"])
    assert float(tags["eval_cost_ratio"]) == pytest.approx(0.9)
    assert tags["eval_held_out_cells"] == "4" and tags["eval_candidate_misses"] == "0"
    assert tags["gate_status"] == "pending" and tags["incumbent"] == "trainwise_heuristic"
    assert _aliases(uri) == {"challenger": "1"}
    # The version's source is the npz itself (no MLflow flavour, no pickle): it loads as a policy.
    run = client.get_run(version.run_id)
    assert run.data.metrics["cost_ratio"] == pytest.approx(0.9)
    assert run.data.params["train_window"] == WINDOW
    local = client.download_artifacts(version.run_id, "policy/v1.npz", str(tmp_path))
    assert load_policy(local, "slow", SLOW_OBS_LAYOUT, REGION).version == 1
    assert version.source.endswith("/policy")


def test_gate_pass_moves_champion_and_the_previous_champion_loses_it(uri):
    _candidate("slow", 1, cheaper=True)
    result = _check("slow")
    assert result.passed and "@champion" in result.description
    assert _aliases(uri) == {"champion": "1"}
    _candidate("slow", 2, cheaper=True)
    assert _aliases(uri) == {"champion": "1", "challenger": "2"}
    assert _check("slow").passed
    assert _aliases(uri) == {"champion": "2"}
    client = MlflowClient(tracking_uri=uri)
    name = registry.model_name("slow", REGION)
    assert client.get_model_version(name, "1").aliases == []
    assert client.get_model_version(name, "2").tags["gate_status"] == "promoted"
    assert registry.file_sha256(policy_dir("slow", REGION) / "champion.npz") == \
        client.get_model_version(name, "2").tags["file_sha256"]


def test_a_refused_candidate_stays_challenger_with_the_gate_figures(uri):
    _candidate("fast", 1, cheaper=True)
    assert _check("fast").passed
    _candidate("fast", 2, cheaper=False)
    result = _check("fast")
    assert not result.passed and "refused" in result.description and "champion v1" in result.description
    assert _aliases(uri, "fast") == {"champion": "1", "challenger": "2"}
    refused = MlflowClient(tracking_uri=uri).get_model_version(
        registry.model_name("fast", REGION), "2")
    assert refused.tags["gate_status"] == "refused"
    assert refused.tags["gate_reason"].startswith("refused: cost ratio 1.1000")
    assert float(refused.tags["eval_cost_ratio"]) == pytest.approx(1.1)
    assert refused.description.startswith("Refused challenger") and "4 held-out cells" in \
        refused.description
    # The incumbent stays in charge, and it is still the registry's champion.
    policy, reason = runs.fast_policy_in_charge("heuristic", REGION)
    assert isinstance(policy, LearnedFastPolicy)
    assert "fast champion v1" in reason and "matches" in reason and "v1 @champion" in reason


def test_aliases_survive_a_second_registration(uri):
    _candidate("slow", 1, cheaper=True)
    _check("slow")
    _candidate("slow", 2, cheaper=False)
    assert _aliases(uri) == {"champion": "1", "challenger": "2"}
    again = registry.register_candidate(
        "slow", REGION, policy_dir("slow", REGION) / "v2.npz", {"reason": "again"})
    assert again["version"] == "2" and again["new"] is False  # no duplicate version
    _candidate("slow", 3, cheaper=False)
    assert _aliases(uri) == {"champion": "1", "challenger": "3"}
    assert len(MlflowClient(tracking_uri=uri).search_model_versions(
        f"name = '{registry.model_name('slow', REGION)}'")) == 3


def test_a_champion_file_replaced_outside_the_gate_is_refused_with_the_reason(uri):
    _candidate("fast", 1, cheaper=True)
    _check("fast")
    _candidate("fast", 2, cheaper=False)
    _check("fast")
    folder = policy_dir("fast", REGION)
    # v2 is a valid policy file (it passes load_policy), but the gate refused it.
    shutil.copyfile(folder / "v2.npz", folder / "champion.npz")
    policy, reason = runs.fast_policy_in_charge("heuristic", REGION)
    assert isinstance(policy, HeuristicFastPolicy)
    assert "fast champion for us-west-2 refused" in reason
    assert "does not match trainwise-fast-policy-us-west-2 v1 @champion" in reason
    assert "heuristic_fast stays in charge" in reason


def test_a_champion_file_the_registry_never_promoted_is_refused(uri):
    _candidate("slow", 1, cheaper=False)
    _check("slow")
    folder = policy_dir("slow", REGION)
    shutil.copyfile(folder / "v1.npz", folder / "champion.npz")
    from controllers.allocation_heuristic import TrainwiseAllocationPolicy

    policy, reason = champion.slow_policy_in_charge(REGION, TrainwiseAllocationPolicy())
    assert isinstance(policy, TrainwiseAllocationPolicy)
    assert "has no 'champion' alias" in reason and "stays in charge" in reason


@pytest.mark.parametrize("where", ["no_database", "server_down"])
def test_without_a_registry_the_file_is_used_and_the_reason_says_why(where, tmp_path, monkeypatch):
    from tests.servers import free_port

    monkeypatch.setenv("TRAINWISE_MLFLOW_URI", f"sqlite:///{tmp_path / 'absent.db'}"
                       if where == "no_database" else f"http://127.0.0.1:{free_port()}")
    save_policy(_weights("fast", 1), policy_dir("fast", REGION) / "champion.npz")
    policy, reason = runs.fast_policy_in_charge("heuristic", REGION)
    assert isinstance(policy, LearnedFastPolicy)
    assert "fast champion v1 for us-west-2 in charge" in reason and "registry not checked" in reason
    assert not (tmp_path / "absent.db").exists()  # a read never creates a registry


def test_a_promotion_the_registry_cannot_record_fails_the_gate(tmp_path, monkeypatch):
    from tests.servers import free_port

    monkeypatch.setenv("TRAINWISE_MLFLOW_URI", f"http://127.0.0.1:{free_port()}")
    out = _candidate("slow", 1, cheaper=True)
    assert out["metadata"]["registry"].startswith("not registered (")
    result = _check("slow")
    assert result.passed is False
    assert "promoted" in result.description and "registry not updated" in result.description
