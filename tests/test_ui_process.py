"""`trainwise ui` stopped by a signal leaves nothing running and keeps its logs (defect 12)."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from pipelines import ui
from tests import servers

pytestmark = pytest.mark.integration


def _proc_table() -> list[tuple[int, int, int]]:
    """(pid, ppid, pgrp) of every live, non-zombie process (Linux /proc)."""
    table = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":
            table.append((int(entry.name), int(fields[1]), int(fields[2])))
    return table


def _groups_alive(pgids: set[int]) -> set[int]:
    return {pgrp for _, _, pgrp in _proc_table() if pgrp in pgids}


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_sigterm_stops_webserver_and_daemon_and_keeps_logs(tmp_path):
    home = tmp_path / "state"
    port = servers.free_port()
    env = {**os.environ, "TRAINWISE_HOME": str(home), "TRAINWISE_MLFLOW_URI": "",
           "TRAINWISE_S3_BUCKET": "", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env.pop("DAGSTER_HOME", None)  # `trainwise ui` puts it under TRAINWISE_HOME
    out = open(tmp_path / "ui.out", "wb")
    parent = subprocess.Popen(
        [sys.executable, "-m", "trainwise.cli", "ui", "--host", "127.0.0.1", "--port", str(port)],
        env=env, cwd=ui.PROJECT_ROOT, stdout=out, stderr=subprocess.STDOUT,
        start_new_session=True)
    child_groups: set[int] = set()
    try:
        deadline = time.monotonic() + 240
        # Both children run once the parent prints its banner (the daemon starts second).
        while b"trainwise UI:" not in (tmp_path / "ui.out").read_bytes():
            assert parent.poll() is None, (tmp_path / "ui.out").read_text()
            assert time.monotonic() < deadline, "trainwise ui did not come up"
            time.sleep(0.5)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=10) as r:
            assert r.status == 200
        # The banner waits for the code location: the jobs are there when the user looks.
        [entry] = ui._location_entries(f"http://127.0.0.1:{port}")
        assert (entry["name"], entry["loadStatus"]) == ("trainwise", "LOADED")
        assert entry["locationOrLoadError"]["__typename"] == "RepositoryLocation"
        child_groups = {pgrp for pid, ppid, pgrp in _proc_table() if ppid == parent.pid}
        assert len(child_groups) == 2 and parent.pid not in child_groups  # own groups

        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=60) == 0
        gone_by = time.monotonic() + 10
        while _groups_alive(child_groups) and time.monotonic() < gone_by:
            time.sleep(0.2)
        assert _groups_alive(child_groups) == set()
        for name in ("webserver", "daemon"):
            assert f"trainwise ui starts {name}" in (home / "logs" / f"{name}.log").read_text()
        assert "dagster" in (home / "logs" / "webserver.log").read_text().split("\n", 1)[1]
    finally:
        for pgid in _groups_alive(child_groups | {parent.pid}):  # only what this test started
            os.killpg(pgid, signal.SIGKILL)
        parent.wait(timeout=10)
        out.close()


def test_non_loopback_bind_warns_loudly():
    assert ui.bind_warning("127.0.0.1") is None and ui.bind_warning("::1") is None
    assert ui.bind_warning("localhost") is None
    warning = ui.bind_warning("0.0.0.0")
    assert warning is not None and "NO LOGIN" in warning and "0.0.0.0" in warning


class _FakeWebserver(http.server.BaseHTTPRequestHandler):
    """Answers the workspace query with the next of `answers` (the last one repeats)."""

    answers: list[list[dict]] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        entries = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        body = json.dumps({"data": {"workspaceOrError": {
            "__typename": "Workspace", "locationEntries": entries}}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _serve(answers: list[list[dict]]):
    handler = type("Handler", (_FakeWebserver,), {"answers": list(answers)})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def _entry(status: str, typename: str = "RepositoryLocation", message: str = "") -> dict:
    error = {"__typename": typename, **({"message": message} if message else {})}
    return {"name": "trainwise", "loadStatus": status, "locationOrLoadError": error}


def test_ready_waits_until_the_code_location_is_loaded():
    server, url = _serve([[_entry("LOADING", "RepositoryLocation")]] * 2 + [[_entry("LOADED")]])
    try:
        started = time.monotonic()
        ui.wait_for_code_locations(url, timeout_s=20)
        assert time.monotonic() - started >= 1.5  # two LOADING answers, a second apart
    finally:
        server.shutdown()


def test_a_code_location_that_fails_to_load_is_an_error_with_dagsters_message():
    server, url = _serve([[_entry("LOADED", "PythonError", "DagsterInvalidDefinitionError: "
                                                           "duplicate job name demo")]])
    try:
        with pytest.raises(RuntimeError, match="trainwise failed to load: "
                                               "DagsterInvalidDefinitionError: duplicate job"):
            ui.wait_for_code_locations(url, timeout_s=20)
    finally:
        server.shutdown()


def test_a_location_still_loading_at_the_deadline_times_out_naming_the_url():
    server, url = _serve([[_entry("LOADING")]])
    try:
        with pytest.raises(TimeoutError, match=f"{url} did not load its code locations"):
            ui.wait_for_code_locations(url, timeout_s=2)
    finally:
        server.shutdown()
