"""MLflow: one run per training run, with cost against eval loss.

mlflow is imported lazily (about 1.2 s) so the CLI and the trainer's hot path never pay for it.
Parameters and tags pass through `scrub_params` first: a key that names a secret is dropped, and
a value that carries one (a password in a URL, a token of a known shape) is redacted, so secrets
never land in MLflow even when a caller hands them in by mistake.

Artifacts go under the state folder (`<state>/mlflow-artifacts/<experiment>`), never into
`<cwd>/mlruns`; a tracking server (http) decides its own artifact store.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

from trainwise.services import Backoff, ServiceUnreachableError, retry, tcp_probe

T = TypeVar("T")
LOG = logging.getLogger("trainwise.tracking")

_MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value
REDACTED = "***"
# The tag that makes the MLflow 3 UI open an experiment in its classic model-training view
# (values from the UI bundle of mlflow 3.17: genai_development | custom_model_development).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
URI_SETTING = "TRAINWISE_MLFLOW_URI"

# --- secrets by name -------------------------------------------------------------------------
# Matched anywhere in the normalised key (camelCase split, lower case, "_" between words).
_SECRET_NAME = re.compile(
    r"secret|passw(or)?d|credential|authori[sz]ation|bearer|cookie|"
    r"(private|access|session|ssh|api|signing|encryption|master)_?key",
)
# Matched only as a whole word, so max_tokens, tokenizer and tokens_seen stay.
_SECRET_WORDS = frozenset({"token", "pwd", "dsn", "apikey", "passphrase", "auth"})

# --- secrets by value ------------------------------------------------------------------------
_URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.\-]*://[^/\s:@]*:)(?P<password>[^/\s@]+)@",
                           re.I)
_QUERY_SECRET = re.compile(
    r"(?P<head>[?&](?:token|access_token|id_token|refresh_token|api_key|apikey|key|password|"
    r"secret|sig|signature|x-amz-signature|x-amz-credential|x-amz-security-token|"
    r"x-goog-signature|code)=)(?P<secret>[^&#\s]+)", re.I)
_TOKEN_SHAPES = re.compile("|".join((
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----(?:.*?-----END [A-Z ]*PRIVATE KEY-----|.*)",
    r"\b(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA)[A-Z0-9]{16}\b",   # AWS key ids
    r"\bgh[pousr]_[A-Za-z0-9]{30,}\b", r"\bgithub_pat_[A-Za-z0-9_]{22,}",  # GitHub
    r"\bxox[abposr]-[A-Za-z0-9-]{10,}",                                 # Slack
    r"\beyJ[A-Za-z0-9_-]{5,}\.eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]*",   # JWT
    r"\b(?:Bearer|Basic|Token)\s+[A-Za-z0-9._~+/=\-]{8,}",              # HTTP auth headers
    r"\bsk-(?:proj-|ant-)?[A-Za-z0-9_\-]{20,}",                         # OpenAI, Anthropic
    r"\bhf_[A-Za-z0-9]{30,}\b", r"\bAIza[0-9A-Za-z_\-]{35}\b",          # Hugging Face, Google
    r"\b[rs]k_live_[A-Za-z0-9]{16,}\b", r"\bnpm_[A-Za-z0-9]{36}\b",     # Stripe, npm
)), re.S)
# A bare value that looks random enough to be a key (AWS secret keys: 40 base64 characters).
# Hex (digests, run ids) is never treated as a secret: this project logs sha256s on purpose.
_KEY_LIKE = re.compile(r"[A-Za-z0-9+/=_\-]{32,256}")
_HEX_LIKE = re.compile(r"[0-9a-fA-F\-]+")


def _key_words(key: str) -> list[str]:
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", key)
    return [word for word in re.split(r"[^a-z0-9]+", spaced.lower()) if word]


def is_secret_name(key: str) -> bool:
    """True when a param or tag name says its value is a secret (api_key, DB_PASSWORD, dsn...)."""
    words = _key_words(key)
    return bool(_SECRET_WORDS.intersection(words)) or bool(_SECRET_NAME.search("_".join(words)))


def _entropy_bits_per_char(text: str) -> float:
    counts = Counter(text)
    return -sum(n / len(text) * math.log2(n / len(text)) for n in counts.values())


def _looks_like_random_key(value: str) -> bool:
    if not _KEY_LIKE.fullmatch(value) or _HEX_LIKE.fullmatch(value) or "//" in value:
        return False
    has_classes = (any(c.islower() for c in value) and any(c.isupper() for c in value)
                   and any(c.isdigit() for c in value))
    return has_classes and _entropy_bits_per_char(value) >= 4.5


def scrub_value(value: str) -> str:
    """The value with passwords in URLs, query-string secrets and token shapes replaced by ***."""
    if _looks_like_random_key(value.strip()):
        return REDACTED
    value = _URL_PASSWORD.sub(lambda m: f"{m['head']}{REDACTED}@", value)
    value = _QUERY_SECRET.sub(lambda m: f"{m['head']}{REDACTED}", value)
    return _TOKEN_SHAPES.sub(REDACTED, value)


def scrub_params(params: Mapping[str, Any]) -> dict[str, str]:
    """Params (or tags) as strings: secret names dropped, secrets inside values redacted."""
    clean: dict[str, str] = {}
    for key, value in params.items():
        if is_secret_name(str(key)):
            continue
        clean[str(key)] = scrub_value(str(value))[:_MAX_PARAM_CHARS]
    return clean


# --- reachability ----------------------------------------------------------------------------
def _is_http(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a sqlite:/// tracking URI, else None."""
    if not tracking_uri.startswith("sqlite:"):
        return None
    path = tracking_uri.split(":", 1)[1].lstrip("/")
    if not path or path == ":memory:":
        return None
    return Path("/" + path) if tracking_uri.startswith("sqlite:////") else Path(path).resolve()


def _check_http(real_uri: str, timeout_s: float) -> None:
    base = real_uri.rstrip("/")
    uri = scrub_value(real_uri)  # what messages show: never a password in the URL
    parts = urlsplit(base)
    try:
        # A TCP probe first: a dead port or host fails in milliseconds instead of a long timeout.
        tcp_probe(parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80),
                  timeout_s)
        request = urllib.request.Request(f"{base}/health")
        with urllib.request.urlopen(request, timeout=timeout_s):
            return
    except urllib.error.HTTPError as error:
        if error.code == 404:  # a server behind a proxy path may not route /health: try the API
            _check_http_api(base, timeout_s)
            return
        if error.code in (401, 403):
            raise ServiceUnreachableError(
                f"MLflow server {uri} refused the request (HTTP {error.code}): set the credentials "
                "MLflow reads (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD or "
                f"MLFLOW_TRACKING_TOKEN), or point {URI_SETTING} at another server") from error
        raise ServiceUnreachableError(
            f"MLflow server {uri} answered HTTP {error.code} on /health; check the server, or "
            f"set {URI_SETTING} to another server (empty = sqlite under TRAINWISE_HOME)"
        ) from error
    except OSError as error:
        raise ServiceUnreachableError(
            f"MLflow server {uri} is unreachable ({error}); start it, or set {URI_SETTING} to a "
            "reachable server (empty = sqlite under TRAINWISE_HOME)") from error


def _check_http_api(base: str, timeout_s: float) -> None:
    url = f"{base}/api/2.0/mlflow/experiments/search?max_results=1"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s):
            return
    except (OSError, urllib.error.HTTPError) as error:
        raise ServiceUnreachableError(
            f"{scrub_value(url)} does not answer as an MLflow server ({error}); check "
            f"{URI_SETTING}") from error


def _check_writable_folder(folder: Path, what: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ServiceUnreachableError(
            f"{what}: cannot create folder {folder} ({error}); set {URI_SETTING} or "
            "TRAINWISE_HOME to a writable place") from error
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise ServiceUnreachableError(
            f"{what}: folder {folder} is not a writable folder; set {URI_SETTING} or "
            "TRAINWISE_HOME to a writable place")


def check_reachable(tracking_uri: str, timeout_s: float = 5.0) -> None:
    """Raise ServiceUnreachableError (naming the URI and TRAINWISE_MLFLOW_URI) unless MLflow at
    `tracking_uri` can take a run: http answers /health, a sqlite file's folder is writable."""
    shown = scrub_value(tracking_uri)
    if _is_http(tracking_uri):
        _check_http(tracking_uri, timeout_s)
        return
    database = sqlite_path(tracking_uri)
    if database is not None:
        if database.is_dir():
            raise ServiceUnreachableError(
                f"MLflow tracking URI {shown} names a folder, not a database file; set "
                f"{URI_SETTING} to sqlite:///<folder>/mlflow.db")
        _check_writable_folder(database.parent, f"MLflow tracking URI {shown}")
        if database.is_file():
            with open(database, "rb") as handle:
                header = handle.read(16)
            if header and header != b"SQLite format 3\x00":
                raise ServiceUnreachableError(
                    f"MLflow tracking URI {shown}: {database} is not a SQLite database; move it "
                    f"away or set {URI_SETTING} to another file")
            if not os.access(database, os.R_OK | os.W_OK):
                raise ServiceUnreachableError(
                    f"MLflow tracking URI {shown}: {database} is not writable; fix its "
                    f"permissions or set {URI_SETTING} to another file")
        return
    if tracking_uri.startswith("file:") or "://" not in tracking_uri:
        folder = Path(unquote(urlsplit(tracking_uri).path) if tracking_uri.startswith("file:")
                      else tracking_uri)
        _check_writable_folder(folder.resolve(), f"MLflow tracking URI {shown}")
        return
    parts = urlsplit(tracking_uri)  # postgresql://, mysql://: the database port must answer
    if parts.hostname and parts.port:
        try:
            tcp_probe(parts.hostname, parts.port, timeout_s)
        except OSError as error:
            raise ServiceUnreachableError(
                f"MLflow backend {parts.scheme}://{parts.hostname}:{parts.port} is unreachable "
                f"({error}); check {URI_SETTING}") from error


# --- logging ---------------------------------------------------------------------------------
@dataclass
class RunRecord:
    """Everything one training run sends to MLflow."""

    experiment: str
    run_name: str
    params: Mapping[str, Any]
    # (step, {metric name: value}) along the run; names are namespaced ("losses/eval", "cost/usd").
    step_metrics: Iterable[tuple[int, Mapping[str, float]]] = ()
    final_metrics: Mapping[str, float] = field(default_factory=dict)
    tags: Mapping[str, str] = field(default_factory=dict)
    artifacts: Iterable[Path] = ()
    # Where new experiments keep artifacts (a local folder, e.g. <TRAINWISE_HOME>/mlflow-artifacts)
    # None = next to a sqlite database; ignored for an http server, which has its own store.
    artifact_root: Path | None = None


def default_artifact_root(tracking_uri: str) -> Path | None:
    """`<folder of the sqlite file>/mlflow-artifacts`; `<TRAINWISE_HOME>/mlflow-artifacts` for a
    database server (postgresql://, mysql://), which has no folder (MLflow would use
    `<cwd>/mlruns`); None for http servers, which keep their own artifact store."""
    database = sqlite_path(tracking_uri)
    if database is not None:
        return database.parent / "mlflow-artifacts"
    if tracking_uri.startswith(("postgresql:", "postgresql+", "mysql:", "mysql+")):
        from trainwise import settings

        return settings.home_dir() / "mlflow-artifacts"
    return None


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "experiment"


@contextmanager
def no_inner_http_retries() -> Iterator[None]:
    """MLflow's own HTTP retries wait ~4 minutes per call on a dead server (7 tries, factor 2):
    turn them down while we log, so our bounded backoff is the only one (unless a user set them)."""
    wanted = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}
    added = [name for name in wanted if name not in os.environ]
    for name in added:
        os.environ[name] = wanted[name]
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def mlflow_caller(tracking_uri: str, backoff: Backoff | None = None,
                  sleep: Callable[[float], object] = time.sleep) -> Callable[..., Any]:
    """`call(method, *args, **kwargs)`: one MLflow client call, retried on connection errors with
    `backoff`; after that ServiceUnreachableError names the URI and TRAINWISE_MLFLOW_URI."""
    def call(method: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return retry(lambda: method(*args, **kwargs), backoff=backoff, sleep=sleep,
                     what=f"MLflow {method.__name__} at {scrub_value(tracking_uri)} (check the "
                          f"server, or set {URI_SETTING})")
    return call


def experiment_id(client: Any, tracking_uri: str, name: str, artifact_root: Path | None,
                  call: Callable) -> str:
    """The id of experiment `name`, created (typed as model training) when it does not exist."""
    experiment = call(client.get_experiment_by_name, name)
    root = None if _is_http(tracking_uri) else (
        artifact_root or default_artifact_root(tracking_uri))
    if experiment is None:
        location = (Path(root).resolve() / _slug(name)).as_uri() if root else None
        try:
            return call(client.create_experiment, name,
                        artifact_location=location, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
        except Exception as error:  # created meanwhile by a concurrent run: use that one
            if "already exists" not in str(error).lower():
                raise
            experiment = call(client.get_experiment_by_name, name)
    if root and not str(experiment.artifact_location).startswith(Path(root).resolve().as_uri()):
        # MLflow cannot move an experiment's artifact location; say where they go instead.
        LOG.warning("MLflow experiment %r keeps its artifacts in %s (made by an older trainwise "
                    "or another tool), not under %s; rename or delete that experiment to move "
                    "them", name, experiment.artifact_location, root)
    if experiment.lifecycle_stage == "deleted":
        call(client.restore_experiment, experiment.experiment_id)
    if EXPERIMENT_KIND_TAG not in (experiment.tags or {}):
        call(client.set_experiment_tag, experiment.experiment_id, EXPERIMENT_KIND_TAG,
             EXPERIMENT_KIND)
    return experiment.experiment_id


def log_run(tracking_uri: str, record: RunRecord, *, artifact_root: Path | None = None,
            backoff: Backoff | None = None,
            sleep: Callable[[float], object] = time.sleep) -> str:
    """Log one run and return its MLflow run id.

    Each MLflow call is retried on connection errors with `backoff` (default 5 tries over 60 s);
    after that ServiceUnreachableError names the URI and TRAINWISE_MLFLOW_URI.
    `artifact_root` (or record.artifact_root) is where a NEW experiment keeps its artifacts.
    """
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

    if artifact_root is not None:
        record = dataclasses.replace(record, artifact_root=artifact_root)

    call = mlflow_caller(tracking_uri, backoff, sleep)
    with no_inner_http_retries():
        client = MlflowClient(tracking_uri=tracking_uri)
        experiment = experiment_id(client, tracking_uri, record.experiment, record.artifact_root,
                                   call)
        tags = scrub_params(record.tags)
        run = call(client.create_run, experiment, run_name=scrub_value(record.run_name),
                   tags=tags)
        run_id = run.info.run_id
        try:
            now_ms = int(time.time() * 1000)
            params = [Param(k, v) for k, v in scrub_params(record.params).items()]
            metrics = [
                Metric(name, float(value), now_ms, int(step))
                for step, values in record.step_metrics
                for name, value in values.items()
            ]
            final_step = max((m.step for m in metrics), default=0)
            metrics += [
                Metric(name, float(value), now_ms, final_step)
                for name, value in record.final_metrics.items()
            ]
            # log_batch takes at most 1000 metrics and 100 params per call.
            for start in range(0, len(params), 100):
                call(client.log_batch, run_id, params=params[start : start + 100])
            for start in range(0, len(metrics), 1000):
                call(client.log_batch, run_id, metrics=metrics[start : start + 1000])
            call(client.log_batch, run_id, tags=[RunTag("trainwise", "1")])
            for artifact in record.artifacts:
                call(client.log_artifact, run_id, str(artifact))
            call(client.set_terminated, run_id, "FINISHED")
        except BaseException:
            try:
                client.set_terminated(run_id, "FAILED")
            except Exception:  # the server is gone: the original error is the one to report
                pass
            raise
    return run_id


def run_url(tracking_uri: str, run_id: str) -> str:
    """Where a person finds the run: the server URL when there is one, else how to start the UI."""
    if _is_http(tracking_uri):
        return f"{scrub_value(tracking_uri).rstrip('/')}/#/runs/{run_id}"
    return f"mlflow ui --backend-store-uri {tracking_uri}  (then open run {run_id})"
