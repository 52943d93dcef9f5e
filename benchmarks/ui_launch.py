"""How long a run launched from the Dagster UI takes to finish, and where that time goes: the
path a person takes from the Launchpad, measured on the product's own servers.

`make ui`'s webserver and daemon (`pipelines.ui.start`) over a fresh DAGSTER_HOME and
TRAINWISE_HOME; the `demo` job (shards -> scores -> curriculum -> a short training run) launched
through the webserver's GraphQL `launchPipelineExecution`, as the Launchpad sends it, for the
embedded `pystdlib` partition, `--runs` times in a row. For each run, from the launch call to
SUCCESS (wall clock of this process, polled every 0.25 s), split by Dagster's own run record:

- queued: launch call to the run's start (the daemon's queue, then the run launcher starting a
  process that imports the code location);
- steps: each step's own start to end (Dagster's step stats), summed;
- in the run process outside the steps: the run's start to end less the steps (imports,
  resources, the event log);
- after the end: the run's end until this process saw SUCCESS (the poll).

Every launch runs the whole chain (the demo job materializes each of its assets), so the
launches are alike; the first also creates the run and event storage.

    python -m benchmarks.ui_launch [--runs 3] [--steps 12] [--quick] [--out DIR]

Writes benchmarks/results/ui_launch.{json,md} (through `benchmarks.results_io`).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.results_io import write_suite_results
from pipelines import ui
from trainwise import deployment

NAME = "ui_launch"
RESULTS_DIR = Path(__file__).resolve().parent / "results"
PARTITION = "pystdlib"
LAUNCH = ui.LAUNCH_RUN
RUN = """
query Run($runId: ID!) { runOrError(runId: $runId) { __typename ... on Run {
  status startTime endTime stepStats { stepKey status startTime endTime } } } }"""
DONE = {"SUCCESS", "FAILURE", "CANCELED"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _data(url: str, query: str, variables: dict[str, Any]) -> dict[str, Any]:
    payload = ui.graphql_payload(url, query, variables)
    if payload.get("errors"):
        raise RuntimeError(f"GraphQL errors from {url}: {payload['errors']}")
    return payload["data"]


def launch_once(url: str, steps: int, timeout_s: float = 900.0) -> dict[str, Any]:
    """One demo launch through GraphQL, followed to its end; its phases in seconds."""
    params = {
        "selector": {"repositoryLocationName": "trainwise", "repositoryName": "__repository__",
                     "jobName": "demo"},
        "runConfigData": {"ops": {"checkpoint": {"config": {
            "max_steps": steps, "eval_every_steps": max(1, steps // 2)}}}},
        "executionMetadata": {"tags": [{"key": "dagster/partition", "value": PARTITION}]},
    }
    launched_at = time.time()
    answer = _data(url, LAUNCH, {"executionParams": params})["launchPipelineExecution"]
    if answer["__typename"] != "LaunchRunSuccess":
        raise RuntimeError(f"the demo launch was refused: {answer}")
    run_id = answer["run"]["runId"]
    deadline = time.monotonic() + timeout_s
    while True:
        run = _data(url, RUN, {"runId": run_id})["runOrError"]
        if run.get("status") in DONE:
            seen_at = time.time()
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"run {run_id} did not end within {timeout_s:.0f} s")
        time.sleep(0.25)
    if run["status"] != "SUCCESS":
        raise RuntimeError(f"run {run_id} ended {run['status']}; see the daemon log")
    return phases(run_id, launched_at, seen_at, run)


def phases(run_id: str, launched_at: float, seen_at: float, run: dict[str, Any]) -> dict[str, Any]:
    """The launch's seconds split as the module doc says, from Dagster's run record."""
    start, end = float(run["startTime"]), float(run["endTime"])
    steps = {s["stepKey"]: float(s["endTime"]) - float(s["startTime"])
             for s in run["stepStats"] if s.get("startTime") and s.get("endTime")}
    in_steps = sum(steps.values())
    return {"run_id": run_id, "total_s": seen_at - launched_at, "queued_s": start - launched_at,
            "steps_s": in_steps, "run_outside_steps_s": (end - start) - in_steps,
            "after_end_s": seen_at - end, "step_s": steps}


def measure(runs: int, steps: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="trainwise-ui-launch-"))
    home = root / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text(deployment.instance_yaml(postgres=False))  # as `make ui`
    env = {"DAGSTER_HOME": str(home), "TRAINWISE_HOME": str(root / "state"),
           "TRAINWISE_MLFLOW_URI": "", "TRAINWISE_S3_BUCKET": "", "TRAINWISE_DUCKDB_PATH": "",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    port = _free_port()
    began = time.monotonic()
    processes = ui.start("127.0.0.1", port, env=env, log_dir=root, timeout_s=300)
    ready_s = time.monotonic() - began
    launches = []
    try:
        for index in range(runs):
            launches.append(launch_once(f"http://127.0.0.1:{port}", steps))
            print(f"launch {index + 1}/{runs}: {launches[-1]['total_s']:.1f} s", flush=True)
    finally:
        ui.stop(processes)
    keys = ("total_s", "queued_s", "steps_s", "run_outside_steps_s", "after_end_s")
    return {"runs": runs, "steps": steps, "partition": PARTITION, "ui_ready_s": ready_s,
            "executor": "in_process_executor (pipelines/definitions.py)",
            "load_average_after": os.getloadavg()[0],
            "median": {k: statistics.median(x[k] for x in launches) for k in keys},
            "launches": launches}


def report(result: dict[str, Any]) -> str:
    median = result["median"]
    lines = [
        "# A run launched from the Dagster UI, launch to SUCCESS", "",
        f"The `demo` job ({result['steps']} training steps, partition `{result['partition']}`) "
        f"launched {result['runs']} times through the webserver's GraphQL, as the Launchpad "
        f"does, on `make ui`'s webserver and daemon; executor: {result['executor']}. The UI "
        f"was ready (code location loaded) {result['ui_ready_s']:.1f} s after its start.", "",
        f"**Median launch to SUCCESS: {median['total_s']:.1f} s**, of which "
        f"{median['queued_s']:.1f} s queued and starting the run's process, "
        f"{median['steps_s']:.1f} s in the steps, {median['run_outside_steps_s']:.1f} s in the "
        f"run's process outside them, {median['after_end_s']:.1f} s until the poll saw it.", "",
        "| launch | total s | queued s | steps s | run outside steps s | after end s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for index, x in enumerate(result["launches"], 1):
        lines.append(f"| {index} | {x['total_s']:.1f} | {x['queued_s']:.1f} | {x['steps_s']:.1f} "
                     f"| {x['run_outside_steps_s']:.1f} | {x['after_end_s']:.1f} |")
    last = result["launches"][-1]["step_s"]
    lines += ["", "Steps of the last launch (s): "
              + ", ".join(f"{k} {v:.1f}" for k, v in last.items()) + ".", "",
              f"Load average (1 min) after: {result['load_average_after']:.2f}."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ui_launch")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="one launch, nothing written")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    runs = 1 if args.quick else args.runs
    if runs < 1 or args.steps < 1:
        raise SystemExit(f"--runs {runs} / --steps {args.steps}: give at least 1 of each")
    result = measure(runs, args.steps)
    markdown = report(result)
    print(markdown)
    write_suite_results(args.out, args.quick, RESULTS_DIR, NAME, "benchmarks.ui_launch", argv,
                        result, markdown)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
