"""`trainwise ui` / `make ui`: the Dagster webserver and daemon over this project's workspace.

Both start in their own process group (session) so they can be stopped together by id, never
by name. `serve` stops both groups on SIGTERM, SIGINT and SIGHUP and at interpreter exit, and on
Linux each child also gets SIGTERM if this process dies without cleaning up (kill -9):
a stopped `trainwise ui` leaves nothing running. Their output goes to
`<TRAINWISE_HOME>/logs/{webserver,daemon}.log` (appended, one header line per start).
"""

from __future__ import annotations

import atexit
import ctypes
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


def _bin(name: str) -> str:
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def bind_warning(host: str) -> str | None:
    """A loud warning when `host` is not loopback: the Dagster UI has no login."""
    if is_loopback(host):
        return None
    bar = "!" * 78
    return (f"{bar}\n"
            f"WARNING: the trainwise UI is binding {host}, which is not loopback.\n"
            "The Dagster UI has NO LOGIN: anyone who can reach this port can launch and cancel\n"
            "runs, read run configs and logs. Bind 127.0.0.1 (the default) and use an SSH\n"
            "tunnel, or put an authenticating proxy in front of it.\n"
            f"{bar}")


def default_log_dir(env: dict[str, str] | None = None) -> Path:
    """`<TRAINWISE_HOME>/logs`, with TRAINWISE_HOME taken from `env` when it sets one."""
    from trainwise import settings

    home = (env or {}).get("TRAINWISE_HOME") or ""
    root = Path(home).expanduser().resolve() if home else settings.home_dir()
    log_dir = root / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    return log_dir


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux to send SIGTERM when the parent dies (even kill -9)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the signal handlers and atexit still apply
        pass


def start(host: str, port: int, env: dict[str, str] | None = None,
          log_dir: Path | None = None, timeout_s: float = 180.0) -> list[subprocess.Popen]:
    """Start dagster-webserver, wait until it answers, then dagster-daemon, then wait until the
    webserver has loaded the code locations; returns both.

    In sequence, because on a fresh DAGSTER_HOME both would create the sqlite storage at once
    and one dies on "table alembic_version already exists". The webserver answers a minute
    before it has loaded the code (on a loaded machine): a page opened then shows no jobs, so
    the UI is ready only once the location is (a location that fails to load is an error here,
    with Dagster's message, not an empty UI).
    """
    workspace = str(PROJECT_ROOT / "workspace.yaml")
    full_env = {**os.environ, **(env or {})}
    if "DAGSTER_HOME" not in full_env:
        raise ValueError("DAGSTER_HOME must be set to an absolute, existing folder")
    log_dir = Path(log_dir) if log_dir else default_log_dir(env)
    log_dir.mkdir(parents=True, exist_ok=True)
    commands = {
        "webserver": [_bin("dagster-webserver"), "-h", host, "-p", str(port), "-w", workspace],
        "daemon": [_bin("dagster-daemon"), "run", "-w", workspace],
    }
    processes: list[subprocess.Popen] = []
    try:
        for name, command in commands.items():
            with open(log_dir / f"{name}.log", "ab") as log:
                log.write(f"=== {datetime.now(UTC).isoformat()} trainwise ui starts {name}: "
                          f"{' '.join(command)}\n".encode())
                log.flush()
                processes.append(subprocess.Popen(
                    command, cwd=PROJECT_ROOT, env=full_env, stdout=log,
                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True, preexec_fn=_die_with_parent,
                ))
            if name == "webserver":
                wait_until_up(f"http://{_url_host(host)}:{port}", timeout_s, processes)
        wait_for_code_locations(f"http://{_url_host(host)}:{port}", timeout_s, processes)
    except BaseException:
        stop(processes)
        raise
    return processes


_WORKSPACE_QUERY = """
{ workspaceOrError { __typename ... on Workspace { locationEntries { name loadStatus
    locationOrLoadError { __typename ... on PythonError { message } } } } } }"""


# What the Launchpad's "Launch run" sends (variables: executionParams with the job's selector,
# runConfigData and the partition tag), with every answer type it can get.
LAUNCH_RUN = """
mutation Launch($executionParams: ExecutionParams!) {
  launchPipelineExecution(executionParams: $executionParams) {
    __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on PythonError { message }
    ... on RunConfigValidationInvalid { errors { message } }
    ... on InvalidSubsetError { message }
  }
}"""


def graphql_payload(url: str, query: str, variables: dict | None = None,
                    timeout_s: float = 60.0) -> dict:
    """The webserver's whole GraphQL answer (`data`, and `errors` when there are any)."""
    body = json.dumps({"query": query, "variables": variables or {}}).encode()
    request = urllib.request.Request(f"{url}/graphql", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def _location_entries(url: str) -> list[dict]:
    payload = graphql_payload(url, _WORKSPACE_QUERY, timeout_s=30)
    workspace = (payload.get("data") or {}).get("workspaceOrError") or {}
    return workspace.get("locationEntries") or []


def wait_for_code_locations(url: str, timeout_s: float = 180.0,
                            processes: list[subprocess.Popen] | None = None) -> None:
    """Until every code location of the webserver at `url` is LOADED; a location that loaded
    with an error raises RuntimeError with Dagster's message."""
    deadline = time.monotonic() + timeout_s
    entries: list[dict] = []
    while time.monotonic() < deadline:
        for process in processes or []:
            if process.poll() is not None:
                raise RuntimeError(f"{process.args[0]} exited with {process.returncode}")
        try:
            entries = _location_entries(url)
        except OSError:  # busy: the webserver answers GraphQL once it has a moment
            entries = []
        loaded = [e for e in entries if e.get("loadStatus") == "LOADED"]
        if entries and len(loaded) == len(entries):
            failed = [e for e in loaded
                      if (e.get("locationOrLoadError") or {}).get("__typename") == "PythonError"]
            if failed:
                raise RuntimeError("code location " + "; ".join(
                    f"{e['name']} failed to load: {e['locationOrLoadError'].get('message')}"
                    for e in failed) + " (the webserver log has the traceback)")
            return
        time.sleep(1)
    raise TimeoutError(f"Dagster webserver at {url} did not load its code locations within "
                       f"{timeout_s:.0f} s: {entries}")


def _url_host(host: str) -> str:
    """Where to reach a server bound to `host` from this machine."""
    if host in ("0.0.0.0", "", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


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
        try:
            os.killpg(process.pid, signal.SIGTERM)  # the group too, even if the leader exited
        except (ProcessLookupError, PermissionError):
            pass
    for process in processes:
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        try:  # whatever is left in the group (code servers the leader started)
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


class _StopRequested(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stop(signum: int, _frame: object) -> None:
    raise _StopRequested(signum)


def serve(host: str = "127.0.0.1", port: int = 3000) -> int:
    """Run the UI until a signal (or a child exits); both children are stopped either way."""
    warning = bind_warning(host)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    log_dir = default_log_dir()
    processes: list[subprocess.Popen] = []
    previous = {signum: signal.signal(signum, _raise_stop) for signum in STOP_SIGNALS}
    # atexit covers an exit through sys.exit or an uncaught error elsewhere.
    atexit.register(stop, processes)
    try:
        processes += start(host, port, log_dir=log_dir)
        url = f"http://{_url_host(host)}:{port}"
        print(f"trainwise UI: {url}  (Dagster webserver + daemon; Ctrl-C stops both)\n"
              f"logs: {log_dir}/webserver.log, {log_dir}/daemon.log", flush=True)
        while all(process.poll() is None for process in processes):
            time.sleep(1)
        failed = [p for p in processes if p.poll() is not None]
        print(f"trainwise UI: {failed[0].args[0]} exited with {failed[0].returncode}; "
              f"see {log_dir}", file=sys.stderr)
        return 1
    except (_StopRequested, KeyboardInterrupt) as stopped:
        name = stopped.args[0] if isinstance(stopped, _StopRequested) else "SIGINT"
        print(f"trainwise UI: {name} received, stopping the webserver and daemon", flush=True)
        return 0
    finally:
        # No second signal may interrupt the clean-up half way.
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        stop(processes)
        atexit.unregister(stop)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
