"""A test cluster of hosts on this machine: Linux network namespaces joined by a bridge.

Each host is a network namespace with one veth interface `eth0` (its own address, 10.X.Y.N/24)
whose peer is a port of a bridge in the root namespace, and its own loopback. The hosts reach one
another only over that link, as separate machines on one subnet would; they share this machine's
file system (standing for a store every node mounts) and its hostname, which therefore does not
resolve to a host's address: a gang's rendezvous and gloo are told the addresses
(`TRAINWISE_AGENT_NODE_ADDR`, `GLOO_SOCKET_IFNAME=eth0`).

Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and `ip` (iproute2); `unavailable()` says why not, for a
skip. Names carry the process id, so two test workers build two clusters side by side, each on
its own subnet (the third octet from the name); the bridge gets an address only when a test
serves something to the hosts from here (`gateway`).
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from dataclasses import dataclass, field

_COUNTER = itertools.count()


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")


def pids(host: Host) -> list[int]:
    """The processes living in the host's network namespace (`ip netns pids`)."""
    done = subprocess.run(["ip", "netns", "pids", host.name], capture_output=True, text=True,
                          timeout=30)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def unavailable() -> str | None:
    """Why a cluster cannot be built here, or None when it can."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    probe = Cluster()
    try:
        probe.add_host()  # a namespace, a bridge, a veth pair, addresses: all a cluster needs
    except (RuntimeError, OSError, subprocess.SubprocessError) as error:
        return f"a network-namespace host cannot be made here ({error})"
    finally:
        probe.close()
    return None


@dataclass
class Host:
    name: str  # the network namespace
    addr: str

    def argv(self, command: list[str]) -> list[str]:
        """`command` run inside this host's network namespace."""
        return ["ip", "netns", "exec", self.name, *command]


@dataclass
class Cluster:
    tag: str = field(default_factory=lambda: f"{os.getpid() % 100000}{next(_COUNTER)}")
    hosts: list[Host] = field(default_factory=list)
    _links: list[str] = field(default_factory=list)
    _up: bool = False
    _gateway: str = ""  # the bridge's address, once set

    @property
    def bridge(self) -> str:
        return f"twb{self.tag}"[:15]

    def _ensure_bridge(self) -> None:
        if not self._up:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            self._up = True

    def add_host(self, addr: str | None = None, prefix: int = 24) -> Host:
        """A new host on the bridge, with the next address (or `addr`/`prefix`: a cloud's
        private address for the instance the host stands for)."""
        self._ensure_bridge()
        index = len(self.hosts) + 1
        host = Host(f"tw{self.tag}h{index}", addr or f"10.77.{int(self.tag) % 250}.{index}")
        link = f"twv{self.tag}{index}"[:15]
        _ip("netns", "add", host.name)
        self.hosts.append(host)
        _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", host.name)
        self._links.append(link)
        _ip("link", "set", link, "master", self.bridge, "up")
        _ip("-n", host.name, "addr", "add", f"{host.addr}/{prefix}", "dev", "eth0")
        _ip("-n", host.name, "link", "set", "eth0", "up")
        _ip("-n", host.name, "link", "set", "lo", "up")
        return host

    def gateway(self, address: str | None = None, prefix: int = 24) -> str:
        """An address of this machine's root namespace on the bridge (10.X.Y.254, or
        `address`/`prefix` on the hosts' subnet), where the hosts reach services the test runs
        here (a metadata double); set once."""
        self._ensure_bridge()
        address = address or f"10.77.{int(self.tag) % 250}.254"
        if not self._gateway:
            _ip("addr", "add", f"{address}/{prefix}", "dev", self.bridge)
            self._gateway = address
        return self._gateway

    def cut(self, host: Host) -> None:
        """Pull the host's cable: its link goes down (its processes live on, unreachable)."""
        _ip("link", "set", self._links[self.hosts.index(host)], "down")

    def close(self) -> None:
        for host in self.hosts:
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True, timeout=30)
        if self._up:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
        self.hosts, self._links, self._up, self._gateway = [], [], False, ""
