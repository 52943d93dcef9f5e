"""What the run path shares about external services: the unreachable error and bounded retries.

A service that is down before training starts is refused at once (each service's
`check_reachable`); one that drops while a run is going is retried with exponential backoff,
bounded in tries and seconds, so a flaky network costs a minute, not the trained model.
The retry loop is tenacity's (`retrying`); what counts as transient is decided by the error's
TYPE (`is_transient`), never by English words in its message, with one commented exception.
No dagster, mlflow or boto3 import here: this module is imported by all of them (their error
types are looked up only when their module is already loaded, see `_loaded_types`).
"""

from __future__ import annotations

import socket
import sqlite3
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import tenacity

T = TypeVar("T")


class ServiceUnreachableError(RuntimeError):
    """An external service (MLflow, S3) could not be reached; the message names it and the fix."""


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff: `tries` attempts, waiting first_delay_s, then x factor, capped.

    The default waits 4 + 8 + 16 + 32 = 60 s in all between its 5 tries. `delays_s` is the one
    formula (the same as tenacity.wait_exponential(first_delay_s, max_delay_s, factor)); the
    tenacity loop waits exactly these, so a test that patches `delays_s` patches the waits.
    """

    tries: int = 5
    first_delay_s: float = 4.0
    factor: float = 2.0
    max_delay_s: float = 32.0

    def delays_s(self) -> list[float]:
        """The waits between tries (one fewer than tries)."""
        delays, delay = [], self.first_delay_s
        for _ in range(max(self.tries - 1, 0)):
            delays.append(min(delay, self.max_delay_s))
            delay *= self.factor
        return delays


# HTTP statuses that mean "busy or briefly broken, ask again": request timeout, too many
# requests, and the 5xx a restarting server or its proxy answers.
RETRYABLE_HTTP_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# S3/AWS error codes for throttling and timeouts (botocore's standard retry mode uses the same).
RETRYABLE_AWS_CODES = frozenset({
    "SlowDown", "RequestTimeout", "RequestTimeoutException", "Throttling", "ThrottlingException",
    "ThrottledException", "RequestThrottled", "RequestThrottledException", "TooManyRequestsException",
    "RequestLimitExceeded", "BandwidthLimitExceeded", "PriorRequestNotComplete",
    "ProvisionedThroughputExceededException", "ServiceUnavailable", "InternalError",
})
# MLflow error codes a server answers when it is busy or overloaded (HTTP 503, 504, 429).
# MLflow's default code INTERNAL_ERROR (500) is NOT here: every MlflowException raised on the
# client without a code gets it (a bad URI, a missing file), so only a server's answer
# (RestException, below) counts as transient at 500.
RETRYABLE_MLFLOW_CODES = frozenset({
    "TEMPORARILY_UNAVAILABLE", "DEADLINE_EXCEEDED", "REQUEST_LIMIT_EXCEEDED", "RESOURCE_EXHAUSTED",
})

# Python's own connection failures (refused, reset, broken pipe, remote end closed are all
# ConnectionError), timeouts (socket.timeout is TimeoutError) and a DNS lookup that failed.
_BUILTIN_TRANSIENT: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError,
                                                       socket.gaierror)
# (module, class names): connection and timeout errors of the HTTP stacks MLflow and boto3 use.
_LIBRARY_TRANSIENT = (
    ("requests.exceptions", ("ConnectionError", "Timeout", "ChunkedEncodingError")),
    ("urllib3.exceptions", ("ProtocolError", "NewConnectionError", "TimeoutError",
                            "ConnectTimeoutError", "ReadTimeoutError")),
    ("botocore.exceptions", ("EndpointConnectionError", "ConnectionClosedError",
                             "ConnectTimeoutError", "ReadTimeoutError")),
)


def _loaded_types(module: str, names: tuple[str, ...]) -> tuple[type[BaseException], ...]:
    """The named exception classes of `module` if it is already imported, else none: an error of
    a library that was never imported cannot exist, and importing boto3 or mlflow here to ask
    would cost seconds on every import of this module."""
    loaded = sys.modules.get(module)
    if loaded is None:
        return ()
    return tuple(cls for cls in (getattr(loaded, name, None) for name in names)
                 if isinstance(cls, type) and issubclass(cls, BaseException))


def _chain(error: BaseException) -> list[BaseException]:
    """The error, its causes and contexts (MLflow and boto3 wrap the socket error they got),
    and urllib3's MaxRetryError.reason (the connection error it gave up on)."""
    seen: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in seen:
        seen.append(current)
        reason = getattr(current, "reason", None)
        if isinstance(reason, BaseException) and reason not in seen:
            seen.append(reason)
        current = current.__cause__ or current.__context__
    return seen


def _transient_link(link: BaseException) -> bool:
    if isinstance(link, _BUILTIN_TRANSIENT):
        return True
    for module, names in _LIBRARY_TRANSIENT:
        if isinstance(link, _loaded_types(module, names)):
            return True
    # SQLite says "busy" only in its message: OperationalError also covers a missing table or a
    # syntax error, which retrying cannot fix. The one case recognised by text, on purpose.
    if isinstance(link, sqlite3.OperationalError) and "database is locked" in str(link).lower():
        return True
    client_error = _loaded_types("botocore.exceptions", ("ClientError",))
    if client_error and isinstance(link, client_error):
        response: dict[str, Any] = getattr(link, "response", None) or {}
        code = str(response.get("Error", {}).get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code in RETRYABLE_AWS_CODES or status in RETRYABLE_HTTP_STATUSES
    rest_error = _loaded_types("mlflow.exceptions", ("RestException",))
    mlflow_error = _loaded_types("mlflow.exceptions", ("MlflowException",))
    if mlflow_error and isinstance(link, mlflow_error):
        code = str(getattr(link, "error_code", ""))
        if code in RETRYABLE_MLFLOW_CODES:
            return True
        # A RestException is the server's own JSON answer: a 5xx there (its database locked,
        # a worker restarting) is the server's trouble, not our request's.
        return bool(rest_error) and isinstance(link, rest_error) and (
            link.get_http_status_code() in RETRYABLE_HTTP_STATUSES)
    return False


def is_transient(error: BaseException) -> bool:
    """True for connection failures, timeouts and busy/overloaded answers anywhere in the chain,
    decided by the errors' types and the status codes they carry, not by their text."""
    return any(_transient_link(link) for link in _chain(error))


def retrying(backoff: Backoff, *, transient: Callable[[BaseException], bool] = is_transient,
             sleep: Callable[[float], object] = time.sleep,
             before_sleep: Callable[[tenacity.RetryCallState], None] | None = None,
             ) -> tenacity.Retrying:
    """A tenacity loop of `backoff.tries` tries, waiting `backoff.delays_s()` between them,
    retrying only errors `transient` accepts (others are raised at once, unchanged). When every
    try failed it raises tenacity.RetryError; `retry` turns that into ServiceUnreachableError.
    `sleep` is injectable so tests never wait."""
    delays = backoff.delays_s()

    def wait_s(state: tenacity.RetryCallState) -> float:
        return delays[min(state.attempt_number, len(delays)) - 1] if delays else 0.0

    return tenacity.Retrying(
        stop=tenacity.stop_after_attempt(max(backoff.tries, 1)),
        wait=wait_s,
        retry=tenacity.retry_if_exception(transient),
        sleep=sleep,  # type: ignore[arg-type]
        before_sleep=before_sleep,
        reraise=False,
    )


def retry(call: Callable[[], T], *, what: str, backoff: Backoff | None = None,
          transient: Callable[[BaseException], bool] = is_transient,
          sleep: Callable[[float], object] = time.sleep,
          on_retry: Callable[[int, float, BaseException], None] | None = None) -> T:
    """`call()`, retried on transient errors with `backoff`; other errors pass through at once.

    After the last try the error is raised again as ServiceUnreachableError naming `what`
    (which should name the fix too). `on_retry(try_number, wait_s, error)` runs before each wait.
    """
    backoff = backoff or Backoff()

    def before_sleep(state: tenacity.RetryCallState) -> None:
        if on_retry is not None and state.outcome is not None:
            wait_s = state.next_action.sleep if state.next_action is not None else 0.0
            on_retry(state.attempt_number, wait_s, state.outcome.exception())

    try:
        return retrying(backoff, transient=transient, sleep=sleep,
                        before_sleep=before_sleep)(call)
    except tenacity.RetryError as gave_up:
        error = gave_up.last_attempt.exception()
        waited_s = sum(backoff.delays_s())
        raise ServiceUnreachableError(
            f"{what} failed {max(backoff.tries, 1)} times over {waited_s:.0f} s of backoff; "
            f"last error: {error}") from error


def tcp_probe(host: str, port: int, timeout_s: float) -> None:
    """Open and close one TCP connection; raises OSError when nothing answers in time."""
    with socket.create_connection((host, port), timeout=timeout_s):
        pass
