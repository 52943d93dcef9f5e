"""`trainwise`: the headless entry point (demo, ui, bench, explain, settings).

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

from trainwise import settings

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

    # Telemetry off; PostgreSQL storage when TRAINWISE_POSTGRES_URL is set; a user's own file is kept.
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
    demo.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
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
        "time_to_quality | rl | rl_retraining | ingestion | fidelity | end_to_end | all"))
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="options passed to the suite")
    bench.set_defaults(func=_cmd_bench)

    explain = sub.add_parser("explain", help="print the decision timeline of a run")
    explain.add_argument("run", help="run id (the Dagster run id of the training run)")
    explain.add_argument("--summary", action="store_true",
                         help="one screen of where every dollar of the run's bill went "
                         "(market, boots, notices, saves, waste, saving against on-demand)")
    explain.set_defaults(func=_cmd_explain)

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
