"""trainwise.services: bounded retries on tenacity, transient errors told apart by TYPE."""

import sqlite3

import pytest

from trainwise.services import Backoff, ServiceUnreachableError, is_transient, retry

FAST = Backoff(tries=4, first_delay_s=1.0, factor=2.0, max_delay_s=3.0)  # waits 1, 2, 3 s


class Flaky:
    """A call that raises `error` the first `failures` times, then returns "done"."""

    def __init__(self, error: BaseException, failures: int) -> None:
        self.error, self.failures, self.calls = error, failures, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "done"


def test_transient_error_by_type_is_retried_then_succeeds():
    waits, retried = [], []
    call = Flaky(ConnectionRefusedError(111, "refused"), failures=2)
    result = retry(call, what="MLflow log_batch", backoff=FAST, sleep=waits.append,
                   on_retry=lambda number, wait_s, error: retried.append((number, wait_s)))
    assert result == "done" and call.calls == 3
    assert waits == [1.0, 2.0]  # the injected sleep: the test never waits
    assert retried == [(1, 1.0), (2, 2.0)]


def test_non_transient_error_passes_through_at_once():
    waits = []
    call = Flaky(KeyError("run 5031abc"), failures=10)
    with pytest.raises(KeyError, match="5031abc"):
        retry(call, what="x", backoff=FAST, sleep=waits.append)
    assert call.calls == 1 and waits == []


@pytest.mark.parametrize("text", [
    "connection refused", "Read timed out", "503 Service Unavailable", "database is locked",
    "Max retries exceeded with url", "SlowDown: please reduce your request rate",
])
def test_transient_looking_text_on_a_non_transient_type_is_not_retried(text):
    # The old word list retried these: an error's type, not its wording, says it is transient.
    waits = []
    call = Flaky(ValueError(text), failures=10)
    assert not is_transient(ValueError(text))
    with pytest.raises(ValueError):
        retry(call, what="x", backoff=FAST, sleep=waits.append)
    assert call.calls == 1 and waits == []


def test_give_up_names_the_service_the_tries_and_the_fix():
    waits = []
    call = Flaky(TimeoutError("timed out after 30 s"), failures=10)
    what = "MLflow create_run at http://mlflow:5000 (check the server, or set TRAINWISE_MLFLOW_URI)"
    with pytest.raises(ServiceUnreachableError) as caught:
        retry(call, what=what, backoff=FAST, sleep=waits.append)
    message = str(caught.value)
    assert message.startswith(f"{what} failed 4 times over 6 s of backoff; last error: ")
    assert "timed out after 30 s" in message and "TRAINWISE_MLFLOW_URI" in message
    assert call.calls == 4 and waits == [1.0, 2.0, 3.0]
    assert isinstance(caught.value.__cause__, TimeoutError)


def test_one_try_backoff_never_waits():
    waits = []
    with pytest.raises(ServiceUnreachableError, match="failed 1 times over 0 s"):
        retry(Flaky(ConnectionResetError(), 5), what="x", backoff=Backoff(tries=1),
              sleep=waits.append)
    assert waits == []


def test_builtin_and_wrapped_connection_errors_are_transient():
    assert is_transient(ConnectionResetError()) and is_transient(BrokenPipeError())
    assert is_transient(TimeoutError())
    try:  # how MLflow wraps what requests raised: a new error raised inside `except`
        try:
            raise ConnectionRefusedError(111, "refused")
        except ConnectionRefusedError as error:
            raise RuntimeError(f"API request failed with exception {error}")  # noqa: B904
    except RuntimeError as wrapped:
        assert is_transient(wrapped)  # found by type in its __context__, not by its words
    assert not is_transient(RuntimeError("API request failed with exception refused"))


def test_sqlite_locked_is_the_one_case_told_by_its_message():
    assert is_transient(sqlite3.OperationalError("database is locked"))
    assert not is_transient(sqlite3.OperationalError("no such table: runs"))


def test_requests_and_urllib3_connection_errors_are_transient():
    requests = pytest.importorskip("requests")
    urllib3 = pytest.importorskip("urllib3")
    assert is_transient(requests.exceptions.ConnectionError("refused"))
    assert is_transient(requests.exceptions.ReadTimeout("slow"))
    assert not is_transient(requests.exceptions.InvalidURL("no scheme"))
    reason = urllib3.exceptions.NewConnectionError(None, "Failed to establish a new connection")
    assert is_transient(urllib3.exceptions.MaxRetryError(None, "/api", reason=reason))
    assert not is_transient(urllib3.exceptions.MaxRetryError(None, "/api", reason=None))


def _client_error(code: str, status: int):
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": code},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


@pytest.mark.parametrize(("code", "status", "transient"), [
    ("SlowDown", 503, True), ("RequestTimeout", 400, True), ("Throttling", 400, True),
    ("InternalError", 500, True), ("BadGateway", 502, True), ("TooMany", 429, True),
    ("AccessDenied", 403, False), ("NoSuchBucket", 404, False), ("InvalidArgument", 400, False),
])
def test_botocore_client_errors_by_code_and_status(code, status, transient):
    pytest.importorskip("botocore")
    assert is_transient(_client_error(code, status)) is transient


def test_botocore_connection_errors_are_transient():
    exceptions = pytest.importorskip("botocore.exceptions")
    assert is_transient(exceptions.EndpointConnectionError(endpoint_url="http://s3:9000"))
    assert is_transient(exceptions.ConnectTimeoutError(endpoint_url="http://s3:9000"))
    assert is_transient(exceptions.ReadTimeoutError(endpoint_url="http://s3:9000"))
    assert not is_transient(exceptions.NoCredentialsError())


def test_mlflow_errors_by_their_http_status():
    exceptions = pytest.importorskip("mlflow.exceptions")
    from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE

    busy = exceptions.MlflowException("busy", error_code=TEMPORARILY_UNAVAILABLE)
    assert busy.get_http_status_code() == 503 and is_transient(busy)
    # The server's own 500 answer (its backend store locked, say) is worth another try ...
    assert is_transient(exceptions.RestException(
        {"error_code": "INTERNAL_ERROR", "message": "(sqlite3.OperationalError) database is locked"}))
    assert not is_transient(exceptions.RestException(
        {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "Run 'abc' not found"}))
    # ... but a client-side MlflowException gets INTERNAL_ERROR by default: not transient.
    assert not is_transient(exceptions.MlflowException("could not connect, timed out"))
