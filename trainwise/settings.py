"""Every setting trainwise reads, in one place, each an environment variable with a default.

Only this module reads the environment for configuration, so the README's settings table can be
checked against `SETTINGS` (a test does). Secrets (AWS keys) are never read here: boto3 takes
them from its own environment chain, so they cannot leak into params or metadata.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

PROJECT_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Setting:
    name: str
    default: str
    help: str

    @property
    def shown_default(self) -> str:
        """The default as the README shows it: relative to the project, "(empty)" if empty."""
        shown = self.default.replace(str(PROJECT_ROOT), "<project>")
        return shown.replace(str(PROJECT_ROOT.parent), "<project>/..") or "(empty)"


SETTINGS: tuple[Setting, ...] = (
    Setting("TRAINWISE_HOME", str(PROJECT_ROOT / ".trainwise"),
            "state folder: shards, curricula, checkpoints, telemetry, DuckDB, MLflow, Dagster"),
    Setting("TRAINWISE_DATA_DIR", str(PROJECT_ROOT.parent / "shared" / "data"),
            "real data (corpora, images, spot traces); when missing, the demo falls back to "
            "Python's own standard library as its corpus"),
    Setting("TRAINWISE_DUCKDB_PATH", "", "DuckDB file for telemetry; empty = $TRAINWISE_HOME/trainwise.duckdb"),
    Setting("TRAINWISE_MLFLOW_URI", "", "MLflow tracking URI (e.g. http://127.0.0.1:5000); "
            "empty = sqlite:///$TRAINWISE_HOME/mlflow.db"),
    Setting("TRAINWISE_POSTGRES_URL", "", "PostgreSQL of a multi-machine deployment, "
            "postgresql+psycopg2://USER@HOST:PORT/DB (password in PGPASSWORD, not in the URL): "
            "Dagster's instance storage in DB, MLflow's backend store in DB_mlflow unless "
            "TRAINWISE_MLFLOW_URI is set; empty = embedded sqlite under TRAINWISE_HOME"),
    Setting("TRAINWISE_S3_BUCKET", "", "S3 bucket for checkpoints; empty = local folder "
            "$TRAINWISE_HOME/objects"),
    Setting("TRAINWISE_S3_ENDPOINT_URL", "", "S3 endpoint override (moto_server, MinIO); empty = AWS"),
    Setting("TRAINWISE_S3_PREFIX", "trainwise", "key prefix inside the S3 bucket"),
    Setting("TRAINWISE_INSTANCE_TYPE", "p3.2xlarge", "instance type the emulated node stands for "
            "(sets the USD price)"),
    Setting("TRAINWISE_REGION", "us-west-2", "AWS region whose list prices bill the emulated node"),
    Setting("TRAINWISE_PRUNING_RATE", "0.3", "share of low-difficulty examples pruned per epoch; 0 keeps all"),
    Setting("TRAINWISE_DEMO_PARTITION", "", "data partition of the demo; empty = tinyshakespeare, "
            "or pystdlib when the shared data is missing"),
    Setting("TRAINWISE_TORCH_THREADS", "1", "torch intra-op threads in the trainer"),
    Setting("TRAINWISE_PROVIDER", "emulated", "compute provider of cloud.providers: emulated | "
            "aws | kubernetes | one registered by TRAINWISE_PROVIDER_MODULES"),
    Setting("TRAINWISE_PROVIDER_MODULES", "", "comma-separated Python modules (import paths) "
            "imported before the provider is looked up, each registering a compute provider "
            "with @register_provider (cloud/providers/registry.py); empty = the built-ins only"),
    Setting("TRAINWISE_EC2_ENDPOINT_URL", "", "EC2 (and SSM, for the image parameter) endpoint "
            "override (moto_server in tests); empty = AWS"),
    Setting("TRAINWISE_EC2_IMAGE_ID", "", "aws: the AMI (ami-...) the nodes boot, with "
            "trainwise installed so that the node agent starts (docs/agent.md); required unless "
            "TRAINWISE_EC2_IMAGE_PARAMETER is set"),
    Setting("TRAINWISE_EC2_IMAGE_PARAMETER", "", "aws: an SSM parameter (e.g. /trainwise/node-ami) "
            "whose value is the AMI id, read at the first launch (at TRAINWISE_EC2_ENDPOINT_URL); "
            "instead of TRAINWISE_EC2_IMAGE_ID"),
    Setting("TRAINWISE_EC2_INSTANCE_PROFILE", "", "aws, required: the IAM instance profile (name "
            "or ARN) of the nodes, their credentials for the object store (user-data carries no "
            "keys)"),
    Setting("TRAINWISE_EC2_SUBNET_IDS", "", "aws, required: comma-separated subnets (subnet-...) "
            "of the nodes, one per zone a run may be placed in; runs go only to their zones"),
    Setting("TRAINWISE_EC2_SECURITY_GROUP_IDS", "", "aws, required: comma-separated security "
            "groups (sg-...) of the nodes, in the subnets' VPC"),
    Setting("TRAINWISE_EC2_TAGS", "", "aws: extra tags on every node, comma-separated KEY=VALUE "
            "(keys not aws: or trainwise:)"),
    Setting("TRAINWISE_EC2_AGENT_COMMAND", "python3 -m trainwise.agent", "aws: the command that "
            "starts the node agent on the AMI (e.g. /opt/trainwise/.venv/bin/python -m "
            "trainwise.agent); the nodes' user-data runs it with the run's --store and --run-id"),
    Setting("TRAINWISE_K8S_IMAGE", "", "kubernetes, required: the image the pods run, with "
            "trainwise installed (deploy/Dockerfile)"),
    Setting("TRAINWISE_K8S_NAMESPACE", "default", "kubernetes: the namespace of the run's pods"),
    Setting("TRAINWISE_K8S_CAPACITY_LABEL", "karpenter.sh/capacity-type", "kubernetes: the node "
            "label that holds the market, selected by the pod and tolerated as a taint for spot "
            "(GKE: cloud.google.com/gke-spot)"),
    Setting("TRAINWISE_K8S_SPOT_VALUES", "spot,on-demand", "kubernetes: the capacity label's "
            "values for spot and on-demand, comma-separated (GKE: true,false)"),
    Setting("TRAINWISE_K8S_GRACE_S", "120", "kubernetes: the pods' termination grace period, "
            "the notice a drained node gives the agent"),
    Setting("TRAINWISE_K8S_AGENT_COMMAND", "python -m trainwise.agent", "kubernetes: the "
            "command that starts the node agent in the image"),
    Setting("TRAINWISE_ALLOCATION_POLICY", "trainwise_heuristic", "node allocation policy of the "
            "schedule until an approved schedule_change replaces it"),
    Setting("TRAINWISE_APPROVERS", "", "comma-separated identities allowed to approve schedule "
            "changes (the Dagster run's user tag, else the typed name); empty = anyone"),
    Setting("TRAINWISE_REQUIRE_VERIFIED_APPROVER", "0", "1 = refuse an approval whose run has no "
            "Dagster user tag (set by Dagster+ or the authenticating proxy deployment)"),
    Setting("TRAINWISE_SENSOR_INTERVAL_S", "300", "least seconds between two ticks of the "
            "slow-policy sensor in the daemon (how soon a live run meets a decision or an "
            "approved schedule)"),
    Setting("TRAINWISE_MIN_FORECAST_SAVINGS_USD", "0", "schedule gate: least forecast P50 "
            "savings (USD per run) a schedule change must show"),
    Setting("TRAINWISE_MAX_EVAL_LOSS_REGRESSION", "0.05", "schedule gate: largest rise of the "
            "eval loss (recent runs, new vs current pruning rate) a change may show"),
    Setting("TRAINWISE_BUDGET_USD", "50", "budget of the schedule (until an approved "
            "schedule_change sets budget_usd); a train launch whose forecast P90 exceeds it is "
            "refused (schedule_override_reason overrides), and so is the p90_within_budget check"),
    Setting("TRAINWISE_FORECAST_WORK_GPU_H", "24", "work of the next run in GPU-hours (before "
            "pruning), for cost_forecast"),
    Setting("TRAINWISE_FORECAST_DEADLINE_H", "36", "deadline of the next run in hours, for "
            "cost_forecast, the job forecast and the launch's budget gate"),
    Setting("TRAINWISE_FORECAST_SAMPLES", "64", "Monte Carlo start times per policy in "
            "cost_forecast"),
    Setting("TRAINWISE_PROJECT_FILE", "", "a team's project file (TOML, kept in its own "
            "repository): its [datasets.NAME] become data_shards partitions when the code "
            "location loads (docs/user_datasets.md); empty = the built-in partitions only"),
    Setting("TRAINWISE_SPOT_TRACES", "availability-1node-aws-2023-02", "spot trace folder under "
            "$TRAINWISE_DATA_DIR/spot that cost_forecast replays; missing = embedded market"),
    Setting("TRAINWISE_AGENT_METADATA", "none", "the node agent's metadata service: ec2 (IMDSv2 "
            "spot/instance-action and rebalance) | gcp (instance/preempted) | azure (Scheduled "
            "Events) | none (SIGTERM only)"),
    Setting("TRAINWISE_AGENT_METADATA_URL", "", "the node agent's metadata endpoint; empty = "
            "the cloud's own (http://169.254.169.254 for ec2 and azure, "
            "http://metadata.google.internal for gcp)"),
    Setting("TRAINWISE_AGENT_POLL_S", "1", "seconds between two questions of the node agent "
            "to the metadata service"),
    Setting("TRAINWISE_AGENT_NOTICE_MARGIN_S", "10", "the node agent SIGTERMs a job still "
            "running this many seconds before the notice's end, and kills it this long after"),
    Setting("TRAINWISE_AGENT_NODE_ID", "", "the provider's id of this node, reported in the "
            "agent's status so the launcher names a node whose agent never reported (EC2: read "
            "from IMDSv2 when empty; the kubernetes provider sets the pod's name)"),
    Setting("TRAINWISE_AGENT_NODE_ADDR", "", "the address the other hosts of a multi-host gang "
            "reach this node at (on EC2 its private IPv4); the node whose address is the "
            "rendezvous endpoint's host hosts it; empty = torchrun's guess from the hostname"),
    Setting("TRAINWISE_AGENT_TELEMETRY_EVERY_S", "30", "seconds between two copies of the "
            "job's telemetry into the object store by the node agent (and once at the end)"),
    Setting("TRAINWISE_AGENT_TASK_WAIT_S", "600", "seconds a node agent waits for its run's "
            "task to appear in the store (the launcher writes it once the nodes have addresses) "
            "before it refuses"),
    Setting("TRAINWISE_NODE_PROJECT_DIR", "", "where a node's image holds the team's project "
            "folder (the agent runs the registered job from there); empty = the same path as "
            "on the launching machine"),
)

_BY_NAME = {s.name: s for s in SETTINGS}

# Most torch intra-op threads a trainer may ask for; more than the machine has only slows it.
MAX_TORCH_THREADS = 1024


class SettingError(ValueError):
    """A setting whose value cannot be used; the message names the variable, the value and the
    valid range (a ValueError, so callers that catch bad input catch this too)."""


def get(name: str) -> str:
    """The value of a trainwise setting: the environment, else its documented default."""
    if name not in _BY_NAME:
        raise KeyError(f"unknown setting {name!r}; known: {', '.join(sorted(_BY_NAME))}")
    value = os.environ.get(name, "")
    return value if value != "" else _BY_NAME[name].default


def _range_text(minimum: float | None, maximum: float | None, max_inclusive: bool) -> str:
    low = "-inf" if minimum is None else f"{minimum:g}"
    high = "inf" if maximum is None else f"{maximum:g}"
    return f"[{low}, {high}{']' if max_inclusive else ')'}"


def get_float(name: str, minimum: float | None = None, maximum: float | None = None, *,
              max_inclusive: bool = True) -> float:
    """A setting as a finite float in [minimum, maximum] (or [minimum, maximum) when
    `max_inclusive` is False); otherwise a SettingError naming the variable and the range."""
    raw = get(name)
    valid = _range_text(minimum, maximum, max_inclusive)
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    too_high = maximum is not None and (value > maximum or (not max_inclusive and value == maximum))
    if not math.isfinite(value) or (minimum is not None and value < minimum) or too_high:
        raise SettingError(
            f"{name}={raw!r} is not a number in {valid}; set {name} to a number in {valid} "
            f"or unset it for the default {_BY_NAME[name].default!r}")
    return value


def get_int(name: str, minimum: int | None = None, maximum: int | None = None) -> int:
    """A setting as an integer in [minimum, maximum]; otherwise a SettingError naming the
    variable, the bad value and the range."""
    raw = get(name)
    valid = _range_text(minimum, maximum, True)
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or (minimum is not None and value < minimum) or (
            maximum is not None and value > maximum):
        raise SettingError(
            f"{name}={raw!r} is not a whole number in {valid}; set {name} to a whole number "
            f"in {valid} or unset it for the default {_BY_NAME[name].default!r}")
    return value


def pruning_rate() -> float:
    """TRAINWISE_PRUNING_RATE: share of easy examples pruned, in [0, 1)."""
    return get_float("TRAINWISE_PRUNING_RATE", 0.0, 1.0, max_inclusive=False)


def torch_threads() -> int:
    """TRAINWISE_TORCH_THREADS: torch intra-op threads of the trainer, >= 1."""
    return get_int("TRAINWISE_TORCH_THREADS", 1, MAX_TORCH_THREADS)


def min_forecast_savings_usd() -> float:
    """TRAINWISE_MIN_FORECAST_SAVINGS_USD: the schedule gate's least forecast savings (may be
    negative: a person may accept a dearer but safer schedule)."""
    return get_float("TRAINWISE_MIN_FORECAST_SAVINGS_USD")


def max_eval_loss_regression() -> float:
    """TRAINWISE_MAX_EVAL_LOSS_REGRESSION: the schedule gate's largest eval-loss rise, >= 0."""
    return get_float("TRAINWISE_MAX_EVAL_LOSS_REGRESSION", 0.0)


def sensor_interval_s() -> int:
    """TRAINWISE_SENSOR_INTERVAL_S: the slow-policy sensor's minimum interval, 5 s to 1 day."""
    return get_int("TRAINWISE_SENSOR_INTERVAL_S", 5, 86_400)


def budget_usd() -> float:
    """TRAINWISE_BUDGET_USD: the next run's budget, > 0 (0 would warn on every forecast)."""
    return get_float("TRAINWISE_BUDGET_USD", 0.0)


# A partition names a folder (shards/<partition>, curricula/<partition>): one plain path part.
# fullmatch: `$` would let "mnist\n" through.
_PARTITION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


def demo_partition() -> str:
    """TRAINWISE_DEMO_PARTITION: '' (the demo chooses) or a plain name: letters, digits, '_'
    and '-', no path separators or dots, so `../../etc` is refused here with the other settings
    rather than later by Dagster with a traceback. Whether the name is a known partition is
    checked by `training.shards.validate_partition` (this module imports nothing of ours)."""
    raw = get("TRAINWISE_DEMO_PARTITION")
    if raw and not _PARTITION_NAME.fullmatch(raw):
        raise SettingError(
            f"TRAINWISE_DEMO_PARTITION={raw!r} is not a partition name (letters, digits, '_' "
            "or '-'; no path separators or dots); set it to a partition such as "
            "tinyshakespeare, pystdlib or mnist, or unset it for the default")
    return raw


def home_dir() -> Path:
    """The state folder (created on first use); everything trainwise writes lives under it.

    A TRAINWISE_HOME that is a file, or that cannot be created, is a SettingError naming the
    variable (not a bare FileExistsError from deep inside a run)."""
    raw = get("TRAINWISE_HOME")
    path = Path(raw).expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise SettingError(
            f"TRAINWISE_HOME={raw!r} is a file, not a folder; set TRAINWISE_HOME to a folder "
            "(it is created if missing), or move the file away")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SettingError(
            f"TRAINWISE_HOME={raw!r} cannot be created ({error.strerror or error}); set "
            "TRAINWISE_HOME to a writable folder") from error
    return path


def data_dir() -> Path:
    """Where the real shared data lives (may not exist: callers fall back)."""
    return Path(get("TRAINWISE_DATA_DIR")).expanduser().resolve()


def project_file() -> Path | None:
    """TRAINWISE_PROJECT_FILE: the team's project file, or None (the built-in partitions only).
    Whether it exists and parses is checked by `trainwise.user_project` (it names the fix)."""
    raw = get("TRAINWISE_PROJECT_FILE")
    return Path(raw).expanduser().resolve() if raw else None


def duckdb_path() -> Path:
    value = get("TRAINWISE_DUCKDB_PATH")
    return Path(value).expanduser().resolve() if value else home_dir() / "trainwise.duckdb"


# Dagster and MLflow both hand the URL to SQLAlchemy, whose 2.1 reads a bare postgresql:// with
# psycopg 3; the driver installed is psycopg2, so the URL names it.
POSTGRES_SCHEME = "postgresql+psycopg2"
MLFLOW_DB_SUFFIX = "_mlflow"  # MLflow's own database: both it and Dagster keep alembic_version


def postgres_url() -> str:
    """TRAINWISE_POSTGRES_URL checked: '' (embedded sqlite) or
    postgresql+psycopg2://USER@HOST[:PORT]/DB.

    A password in the URL is refused: libpq takes it from PGPASSWORD (or ~/.pgpass), so the URL
    can show in dagster.yaml, MLflow and the Launchpad without a secret in it."""
    raw = get("TRAINWISE_POSTGRES_URL")
    if not raw:
        return ""
    form = f"{POSTGRES_SCHEME}://USER@HOST:PORT/DB (password in PGPASSWORD)"
    try:
        parts = urlsplit(raw)
        has_password, host, _port = parts.password is not None, parts.hostname, parts.port
    except ValueError:  # a port that is not a number
        parts, has_password, host = None, False, None
    if has_password:
        raise SettingError("TRAINWISE_POSTGRES_URL has a password in it; remove it from the URL "
                           "and export PGPASSWORD instead (libpq reads it), so no log shows it")
    database = parts.path.lstrip("/") if parts else ""
    if parts is None or parts.scheme != POSTGRES_SCHEME or not host or not parts.username \
            or not database or "/" in database:
        raise SettingError(f"TRAINWISE_POSTGRES_URL={raw!r} is not {form}; set it so, or unset "
                           "it for the embedded sqlite")
    return raw


def mlflow_uri() -> str:
    """TRAINWISE_MLFLOW_URI; else DB_mlflow on TRAINWISE_POSTGRES_URL's server; else sqlite."""
    value = get("TRAINWISE_MLFLOW_URI")
    if value:
        return value
    postgres = postgres_url()
    if postgres:
        parts = urlsplit(postgres)
        return urlunsplit(parts._replace(path=parts.path + MLFLOW_DB_SUFFIX))
    return f"sqlite:///{home_dir() / 'mlflow.db'}"


def check_all() -> None:
    """Checks every typed setting at once (the CLI calls it before any slow work); raises a
    SettingError listing each bad one."""
    problems = []
    for check in (home_dir, pruning_rate, torch_threads, min_forecast_savings_usd,
                  max_eval_loss_regression, budget_usd, postgres_url, demo_partition):
        try:
            check()
        except SettingError as error:
            problems.append(str(error))
    if problems:
        raise SettingError("\n".join(problems))
