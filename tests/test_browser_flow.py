"""The governance flow in a real browser (issue 13, item 8): Chromium (Debian's package) driven
by Playwright against the Dagster webserver and daemon that `make ui` starts.

One UI for the module, steps in order, as a person does them: see the asset graph; launch
`demo` for a partition from the Launchpad and see it succeed; propose a schedule change and see
its blocking gate `schedule_approved` fail (no approval); approve the proposal's hash by
launching `schedule_approve` (the `approvals` asset) with run config and see the gate pass and
the change go live; publish a second curriculum and roll back to the first through
`curriculum_rollback`. Each step leaves a screenshot under test-artifacts/browser/.

The runs are slow here (a run's process imports the code location: a minute or more on two
busy cores), so the steps that launch runs are `slow` (make test-all); the asset-graph step
runs by default. Run configs ask for the in-process executor: the default multiprocess one
starts a Python process per step, minutes each on a loaded machine.
"""

from __future__ import annotations

import re

import pytest

from tests import browser_support as bs
from training import curriculum as curriculum_lib
from trainwise import approvals

pytestmark = pytest.mark.integration

PARTITION = "pystdlib"
IN_PROCESS = "execution:\n  config:\n    in_process: {}\n"
NEW_POLICY = "skypilot_failover"
# Small and fast: the embedded-size forecast (as tests/test_approvals.py) and an allocation-only
# change (its eval-loss change is 0 by construction) whose savings clear the minimum.
UI_ENV = {"TRAINWISE_FORECAST_WORK_GPU_H": "2", "TRAINWISE_FORECAST_DEADLINE_H": "4",
          "TRAINWISE_FORECAST_SAMPLES": "4", "TRAINWISE_MIN_FORECAST_SAVINGS_USD": "-1000"}
RUN_TIMEOUT_S = 600
HASH = re.compile(r"proposal ([0-9a-f]{16}) blocked")
PUBLISHED_VERSION = re.compile(r"candidate ([0-9a-f]{12}) published")


@pytest.fixture(scope="module")
def browser_ui(tmp_path_factory):
    """(page, url, state folder, shared dict of what earlier steps saw); one UI, one browser."""
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="playwright is not installed (pip install playwright)")
    bs.chromium_path()
    root = tmp_path_factory.mktemp("browser_ui")
    url, processes, env = bs.start_ui(root, UI_ENV)
    playwright = sync_api.sync_playwright().start()
    try:
        browser = bs.launch(playwright)
        page = bs.new_page(browser)
        yield page, url, root / "state", {}
        browser.close()
    finally:
        playwright.stop()
        bs.ui.stop(processes)


def _needs(seen: dict, key: str, step: str):
    if key not in seen:
        pytest.fail(f"the step '{step}' did not pass earlier in this module; run the whole "
                    "module (tests/test_browser_flow.py), the steps build on each other")
    return seen[key]


def _run(page, url, state, job, config, expected, partition=None, shot=""):
    """Launch from the Launchpad, wait for the end; a run that ends otherwise than `expected`
    fails here with its run page saved and the daemon log named."""
    run_id = bs.launch_from_launchpad(page, url, job, config, partition, shot=f"{shot}-launchpad")
    status = bs.wait_for_run(page, url, run_id, RUN_TIMEOUT_S)
    if status != expected:
        bs.screenshot(page, f"{shot}-unexpected-{status}")
        pytest.fail(f"{job} run {run_id} ended {status}, expected {expected}; see its run page "
                    f"screenshot and {state.parent}/daemon.log")
    return run_id


@pytest.mark.timeout(600)
def test_ui_shows_the_asset_graph(browser_ui):
    page, url, _, _ = browser_ui
    for group, names in (("data", ("data_shards", "difficulty_scores", "curriculum",
                                   "checkpoint")),
                         ("governance", ("schedule_change", "approvals"))):
        page.goto(f"{url}/locations/{bs.LOCATION}/asset-groups/{group}")
        try:
            for name in names:
                page.get_by_text(name, exact=True).filter(visible=True).first.wait_for()
        finally:
            bs.screenshot(page, f"01-asset-graph-{group}")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_demo_launched_for_a_partition_from_the_launchpad_succeeds(browser_ui):
    page, url, state, seen = browser_ui
    config = (IN_PROCESS + "ops:\n  checkpoint:\n    config:\n      max_steps: 4\n"
              "      eval_every_steps: 2\n  curriculum:\n    config:\n      pruning_rate: 0.0\n")
    run_id = _run(page, url, state, "demo", config, "SUCCESS", PARTITION, shot="02-demo")
    text = bs.run_page_text(page, "RUN_SUCCESS", "02-demo-run")
    assert f"partition: {PARTITION}" in text
    # The curriculum went through its gate and was published before training read it.
    found = PUBLISHED_VERSION.search(text)
    assert found, f"no 'candidate <version> published' on the run page of {run_id}"
    seen["first_curriculum"] = found.group(1)
    assert list((state / "objects" / "checkpoints" / PARTITION / run_id).rglob("*.pt"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_unapproved_schedule_change_is_blocked_by_its_gate(browser_ui):
    page, url, state, seen = browser_ui
    config = (IN_PROCESS + f"ops:\n  schedule_change:\n    config:\n"
              f"      allocation_policy: {NEW_POLICY}\n      reason: cheaper failover\n")
    run_id = _run(page, url, state, "schedule_propose", config, "FAILURE", shot="03-propose")
    text = bs.run_page_text(page, "Check schedule_approved failed", "03-propose-gate-blocks")
    found = HASH.search(text)
    assert found, f"the gate's 'proposal <hash> blocked' is not on the run page of {run_id}"
    assert f"no approval of {found.group(1)}" in text
    schedule = approvals.current_schedule(state / "governance" / "schedule")
    assert schedule["allocation_policy"] != NEW_POLICY  # nothing went live
    seen["proposal_hash"] = found.group(1)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_approval_from_the_launchpad_passes_the_gate_and_the_change_goes_live(browser_ui):
    page, url, state, seen = browser_ui
    content_hash = _needs(seen, "proposal_hash", "unapproved schedule change is blocked")
    config = (IN_PROCESS + "ops:\n  approvals:\n    config:\n      approver: ada\n"
              f"      content_hash: '{content_hash}'\n      comment: failover is cheaper\n")
    _run(page, url, state, "schedule_approve", config, "SUCCESS", shot="04-approve")
    text = bs.run_page_text(page, "Check schedule_approved succeeded",
                            "04-approve-gate-passes")
    assert f"proposal {content_hash} published" in text
    folder = state / "governance" / "schedule"
    assert approvals.current_schedule(folder)["allocation_policy"] == NEW_POLICY
    published = approvals.history(folder)[-1]
    assert published["event"] == "published" and published["approval"]["approver"] == "ada"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_curriculum_rollback_from_the_launchpad_restores_the_previous_version(browser_ui):
    page, url, state, seen = browser_ui
    first = _needs(seen, "first_curriculum", "demo launched for a partition")
    refresh = (IN_PROCESS + "ops:\n  curriculum:\n    config:\n      pruning_rate: 0.4\n"
               "      reason: prune more\n")
    _run(page, url, state, "curriculum_refresh", refresh, "SUCCESS", PARTITION, shot="05-refresh")
    text = bs.run_page_text(page, "RUN_SUCCESS", "05-refresh-run")
    second = PUBLISHED_VERSION.search(text).group(1)
    assert second != first
    folder = state / "curricula" / PARTITION
    assert curriculum_lib.current_version(folder) == second

    rollback = (IN_PROCESS + f"ops:\n  curriculum:\n    config:\n      restore_version: "
                f"'{first}'\n      reason: eval loss regressed at 0.4\n      requested_by: ada\n")
    _run(page, url, state, "curriculum_rollback", rollback, "SUCCESS", PARTITION,
         shot="05-rollback")
    text = bs.run_page_text(page, "RUN_SUCCESS", "05-rollback-run")
    assert "candidate (rollback)" in text and f"candidate {first} published" in text
    assert curriculum_lib.current_version(folder) == first
    record = curriculum_lib.read_history(folder)[-1]
    assert record["event"] == "rollback" and record["requested_by"] == "ada"
