"""A test double of the clouds' instance metadata services, on 127.0.0.1 or a given address
(http.server, a thread); the node agent's tests and the cluster benchmark serve notices with it.

One server answers the three clouds' paths as they do (only what the node agent asks):

- EC2 IMDSv2: `PUT /latest/api/token` needs `X-aws-ec2-metadata-token-ttl-seconds` (400
  without); every `GET /latest/...` needs a token it issued in `X-aws-ec2-metadata-token` (401
  without). `spot/instance-action` and `events/recommendations/rebalance` answer 404 until the
  test injects a notice (`inject_spot`, `inject_rebalance`).
- GCP: `GET /computeMetadata/v1/instance/preempted` needs `Metadata-Flavor: Google` (403
  without); FALSE until `inject_gcp_preempted`.
- Azure: `GET /metadata/scheduledevents?api-version=...` needs `Metadata: true` (400 without);
  no events until `inject_azure`.

`requests` lists (method, path, status) of every request, for assertions.
"""

from __future__ import annotations

import json
import threading
import uuid
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


def iso_in(seconds: float) -> str:
    moment = datetime.now(UTC) + timedelta(seconds=seconds)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


class ImdsDouble:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.tokens: set[str] = set()
        self.spot_action: dict[str, Any] | None = None
        self.rebalance: dict[str, Any] | None = None
        self.gcp_preempted = False
        self.azure_events: list[dict[str, Any]] = []
        self.local_ipv4: str | None = None  # meta-data/local-ipv4, when set
        self.instance_id: str | None = None  # meta-data/instance-id, when set
        self.requests: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()
        double = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _answer(self, status: int, body: bytes | str = b"",
                        kind: str = "text/plain") -> None:
                data = body.encode() if isinstance(body, str) else body
                with double._lock:
                    double.requests.append((self.command, self.path, status))
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self) -> None:  # noqa: N802 - http.server's name
                if urlsplit(self.path).path != "/latest/api/token":
                    return self._answer(404, "Not Found")
                ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
                if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                    return self._answer(400, "Bad Request")
                token = uuid.uuid4().hex
                with double._lock:
                    double.tokens.add(token)
                return self._answer(200, token)

            def do_GET(self) -> None:  # noqa: N802
                parts = urlsplit(self.path)
                path = parts.path
                if path.startswith("/latest/"):
                    if self.headers.get("X-aws-ec2-metadata-token") not in double.tokens:
                        return self._answer(401, "Unauthorized")
                    if path == "/latest/meta-data/spot/instance-action":
                        if double.spot_action is None:
                            return self._answer(404, "Not Found")
                        return self._answer(200, json.dumps(double.spot_action),
                                            "application/json")
                    if path == "/latest/meta-data/local-ipv4" and double.local_ipv4:
                        return self._answer(200, double.local_ipv4)
                    if path == "/latest/meta-data/instance-id" and double.instance_id:
                        return self._answer(200, double.instance_id)
                    if path == "/latest/meta-data/events/recommendations/rebalance":
                        if double.rebalance is None:
                            return self._answer(404, "Not Found")
                        return self._answer(200, json.dumps(double.rebalance),
                                            "application/json")
                    return self._answer(404, "Not Found")
                if path == "/computeMetadata/v1/instance/preempted":
                    if self.headers.get("Metadata-Flavor") != "Google":
                        return self._answer(403, "Missing Metadata-Flavor:Google header.")
                    return self._answer(200, "TRUE" if double.gcp_preempted else "FALSE")
                if path == "/metadata/scheduledevents":
                    if (self.headers.get("Metadata") != "true"
                            or "api-version" not in parse_qs(parts.query)):
                        return self._answer(400, json.dumps({"error": "Bad request"}))
                    body = {"DocumentIncarnation": len(double.azure_events),
                            "Events": double.azure_events}
                    return self._answer(200, json.dumps(body), "application/json")
                return self._answer(404, "Not Found")

        # `host`: an address a network-namespace host of a test cluster reaches (its bridge's).
        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="imds-double",
                                        daemon=True)

    def __enter__(self) -> ImdsDouble:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- what a test injects -------------------------------------------------------------------
    def inject_spot(self, action: str = "terminate", in_s: float = 120.0) -> str:
        """The spot instance-action EC2 serves two minutes (`in_s`) before the node's end."""
        self.spot_action = {"action": action, "time": iso_in(in_s)}
        return self.spot_action["time"]

    def inject_rebalance(self) -> str:
        self.rebalance = {"noticeTime": iso_in(0)}
        return self.rebalance["noticeTime"]

    def inject_gcp_preempted(self) -> None:
        self.gcp_preempted = True

    def inject_azure(self, event_type: str = "Preempt", in_s: float = 30.0) -> dict[str, Any]:
        event = {"EventId": str(uuid.uuid4()).upper(), "EventType": event_type,
                 "ResourceType": "VirtualMachine", "Resources": ["node_0"],
                 "EventStatus": "Scheduled",
                 "NotBefore": format_datetime(datetime.now(UTC) + timedelta(seconds=in_s),
                                              usegmt=True),
                 "Description": "", "EventSource": "Platform", "DurationInSeconds": -1}
        self.azure_events.append(event)
        return event
