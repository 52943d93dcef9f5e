"""`python -m trainwise.agent --store STORE --run-id ID [--job NAME] [--run-dir DIR]`.

Runs the run's task (the launcher's `runs/<ID>/agent/task.json` in the store STORE: a folder the
node mounts, or `s3://bucket/prefix`) on this
node and exits with the job's exit code (0 completed, 143 preempted with its checkpoint
committed, 2 refused before anything started); see docs/agent.md.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from trainwise import settings
from trainwise.agent.agent import REFUSED_EXIT_CODE, NodeAgent
from trainwise.agent.task import _JOB_NAME
from trainwise.object_store import parse_s3_location


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainwise.agent",
        description="The node agent: runs a run's job from its task in the store, answers the "
                    "node's end (metadata notices, SIGTERM) and exits with the job's code "
                    "(docs/agent.md).")
    parser.add_argument("--store", required=True,
                        help="the object store: s3://bucket/prefix (endpoint "
                             "TRAINWISE_S3_ENDPOINT_URL, credentials boto3's chain) or a folder")
    parser.add_argument("--run-id", required=True,
                        help="the run; its task is runs/<run-id>/agent/task.json in the store")
    parser.add_argument("--job", default=None,
                        help="the job name the task must name (refused otherwise)")
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="the node's local run folder; default "
                             "$TRAINWISE_HOME/agent_runs/<run-id>")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s trainwise.agent %(levelname)s %(message)s")
    log = logging.getLogger("trainwise.agent")
    if args.store.startswith("s3:"):
        try:
            parse_s3_location(args.store)
        except ValueError as error:
            log.error("--store: %s", error)
            return REFUSED_EXIT_CODE
    if not _JOB_NAME.fullmatch(args.run_id):
        log.error("--run-id %r must match %s", args.run_id, _JOB_NAME.pattern)
        return REFUSED_EXIT_CODE
    try:
        run_dir = args.run_dir or settings.home_dir() / "agent_runs" / args.run_id
        agent = NodeAgent(args.store, args.run_id, run_dir, job_name=args.job)
    except settings.SettingError as error:
        log.error("refused, nothing was started: %s", error)
        return REFUSED_EXIT_CODE
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
