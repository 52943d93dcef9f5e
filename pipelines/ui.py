"""`make ui`: the Dagster webserver and daemon on loopback, over this project's workspace.

Both start in their own process group so they can be stopped together by id (never by name).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def _bin(name: str) -> str:
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def start(host: str, port: int, env: dict[str, str] | None = None,
          log_dir: Path | None = None, timeout_s: float = 180.0) -> list[subprocess.Popen]:
    """Start dagster-webserver, wait until it answers, then dagster-daemon; returns both.

    In sequence, because on a fresh DAGSTER_HOME both would create the sqlite storage at once
    and one dies on "table alembic_version already exists".
    """
    workspace = str(PROJECT_ROOT / "workspace.yaml")
    full_env = {**os.environ, **(env or {})}
    if "DAGSTER_HOME" not in full_env:
        raise ValueError("DAGSTER_HOME must be set to an absolute, existing folder")
    commands = {
        "webserver": [_bin("dagster-webserver"), "-h", host, "-p", str(port), "-w", workspace],
        "daemon": [_bin("dagster-daemon"), "run", "-w", workspace],
    }
    processes: list[subprocess.Popen] = []
    try:
        for name, command in commands.items():
            out = open(log_dir / f"{name}.log", "wb") if log_dir else subprocess.DEVNULL
            processes.append(subprocess.Popen(
                command, cwd=PROJECT_ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            ))
            if name == "webserver":
                wait_until_up(f"http://{host}:{port}", timeout_s, processes)
    except BaseException:
        stop(processes)
        raise
    return processes


def wait_until_up(url: str, timeout_s: float = 120.0,
                  processes: list[subprocess.Popen] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for process in processes or []:
            if process.poll() is not None:
                raise RuntimeError(f"{process.args[0]} exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/server_info", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"Dagster webserver did not answer at {url} within {timeout_s:.0f} s")


def stop(processes: list[subprocess.Popen], timeout_s: float = 20.0) -> None:
    """Stop each process group by its id: SIGTERM, then SIGKILL if it lingers."""
    for process in processes:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for process in processes:
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=5)


def serve(host: str = "127.0.0.1", port: int = 3000) -> int:
    processes = start(host, port)
    url = f"http://{host}:{port}"
    try:
        print(f"trainwise UI: {url}  (Dagster webserver + daemon; Ctrl-C stops both)")
        while all(process.poll() is None for process in processes):
            time.sleep(1)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stop(processes)
