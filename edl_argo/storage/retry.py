"""Bounded retries with exponential backoff for storage calls.

One helper, :func:`call_with_retry`, owns every retry edl-argo makes against remote storage. HTTP clients
below it are configured not to retry on their own, so the budget stated here is the real one:

* it retries until :attr:`RetryPolicy.max_seconds` have passed since the operation last made progress: since
  its first attempt, or since the moment an attempt last moved the transfer further than any attempt before
  it (a :class:`Progress` the operation reports bytes to). No attempt starts after that; an attempt already
  running may finish later, bounded by the client's socket timeouts (:func:`socket_timeouts`, well below
  the budget, so a stalled connection costs a fraction of it). A long upload or download interrupted after
  minutes of progress thus gets the whole budget again. :attr:`RetryPolicy.max_attempts` (unset by
  default) can cap the attempts too;
* between attempts it sleeps ``base_delay * 2**n`` seconds (capped at ``max_delay``) with "equal jitter":
  a random delay between half and all of that, so that many workers hitting the same outage do not retry in
  lock-step;
* only errors that :func:`is_transient` accepts are retried: connections refused, reset, timed out or cut
  during the TLS handshake, HTTP 429 and 5xx, S3's throttling codes. A certificate that fails verification
  and any other error propagate at once, unchanged;
* each retry logs one ``storage_retry`` warning with the URL, attempt number, error and delay.

When the budget runs out, :class:`RetryBudgetExhausted` carries the last error and the attempt count and
elapsed time, so the caller can word one user-facing message.

The budget in seconds defaults to 30 and can be set with the environment variable
``EDL_STORAGE_RETRY_SECONDS``.
"""

from __future__ import annotations

import math
import os
import random
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import urllib3.exceptions
from minio.error import InvalidResponseError, S3Error, ServerError

from edl_argo.errors import ConfigError
from edl_argo.log import get_logger

__all__ = [
    "RETRY_SECONDS_ENV",
    "Progress",
    "RetryBudgetExhausted",
    "RetryPolicy",
    "call_with_retry",
    "describe_error",
    "is_connection_error",
    "is_transient",
    "socket_timeouts",
]

log = get_logger(__name__)

T = TypeVar("T")

#: Environment variable that sets the retry budget in seconds.
RETRY_SECONDS_ENV = "EDL_STORAGE_RETRY_SECONDS"

_DEFAULT_SECONDS = 30.0

#: S3 error codes that mean "try again later" (besides HTTP 429 and any 5xx status).
TRANSIENT_S3_CODES = frozenset(
    {
        "SlowDown",
        "InternalError",
        "ServiceUnavailable",
        "RequestTimeout",
        "TooManyRequests",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
    }
)
#: HTTP statuses below 500 that mean "try again later".
TRANSIENT_STATUSES = frozenset({408, 429})


@dataclass(frozen=True)
class RetryPolicy:
    """How long (and, optionally, how often) :func:`call_with_retry` may try. See the module docstring."""

    max_seconds: float = _DEFAULT_SECONDS
    max_attempts: int | None = None
    base_delay: float = 0.25
    max_delay: float = 4.0

    def __post_init__(self) -> None:
        if (
            (self.max_attempts is not None and self.max_attempts < 1)
            or self.max_seconds < 0
            or self.base_delay < 0
            or self.max_delay < 0
        ):
            raise ValueError(f"invalid retry policy {self}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RetryPolicy:
        """The default policy, with the budget from ``EDL_STORAGE_RETRY_SECONDS`` if that is set.

        Raises :class:`~edl_argo.errors.ConfigError` if the variable is not a non-negative number.
        """
        env = os.environ if environ is None else environ
        text = env.get(RETRY_SECONDS_ENV, "").strip()
        if not text:
            return cls()
        try:
            seconds = float(text)
        except ValueError:
            seconds = -1.0
        if not math.isfinite(seconds) or seconds < 0:
            raise ConfigError(f"{RETRY_SECONDS_ENV}={text!r} is not a number of seconds >= 0")
        return cls(max_seconds=seconds)

    def delay(self, retry: int) -> float:
        """The jittered sleep before retry number ``retry`` (1 for the first retry)."""
        nominal = min(self.max_delay, self.base_delay * 2 ** (retry - 1))
        return nominal / 2 + random.uniform(0, nominal / 2)


def socket_timeouts(policy: RetryPolicy) -> tuple[float, float]:
    """``(connect, read)`` socket timeouts for requests under ``policy``: a quarter of the budget, at most
    5 s to connect and 10 s between two reads, at least 1 s."""
    quarter = policy.max_seconds / 4
    return max(1.0, min(5.0, quarter)), max(1.0, min(10.0, quarter))


class Progress:
    """How far an operation's transfer got, reported by the operation as it moves bytes.

    Each attempt calls :meth:`begin` with the position it starts from (0, or where a resumed download
    continues) and :meth:`advance` per chunk; an attempt that gets further than every attempt before it
    restarts the retry budget (:attr:`last_progress`). Also usable as minio's ``progress`` object.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._position = 0
        self._furthest = 0
        #: When the furthest position last grew; None before any progress.
        self.last_progress: float | None = None

    def begin(self, position: int = 0) -> None:
        with self._lock:
            self._position = position

    def advance(self, length: int) -> None:
        with self._lock:
            self._position += length
            if self._position > self._furthest:
                self._furthest = self._position
                self.last_progress = self._clock()

    # minio's ProgressType
    def set_meta(self, object_name: str, total_length: int) -> None:
        self.begin(0)

    def update(self, length: int) -> None:
        self.advance(length)


class RetryBudgetExhausted(Exception):
    """Every attempt failed with a transient error and the budget is spent."""

    def __init__(self, last_error: BaseException, attempts: int, elapsed: float) -> None:
        super().__init__(f"{describe_error(last_error)} (after {attempts} attempts over {elapsed:.1f} s)")
        self.last_error = last_error
        self.attempts = attempts
        self.elapsed = elapsed


def is_connection_error(exc: BaseException) -> bool:
    """Whether ``exc`` means the server could not be reached or the connection broke or timed out,
    including a TLS handshake cut short (but not a certificate that fails verification)."""
    if _is_certificate_error(exc):
        return False
    return isinstance(
        exc,
        urllib3.exceptions.NewConnectionError
        | urllib3.exceptions.TimeoutError
        | urllib3.exceptions.ProtocolError
        | urllib3.exceptions.MaxRetryError
        | urllib3.exceptions.SSLError
        | ssl.SSLError
        | ConnectionError
        | TimeoutError,
    )


def _is_certificate_error(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an error it wraps) is a failed certificate verification."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, ssl.SSLCertVerificationError):
            return True
        wrapped = [a for a in getattr(exc, "args", ()) if isinstance(a, BaseException)]
        reason = getattr(exc, "reason", None)
        exc = wrapped[0] if wrapped else reason if isinstance(reason, BaseException) else exc.__cause__
        seen += 1
    return False


def _http_status(exc: BaseException) -> int:
    if isinstance(exc, ServerError):
        return exc.status_code
    if isinstance(exc, InvalidResponseError):
        return int(getattr(exc, "_code", 0) or 0)
    if isinstance(exc, S3Error):
        return int(getattr(exc.response, "status", 0) or 0)
    return 0


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the same request may succeed: network trouble, HTTP 429 and 5xx, S3 throttling."""
    if is_connection_error(exc):
        return True
    if isinstance(exc, S3Error) and exc.code in TRANSIENT_S3_CODES:
        return True
    status = _http_status(exc)
    return status >= 500 or status in TRANSIENT_STATUSES


def describe_error(exc: BaseException) -> str:
    """A short, single-line reason for ``exc``, fit for a log field or a user message."""
    if isinstance(exc, S3Error):
        return f"{exc.code}: {exc.message}" if exc.message else str(exc.code)
    if isinstance(exc, ServerError | InvalidResponseError):
        return f"HTTP {_http_status(exc)}"
    if isinstance(exc, urllib3.exceptions.MaxRetryError) and exc.reason is not None:
        return describe_error(exc.reason)
    if isinstance(exc, urllib3.exceptions.ProtocolError) and len(exc.args) == 2:
        return f"{exc.args[0].rstrip('.')}: {exc.args[1]}"
    text = str(exc)
    if isinstance(exc, urllib3.exceptions.NewConnectionError | urllib3.exceptions.TimeoutError):
        # "<HTTPConnection object at 0x...>: Failed to ..." / "HTTPConnectionPool(...): Read timed out."
        text = text.split("): ", 1)[-1].split(">: ", 1)[-1]
    return " ".join(text.split()) or type(exc).__name__


def call_with_retry(
    fn: Callable[[], T],
    *,
    url: str,
    policy: RetryPolicy | None = None,
    transient: Callable[[BaseException], bool] = is_transient,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    progress: Progress | None = None,
) -> T:
    """Call ``fn()`` until it succeeds, a non-transient error occurs, or the budget is spent.

    ``fn`` must be safe to repeat (every storage operation here is: PUTs replace whole objects). ``url``
    names what is being accessed, for the retry log lines. ``progress``, if ``fn`` reports its transfer to
    it, restarts the budget whenever an attempt gets further than any before. Non-transient errors
    propagate unchanged; exhausting the budget raises :class:`RetryBudgetExhausted` from the last error.
    ``sleep`` and ``clock`` exist for tests (``progress`` must then use the same clock).
    """
    policy = policy or RetryPolicy.from_env()
    start = clock()
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as exc:
            if not transient(exc):
                raise
            now = clock()
            since = max(start, progress.last_progress or start) if progress is not None else start
            remaining = policy.max_seconds - (now - since)
            if (policy.max_attempts is not None and attempt >= policy.max_attempts) or remaining <= 0:
                raise RetryBudgetExhausted(exc, attempt, now - start) from exc
            delay = min(policy.delay(attempt), remaining)
            log.warning(
                "storage_retry", url=url, attempt=attempt, error=describe_error(exc), delay_s=round(delay, 3)
            )
            sleep(delay)
