"""The user-data an `aws` node boots with: a cloud-init shell script that starts the node agent.

`agent_user_data(run_id, store_root, job=None, agent_command=...)` returns the script. On the
node, cloud-init runs it once, as root, at first boot. It:

1. exports TRAINWISE_HOME (the node's local state, `/var/lib/trainwise`) and, when the AMI has
   one, reads the env file `/etc/trainwise/agent.env` (where the AMI, not the launch, keeps
   what the agent needs and must not travel in user-data, such as TRAINWISE_STATE_KEY);
2. sets TRAINWISE_AGENT_METADATA=ec2, so the agent watches IMDSv2's spot/instance-action and
   rebalance recommendation;
3. execs the agent (`python3 -m trainwise.agent` unless the AMI installs it elsewhere) with the
   run's `--store`, `--run-id`, `--job` and a local `--run-dir`, its output appended to
   `/var/log/trainwise/agent-<run_id>.log`.

The AMI must have trainwise installed (docs/agent.md). The script carries no secret: it is
built only from the arguments below, never from the environment, and AWS credentials come from
the instance profile. User-data is readable by anyone who may describe the instance, so that
matters.

Every value is shell-quoted (`shlex.quote`), and refused when it has a newline or another
control character (a newline cannot be quoted safely through every tool that shows user-data).
The run id and the job name must also be names the agent accepts, so a node never boots into an
agent that refuses its arguments.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

DEFAULT_AGENT_COMMAND = "python3 -m trainwise.agent"
NODE_HOME = "/var/lib/trainwise"
LOG_DIR = "/var/log/trainwise"
ENV_FILE = "/etc/trainwise/agent.env"
# The names the agent accepts for --run-id and --job (trainwise/agent/task.py `_JOB_NAME`; a
# test checks they are the same: cloud/ may not import the agent).
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# EC2 refuses user-data over 16 KiB (before base64); ours is far smaller, unless a path is huge.
MAX_USER_DATA_BYTES = 16 * 1024
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_text(what: str, value: str, fix: str) -> str:
    """`value` as given, refused when empty or when it has a newline or another control
    character (they would split or hide a line of the script)."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} is empty; {fix}")
    if _CONTROL.search(value):
        raise ValueError(f"{what}={value!r} has a newline or another control character, which "
                         f"the node's user-data script cannot carry; {fix}")
    return value


def check_name(what: str, value: str) -> str:
    check_text(what, value, f"use letters, digits, '.', '_' and '-' ({NAME_PATTERN.pattern})")
    if not NAME_PATTERN.fullmatch(value):
        raise ValueError(f"{what}={value!r} is not a name the node agent accepts; use letters, "
                         f"digits, '.', '_' and '-' ({NAME_PATTERN.pattern})")
    return value


# An S3 store the node reaches with its instance profile (trainwise.object_store.store_at; the
# same bucket rule, kept here because cloud/ does not import trainwise).
S3_STORE = re.compile(r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[A-Za-z0-9!_.*'()/-]*)?")


def check_store_root(store_root: str) -> str:
    """The run's store as the node reaches it: `s3://bucket/prefix` (credentials from the
    instance profile, an endpoint override from the AMI's env file), or the absolute path of a
    folder the node mounts (docs/agent.md)."""
    fix = ("give s3://bucket/prefix (the node reaches it with its instance profile) or the "
           "absolute path of a folder store that the node mounts")
    check_text("the run's store", store_root, fix)
    if store_root.startswith("s3:"):
        if not S3_STORE.fullmatch(store_root):
            raise ValueError(f"the run's store {store_root!r} is not an S3 location this node "
                             f"can read; {fix}")
        return store_root
    if "://" in store_root or not store_root.startswith("/"):
        raise ValueError(f"the run's store {store_root!r} is not an absolute folder path; {fix}")
    return store_root


def agent_argv(agent_command: str) -> list[str]:
    """The agent command's words (shell syntax, as in a terminal: quotes allowed)."""
    fix = ("set TRAINWISE_EC2_AGENT_COMMAND to the command that starts the agent on the AMI, "
           f"such as {DEFAULT_AGENT_COMMAND!r}")
    check_text("TRAINWISE_EC2_AGENT_COMMAND", agent_command, fix)
    try:
        words = shlex.split(agent_command)
    except ValueError as error:
        raise ValueError(f"TRAINWISE_EC2_AGENT_COMMAND={agent_command!r} cannot be split into "
                         f"words ({error}); {fix}") from None
    if not words:
        raise ValueError(f"TRAINWISE_EC2_AGENT_COMMAND={agent_command!r} names no command; {fix}")
    return words


def agent_user_data(run_id: str, store_root: str, job: str | None = None, *,
                    agent_command: str = DEFAULT_AGENT_COMMAND, node_home: str = NODE_HOME,
                    log_dir: str = LOG_DIR, env_file: str = ENV_FILE) -> str:
    """The cloud-init script (see the module docstring). `node_home`, `log_dir` and `env_file`
    are the node's paths; a test moves them into a temporary folder to run the script."""
    check_name("the run id", run_id)
    if job is not None:
        check_name("the job name", job)
    argv = [*agent_argv(agent_command), "--store", check_store_root(store_root),
            "--run-id", run_id]
    if job is not None:
        argv += ["--job", job]
    run_dir = f"{node_home}/agent_runs/{run_id}"
    for what, path in (("node_home", node_home), ("log_dir", log_dir), ("env_file", env_file)):
        check_text(what, path, "give an absolute path")
    q = shlex.quote
    lines = [
        "#!/bin/bash",
        "# The trainwise node agent (cloud/providers/aws_user_data.py). No secret here: AWS",
        "# credentials come from the instance profile, anything else from the AMI's env file.",
        "set -eu",
        "umask 077",
        f"export TRAINWISE_HOME={q(node_home)}",
        f"mkdir -p -- {q(log_dir)} {q(run_dir)}",
        f"if [ -r {q(env_file)} ]; then set -a; . {q(env_file)}; set +a; fi",
        # After the env file: this node is an EC2 instance whatever the AMI's file says.
        "export TRAINWISE_AGENT_METADATA=ec2",
        f"exec {shlex.join([*argv, '--run-dir', run_dir])} "
        f">>{q(f'{log_dir}/agent-{run_id}.log')} 2>&1",
    ]
    script = "\n".join(lines) + "\n"
    if len(script.encode("utf-8")) > MAX_USER_DATA_BYTES:
        raise ValueError(f"the node's user-data is {len(script.encode('utf-8'))} bytes, over "
                         f"EC2's {MAX_USER_DATA_BYTES}; shorten the store path or the agent "
                         "command")
    return script


@dataclass(frozen=True)
class AgentBoot:
    """What a node needs to start the agent for one run. Checked when built (before any
    launch): a bad run id, job, store or agent command raises ValueError here."""

    run_id: str
    store_root: str
    job: str | None = None
    agent_command: str = DEFAULT_AGENT_COMMAND

    def __post_init__(self) -> None:
        self.user_data()

    def user_data(self) -> str:
        return agent_user_data(self.run_id, self.store_root, self.job,
                               agent_command=self.agent_command)
