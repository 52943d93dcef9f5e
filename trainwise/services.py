"""What the run path shares about external services: the unreachable error and bounded retries.

A service that is down before training starts is refused at once (each service's
`check_reachable`); one that drops while a run is going is retried with exponential backoff,
bounded in tries and seconds, so a flaky network costs a minute, not the trained model.
No dagster, mlflow or boto3 import here: this module is imported by all of them.
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


class ServiceUnreachableError(RuntimeError):
    """An external service (MLflow, S3) could not be reached; the message names it and the fix."""


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff: `tries` attempts, waiting first_delay_s, then x factor, capped.

    The default waits 4 + 8 + 16 + 32 = 60 s in all between its 5 tries.
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


# Words in an exception chain that mean "try again later", not "your request is wrong".
_TRANSIENT_WORDS = (
    "connection refused", "connection reset", "connection aborted", "max retries exceeded",
    "failed to establish a new connection", "timed out", "timeout", "temporarily unavailable",
    "name or service not known", "temporary failure in name resolution", "database is locked",
    "broken pipe", "remote end closed", "could not connect to the endpoint",
    "slowdown", "service unavailable",
)
# Busy/overloaded HTTP statuses as whole numbers (not digits inside a run id).
_TRANSIENT_STATUS = re.compile(r"\b(429|502|503|504)\b")


def _chain(error: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def is_transient(error: BaseException) -> bool:
    """True for connection failures, timeouts and busy/overloaded answers anywhere in the chain."""
    for link in _chain(error):
        if isinstance(link, (ConnectionError, TimeoutError, socket.timeout, socket.gaierror)):
            return True
        text = f"{type(link).__name__}: {link}".lower()
        if any(word in text for word in _TRANSIENT_WORDS) or _TRANSIENT_STATUS.search(text):
            return True
        if type(link).__name__ in {"EndpointConnectionError", "ConnectTimeoutError",
                                   "ReadTimeoutError", "ConnectionClosedError",
                                   "NewConnectionError", "MaxRetryError"}:
            return True
    return False


def retry(call: Callable[[], T], *, what: str, backoff: Backoff | None = None,
          transient: Callable[[BaseException], bool] = is_transient,
          sleep: Callable[[float], object] = time.sleep,
          on_retry: Callable[[int, float, BaseException], None] | None = None) -> T:
    """`call()`, retried on transient errors with `backoff`; other errors pass through at once.

    After the last try the error is raised again as ServiceUnreachableError naming `what`.
    """
    backoff = backoff or Backoff()
    delays = backoff.delays_s()
    for attempt in range(backoff.tries):
        try:
            return call()
        except Exception as error:
            if not transient(error):
                raise
            if attempt >= len(delays):
                waited_s = sum(delays)
                raise ServiceUnreachableError(
                    f"{what} failed {backoff.tries} times over {waited_s:.0f} s of backoff; "
                    f"last error: {error}") from error
            if on_retry is not None:
                on_retry(attempt + 1, delays[attempt], error)
            sleep(delays[attempt])
    raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises


def tcp_probe(host: str, port: int, timeout_s: float) -> None:
    """Open and close one TCP connection; raises OSError when nothing answers in time."""
    with socket.create_connection((host, port), timeout=timeout_s):
        pass
