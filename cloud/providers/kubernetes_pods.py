"""The `kubernetes` provider: a run's nodes are pods, scheduled by a cluster that already exists.

Kubernetes (the official `kubernetes` Python client) does the provisioning: each node trainwise
asks for is one pod that runs the node agent (`python -m trainwise.agent`) in the image
TRAINWISE_K8S_IMAGE (`deploy/Dockerfile` builds one with trainwise installed), in the namespace
TRAINWISE_K8S_NAMESPACE. The cluster's node provisioner (Karpenter, GKE's or AKS's autoscaler)
turns the pod's node selector into a machine:

- zone: `topology.kubernetes.io/zone`; instance type: `node.kubernetes.io/instance-type`;
- market: the capacity label TRAINWISE_K8S_CAPACITY_LABEL (default Karpenter's
  `karpenter.sh/capacity-type`, `spot` or `on-demand`; on GKE `cloud.google.com/gke-spot` with
  `true`/`false` through TRAINWISE_K8S_SPOT_VALUES), and for spot a toleration of the same key,
  since providers taint spot nodes;
- the notice: the pod's SIGTERM and its grace period (TRAINWISE_K8S_GRACE_S,
  `terminationGracePeriodSeconds`). A spot node's reclaim drains it; the kubelet SIGTERMs the
  pod, whose agent (watching SIGTERM only: TRAINWISE_AGENT_METADATA=none) has the job checkpoint
  to the store within the grace and exit 143. The provider reads the reclaim from the pod:
  a `DisruptionTarget` condition (Kubernetes 1.26+: preemption, taint manager, eviction,
  node shutdown) or a deletion it did not ask for is a NOTICE, the pod gone or failed after one
  is RECLAIMED.
- a gang's rendezvous: the first pod's IP (`node_address`); every pod gets its own IP as
  TRAINWISE_AGENT_NODE_ADDR and its name as TRAINWISE_AGENT_NODE_ID through the downward API.

The store must be one every pod reaches: `s3://bucket/prefix` (the pod's service account
credentials, IRSA or workload identity) or a volume mounted at the same path.

Time is Unix seconds; the bill is the billing rule of every provider (`cloud/providers/base.py`:
node-seconds from the pod's creation to its end at the zone's list price), since a cluster does
not bill per pod. What was run: the pod manifests go through the client's own models
(deserialised into `V1Pod` and serialised back, unchanged) and the provider's calls through a
`CoreV1Api` double in `tests/test_provider_kubernetes.py`. What was not run: a cluster (no API
server can run on the development machine), so scheduling, the provisioner's labels and a real
drain are untested here.
"""

from __future__ import annotations

import re
import shlex
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from cloud import prices
from cloud.providers.aws_user_data import NAME_PATTERN, check_store_root
from cloud.providers.base import (
    ON_DEMAND,
    SPOT,
    ComputeProvider,
    LaunchFailedError,
    NodeEvent,
    NodeHandle,
    NodeState,
    NodeStatus,
    ProviderUnreachableError,
    SpotPricePoint,
    check_count,
    check_market,
)
from cloud.providers.registry import register_provider

NAME = "kubernetes"
ZONE_LABEL = "topology.kubernetes.io/zone"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
RUN_LABEL = "trainwise/run"
NODE_HOME = "/var/lib/trainwise"
# A pod name is a DNS label: lower case, digits, '-', at most 63 characters.
_POD_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
# Reasons Kubernetes gives a DisruptionTarget condition (the pod is about to be ended).
DISRUPTION = "DisruptionTarget"


@dataclass(frozen=True)
class PodSettings:
    """What a pod needs beyond the run: read from the TRAINWISE_K8S_* settings."""

    image: str
    namespace: str = "default"
    capacity_label: str = "karpenter.sh/capacity-type"
    spot_value: str = "spot"
    on_demand_value: str = "on-demand"
    grace_s: int = 120
    agent_command: str = "python -m trainwise.agent"

    @classmethod
    def from_settings(cls) -> PodSettings:
        from trainwise import settings

        spot, _, on_demand = settings.get("TRAINWISE_K8S_SPOT_VALUES").partition(",")
        return cls(image=settings.get("TRAINWISE_K8S_IMAGE").strip(),
                   namespace=settings.get("TRAINWISE_K8S_NAMESPACE").strip() or "default",
                   capacity_label=settings.get("TRAINWISE_K8S_CAPACITY_LABEL").strip(),
                   spot_value=spot.strip(), on_demand_value=on_demand.strip(),
                   grace_s=int(settings.get_float("TRAINWISE_K8S_GRACE_S", 1, 3600)),
                   agent_command=settings.get("TRAINWISE_K8S_AGENT_COMMAND").strip())

    def problems(self) -> list[str]:
        found = []
        if not self.image:
            found.append("TRAINWISE_K8S_IMAGE is empty: give the image the pods run, with "
                         "trainwise installed (docker build -f deploy/Dockerfile)")
        if not _POD_NAME.fullmatch(self.namespace):
            found.append(f"TRAINWISE_K8S_NAMESPACE={self.namespace!r} is not a namespace name "
                         "(lower-case letters, digits and '-')")
        if not self.capacity_label or not self.spot_value or not self.on_demand_value:
            found.append("TRAINWISE_K8S_CAPACITY_LABEL and TRAINWISE_K8S_SPOT_VALUES "
                         "(SPOT,ON_DEMAND) name the node label that holds the market, e.g. "
                         "karpenter.sh/capacity-type with spot,on-demand")
        if not self.agent_command or not shlex.split(self.agent_command):
            found.append("TRAINWISE_K8S_AGENT_COMMAND names no command; give the command that "
                         "starts the node agent in the image (python -m trainwise.agent)")
        return found


def label_value(text: str) -> str:
    """`text` as a label value: at most 63 characters, starting and ending alphanumeric."""
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", text[:63]) or "run"


def pod_name(run_id: str, serial: int) -> str:
    """The pod of the run's `serial`-th node: a DNS label made from the run id."""
    base = re.sub(r"[^a-z0-9-]+", "-", run_id.lower()).strip("-")[:48] or "run"
    return f"tw-{base}-{serial:04d}"


def pod_manifest(settings: PodSettings, *, name: str, run_id: str, store_root: str,
                 job: str | None, zone: str, instance_type: str, market: str,
                 gpus: int = 0) -> dict[str, Any]:
    """The pod (Kubernetes JSON) of one node: the node agent for the run, placed by the node
    selector on a node of `instance_type` in `zone` and `market` (module docstring)."""
    check_market(market)
    spot = market == SPOT
    argv = [*shlex.split(settings.agent_command), "--store", check_store_root(store_root),
            "--run-id", run_id, "--run-dir", f"{NODE_HOME}/agent_runs/{run_id}"]
    if job is not None:
        argv += ["--job", job]
    container: dict[str, Any] = {
        "name": "agent", "image": settings.image, "command": argv,
        "env": [{"name": "TRAINWISE_HOME", "value": NODE_HOME},
                {"name": "TRAINWISE_AGENT_METADATA", "value": "none"},
                {"name": "TRAINWISE_AGENT_NODE_ADDR",
                 "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "TRAINWISE_AGENT_NODE_ID",
                 "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
    }
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": settings.grace_s,
        "nodeSelector": {ZONE_LABEL: zone, INSTANCE_TYPE_LABEL: instance_type,
                         settings.capacity_label: (settings.spot_value if spot
                                                   else settings.on_demand_value)},
        "containers": [container],
    }
    if spot:
        spec["tolerations"] = [{"key": settings.capacity_label, "operator": "Exists",
                                "effect": "NoSchedule"}]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {RUN_LABEL: label_value(run_id),
                                                  "trainwise/market": market}},
            "spec": spec}


@dataclass
class _Pod:
    handle: NodeHandle
    launched_at_s: float
    state: NodeState = NodeState.PENDING
    notice_at_s: float | None = None
    ended_at_s: float | None = None
    reason: str = ""
    ours: bool = False  # we asked for its end
    address: str | None = None


def _get(obj: Any, *names: str) -> Any:
    """`obj.a.b` of a client model, or the same keys of a dict; None where one is missing."""
    for name in names:
        if obj is None:
            return None
        obj = obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)
    return obj


@register_provider(NAME)
@dataclass
class KubernetesProvider(ComputeProvider):
    """A run's nodes as pods of the node agent (module docstring). `api`: a `CoreV1Api`."""

    api: Any
    settings: PodSettings
    run_id: str
    store_root: str
    job: str | None = None
    zones: tuple[str, ...] = ()
    name: str = NAME
    boots_node_agent: ClassVar[bool] = True
    setting_names: ClassVar[tuple[str, ...]] = (
        "TRAINWISE_K8S_IMAGE", "TRAINWISE_K8S_NAMESPACE", "TRAINWISE_K8S_CAPACITY_LABEL",
        "TRAINWISE_K8S_SPOT_VALUES", "TRAINWISE_K8S_GRACE_S", "TRAINWISE_K8S_AGENT_COMMAND")
    _pods: list[_Pod] = field(default_factory=list)
    _events: list[NodeEvent] = field(default_factory=list)
    _serial: int = 0

    def __post_init__(self) -> None:
        if not NAME_PATTERN.fullmatch(self.run_id):
            raise ValueError(f"run id {self.run_id!r} is not a name the node agent accepts "
                             f"({NAME_PATTERN.pattern})")
        if self.job is not None and not NAME_PATTERN.fullmatch(self.job):
            raise ValueError(f"job {self.job!r} is not a name the node agent accepts")
        check_store_root(self.store_root)
        problems = self.settings.problems()
        if problems:
            raise ValueError("the kubernetes provider cannot start pods (nothing was launched):"
                             "\n- " + "\n- ".join(problems))

    # -- the class ------------------------------------------------------------------------------
    @classmethod
    def for_run(cls, instance_type: str, region: str, *, run_id: str | None = None,
                store_root: str | None = None, job: str | None = None, api: Any = None,
                **options: Any) -> KubernetesProvider:
        """The pods of one run: the agent for `run_id` reading `store_root`, in the namespace of
        the settings, through the kube config (`~/.kube/config`, or the in-cluster service
        account when the code location runs in the cluster) unless `api` is given."""
        if run_id is None or store_root is None:
            raise ValueError("the kubernetes provider's pods run the node agent, which runs a "
                             "registered job (the user_job_run asset: docs/agent.md); the "
                             "built-in train job trains in the Dagster process, so it has no "
                             "pods to start: run it with TRAINWISE_PROVIDER=emulated")
        if api is None:
            api = _core_api()
        return cls(api, PodSettings.from_settings(), run_id, store_root, job, **options)

    @classmethod
    def preflight(cls) -> None:
        problems = PodSettings.from_settings().problems()
        try:
            import kubernetes  # noqa: F401
        except ImportError as error:
            problems.append(f"TRAINWISE_PROVIDER='kubernetes' needs the kubernetes client "
                            f"({error}); install it or choose another provider")
        if problems:
            raise ValueError("settings to fix (nothing was launched):\n- "
                             + "\n- ".join(problems))

    # -- the node calls -------------------------------------------------------------------------
    def now_s(self) -> float:
        return time.time()

    def launch(self, zone: str, instance_type: str, market: str, count: int = 1
               ) -> list[NodeHandle]:
        check_market(market)
        check_count(count)
        price = self.price_usd_per_hour(instance_type, zone, market)
        known = prices.INSTANCE_TYPES.get(instance_type)
        gpus = known.gpus if known is not None else 0
        made: list[_Pod] = []
        try:
            for _ in range(count):
                self._serial += 1
                name = pod_name(self.run_id, self._serial)
                body = pod_manifest(self.settings, name=name, run_id=self.run_id,
                                    store_root=self.store_root, job=self.job, zone=zone,
                                    instance_type=instance_type, market=market, gpus=gpus)
                self._call("create_namespaced_pod", self.settings.namespace, body)
                made.append(_Pod(NodeHandle(name, self.name, zone, instance_type, market,
                                            price), self.now_s()))
        except Exception:  # all or none: whatever refused the launch, no pod is left behind
            self._delete_all(made)
            raise
        self._pods += made
        return [p.handle for p in made]

    def terminate(self, node: NodeHandle, reason: str = "released") -> None:
        pod = self._pod(node)
        if not pod.state.alive:
            return
        pod.ours = True
        self._delete(pod.handle.node_id)
        self._end(pod, NodeState.TERMINATED, reason)

    def describe(self, node: NodeHandle) -> NodeStatus:
        pod = self._pod(node)
        self._refresh(pod)
        return NodeStatus(pod.handle, pod.state, pod.launched_at_s, pod.notice_at_s,
                          pod.ended_at_s, pod.reason)

    def spot_price_history(self, zone: str, instance_type: str, start_s: float, end_s: float
                           ) -> list[SpotPricePoint]:
        """A cluster has no spot market of its own: the billing rule's spot price, once."""
        return [SpotPricePoint(zone, instance_type, start_s,
                               self.price_usd_per_hour(instance_type, zone, SPOT))]

    def poll_events(self) -> list[NodeEvent]:
        for pod in self._pods:
            self._refresh(pod)
        events, self._events = self._events, []
        return sorted(events, key=lambda e: (e.at_s, e.state != NodeState.NOTICE))

    def nodes(self) -> list[NodeHandle]:
        return [p.handle for p in self._pods]

    def node_address(self, node: NodeHandle) -> str | None:
        pod = self._pod(node)
        self._refresh(pod)
        return pod.address

    # -- reading a pod --------------------------------------------------------------------------
    def _refresh(self, pod: _Pod) -> None:
        if not pod.state.alive:
            return
        found = self._call("read_namespaced_pod", pod.handle.node_id, self.settings.namespace,
                           missing_ok=True)
        now = self.now_s()
        if found is None:  # gone without our asking: the node went with it
            self._end(pod, NodeState.RECLAIMED, "the pod is gone (its node was removed)")
            return
        pod.address = _get(found, "status", "pod_ip") or pod.address
        phase = _get(found, "status", "phase") or "Pending"
        disruption = next((c for c in (_get(found, "status", "conditions") or [])
                           if _get(c, "type") == DISRUPTION
                           and str(_get(c, "status")) == "True"), None)
        deleting = _get(found, "metadata", "deletion_timestamp") is not None
        if (disruption is not None or deleting) and pod.state != NodeState.NOTICE:
            why = (f"{_get(disruption, 'reason')}: {_get(disruption, 'message') or ''}".strip(": ")
                   if disruption is not None else "the pod is being deleted")
            pod.state, pod.notice_at_s, pod.reason = NodeState.NOTICE, now, why
            self._events.append(NodeEvent(pod.handle.node_id, NodeState.NOTICE, now, why))
        if phase in ("Succeeded", "Failed"):
            ended = NodeState.RECLAIMED if pod.state == NodeState.NOTICE else NodeState.TERMINATED
            self._end(pod, ended, f"the pod {phase.lower()}"
                      + (f" after its notice ({pod.reason})" if ended == NodeState.RECLAIMED
                         else ""))
        elif phase == "Running" and pod.state == NodeState.PENDING:
            pod.state = NodeState.RUNNING
            self._events.append(NodeEvent(pod.handle.node_id, NodeState.RUNNING, now))

    def _end(self, pod: _Pod, state: NodeState, reason: str) -> None:
        if not pod.state.alive:
            return
        pod.state, pod.ended_at_s, pod.reason = state, self.now_s(), reason
        self._events.append(NodeEvent(pod.handle.node_id, state, pod.ended_at_s, reason))

    def _pod(self, node: NodeHandle) -> _Pod:
        for pod in self._pods:
            if pod.handle.node_id == node.node_id:
                return pod
        raise KeyError(f"node {node.node_id!r} was not launched by this provider")

    def _delete(self, name: str) -> None:
        self._call("delete_namespaced_pod", name, self.settings.namespace,
                   grace_period_seconds=self.settings.grace_s, missing_ok=True)

    def _delete_all(self, pods: list[_Pod]) -> None:
        for pod in pods:
            try:
                self._delete(pod.handle.node_id)
            except Exception:  # noqa: BLE001 - the launch's own error is what is raised
                continue

    def _call(self, method: str, *args: Any, missing_ok: bool = False, **kwargs: Any) -> Any:
        """One API call; a 404 is None when `missing_ok`; a refusal (4xx) is LaunchFailedError
        for a create, an unreachable API server ProviderUnreachableError."""
        try:
            return getattr(self.api, method)(*args, **kwargs)
        except Exception as error:
            status = getattr(error, "status", None)
            if status == 404 and missing_ok:
                return None
            if isinstance(status, int) and 400 <= status < 500 and method.startswith("create"):
                body = args[-1] if args else {}
                raise LaunchFailedError(
                    self.name, _get(body, "spec", "nodeSelector", ZONE_LABEL) or "?",
                    _get(body, "spec", "nodeSelector", INSTANCE_TYPE_LABEL) or "?",
                    _get(body, "metadata", "labels", "trainwise/market") or "?", 1,
                    f"the API server refused the pod ({status}: "
                    f"{getattr(error, 'reason', '')}) {str(getattr(error, 'body', ''))[:300]}"
                ) from error
            if status is None:
                raise ProviderUnreachableError(
                    self.name, "the kube config's API server", error,
                    "check ~/.kube/config (or the in-cluster service account) and that the API "
                    "server answers") from error
            raise


@dataclass
class PodSweep:
    """The run pods of the namespace, whoever started them (a code location that died
    included), for the orphan-node clean-up (`trainwise.orphan_nodes`): the same two calls as
    `AwsProvider.tagged_instances` and `terminate_instances`."""

    api: Any
    namespace: str = "default"
    grace_s: int = 120
    name: str = NAME

    @classmethod
    def from_settings(cls, api: Any = None) -> PodSweep:
        settings = PodSettings.from_settings()
        return cls(api if api is not None else _core_api(), settings.namespace,
                   settings.grace_s)

    def tagged_instances(self) -> list[Any]:
        """Every pending or running pod of the namespace labelled `trainwise/run`."""
        from cloud.providers.aws import TaggedInstance

        found = []
        listed = self.api.list_namespaced_pod(self.namespace, label_selector=RUN_LABEL)
        for pod in _get(listed, "items") or []:
            phase = _get(pod, "status", "phase") or "Pending"
            if phase not in ("Pending", "Running"):
                continue
            selector = _get(pod, "spec", "node_selector") or {}
            created = _get(pod, "metadata", "creation_timestamp")
            found.append(TaggedInstance(
                str(_get(pod, "metadata", "name")), str(selector.get(ZONE_LABEL, "")),
                str(selector.get(INSTANCE_TYPE_LABEL, "")), phase.lower(),
                created.timestamp() if created is not None else time.time(),
                str((_get(pod, "metadata", "labels") or {}).get(RUN_LABEL, ""))))
        return sorted(found, key=lambda i: (i.launched_at_s, i.instance_id))

    def terminate_instances(self, instance_ids: list[str]) -> None:
        """Delete the pods by name, each with the grace period (its agent checkpoints)."""
        for name in instance_ids:
            try:
                self.api.delete_namespaced_pod(name, self.namespace,
                                               grace_period_seconds=self.grace_s)
            except Exception as error:
                if getattr(error, "status", None) != 404:  # gone already is what we want
                    raise


def _core_api() -> Any:
    """A CoreV1Api from the kube config, else the in-cluster service account."""
    from kubernetes import client, config

    try:
        config.load_kube_config()
    except Exception:  # noqa: BLE001 - no kube config: the in-cluster account is the other way
        try:
            config.load_incluster_config()
        except Exception as error:
            raise ProviderUnreachableError(
                NAME, "the kube config's API server", error,
                "give a kube config (KUBECONFIG or ~/.kube/config), or run the code location in "
                "the cluster") from error
    return client.CoreV1Api()


__all__ = ["KubernetesProvider", "PodSettings", "PodSweep", "pod_manifest", "pod_name",
           "ON_DEMAND"]
