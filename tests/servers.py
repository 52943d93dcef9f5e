"""Start real servers on loopback for integration tests, and stop them by process-group id."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(command: list[str], log_path: Path, env: dict[str, str] | None = None,
          cwd: Path | None = None) -> subprocess.Popen:
    log = open(log_path, "wb")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                            env={**os.environ, **(env or {})}, start_new_session=True)


def wait_http(url: str, process: subprocess.Popen, log_path: Path, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited: {log_path.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer in {timeout_s} s: {log_path.read_text()[-2000:]}")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=5)
        except ProcessLookupError:
            pass


@contextlib.contextmanager
def moto(folder: Path) -> Iterator[str]:
    """A moto_server on a free loopback port (its log in `folder`), its URL while it runs."""
    log = Path(folder) / "moto.log"
    port = free_port()
    process = start([str(VENV_BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)], log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/moto-api/", process, log, timeout_s=60)
        yield url
    finally:
        stop(process)


@contextlib.contextmanager
def netns_cluster() -> Iterator[Any]:
    """A network-namespace cluster (benchmarks/netns_cluster.py) while it lasts; the test skips,
    saying why, where one cannot be built (not root, no iproute2)."""
    import pytest

    from benchmarks import netns_cluster as netns

    why = netns.unavailable()
    if why:
        pytest.skip(f"no network-namespace cluster here: {why}")
    built = netns.Cluster()
    try:
        yield built
    finally:
        built.close()
