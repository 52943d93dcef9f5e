"""`trainwise`: the headless entry point (demo, ui, bench, explain, forecast, settings).

Heavy imports (dagster, torch, mlflow) happen inside the subcommand that needs them, so
`trainwise --help` and `trainwise explain` start fast.

SIGTERM (issue 31, class 8) stops every subcommand the way Ctrl-C does, with one line saying so
and exit code 143, also while it is still importing; where a subcommand installs its own
handler (the training loop's preemption notice, `trainwise ui`'s shutdown), that one answers
while it is installed.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from trainwise import settings

if TYPE_CHECKING:  # the forecast's imports are heavy: loaded by the subcommand only
    from trainwise.job_forecast import LiveForecast

EXIT_SIGTERM = 128 + signal.SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM reached the CLI outside any handler of its own: unwinds like Ctrl-C."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise Terminated


def _prepare_environment() -> Path:
    """State folder, Dagster home and offline flags shared by every subcommand."""
    home = settings.home_dir()
    dagster_home = home / "dagster"
    dagster_home.mkdir(parents=True, exist_ok=True)
    from trainwise import deployment

    # Telemetry off, the run queue drained every second, PostgreSQL storage when
    # TRAINWISE_POSTGRES_URL is set; a user's own file is kept.
    deployment.write_instance_yaml(dagster_home)
    os.environ.setdefault("DAGSTER_HOME", str(dagster_home))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HOME", str(home / "hf"))
    return home


def _check_demo_args(args: argparse.Namespace) -> None:
    """Arguments and settings, checked in well under a second, before the data build."""
    from training.shards import validate_partition

    if args.partition:
        validate_partition(args.partition)  # unknown or path-like: lists the valid names
    if args.steps < 1:
        raise ValueError(f"--steps {args.steps}: training needs at least 1 step")
    settings.check_all()  # TRAINWISE_DEMO_PARTITION's form among the others
    chosen = settings.demo_partition()
    if chosen and not args.partition:
        try:  # a well-formed name that is no partition: refused now, naming the setting
            validate_partition(chosen)
        except ValueError as error:
            raise settings.SettingError(f"TRAINWISE_DEMO_PARTITION: {error}") from None


def _cmd_demo(args: argparse.Namespace) -> int:
    _check_demo_args(args)
    _prepare_environment()
    from pipelines import headless

    summary = headless.run_demo(partition=args.partition, max_steps=args.steps)
    print(summary)
    return 0


def _cmd_ingest(args: argparse.Namespace) -> int:
    from trainwise import runs

    count = runs.reingest(settings.home_dir(), args.run, settings.duckdb_path())
    print(f"ingested {count} events of run {args.run} into {settings.duckdb_path()}")
    return 0


def _cmd_ui(args: argparse.Namespace) -> int:
    _prepare_environment()
    from pipelines import ui

    return ui.serve(host=args.host, port=args.port)


def _cmd_bench(args: argparse.Namespace) -> int:
    _prepare_environment()
    # The benchmarks import the product, never the reverse: the suite runs as its own program.
    # exec, not a child process, so Ctrl-C and SIGTERM reach the suite itself.
    command = [sys.executable, "-m", "benchmarks.run_all", args.suite, *args.rest]
    sys.stdout.flush()
    os.execv(sys.executable, command)
    return 1  # not reached: execv replaces this process or raises OSError


def _cmd_explain(args: argparse.Namespace) -> int:
    from trainwise import explain

    if args.summary:  # where every dollar went: read from the run folder alone
        from trainwise import cost_summary

        run_dir = explain.find_run_dir(args.run, settings.home_dir() / "runs")
        print(cost_summary.summarize(run_dir).text())
        return 0
    print(explain.timeline(args.run, runs_root=settings.home_dir() / "runs"))
    return 0


def _forecast_table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)


def _cmd_forecast(args: argparse.Namespace) -> int:
    """P50/P90 cost and completion time of a job before launch, or of a live run's rest."""
    from trainwise import job_forecast
    from trainwise import schedule as schedule_lib

    if args.steps < 0 or (args.deadline_h is not None and not args.deadline_h > 0):
        raise ValueError(f"--steps {args.steps} / --deadline-h {args.deadline_h}: give at least "
                         "1 step (0: the launchpad's default) and a deadline above 0 hours")
    home = settings.home_dir()
    deadline_s = None if args.deadline_h is None else args.deadline_h * 3600.0
    head = ("", "steps", "P50 USD", "P90 USD", "P50 h", "P90 h", "deadline risk")
    if args.job:
        return _forecast_user_job(args, head, deadline_s)
    if args.run:
        live = _reforecast_run(home, args.run, deadline_s)
        rest = live.remaining
        rows = [head, ("so far", str(live.steps_done), f"{live.bill_so_far_usd:.2f}", "",
                       f"{live.elapsed_h:.2f}", "", "")]
        if rest is not None:
            rows.append(("remaining", f"{rest.steps:.0f}", f"{rest.p50_usd:.2f}",
                         f"{rest.p90_usd:.2f}", f"{rest.p50_h:.2f}", f"{rest.p90_h:.2f}",
                         f"{rest.deadline_risk:.0%}"))
        rows.append(("whole run", str(live.max_steps), f"{live.p50_usd:.2f}",
                     f"{live.p90_usd:.2f}", f"{live.p50_h:.2f}", f"{live.p90_h:.2f}", ""))
        print(f"run {live.run_id}: step {live.steps_done} of {live.max_steps}; bill so far from "
              f"{live.bill_source}\n{_forecast_table(rows)}")
        if rest is not None:
            print(f"remaining sized from {rest.throughput_source}; {rest.clock_source}; "
                  f"market {rest.market}; policy {rest.policy}; budget {rest.budget_usd:g} USD")
        return 0
    if not args.partition:
        raise ValueError("give a PARTITION (a data set: tinyshakespeare, mnist, pystdlib) or "
                         "--run RUN_ID of a live run")
    from training.shards import validate_partition

    validate_partition(args.partition)
    published = schedule_lib.published(home)
    request = job_forecast.request_for(args.partition, published,
                                       **({"max_steps": args.steps} if args.steps else {}))
    job = job_forecast.forecast_job(home, request, published, deadline_s=deadline_s)
    assert job is not None  # probed when it has no runs
    print(_forecast_table([head, (job.partition, f"{job.steps:.0f}", f"{job.p50_usd:.2f}",
                                  f"{job.p90_usd:.2f}", f"{job.p50_h:.2f}", f"{job.p90_h:.2f}",
                                  f"{job.deadline_risk:.0%}")]))
    print(f"sized from {job.throughput_source} ({job.s_per_sample:.3g} s per sample); "
          f"{job.clock_source}; market {job.market}; policy {job.policy}; deadline "
          f"{job.deadline_h:g} h" + (f"; {job.note}" if job.note else ""))
    verdict = ("OVER the budget: a launch is refused unless it gives schedule_override_reason"
               if job.p90_usd > job.budget_usd else "within the budget")
    print(f"budget {job.budget_usd:g} USD (published schedule {published.version}): P90 "
          f"{verdict}")
    return 0


def _reforecast_run(home: Path, run_id: str, deadline_s: float | None) -> LiveForecast:
    """`trainwise forecast --run RUN_ID`: a built-in run's (its request.json) or a registered
    job's run's (user_job.json, or the launch record of one still going) re-forecast; an unknown
    id names the runs known."""
    from trainwise import explain, job_forecast, user_job_forecast

    run_dir = explain.find_run_dir(run_id, home / "runs")
    if user_job_forecast.is_user_job_run(run_dir):
        return user_job_forecast.reforecast_user_run(home, run_dir.name, deadline_s=deadline_s)
    return job_forecast.reforecast_run(home, run_dir.name, deadline_s=deadline_s)


def _forecast_user_job(args: argparse.Namespace, head: tuple[str, ...],
                       deadline_s: float | None) -> int:
    """`trainwise forecast --job NAME --max-steps N`: a registered job's launch, before it."""
    from trainwise import schedule as schedule_lib
    from trainwise import user_job_forecast, user_jobs
    from trainwise.user_project import load_project

    home = settings.home_dir()
    project = load_project()
    try:
        job = user_jobs.registered_job(project, args.job)
    except user_jobs.UserJobError as error:
        raise ValueError(str(error)) from None
    assert project.path is not None  # a registered job has a project file
    published = schedule_lib.published(home)
    ask = user_job_forecast.ask_for(job.name, max_steps=args.steps, market=args.market,
                                    allocation_policy=args.allocation_policy)
    shards = home / "shards" / job.dataset
    forecast = user_job_forecast.forecast_user_job(
        home, job, project.path.parent, ask, published,
        shards if (shards / "manifest.json").is_file() else None, deadline_s=deadline_s)
    assert forecast is not None  # probed when it has no runs
    print(_forecast_table([head, (f"job {job.name}", f"{forecast.steps:.0f}",
                                  f"{forecast.p50_usd:.2f}", f"{forecast.p90_usd:.2f}",
                                  f"{forecast.p50_h:.2f}", f"{forecast.p90_h:.2f}",
                                  f"{forecast.deadline_risk:.0%}")]))
    print(f"sized from {forecast.throughput_source} ({forecast.s_per_step:.3g} s per step); "
          f"{forecast.clock_source}; market {forecast.market}; policy {forecast.policy}; "
          f"deadline {forecast.deadline_h:g} h" + (f"; {forecast.note}" if forecast.note else ""))
    verdict = (f"OVER the budget: a launch is refused unless it gives "
               f"{user_job_forecast.OVERRIDE_FIELD}" if forecast.p90_usd > forecast.budget_usd
               else "within the budget")
    print(f"budget {forecast.budget_usd:g} USD (published schedule {published.version}): P90 "
          f"{verdict}")
    return 0


def _cmd_settings(_: argparse.Namespace) -> int:
    for setting in settings.SETTINGS:
        print(f"{setting.name}={settings.get(setting.name)}\n    {setting.help}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainwise", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run the whole chain headless and print a summary")
    demo.add_argument("--partition", default="", help="data set (default: tinyshakespeare, "
                      "or pystdlib when the shared data is missing)")
    # 600: the replay is paced at 6 steps per trace tick (pipelines/headless.py), so the demo
    # window's reclaim (tick 52) comes near step 300 on any machine.
    demo.add_argument("--steps", type=int, default=600, help="training steps (default 600)")
    demo.set_defaults(func=_cmd_demo)

    ui = sub.add_parser("ui", help="start the Dagster webserver and daemon on loopback")
    ui.add_argument("--host", default="127.0.0.1")
    ui.add_argument("--port", type=int, default=3000)
    ui.set_defaults(func=_cmd_ui)

    bench = sub.add_parser("bench", help="run a benchmark suite and write benchmarks/results/")
    bench.add_argument("suite", help=(
        "cost | cost_bound | cost_two_zone_floor | cost_mismatch | controller | fast_layer | "
        "data | emulated | faults | cant_be_late | cant_be_late_trainwise | "
        "cant_be_late_ceiling | stragglers_ddp | "
        "time_to_quality | rl | rl_retraining | ingestion | fidelity | end_to_end | hpo | all"))
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="options passed to the suite "
                       "(SUITE --help lists them; cost: --collections, --jobs, --gang-size)")
    bench.set_defaults(func=_cmd_bench)

    explain = sub.add_parser("explain", help="print the decision timeline of a run")
    explain.add_argument("run", help="run id (the Dagster run id of the training run)")
    explain.add_argument("--summary", action="store_true",
                         help="one screen of where every dollar of the run's bill went "
                         "(market, boots, notices, saves, waste, saving against on-demand)")
    explain.set_defaults(func=_cmd_explain)

    forecast = sub.add_parser("forecast", help="P50/P90 cost and completion time of a job "
                              "before launch (from its measured throughput), or of a live run")
    forecast.add_argument("partition", nargs="?", default="", help="the job's data partition")
    forecast.add_argument("--steps", "--max-steps", dest="steps", type=int, default=0,
                          help="steps of the job (default: the launchpad's max_steps; a "
                          "registered job (--job) has none: give it)")
    forecast.add_argument("--deadline-h", type=float, default=None, help="deadline in hours "
                          "(default TRAINWISE_FORECAST_DEADLINE_H)")
    forecast.add_argument("--run", default="", help="re-forecast this live run (its bill so "
                          "far plus the steps left) instead")
    forecast.add_argument("--job", default="", help="a registered job of "
                          "TRAINWISE_PROJECT_FILE instead (sized from its runs, else a probe "
                          "of its first steps)")
    forecast.add_argument("--market", default="spot", help="with --job: the fixed market of "
                          "its node (spot or on_demand), when no --allocation-policy")
    forecast.add_argument("--allocation-policy", default="", help="with --job: the policy "
                          "holding its node (as the Launchpad's allocation_policy)")
    forecast.set_defaults(func=_cmd_forecast)

    ingest = sub.add_parser("ingest", help="ingest a run's telemetry into DuckDB again (after "
                            "a run reported the ingest as pending)")
    ingest.add_argument("run", help="training run id (its folder under $TRAINWISE_HOME/runs)")
    ingest.set_defaults(func=_cmd_ingest)

    show = sub.add_parser("settings", help="print every setting with its current value")
    show.set_defaults(func=_cmd_settings)
    return parser


def main(argv: list[str] | None = None) -> int:
    # First thing: the imports below take seconds, and a SIGTERM there ended the process
    # without a word. Python lets only the main thread install a handler.
    previous = (signal.signal(signal.SIGTERM, _on_sigterm)
                if threading.current_thread() is threading.main_thread() else None)
    try:
        return _main(argv)
    except Terminated:
        print("trainwise: stopped by SIGTERM (exit 143); a training run in progress keeps its "
              "last checkpoint and resumes from it", file=sys.stderr)
        return EXIT_SIGTERM
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    from trainwise.preflight import PreflightError
    from trainwise.runs import RunFailedError

    try:
        return int(args.func(args) or 0)
    except Terminated:
        raise
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, KeyError, PreflightError) as error:
        # SettingError is a ValueError: the message names the variable and the fix.
        print(f"trainwise: error: {error}", file=sys.stderr)
        return 2
    except RunFailedError as error:
        print(f"trainwise: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
