"""Watchers for the end of a node: each asks its cloud's instance metadata service over HTTP.

Each watcher is a small class whose `poll()` returns a `Notice` (or None: nothing new). They
use the standard library only (urllib, no proxy: a metadata address never goes through one)
with short timeouts, so a poll never holds the agent's loop for long.

- EC2 (`Ec2Watcher`): IMDSv2. A session token from `PUT /latest/api/token` (header
  `X-aws-ec2-metadata-token-ttl-seconds`), then `GET /latest/meta-data/spot/instance-action`
  (404: nothing; JSON `{"action": "terminate"|"stop"|"hibernate", "time": "...Z"}`: the node
  ends at `time`) and `GET /latest/meta-data/events/recommendations/rebalance` (404: nothing;
  `{"noticeTime": "...Z"}`: a raised risk, recorded, the job keeps running).
- GCP (`GcpWatcher`): `GET /computeMetadata/v1/instance/preempted` with `Metadata-Flavor:
  Google`; `TRUE` means the preemption has begun (about 30 s are left).
- Azure (`AzureWatcher`): Scheduled Events, `GET /metadata/scheduledevents?api-version=
  2020-07-01` with `Metadata: true`; an event of type `Preempt` (or `Terminate`) ends the node
  at its `NotBefore`; `Freeze`, `Reboot` and `Redeploy` are recorded and do not stop the job.

`probe()` asks the endpoint once at start: an endpoint that does not answer there is reported
by `watcher_from_settings` (the agent falls back to SIGTERM alone and says so).
"""

from __future__ import annotations

import json
import logging
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

from trainwise import settings

LOG = logging.getLogger("trainwise.agent")

CLOUDS = ("ec2", "gcp", "azure", "none")
DEFAULT_URLS = {"ec2": "http://169.254.169.254", "azure": "http://169.254.169.254",
                "gcp": "http://metadata.google.internal"}
# What a cloud leaves between its notice and the node's end when the notice names no time.
NOTICE_S = {"ec2": 120.0, "gcp": 30.0, "azure": 30.0}
HTTP_TIMEOUT_S = 1.0
PROBE_TIMEOUT_S = 2.0
EC2_TOKEN_TTL_S = 21600  # six hours, IMDSv2's most
EC2_TOKEN_REFRESH_S = 3600.0  # a fresh token well before the old one lapses
AZURE_API_VERSION = "2020-07-01"
MAX_BODY_BYTES = 64 * 1024
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


_IPV4 = re.compile(r"(?:(?:25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}"
                   r"(?:25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])")


_INSTANCE_ID = re.compile(r"i-[0-9a-f]{8,32}")


class MetadataUnreachableError(RuntimeError):
    """The metadata endpoint did not answer (or refused us); the message names it."""


@dataclass(frozen=True)
class Notice:
    """Something the node's cloud said about the node's end (or a raised risk of it)."""

    source: str  # "ec2 spot/instance-action", "gcp instance/preempted", "SIGTERM", ...
    kind: str  # terminate | stop | hibernate | preempt | rebalance | sigterm | freeze | ...
    received_wall_s: float  # when the agent saw it (time.time())
    ends_wall_s: float | None  # when the node ends (None: the notice says nothing of it)
    stops_job: bool  # False: recorded only (a rebalance recommendation, a Freeze)
    detail: dict[str, Any] = field(default_factory=dict)  # the cloud's own answer

    def record(self) -> dict[str, Any]:
        ends = self.ends_wall_s
        return {"source": self.source, "kind": self.kind, "stops_job": self.stops_job,
                "received_at": _iso(self.received_wall_s),
                "ends_at": _iso(ends) if ends is not None else None,
                "notice_s": round(ends - self.received_wall_s, 3) if ends is not None else None,
                "detail": self.detail}


def _iso(wall_s: float) -> str:
    return datetime.fromtimestamp(wall_s, UTC).isoformat(timespec="milliseconds")


def parse_time(text: Any) -> float | None:
    """An ISO 8601 time ("2024-05-01T12:00:00Z") or an RFC 1123 one (Azure's NotBefore) as wall
    seconds; None when absent or unreadable (the caller then assumes the cloud's usual notice)."""
    if not isinstance(text, str) or not text.strip():
        return None
    try:
        moment = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        try:
            moment = parsedate_to_datetime(text.strip())
        except (TypeError, ValueError, IndexError):
            return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def _request(url: str, *, method: str = "GET", headers: dict[str, str] | None = None,
             timeout_s: float = HTTP_TIMEOUT_S) -> tuple[int, bytes]:
    """(status, body); an HTTP error status is returned, not raised. A connection that fails or
    times out raises MetadataUnreachableError."""
    request = urllib.request.Request(url, method=method, headers=headers or {},
                                     data=b"" if method == "PUT" else None)
    try:
        with _NO_PROXY.open(request, timeout=timeout_s) as answer:
            return answer.status, answer.read(MAX_BODY_BYTES)
    except urllib.error.HTTPError as error:
        body = error.read(MAX_BODY_BYTES) if error.fp is not None else b""
        return error.code, body
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        raise MetadataUnreachableError(f"{method} {url}: {reason}") from error


def _json(body: bytes, what: str) -> Any:
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise MetadataUnreachableError(f"{what} answered something that is not JSON "
                                       f"({error}): {body[:200]!r}") from error


class _Watcher:
    cloud = "none"

    def __init__(self, base_url: str, *, clock: Any = time.time) -> None:
        self.base_url = base_url.rstrip("/")
        self.clock = clock

    def probe(self) -> None:
        """Raises MetadataUnreachableError when the endpoint does not answer as it should."""
        raise NotImplementedError

    def poll(self) -> Notice | None:
        raise NotImplementedError


class Ec2Watcher(_Watcher):
    """EC2 IMDSv2: spot/instance-action (the node's end) and the rebalance recommendation."""

    cloud = "ec2"
    ACTION_PATH = "/latest/meta-data/spot/instance-action"
    REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
    LOCAL_IPV4_PATH = "/latest/meta-data/local-ipv4"
    INSTANCE_ID_PATH = "/latest/meta-data/instance-id"

    def __init__(self, base_url: str, *, clock: Any = time.time) -> None:
        super().__init__(base_url, clock=clock)
        self._token: str | None = None
        self._token_wall_s = 0.0
        self._rebalance_seen: str | None = None
        self._action_seen: str | None = None

    def _fetch_token(self, timeout_s: float = HTTP_TIMEOUT_S) -> str:
        url = self.base_url + "/latest/api/token"
        status, body = _request(url, method="PUT", timeout_s=timeout_s, headers={
            "X-aws-ec2-metadata-token-ttl-seconds": str(EC2_TOKEN_TTL_S)})
        if status != 200 or not body.strip():
            raise MetadataUnreachableError(f"PUT {url} answered {status} (no IMDSv2 token: is "
                                           "the instance's metadata service turned off, or its "
                                           "hop limit too low for a container?)")
        self._token, self._token_wall_s = body.decode(errors="replace").strip(), self.clock()
        return self._token

    def _get(self, path: str) -> tuple[int, bytes]:
        if self._token is None or self.clock() - self._token_wall_s > EC2_TOKEN_REFRESH_S:
            self._fetch_token()
        status, body = _request(self.base_url + path,
                                headers={"X-aws-ec2-metadata-token": self._token or ""})
        if status == 401:  # the token lapsed (or the service restarted): one fresh try
            self._fetch_token()
            status, body = _request(self.base_url + path,
                                    headers={"X-aws-ec2-metadata-token": self._token or ""})
        return status, body

    def probe(self) -> None:
        self._fetch_token(PROBE_TIMEOUT_S)

    def local_ipv4(self) -> str | None:
        """The instance's private IPv4 (`meta-data/local-ipv4`): the address the other hosts
        of a gang reach it at. None when the service gives none or not an address."""
        status, body = self._get(self.LOCAL_IPV4_PATH)
        text = body.decode(errors="replace").strip()
        return text if status == 200 and _IPV4.fullmatch(text) else None

    def instance_id(self) -> str | None:
        """The instance's id (`meta-data/instance-id`), so the launcher can tell which of its
        nodes this agent runs on; None when the service gives none."""
        status, body = self._get(self.INSTANCE_ID_PATH)
        text = body.decode(errors="replace").strip()
        return text if status == 200 and _INSTANCE_ID.fullmatch(text) else None

    def poll(self) -> Notice | None:
        status, body = self._get(self.ACTION_PATH)
        if status == 200 and body.decode(errors="replace") != self._action_seen:
            answer = _json(body, self.ACTION_PATH)
            if isinstance(answer, dict):
                self._action_seen = body.decode(errors="replace")
                now = self.clock()
                action = str(answer.get("action", "terminate"))
                ends = parse_time(answer.get("time"))
                return Notice("ec2 spot/instance-action", action, now,
                              ends if ends is not None else now + NOTICE_S["ec2"], True, answer)
        status, body = self._get(self.REBALANCE_PATH)
        if status == 200 and body.decode(errors="replace") != self._rebalance_seen:
            answer = _json(body, self.REBALANCE_PATH)
            if isinstance(answer, dict):
                self._rebalance_seen = body.decode(errors="replace")
                return Notice("ec2 events/recommendations/rebalance", "rebalance", self.clock(),
                              None, False, answer)
        return None


class GcpWatcher(_Watcher):
    """GCP: instance/preempted turns TRUE when the preemption begins."""

    cloud = "gcp"
    PATH = "/computeMetadata/v1/instance/preempted"
    HEADERS = {"Metadata-Flavor": "Google"}

    def __init__(self, base_url: str, *, clock: Any = time.time) -> None:
        super().__init__(base_url, clock=clock)
        self._seen = False

    def _get(self, timeout_s: float = HTTP_TIMEOUT_S) -> str:
        status, body = _request(self.base_url + self.PATH, headers=self.HEADERS,
                                timeout_s=timeout_s)
        if status != 200:
            raise MetadataUnreachableError(f"GET {self.base_url + self.PATH} answered {status}")
        return body.decode(errors="replace").strip().upper()

    def probe(self) -> None:
        self._get(PROBE_TIMEOUT_S)

    def poll(self) -> Notice | None:
        if self._seen or self._get() != "TRUE":
            return None
        self._seen = True
        now = self.clock()
        return Notice("gcp instance/preempted", "preempt", now, now + NOTICE_S["gcp"], True,
                      {"preempted": "TRUE"})


class AzureWatcher(_Watcher):
    """Azure Scheduled Events: Preempt (a Spot eviction) and Terminate end the node."""

    cloud = "azure"
    PATH = f"/metadata/scheduledevents?api-version={AZURE_API_VERSION}"
    HEADERS = {"Metadata": "true"}
    STOPPING = ("Preempt", "Terminate")

    def __init__(self, base_url: str, *, clock: Any = time.time) -> None:
        super().__init__(base_url, clock=clock)
        self._seen: set[str] = set()

    def _events(self, timeout_s: float = HTTP_TIMEOUT_S) -> list[dict[str, Any]]:
        url = self.base_url + self.PATH
        status, body = _request(url, headers=self.HEADERS, timeout_s=timeout_s)
        if status != 200:
            raise MetadataUnreachableError(f"GET {url} answered {status}")
        answer = _json(body, url)
        events = answer.get("Events", []) if isinstance(answer, dict) else []
        return [event for event in events if isinstance(event, dict)]

    def probe(self) -> None:
        self._events(PROBE_TIMEOUT_S)

    def poll(self) -> Notice | None:
        events = [e for e in self._events() if str(e.get("EventId", e)) not in self._seen]
        if not events:
            return None
        # A stopping event first: it is the one the agent must act on.
        events.sort(key=lambda e: e.get("EventType") not in self.STOPPING)
        event = events[0]
        self._seen.add(str(event.get("EventId", event)))
        kind = str(event.get("EventType", "unknown"))
        stops = kind in self.STOPPING
        now = self.clock()
        ends = parse_time(event.get("NotBefore"))
        if stops and ends is None:
            ends = now + NOTICE_S["azure"]
        return Notice(f"azure scheduledevents {kind}", kind.lower(), now, ends, stops, event)


WATCHERS: dict[str, type[_Watcher]] = {"ec2": Ec2Watcher, "gcp": GcpWatcher,
                                       "azure": AzureWatcher}


@dataclass(frozen=True)
class WatchChoice:
    """What the agent watches: a watcher (None: SIGTERM alone) and why, in words."""

    cloud: str
    url: str
    watcher: _Watcher | None
    warning: str | None  # set when a cloud was named but its endpoint did not answer

    @property
    def describe(self) -> str:
        if self.watcher is None:
            return "SIGTERM only"
        return f"{self.cloud} metadata at {self.url} and SIGTERM"


def metadata_cloud() -> str:
    raw = settings.get("TRAINWISE_AGENT_METADATA").strip().lower()
    if raw not in CLOUDS:
        raise settings.SettingError(
            f"TRAINWISE_AGENT_METADATA={raw!r} is not one of {', '.join(CLOUDS)}; set it to the "
            "cloud the node runs on (none: watch SIGTERM only)")
    return raw


def metadata_url(cloud: str) -> str:
    raw = settings.get("TRAINWISE_AGENT_METADATA_URL").strip()
    if not raw:
        return DEFAULT_URLS.get(cloud, "")
    if not raw.startswith(("http://", "https://")):
        raise settings.SettingError(
            f"TRAINWISE_AGENT_METADATA_URL={raw!r} is not an http(s) URL; set it to the "
            "metadata endpoint's base (e.g. http://169.254.169.254) or unset it for the "
            "cloud's own")
    return raw.rstrip("/")


def watcher_from_settings() -> WatchChoice:
    """The watcher the settings name, probed once. An endpoint that does not answer gives a
    WatchChoice with no watcher and the warning (logged here): the agent watches SIGTERM only."""
    cloud = metadata_cloud()
    if cloud == "none":
        return WatchChoice(cloud, "", None, None)
    url = metadata_url(cloud)
    watcher = WATCHERS[cloud](url)
    try:
        watcher.probe()
    except MetadataUnreachableError as error:
        warning = (f"the {cloud} metadata endpoint {url} is unreachable ({error}); falling back "
                   "to SIGTERM alone: a spot notice that comes only through the metadata "
                   f"service will be missed. Fix: set TRAINWISE_AGENT_METADATA_URL to the "
                   f"node's metadata endpoint, or TRAINWISE_AGENT_METADATA=none (now {cloud!r}) "
                   "on a machine without one")
        LOG.warning("%s", warning)
        return WatchChoice(cloud, url, None, warning)
    return WatchChoice(cloud, url, watcher, None)
