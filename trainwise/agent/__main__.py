"""`python -m trainwise.agent --store ROOT --run-id ID [--job NAME] [--run-dir DIR]`.

Runs the run's task (the launcher's `runs/<ID>/agent/task.json` in the store at ROOT) on this
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainwise.agent",
        description="The node agent: runs a run's job from its task in the store, answers the "
                    "node's end (metadata notices, SIGTERM) and exits with the job's code "
                    "(docs/agent.md).")
    parser.add_argument("--store", required=True, type=Path,
                        help="the object store's root folder (a local folder standing for it)")
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
    if str(args.store).startswith("s3:"):
        log.error("--store %s: an S3 store is not supported by the agent yet (the SDK's "
                  "checkpoints go to a folder); give a folder", args.store)
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
