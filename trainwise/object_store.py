"""Where checkpoints go: a local folder by default, S3 when a bucket is set.

The S3 client is handed in (built by `dagster_aws.s3.S3Resource` in `assets/resources.py`), so this
module needs neither Dagster nor credentials: boto3 finds those in its own environment chain.

Checkpoints are uploaded as they are written (`CheckpointUploader`, one background thread), each
as three objects in this order: the payload, its manifest, then `<key>.commit` (sha256, bytes,
step). A reader trusts only a checkpoint whose commit marker exists and whose payload matches it
(`latest_committed_checkpoint`), so a node lost mid-upload never leaves a half checkpoint that
looks whole: it loses at most the checkpoint interval.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import tenacity

from trainwise.services import (
    Backoff,
    ServiceUnreachableError,
    is_transient,
    retrying,
    tcp_probe,
)

LOG = logging.getLogger("trainwise.upload")
MANIFEST_SUFFIX = ".manifest.json"
COMMIT_SUFFIX = ".commit"
MAX_COMMIT_BYTES = 64 * 1024  # a commit marker is ~300 bytes; never read a huge one
SETTINGS_HINT = ("set TRAINWISE_S3_BUCKET and TRAINWISE_S3_ENDPOINT_URL to a reachable store, or "
                 "leave TRAINWISE_S3_BUCKET empty to keep checkpoints in $TRAINWISE_HOME/objects")


class ObjectStore(Protocol):
    def put_file(self, local_path: Path, key: str, *, sha256: str | None = None) -> str: ...
    def put_bytes(self, data: bytes, key: str) -> str: ...
    def get_file(self, key: str, local_path: Path) -> Path: ...
    def get_bytes(self, key: str) -> bytes: ...
    def exists(self, key: str) -> bool: ...
    def list_keys(self, prefix: str) -> list[str]: ...
    def delete(self, key: str) -> None: ...
    def uri(self, key: str) -> str: ...
    def check_reachable(self) -> None: ...
    def put_checkpoint(self, path: Path, manifest_path: Path, key: str, *,
                       step: int | None = None, sha256: str | None = None) -> str: ...


def _check_key(key: str) -> str:
    if not key or key.startswith("/") or ".." in Path(key).parts:
        raise ValueError(f"object key {key!r} must be a relative path without '..'")
    return key


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_small_json(data: bytes, what: str) -> dict[str, Any]:
    if len(data) > MAX_COMMIT_BYTES:
        raise ValueError(f"{what} is {len(data)} bytes, more than a manifest can be")
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{what} is not valid JSON ({error})") from error
    if not isinstance(value, dict):
        raise ValueError(f"{what} is not a JSON object")
    return value


class _CheckpointPuts:
    """The checkpoint upload protocol, shared by both stores (built on put_file / put_bytes)."""

    def put_checkpoint(self, path: Path, manifest_path: Path, key: str, *,
                       step: int | None = None, sha256: str | None = None) -> str:
        """Upload payload, manifest, then `<key>.commit` last; returns the payload's URI.

        The local payload is checked against its manifest first, so a file damaged on the node
        is never committed to the store (ValueError naming the file).
        """
        path, manifest_path = Path(path), Path(manifest_path)
        manifest = _read_small_json(manifest_path.read_bytes(), f"manifest {manifest_path}")
        actual = sha256_of(path)
        expected = sha256 or manifest.get("sha256") or actual
        if actual != expected or manifest.get("sha256", actual) != actual:
            raise ValueError(
                f"checkpoint {path} does not match its manifest {manifest_path} (sha256 {actual} "
                f"!= {expected}): the local file is damaged; it is not uploaded")
        size_bytes = path.stat().st_size
        step = step if step is not None else int(manifest.get("step", -1))
        uri = self.put_file(path, key, sha256=actual)  # type: ignore[attr-defined]
        self.put_file(manifest_path, key + MANIFEST_SUFFIX)  # type: ignore[attr-defined]
        commit = {
            "format": "trainwise-checkpoint-commit", "version": 1, "payload": key,
            "manifest": key + MANIFEST_SUFFIX, "sha256": actual, "bytes": size_bytes,
            "step": step, "committed_at": datetime.now(UTC).isoformat(),
        }
        self.put_bytes(json.dumps(commit).encode(), key + COMMIT_SUFFIX)  # type: ignore[attr-defined]
        return uri


class LocalObjectStore(_CheckpointPuts):
    """Objects as files under one root folder; puts are atomic (copy to a temp file, rename)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def uri(self, key: str) -> str:
        return (self.root / _check_key(key)).as_uri()

    def _put_atomic(self, write: Any, key: str) -> str:
        target = self.root / _check_key(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".put-")
        os.close(fd)
        try:
            write(tmp)
            with open(tmp, "rb") as handle:
                os.fsync(handle.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return target.as_uri()

    def put_file(self, local_path: Path, key: str, *, sha256: str | None = None) -> str:
        return self._put_atomic(lambda tmp: shutil.copyfile(local_path, tmp), key)

    def put_bytes(self, data: bytes, key: str) -> str:
        return self._put_atomic(lambda tmp: Path(tmp).write_bytes(data), key)

    def get_file(self, key: str, local_path: Path) -> Path:
        source = self.root / _check_key(key)
        if not source.exists():
            raise FileNotFoundError(f"object {key!r} not found under {self.root}")
        local_path = Path(local_path)
        local_path.parent.mkdir(parents=True, exist_ok=True)
        # Copied to an unpredictable temp name, then renamed: shutil.copyfile onto `local_path`
        # (a predictable name in the run folder, `.step-N.pt.download`) would write through a
        # link planted there (issue 31, class 2). As boto3's download_file does for s3.
        fd, tmp = tempfile.mkstemp(dir=local_path.parent, prefix=f".{local_path.name}.",
                                   suffix=".tmp")
        os.fchmod(fd, 0o644)  # mkstemp makes it private; copyfile keeps the mode
        os.close(fd)
        try:
            shutil.copyfile(source, tmp)
            os.replace(tmp, local_path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return local_path

    def get_bytes(self, key: str) -> bytes:
        source = self.root / _check_key(key)
        if not source.exists():
            raise FileNotFoundError(f"object {key!r} not found under {self.root}")
        return source.read_bytes()

    def exists(self, key: str) -> bool:
        return (self.root / _check_key(key)).exists()

    def delete(self, key: str) -> None:
        """Removes the object; one that is not there is not an error (as S3's delete_object)."""
        (self.root / _check_key(key)).unlink(missing_ok=True)

    def list_keys(self, prefix: str) -> list[str]:
        folder = self.root / _check_key(prefix.strip("/"))
        if not folder.is_dir():
            return []
        return sorted(p.relative_to(self.root).as_posix() for p in folder.rglob("*")
                      if p.is_file() and not p.name.startswith(".put-"))

    def check_reachable(self) -> None:
        """The root folder exists (or can be made) and takes a file."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.root, prefix=".put-probe-"):
                pass
        except OSError as error:
            raise ServiceUnreachableError(
                f"local object store {self.root} is not a writable folder ({error}); set "
                "TRAINWISE_HOME to a writable folder, or TRAINWISE_S3_BUCKET to use S3"
            ) from error


def _proxied(url: str) -> bool:
    """True when requests to `url` go through an HTTP proxy (then a direct TCP probe means
    nothing)."""
    host = urlsplit(url).hostname or ""
    proxies = urllib.request.getproxies()
    return bool(proxies.get(urlsplit(url).scheme)) and not urllib.request.proxy_bypass(host)


# botocore's own retries for each S3 call. "standard" mode retries connection errors, timeouts,
# throttling (SlowDown, Throttling) and 5xx answers, told apart by exception type and error code,
# with jittered exponential backoff: that rides out a blip inside one call, while
# CheckpointUploader's backoff (UPLOAD_BACKOFF) rides out an endpoint gone for a minute.
# Given as total_max_attempts (tries including the first): botocore's `max_attempts` key counts
# only the retries after it. dagster-aws's S3Resource builds the job's client in standard mode too.
S3_TOTAL_ATTEMPTS = 5


def s3_client_config(total_attempts: int = S3_TOTAL_ATTEMPTS, **options: Any) -> Any:
    """A botocore Config with standard-mode retries, `total_attempts` tries per call in all."""
    from botocore.config import Config  # botocore only where S3 is used: the local store needs none

    return Config(retries={"mode": "standard", "total_max_attempts": total_attempts}, **options)


def s3_client(endpoint_url: str | None = None, region_name: str | None = None, *,
              total_attempts: int = S3_TOTAL_ATTEMPTS) -> Any:
    """A boto3 S3 client with `s3_client_config` retries; credentials from boto3's own chain."""
    import boto3  # heavy and optional: only an S3 store needs it

    return boto3.client("s3", endpoint_url=endpoint_url or None, region_name=region_name,
                        config=s3_client_config(total_attempts))


class StoreUnavailableError(OSError):
    """An S3 call failed (the endpoint, credentials or bucket): an OSError, as a folder store's
    failures are, so a node's agent and SDK handle both alike; botocore's error is its cause
    (`services.is_transient` reads it there)."""


def _missing(error: BaseException) -> bool:
    response = getattr(error, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    return code in ("404", "NoSuchKey", "NotFound")


def _s3_errors(what: str) -> Any:
    """S3ObjectStore's calls raise FileNotFoundError for a missing key and StoreUnavailableError
    for any other botocore failure, each naming the call and the object."""
    def wrap(method: Any) -> Any:
        def call(self: S3ObjectStore, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except OSError:
                raise
            except Exception as error:
                if type(error).__module__.split(".")[0] not in ("botocore", "boto3", "s3transfer"):
                    raise
                key = next((a for a in args if isinstance(a, str)), "")
                where = f"{what} {key!r} in s3://{self.bucket}/{self.prefix}"
                if _missing(error):
                    raise FileNotFoundError(f"{where}: no such object") from error
                raise StoreUnavailableError(f"{where} failed at {self.endpoint}: "
                                            f"{type(error).__name__}: {error}") from error
        call.__name__, call.__doc__ = method.__name__, method.__doc__
        return call
    return wrap


S3_URI_PREFIX = "s3://"


def parse_s3_location(location: str) -> tuple[str, str]:
    """(bucket, prefix) of `s3://bucket[/prefix]`; ValueError naming the fix otherwise."""
    if not location.startswith(S3_URI_PREFIX):
        raise ValueError(f"{location!r} is not an s3:// location (s3://bucket/prefix)")
    bucket, _, prefix = location[len(S3_URI_PREFIX):].partition("/")
    if not 3 <= len(bucket) <= 63 or not all(c.isalnum() or c in ".-" for c in bucket):
        raise ValueError(f"{location!r}: the bucket {bucket!r} is not an S3 bucket name (3-63 "
                         "lower-case letters, digits, dots and dashes); give s3://bucket/prefix")
    return bucket, prefix.strip("/")


def store_at(location: str | os.PathLike[str]) -> ObjectStore:
    """The store at `location`, as a node's agent and the SDK reach it: `s3://bucket/prefix`
    (endpoint TRAINWISE_S3_ENDPOINT_URL, empty for AWS; region and credentials from boto3's own
    chain, an instance profile on EC2), or a folder."""
    text = os.fspath(location)
    if text.startswith(S3_URI_PREFIX):
        from trainwise import settings

        bucket, prefix = parse_s3_location(text)
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None
        return S3ObjectStore(s3_client(settings.get("TRAINWISE_S3_ENDPOINT_URL") or None,
                                       region), bucket, prefix)
    return LocalObjectStore(Path(text))


def store_location(store: ObjectStore) -> str:
    """What `store_at` takes to reach `store` again (a node's `--store`)."""
    if isinstance(store, S3ObjectStore):
        return f"{S3_URI_PREFIX}{store.bucket}/{store.prefix}".rstrip("/")
    return str(Path(store.root).resolve())  # type: ignore[attr-defined]


class S3ObjectStore(_CheckpointPuts):
    """Objects in an S3 bucket under a prefix, through a boto3 client (S3 puts are atomic).
    Failures are OSErrors (`_s3_errors`): FileNotFoundError for a missing key."""

    def __init__(self, client: Any, bucket: str, prefix: str = "trainwise") -> None:
        if len(bucket) < 3:
            raise ValueError(
                f"S3 bucket name {bucket!r} is too short: S3 needs 3-63 characters "
                "(set TRAINWISE_S3_BUCKET)"
            )
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/")

    def _full_key(self, key: str) -> str:
        key = _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._full_key(key)}"

    @property
    def endpoint(self) -> str:
        return str(getattr(getattr(self.client, "meta", None), "endpoint_url", "") or "AWS")

    @_s3_errors("put")
    def put_file(self, local_path: Path, key: str, *, sha256: str | None = None) -> str:
        """Upload one file; its sha256 (computed unless given) goes into the object metadata."""
        self.client.upload_file(
            str(local_path), self.bucket, self._full_key(key),
            ExtraArgs={"Metadata": {"sha256": sha256 or sha256_of(Path(local_path))}},
        )
        return self.uri(key)

    @_s3_errors("put")
    def put_bytes(self, data: bytes, key: str) -> str:
        self.client.put_object(Bucket=self.bucket, Key=self._full_key(key), Body=data)
        return self.uri(key)

    @_s3_errors("get")
    def get_file(self, key: str, local_path: Path) -> Path:
        Path(local_path).parent.mkdir(parents=True, exist_ok=True)
        self.client.download_file(self.bucket, self._full_key(key), str(local_path))
        return Path(local_path)

    @_s3_errors("get")
    def get_bytes(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=self._full_key(key))["Body"].read()

    @_s3_errors("head")
    def exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._full_key(key))
        except Exception as error:  # botocore ClientError 404: keep botocore out of imports
            if "404" in str(error) or "Not Found" in str(error):
                return False
            raise
        return True

    @_s3_errors("delete")
    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._full_key(key))

    @_s3_errors("list")
    def list_keys(self, prefix: str) -> list[str]:
        full = self._full_key(prefix.strip("/")) + "/"
        strip = len(self.prefix) + 1 if self.prefix else 0
        keys: list[str] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=full):
            keys += [item["Key"][strip:] for item in page.get("Contents", [])]
        return sorted(keys)

    def check_reachable(self, timeout_s: float = 2.0) -> None:
        """The endpoint answers (a TCP probe: a dead endpoint fails in milliseconds, not after
        boto3's retries) and the bucket exists and is ours (head_bucket)."""
        where = f"S3 bucket {self.bucket!r} at endpoint {self.endpoint}"
        endpoint = getattr(getattr(self.client, "meta", None), "endpoint_url", None)
        if endpoint and not _proxied(endpoint):
            parts = urlsplit(endpoint)
            try:
                tcp_probe(parts.hostname or "", parts.port or (443 if parts.scheme == "https"
                                                               else 80), timeout_s)
            except OSError as error:
                raise ServiceUnreachableError(
                    f"{where} is unreachable ({error}); {SETTINGS_HINT}") from error
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except Exception as error:
            text = str(error)
            if "404" in text or "Not Found" in text or "NoSuchBucket" in text:
                reason = "the bucket does not exist: create it, or"
            elif "403" in text or "Forbidden" in text or "AccessDenied" in text:
                reason = ("access denied: check the AWS credentials boto3 finds "
                          "(AWS_PROFILE, AWS_ACCESS_KEY_ID), or")
            else:
                reason = "the endpoint did not answer:"
            raise ServiceUnreachableError(
                f"{where}: {reason} {SETTINGS_HINT} ({type(error).__name__}: {text})"
            ) from error


# -- background uploads -------------------------------------------------------------------------
# Waits between tries of one upload: 2 + 4 + 8 + 16 + 30 = 60 s, then the checkpoint is reported
# failed (it stays on local disk; the next checkpoint is tried afresh).
UPLOAD_BACKOFF = Backoff(tries=6, first_delay_s=2.0, factor=2.0, max_delay_s=30.0)


@dataclass
class UploadReport:
    """What the uploader did: uploaded payload URIs, failures and skipped checkpoints (key, why)."""

    uploaded: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    # Older checkpoints not uploaded because a newer one was waiting (only the newest matters).
    skipped: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed

    def summary(self) -> str:
        lines = [f"{len(self.uploaded)} checkpoint(s) uploaded, {len(self.failed)} failed, "
                 f"{len(self.skipped)} skipped (superseded)"]
        lines += [f"  failed {key}: {why}" for key, why in self.failed]
        return "\n".join(lines)


class CheckpointUploader:
    """Uploads checkpoints as they become durable locally, on one background thread.

    `submit(info)` only queues (it is called from the trainer's persist thread and must not
    block); the thread uploads with `put_checkpoint`, retrying with exponential backoff. When a
    newer checkpoint is queued, older ones still waiting are skipped: the store needs only the
    newest. `drain(timeout_s)` waits for the queue, stops the thread and returns the report.
    `info` is a `training._loop_persist.CheckpointInfo` or anything with its attributes
    (path, manifest_path, step, sha256).
    """

    def __init__(self, store: ObjectStore, key_prefix: str, *, backoff: Backoff = UPLOAD_BACKOFF,
                 supersede: bool = True) -> None:
        self.store = store
        self.key_prefix = _check_key(key_prefix.strip("/"))
        self.backoff = backoff
        self.supersede = supersede
        self._queue: deque[Any] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._abandon = threading.Event()
        self._report = UploadReport()
        self._thread: threading.Thread | None = None
        self._current: Any = None

    def key_for(self, info: Any) -> str:
        return f"{self.key_prefix}/{Path(info.path).name}"

    def submit(self, info: Any) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("CheckpointUploader.submit after drain(): create a new one")
            self._queue.append(info)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="checkpoint-upload",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def drain(self, timeout_s: float) -> UploadReport:
        """Wait up to timeout_s for every submitted checkpoint; what is left is reported failed."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            while (self._queue or self._busy) and time.monotonic() < deadline:
                self._cond.wait(timeout=max(deadline - time.monotonic(), 0.0))
            if self._queue or self._busy:
                self._abandon.set()  # the worker stops at its next wait
                why = f"not uploaded within drain timeout of {timeout_s:.0f} s (store unreachable?)"
                if self._busy and self._current is not None:
                    self._report.failed.append((self.key_for(self._current), why))
                self._report.failed += [(self.key_for(info), why) for info in self._queue]
                self._queue.clear()
            return UploadReport(list(self._report.uploaded), list(self._report.failed),
                                list(self._report.skipped))

    def _newer_waiting(self, info: Any) -> bool:
        with self._cond:
            return self.supersede and any(o.step > info.step for o in self._queue)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue or self._abandon.is_set():
                    return
                if self.supersede:
                    newest = max(self._queue, key=lambda o: o.step)
                    self._report.skipped += [
                        (self.key_for(o), f"superseded by step {newest.step}")
                        for o in self._queue if o is not newest]
                    self._queue.clear()
                    info = newest
                else:
                    info = self._queue.popleft()
                self._busy, self._current = True, info
            outcome, detail = self._upload_with_retries(info)
            with self._cond:
                if self._abandon.is_set():
                    pass  # drain() already reported it
                elif outcome == "uploaded":
                    self._report.uploaded.append(detail)
                elif outcome == "skipped":
                    self._report.skipped.append((self.key_for(info), detail))
                else:
                    self._report.failed.append((self.key_for(info), detail))
                self._busy, self._current = False, None
                self._cond.notify_all()

    def _upload_with_retries(self, info: Any) -> tuple[str, str]:
        """One checkpoint through a tenacity loop: transient errors (by type: the endpoint down,
        throttled, timing out) are retried with `self.backoff`; any other error fails it at once,
        since a retry cannot fix a denied access or a damaged file."""
        key = self.key_for(info)
        last: list[BaseException] = []  # the latest failed try's error, for the report

        def pause(delay_s: float) -> None:
            # tenacity's sleep: drain() may abandon the wait, and a newer checkpoint queued
            # meanwhile makes this one moot (the store needs only the newest).
            if self._abandon.wait(delay_s):
                raise _UploadAbandoned
            if self._newer_waiting(info):
                raise _UploadSuperseded

        def warn(state: tenacity.RetryCallState) -> None:
            error = state.outcome.exception() if state.outcome is not None else None
            last[:] = [error] if error is not None else []
            wait_s = state.next_action.sleep if state.next_action is not None else 0.0
            LOG.warning("checkpoint upload %s failed (try %d of %d), retrying in %.0f s: %s",
                        key, state.attempt_number, self.backoff.tries, wait_s, error)

        loop = retrying(self.backoff, transient=is_transient, sleep=pause, before_sleep=warn)
        try:
            uri = loop(self.store.put_checkpoint, Path(info.path), Path(info.manifest_path), key,
                       step=info.step, sha256=info.sha256)
            return "uploaded", uri
        except _UploadAbandoned:
            return "failed", f"abandoned at drain timeout; last error: {last[0] if last else ''}"
        except _UploadSuperseded:
            return "skipped", f"superseded while retrying ({last[0] if last else ''})"
        except tenacity.RetryError as gave_up:
            error = gave_up.last_attempt.exception()
            waited_s = sum(self.backoff.delays_s())
            return "failed", (f"{self.backoff.tries} tries over {waited_s:.0f} s failed; last "
                              f"error: {type(error).__name__}: {error}; {SETTINGS_HINT}")
        except (FileNotFoundError, ValueError) as error:  # pruned locally, or damaged
            if self._newer_waiting(info):
                return "skipped", f"superseded while it failed ({error})"
            return "failed", f"{error}"
        except Exception as error:  # noqa: BLE001 - not transient (access denied, no bucket)
            return "failed", (f"{type(error).__name__}: {error} (not a transient error, so not "
                              f"retried); {SETTINGS_HINT}")


class _UploadAbandoned(Exception):
    """Raised from the retry wait when drain() gave up on the upload."""


class _UploadSuperseded(Exception):
    """Raised from the retry wait when a newer checkpoint is queued."""


def local_checkpoint_uploader(root: str, key_prefix: str) -> CheckpointUploader:
    """Rank 0's uploader in a torchrun gang (`training.ddp_worker` spec "store"): a local folder
    standing for the object store."""
    return CheckpointUploader(LocalObjectStore(Path(root)), key_prefix)


# -- reading back -------------------------------------------------------------------------------
@dataclass(frozen=True)
class CommittedCheckpoint:
    key: str
    path: Path  # the downloaded payload (its manifest sits next to it)
    manifest_path: Path
    step: int
    sha256: str
    skipped: list[tuple[str, str]]  # newer commit markers that did not verify, and why


def latest_committed_checkpoint(store: ObjectStore, key_prefix: str,
                                download_dir: Path) -> CommittedCheckpoint | None:
    """Download the newest checkpoint under key_prefix whose commit marker exists and whose
    payload matches it (sha256, bytes); newer ones that fail are listed in `skipped`."""
    download_dir = Path(download_dir)
    skipped: list[tuple[str, str]] = []
    commits: list[tuple[int, str, dict[str, Any]]] = []
    for commit_key in store.list_keys(key_prefix):
        if not commit_key.endswith(COMMIT_SUFFIX):
            continue
        try:
            commit = _read_small_json(store.get_bytes(commit_key), f"commit marker {commit_key}")
            commits.append((int(commit["step"]), commit_key, commit))
        except (ValueError, KeyError, TypeError) as error:
            skipped.append((commit_key, f"unreadable commit marker: {error}"))
    for step, commit_key, commit in sorted(commits, reverse=True):
        key = commit_key[: -len(COMMIT_SUFFIX)]
        name = Path(key).name
        target, manifest = download_dir / name, download_dir / (name + MANIFEST_SUFFIX)
        partial = download_dir / f".{name}.download"
        partial_manifest = download_dir / f".{name}{MANIFEST_SUFFIX}.download"
        try:
            store.get_file(key, partial)
            size, digest = partial.stat().st_size, sha256_of(partial)
            if size != commit.get("bytes") or digest != commit.get("sha256"):
                raise ValueError(f"payload is {size} bytes with sha256 {digest}, the commit says "
                                 f"{commit.get('bytes')} bytes, {commit.get('sha256')}")
            store.get_file(key + MANIFEST_SUFFIX, partial_manifest)
            manifest_sha256 = _read_small_json(partial_manifest.read_bytes(),
                                               f"manifest of {key}").get("sha256")
            if manifest_sha256 != digest:
                raise ValueError(f"its manifest says sha256 {manifest_sha256}, payload is {digest}")
            # Payload first, manifest last: locally too, the manifest is what commits a file.
            os.replace(partial, target)
            os.replace(partial_manifest, manifest)
        except Exception as error:
            partial.unlink(missing_ok=True)
            partial_manifest.unlink(missing_ok=True)
            skipped.append((key, f"{type(error).__name__}: {error}"))
            continue
        return CommittedCheckpoint(key, target, manifest, step, digest, skipped)
    return None
