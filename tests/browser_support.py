"""Drive the Dagster UI in a real Chromium (Debian's package) through Playwright, as a user does.

Only what a user does in the browser: open a page, pick a partition, paste run config into the
Launchpad editor, press "Launch Run", read the run page. One exception, said where it is used:
`wait_for_run` polls the webserver's GraphQL for the run's end, because the run page's own
polling keeps Chromium busy on a shared 2-core machine for the minutes a run takes there; the
assertions are then made on the page the user sees.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from pipelines import ui
from trainwise import deployment

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
LOCATION = "trainwise"
# Screenshots land here (git-ignored: `test-artifacts/`); TRAINWISE_TEST_ARTIFACTS overrides.
ARTIFACTS = Path(os.environ.get("TRAINWISE_TEST_ARTIFACTS")
                 or ui.PROJECT_ROOT / "test-artifacts" / "browser")
FINISHED = {"SUCCESS", "FAILURE", "CANCELED"}
STATUS = """
query Status($runId: ID!) { runOrError(runId: $runId) { __typename ... on Run { status } } }"""
# Page loads and clicks on a loaded 2-core machine take seconds, not the default 30 s budget
# of Playwright's waits (a webserver query can queue behind a run's imports).
UI_TIMEOUT_MS = 120_000


def chromium_path() -> str:
    """Debian's Chromium, or skip (Playwright's own browser download is not reachable here)."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.skip("Chromium is not installed; `apt-get install chromium` (Debian) to run the "
                    "browser tests")
    return path


def launch(playwright):
    return playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)


def new_page(browser):
    """A page whose browser already dismissed the 'Join the Dagster community' dialog (a fresh
    instance opens it over any page a second after load, where it would swallow a click)."""
    context = browser.new_context(viewport={"width": 1600, "height": 1000})
    context.add_init_script("window.localStorage.setItem('communityNux', JSON.stringify('1'))")
    page = context.new_page()
    page.set_default_timeout(UI_TIMEOUT_MS)
    return page


def start_ui(root: Path, extra_env: dict[str, str]) -> tuple[str, list, dict[str, str]]:
    """The Dagster webserver and daemon (pipelines/ui.py, as `make ui`) on a free loopback port,
    with a private DAGSTER_HOME and TRAINWISE_HOME under `root`."""
    from tests import servers

    home = root / "dagster_home"
    home.mkdir(parents=True, exist_ok=True)
    (home / "dagster.yaml").write_text(deployment.instance_yaml(postgres=False))  # as `make ui`
    env = {"DAGSTER_HOME": str(home), "TRAINWISE_HOME": str(root / "state"),
           "TRAINWISE_MLFLOW_URI": "", "TRAINWISE_S3_BUCKET": "", "TRAINWISE_DUCKDB_PATH": "",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "TRAINWISE_TORCH_THREADS": "1", **extra_env}
    port = servers.free_port()
    # ui.start returns once the code location is loaded (a page opened before then shows an
    # empty asset graph and no jobs), as `make ui` prints its banner.
    processes = ui.start("127.0.0.1", port, env=env, log_dir=root, timeout_s=300)
    return f"http://127.0.0.1:{port}", processes, env


def screenshot(page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def launch_from_launchpad(page, url: str, job: str, config_yaml: str,
                          partition: str | None = None, shot: str | None = None) -> str:
    """Open the job's Launchpad, pick the partition, paste the run config, press Launch Run;
    returns the run id from the run page the UI opens."""
    page.goto(f"{url}/locations/{LOCATION}/jobs/{job}/playground")
    editor = page.locator(".CodeMirror")
    editor.wait_for(timeout=UI_TIMEOUT_MS)
    if partition is not None:
        # Before the config: picking a partition reloads the editor with that partition's config.
        pick_partition(page, partition, shot or job)
    editor.click()
    page.keyboard.press("Control+A")
    page.keyboard.insert_text(config_yaml)  # a paste: no auto-indent of the YAML
    page.get_by_text("No errors").wait_for(timeout=UI_TIMEOUT_MS)
    if shot:
        screenshot(page, shot)
    page.get_by_role("button", name="Launch Run").click()
    page.wait_for_url("**/runs/*", timeout=UI_TIMEOUT_MS)
    return page.url.rstrip("/").rsplit("/", 1)[-1]


def pick_partition(page, partition: str, shot: str, tries: int = 3) -> None:
    """Type the partition into the Launchpad's picker and choose it from the menu. The menu can
    miss a click made while the page is still rendering on a busy machine: then type again."""
    picker = page.get_by_placeholder("Partition")
    item = page.get_by_role("menuitem", name=partition, exact=True)
    for attempt in range(tries):
        picker.click()
        picker.fill("")
        picker.fill(partition)
        try:
            item.click(timeout=20_000 if attempt < tries - 1 else UI_TIMEOUT_MS)
            break
        except Exception:  # noqa: BLE001 - Playwright's TimeoutError; the last try raises
            if attempt == tries - 1:
                screenshot(page, f"{shot}-partition-picker")
                raise
            page.keyboard.press("Escape")
    page.wait_for_timeout(1_000)


def graphql(url: str, query: str, variables: dict | None = None) -> dict:
    payload = ui.graphql_payload(url, query, variables)
    assert "errors" not in payload, payload
    return payload["data"]


def wait_for_run(page, url: str, run_id: str, timeout_s: float = 600) -> str:
    """Leave the run page while the run works (its live Gantt chart costs a core), wait for its
    end through GraphQL, then reopen the run page; returns the run status."""
    page.goto("about:blank")
    deadline = time.monotonic() + timeout_s
    status = ""
    while time.monotonic() < deadline:
        status = graphql(url, STATUS, {"runId": run_id})["runOrError"]["status"]
        if status in FINISHED:
            break
        time.sleep(2)
    page.goto(f"{url}/runs/{run_id}")
    return status


def run_page_text(page, expected: str, shot: str) -> str:
    """The run page's text once `expected` (e.g. an event's message) is on it; a screenshot
    named `shot` either way (the failing page is the one to look at)."""
    try:
        row = page.get_by_text(expected).first
        row.wait_for(timeout=UI_TIMEOUT_MS)
        row.scroll_into_view_if_needed()  # the event log scrolls inside the page
    finally:
        screenshot(page, shot)
    return page.inner_text("body")


def start_server(command: list[str], log_path: Path, ready_url: str, timeout_s: float = 120):
    """A server the browser reads (MLflow, the exporter, Prometheus), in its own process group;
    stop it with tests.servers.stop."""
    from tests import servers

    process = servers.start(command, log_path, cwd=ui.PROJECT_ROOT)
    try:
        servers.wait_http(ready_url, process, log_path, timeout_s=timeout_s)
    except BaseException:
        servers.stop(process)
        raise
    return process


def page_text_once(page, url: str, expected: str, shot: str) -> str:
    """Open `url`, wait for `expected` on the page, screenshot either way; the page's text."""
    page.goto(url)
    try:
        page.get_by_text(expected).first.wait_for(timeout=UI_TIMEOUT_MS)
    finally:
        screenshot(page, shot)
    return page.inner_text("body")
