"""The `kubernetes` provider (issue 27, item 4): a run's nodes as pods of the node agent.

What runs here: every pod manifest through the `kubernetes` client's own models (deserialised
into `V1Pod`, which checks types, and serialised back unchanged, which catches a misspelt key),
and the provider's calls against `CoreV1ApiDouble`, which keeps pods as the API server's JSON
and answers with the client's own `ApiException`. What does not run here: a cluster (no API
server runs on this machine), so scheduling and a real node drain are not tested.
"""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime

import pytest
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from cloud.providers import (
    LaunchFailedError,
    NodeState,
    ProviderUnreachableError,
    provider_names,
)
from cloud.providers.kubernetes_pods import (
    INSTANCE_TYPE_LABEL,
    ZONE_LABEL,
    KubernetesProvider,
    PodSettings,
    PodSweep,
    pod_manifest,
    pod_name,
)
from trainwise import gang, orphan_nodes

STORE = "s3://trainwise-runs/team-a"
SETTINGS = PodSettings(image="registry.example/trainwise:1.0", namespace="training")


def as_v1pod(manifest: dict) -> dict:
    """The manifest through the client's V1Pod model and back."""
    api = ApiClient()
    return api.sanitize_for_serialization(
        api.deserialize(json.dumps(manifest), "V1Pod", "application/json"))


class CoreV1ApiDouble:
    """The three CoreV1Api calls the provider makes, over pods kept as the server's JSON."""

    def __init__(self, refuse_after: int | None = None, unreachable: bool = False) -> None:
        self.pods: dict[tuple[str, str], dict] = {}
        self.calls: list[tuple] = []
        self.refuse_after, self.unreachable = refuse_after, unreachable

    def _check(self) -> None:
        if self.unreachable:
            raise ConnectionRefusedError("[Errno 111] Connection refused")

    def create_namespaced_pod(self, namespace: str, body: dict) -> dict:
        self._check()
        self.calls.append(("create", namespace, body["metadata"]["name"]))
        if self.refuse_after is not None and len(self.pods) >= self.refuse_after:
            raise ApiException(status=403, reason="Forbidden",
                               http_resp=None) from None
        pod = as_v1pod(body)
        pod["status"] = {"phase": "Pending"}
        pod["metadata"]["creationTimestamp"] = datetime.now(UTC).isoformat()
        self.pods[(namespace, body["metadata"]["name"])] = pod
        return pod

    def read_namespaced_pod(self, name: str, namespace: str) -> dict:
        self._check()
        if (namespace, name) not in self.pods:
            raise ApiException(status=404, reason="Not Found")
        return _Model(self.pods[(namespace, name)])

    def list_namespaced_pod(self, namespace: str, label_selector: str) -> dict:
        self._check()
        return {"items": [_Model(pod) for (space, _), pod in sorted(self.pods.items())
                          if space == namespace and label_selector in pod["metadata"]["labels"]]}

    def delete_namespaced_pod(self, name: str, namespace: str, grace_period_seconds: int) -> None:
        self._check()
        self.calls.append(("delete", namespace, name, grace_period_seconds))
        self.pods.pop((namespace, name), None)

    # what the cluster does, for the test
    def set_status(self, name: str, **status: object) -> None:
        self.pods[("training", name)]["status"].update(status)


class _Model:
    """A pod as the client returns it (attributes, snake_case), from the server's JSON."""

    def __init__(self, pod: dict) -> None:
        self._pod = ApiClient().deserialize(json.dumps(pod), "V1Pod", "application/json")

    def __getattr__(self, name: str) -> object:
        return getattr(self._pod, name)


def provider(api: CoreV1ApiDouble, **changes) -> KubernetesProvider:
    return KubernetesProvider(api, changes.pop("settings", SETTINGS), "blobs-7", STORE,
                              "blobs-classifier", **changes)


# -- the pod -------------------------------------------------------------------------------------
@pytest.mark.parametrize("market", ["spot", "on_demand"])
def test_the_pod_is_a_valid_v1pod_that_runs_the_agent_where_the_allocation_says(market):
    manifest = pod_manifest(SETTINGS, name=pod_name("blobs-7", 1), run_id="blobs-7",
                            store_root=STORE, job="blobs-classifier", zone="us-east-1a",
                            instance_type="p3.8xlarge", market=market, gpus=4)
    assert as_v1pod(manifest) == manifest  # every key is one the API knows, every type right
    spec = manifest["spec"]
    assert spec["nodeSelector"] == {ZONE_LABEL: "us-east-1a", INSTANCE_TYPE_LABEL: "p3.8xlarge",
                                    "karpenter.sh/capacity-type": (
                                        "spot" if market == "spot" else "on-demand")}
    assert ("tolerations" in spec) == (market == "spot")
    assert spec["terminationGracePeriodSeconds"] == 120 and spec["restartPolicy"] == "Never"
    [container] = spec["containers"]
    assert container["command"] == [
        "python", "-m", "trainwise.agent", "--store", STORE, "--run-id", "blobs-7",
        "--run-dir", "/var/lib/trainwise/agent_runs/blobs-7", "--job", "blobs-classifier"]
    env = {e["name"]: e for e in container["env"]}
    assert env["TRAINWISE_AGENT_METADATA"]["value"] == "none"  # SIGTERM + grace is the notice
    assert env["TRAINWISE_AGENT_NODE_ADDR"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["TRAINWISE_AGENT_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert container["resources"] == {"limits": {"nvidia.com/gpu": "4"}}


def test_gke_names_its_spot_label_and_values():
    gke = PodSettings(image="img", capacity_label="cloud.google.com/gke-spot",
                      spot_value="true", on_demand_value="false")
    manifest = pod_manifest(gke, name="tw-a-0001", run_id="a", store_root="/mnt/store",
                            job=None, zone="us-central1-a", instance_type="p3.2xlarge",
                            market="spot")
    assert manifest["spec"]["nodeSelector"]["cloud.google.com/gke-spot"] == "true"
    assert manifest["spec"]["tolerations"][0]["key"] == "cloud.google.com/gke-spot"
    assert as_v1pod(manifest) == manifest


def test_bad_settings_and_runs_are_refused_before_any_pod(monkeypatch):
    api = CoreV1ApiDouble()
    with pytest.raises(ValueError, match="TRAINWISE_K8S_IMAGE is empty"):
        provider(api, settings=PodSettings(image=""))
    with pytest.raises(ValueError, match="TRAINWISE_K8S_NAMESPACE='Team A'"):
        provider(api, settings=PodSettings(image="img", namespace="Team A"))
    with pytest.raises(ValueError, match="not an absolute folder path"):
        KubernetesProvider(api, SETTINGS, "blobs-7", "relative/store")
    with pytest.raises(ValueError, match="run id 'blobs 7'"):
        KubernetesProvider(api, SETTINGS, "blobs 7", STORE)
    monkeypatch.setenv("TRAINWISE_PROVIDER", "kubernetes")
    monkeypatch.setenv("TRAINWISE_K8S_IMAGE", "")
    with pytest.raises(ValueError, match="TRAINWISE_K8S_IMAGE"):
        KubernetesProvider.preflight()
    # The built-in train job asks for nodes with no run to start on them: told what to use.
    with pytest.raises(ValueError, match="built-in train job trains in the Dagster process"):
        gang.provider_for_run("p3.2xlarge", "us-east-1")
    assert api.calls == []


# -- the pods' lives -----------------------------------------------------------------------------
def test_a_spot_pod_runs_gets_its_disruption_notice_and_is_reclaimed():
    api = CoreV1ApiDouble()
    cloud = provider(api)
    first, second = cloud.launch("us-east-1a", "p3.2xlarge", "spot", 2)
    assert [c[:2] for c in api.calls] == [("create", "training")] * 2
    assert cloud.describe(first).state == NodeState.PENDING
    api.set_status(first.node_id, phase="Running", podIP="10.0.3.7")
    api.set_status(second.node_id, phase="Running", podIP="10.0.3.8")
    assert cloud.node_address(first) == "10.0.3.7"  # the gang's rendezvous host
    assert {e.state for e in cloud.poll_events()} == {NodeState.RUNNING}
    # The provisioner drains the spot node: Kubernetes marks the pod before it SIGTERMs it.
    api.set_status(first.node_id, conditions=[{
        "type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet",
        "message": "Pod was terminated in response to imminent node shutdown."}])
    [notice] = cloud.poll_events()
    assert notice.state == NodeState.NOTICE and notice.node_id == first.node_id
    assert notice.detail.startswith("TerminationByKubelet: Pod was terminated")
    api.set_status(first.node_id, phase="Failed")  # the agent exited 143 within the grace
    [reclaimed] = cloud.poll_events()
    assert reclaimed.state == NodeState.RECLAIMED
    status = cloud.describe(first)
    assert status.notice_at_s is not None and status.ended_at_s >= status.notice_at_s
    # Ours to end: deleted with the grace period, so its agent checkpoints in it.
    cloud.terminate(second, "released")
    assert api.calls[-1] == ("delete", "training", second.node_id, 120)
    assert cloud.describe(second).state == NodeState.TERMINATED
    cloud.terminate(second)  # idempotent
    assert sum(c[0] == "delete" for c in api.calls) == 1
    assert cloud.bill_usd() > 0 and not any(n.market != "spot" for n in cloud.nodes())


def test_a_pod_gone_without_our_asking_is_reclaimed():
    api = CoreV1ApiDouble()
    cloud = provider(api)
    [node] = cloud.launch("us-east-1a", "p3.2xlarge", "on_demand")
    api.pods.clear()  # its node was removed, and the pod with it
    [event] = cloud.poll_events()
    assert event.state == NodeState.RECLAIMED and "gone" in event.detail


def test_a_refused_launch_leaves_no_pod_and_an_unreachable_server_is_named():
    api = CoreV1ApiDouble(refuse_after=1)  # a quota: the second pod is refused
    cloud = provider(api)
    with pytest.raises(LaunchFailedError, match="refused the pod \\(403"):
        cloud.launch("us-east-1a", "p3.2xlarge", "spot", 2)
    assert api.pods == {} and cloud.nodes() == []  # all or none: the first one deleted
    down = provider(CoreV1ApiDouble(unreachable=True))
    with pytest.raises(ProviderUnreachableError, match="kube config"):
        down.launch("us-east-1a", "p3.2xlarge", "spot")


def test_it_is_a_registered_provider_whose_nodes_run_the_agent(monkeypatch):
    assert "kubernetes" in provider_names()
    monkeypatch.setenv("TRAINWISE_PROVIDER", "kubernetes")
    monkeypatch.setenv("TRAINWISE_K8S_IMAGE", "registry.example/trainwise:1.0")
    from trainwise.agent_launch import runs_on_nodes

    assert runs_on_nodes()  # a registered job's asset takes the node-agent launcher
    api = CoreV1ApiDouble()
    built = gang.provider_for_run("p3.2xlarge", "us-east-1", run_id="blobs-7", store_root=STORE,
                                  job="blobs-classifier", api=api)
    assert isinstance(built, KubernetesProvider) and built.settings.namespace == "default"


# -- nothing billed runs idle: pods a dead run left -----------------------------------------------
def _run_folder(state, run_id: str, pods: list[str], *, age_s: float) -> None:
    run_dir = state / "runs" / run_id
    run_dir.mkdir(parents=True)
    record = run_dir / gang.GANG_FILE
    record.write_text(json.dumps({"provider": "kubernetes",
                                  "launched": [{"node_id": p} for p in pods]}))
    os.utime(record, (time.time() - age_s, time.time() - age_s))


def test_the_pods_of_a_dead_run_are_found_and_deleted_and_a_live_runs_kept(tmp_path):
    api = CoreV1ApiDouble()
    [dead] = KubernetesProvider(api, SETTINGS, "run-dead", STORE).launch(
        "us-east-1a", "p3.2xlarge", "spot")
    [live] = KubernetesProvider(api, SETTINGS, "run-live", STORE).launch(
        "us-east-1a", "p3.2xlarge", "spot")
    [foreign] = KubernetesProvider(api, SETTINGS, "someone-else", STORE).launch(
        "us-east-1b", "p3.2xlarge", "on_demand")
    _run_folder(tmp_path, "run-dead", [dead.node_id], age_s=3 * 3600)
    _run_folder(tmp_path, "run-live", [live.node_id], age_s=10)
    sweep = PodSweep(api, "training")
    listed = {i.instance_id: i for i in sweep.tagged_instances()}
    assert set(listed) == {dead.node_id, live.node_id, foreign.node_id}
    assert (listed[foreign.node_id].zone, listed[foreign.node_id].run_id) == (
        "us-east-1b", "someone-else")
    orphans = orphan_nodes.find_orphans(sweep, tmp_path)
    assert {o.instance_id for o in orphans} == {dead.node_id, foreign.node_id}
    done, left = orphan_nodes.terminate_orphans(sweep, orphans)
    assert [o.instance_id for o in done] == [dead.node_id] and "its run is dead" in done[0].why
    assert [o.instance_id for o in left] == [foreign.node_id]  # unknown: listed, left alone
    assert ("delete", "training", dead.node_id, 120) in api.calls
    assert {name for _, name in api.pods} == {live.node_id, foreign.node_id}


def test_the_orphan_sensor_looks_at_pods_and_says_when_it_cannot(monkeypatch, tmp_path):
    import dagster as dg

    from pipelines.definitions import defs
    from sensors.orphan_nodes import orphan_nodes_sensor

    monkeypatch.setenv("TRAINWISE_PROVIDER", "kubernetes")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-config"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    context = dg.build_sensor_context(instance=dg.DagsterInstance.ephemeral(), definitions=defs)
    skipped = orphan_nodes_sensor.evaluate_tick(context).skip_message
    assert skipped.startswith("kubernetes could not be read: provider 'kubernetes'"), skipped
    assert "kube config" in skipped
