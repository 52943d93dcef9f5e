"""An EC2 boot double: runs the user-data of what moto_server launches, as cloud-init would.

moto keeps an instance's user-data but boots nothing. `Ec2BootDouble` watches moto's
instances (tag `trainwise:node`) and, for each one that runs and carries a user-data script,
runs that script with bash on this machine, its node paths (`/var/lib/trainwise`,
`/var/log/trainwise`, `/etc/trainwise/agent.env`) moved under `root/<instance id>/` and
`python3` made this interpreter. Each instance gets its own IMDSv2 double
(`benchmarks.imds_double`), named in its env file as an AMI would configure the agent.

What EC2 does to a node, the double does to the processes it started:
- an instance that leaves `running` (terminated by anyone) gets SIGTERM, as an instance's
  shutdown sends it, and SIGKILL `grace_s` later with everything it started;
- `reclaim(instance_id, notice_s)`: the instance's metadata serves a spot instance-action
  `notice_s` ahead, and after `notice_s` the double terminates the instance in EC2 (the spot
  market taking it back: not the launcher's call).

With `cluster` (a `benchmarks.netns_cluster.Cluster`), each instance boots in a host of its
own: a network namespace at the instance's private IPv4 (so a gang's rendezvous at the first
node's address is reached over the bridge), its metadata double served on the cluster's
gateway, `meta-data/local-ipv4` answering the instance's address. Without it every node shares
this machine's network. Either way the nodes share its disk, standing for the store folder
every node mounts.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import netns_cluster as netns
from benchmarks.imds_double import ImdsDouble

NODE_HOME, LOG_DIR, ENV_FILE = "/var/lib/trainwise", "/var/log/trainwise", "/etc/trainwise/agent.env"


@dataclass
class BootedNode:
    instance_id: str
    folder: Path
    imds: ImdsDouble
    process: subprocess.Popen
    ended_at: float | None = None
    children: list[int] = field(default_factory=list)
    host: Any = None  # its netns host, with a cluster

    @property
    def log(self) -> str:
        found = sorted((self.folder / "log").glob("agent-*.log"))
        return found[0].read_text(errors="replace") if found else ""


class Ec2BootDouble:
    def __init__(self, endpoint_url: str, region: str, root: Path, *,
                 run_id: str | None = None, env: dict[str, str] | None = None,
                 agent_env: dict[str, str] | None = None, poll_s: float = 0.2,
                 grace_s: float = 30.0, cluster: Any = None, gateway: str = "",
                 prefix: int = 24, broken_boots: tuple[int, ...] = ()) -> None:
        import boto3

        self.client = boto3.client("ec2", endpoint_url=endpoint_url, region_name=region)
        self.root = Path(root)
        self.run_id = run_id  # only this run's nodes (tag trainwise:run), when given
        self.env = dict(os.environ if env is None else env)
        self.agent_env = dict(agent_env or {})
        self.poll_s, self.grace_s = poll_s, grace_s
        self.cluster, self.prefix = cluster, prefix
        # The boots (0 = the first instance booted) whose user-data fails at once, as on an
        # AMI without the agent: the instance runs, billed, and nothing reports.
        self.broken_boots = set(broken_boots)
        self.gateway = cluster.gateway(gateway or None, prefix) if cluster is not None else ""
        self.booted: dict[str, BootedNode] = {}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="ec2-boot-double")
        self._timers: list[threading.Timer] = []

    def __enter__(self) -> Ec2BootDouble:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- what a test asks ---------------------------------------------------------------------
    def wait_booted(self, count: int, timeout_s: float = 60.0) -> list[BootedNode]:
        deadline = time.monotonic() + timeout_s
        while len(self.booted) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.booted)} of {count} instances booted: "
                                   f"{self.errors}")
            time.sleep(0.05)
        with self._lock:
            return list(self.booted.values())

    def reclaim(self, instance_id: str, notice_s: float = 30.0) -> None:
        """A spot interruption: the notice through the node's metadata, the end `notice_s`
        later through EC2."""
        node = self.booted[instance_id]
        node.imds.inject_spot("terminate", in_s=notice_s)
        timer = threading.Timer(notice_s, self._terminate_in_ec2, args=(instance_id,))
        timer.daemon = True
        timer.start()
        self._timers.append(timer)

    def close(self) -> None:
        self._stop.set()
        for timer in self._timers:
            timer.cancel()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        for node in list(self.booted.values()):
            self._kill(node)
            node.imds.close()

    # -- the loop -------------------------------------------------------------------------------
    def _terminate_in_ec2(self, instance_id: str) -> None:
        with contextlib.suppress(Exception):
            self.client.terminate_instances(InstanceIds=[instance_id])

    def _instances(self) -> dict[str, tuple[str, str]]:
        filters = [{"Name": "tag-key", "Values": ["trainwise:node"]}]
        if self.run_id is not None:
            filters.append({"Name": "tag:trainwise:run", "Values": [self.run_id]})
        answer = self.client.describe_instances(Filters=filters)
        return {i["InstanceId"]: (i["State"]["Name"], i.get("PrivateIpAddress", ""))
                for r in answer["Reservations"] for i in r["Instances"]}

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                states = self._instances()
                for instance_id, (state, address) in states.items():
                    node = self.booted.get(instance_id)
                    if node is None and state == "running":
                        self._boot(instance_id, address)
                    elif node is not None and state != "running" and node.ended_at is None:
                        self._shutdown(node)
                for node in list(self.booted.values()):
                    if (node.ended_at is not None and node.process.poll() is None
                            and time.monotonic() > node.ended_at + self.grace_s):
                        self._kill(node)
            except Exception as error:  # noqa: BLE001 - reported to the test, never hidden
                self.errors.append(f"{type(error).__name__}: {error}")
            self._stop.wait(self.poll_s)

    def _user_data(self, instance_id: str) -> str:
        answer = self.client.describe_instance_attribute(InstanceId=instance_id,
                                                         Attribute="userData")
        value = answer.get("UserData", {}).get("Value")
        return base64.b64decode(value).decode() if value else ""

    def _boot(self, instance_id: str, address: str) -> None:
        script = self._user_data(instance_id)
        folder = self.root / instance_id
        folder.mkdir(parents=True, exist_ok=True)
        host = self.cluster.add_host(address, self.prefix) if self.cluster is not None else None
        imds = ImdsDouble(self.gateway or "127.0.0.1")
        imds.local_ipv4 = address or None
        imds.instance_id = instance_id
        imds.__enter__()
        if len(self.booted) in self.broken_boots:
            script = "#!/bin/bash\necho 'python3: No module named trainwise.agent' >&2\nexit 1\n"
        if not script:  # a bare node: nothing to run
            self.booted[instance_id] = BootedNode(instance_id, folder, imds, subprocess.Popen(
                ["true"]), host=host)
            return
        env_file = folder / "agent.env"
        env_file.write_text("".join(f"{k}={shlex.quote(v)}\n" for k, v in {
            "TRAINWISE_AGENT_METADATA_URL": imds.url, **self.agent_env}.items()))
        moved = (script.replace(NODE_HOME, str(folder / "home"))
                 .replace(LOG_DIR, str(folder / "log")).replace(ENV_FILE, str(env_file))
                 .replace("exec python3 ", f"exec {shlex.quote(sys.executable)} "))
        (folder / "user-data.sh").write_text(moved)
        with open(folder / "cloud-init.log", "wb") as output:
            command = ["bash", str(folder / "user-data.sh")]
            process = subprocess.Popen(host.argv(command) if host is not None else command,
                                       env=self.env,
                                       cwd=folder, stdout=output, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        with self._lock:
            self.booted[instance_id] = BootedNode(instance_id, folder, imds, process, host=host)

    def _descendants(self, pid: int) -> list[int]:
        import psutil

        try:
            return [child.pid for child in psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            return []

    def _shutdown(self, node: BootedNode) -> None:
        node.ended_at = time.monotonic()
        node.children = self._descendants(node.process.pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.process.pid, signal.SIGTERM)

    def _kill(self, node: BootedNode) -> None:
        in_host = netns.pids(node.host) if node.host is not None else []
        for pid in [node.process.pid, *node.children, *self._descendants(node.process.pid),
                    *in_host]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.process.wait(timeout=10)


__all__ = ["BootedNode", "Ec2BootDouble"]
