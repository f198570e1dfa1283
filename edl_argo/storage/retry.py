"""Bounded retries with exponential backoff for storage calls.

One helper, :func:`call_with_retry`, owns every retry edl-argo makes against remote storage. HTTP clients
below it are configured not to retry on their own, so the budget stated here is the real one:

* at most :attr:`RetryPolicy.max_attempts` attempts, and no attempt starts later than
  :attr:`RetryPolicy.max_seconds` after the first one (an attempt already running may finish later, bounded
  by the client's own connect/read timeouts);
* between attempts it sleeps ``base_delay * 2**n`` seconds (capped at ``max_delay``) with "equal jitter":
  a random delay between half and all of that, so that many workers hitting the same outage do not retry in
  lock-step;
* only errors that :func:`is_transient` accepts are retried; any other error propagates at once, unchanged;
* each retry logs one ``storage_retry`` warning with the URL, attempt number, error and delay.

When the budget runs out, :class:`RetryBudgetExhausted` carries the last error and the attempt count and
elapsed time, so the caller can word one user-facing message.

The budget in seconds defaults to 30 and can be set with the environment variable
``EDL_STORAGE_RETRY_SECONDS``; the attempt cap grows in proportion (8 attempts per 30 s) so that a longer
budget is not cut short by it.
"""

from __future__ import annotations

import math
import os
import random
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
    "RetryBudgetExhausted",
    "RetryPolicy",
    "call_with_retry",
    "describe_error",
    "is_connection_error",
    "is_transient",
]

log = get_logger(__name__)

T = TypeVar("T")

#: Environment variable that sets the retry budget in seconds.
RETRY_SECONDS_ENV = "EDL_STORAGE_RETRY_SECONDS"

_DEFAULT_SECONDS = 30.0
_DEFAULT_ATTEMPTS = 8

#: S3 error codes that mean "try again later" (besides any HTTP 5xx status).
TRANSIENT_S3_CODES = frozenset({"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout"})


@dataclass(frozen=True)
class RetryPolicy:
    """How long and how often :func:`call_with_retry` may try. See the module docstring."""

    max_seconds: float = _DEFAULT_SECONDS
    max_attempts: int = _DEFAULT_ATTEMPTS
    base_delay: float = 0.25
    max_delay: float = 8.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.max_seconds < 0 or self.base_delay < 0 or self.max_delay < 0:
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
        attempts = max(_DEFAULT_ATTEMPTS, math.ceil(_DEFAULT_ATTEMPTS * seconds / _DEFAULT_SECONDS))
        return cls(max_seconds=seconds, max_attempts=attempts)

    def delay(self, retry: int) -> float:
        """The jittered sleep before retry number ``retry`` (1 for the first retry)."""
        nominal = min(self.max_delay, self.base_delay * 2 ** (retry - 1))
        return nominal / 2 + random.uniform(0, nominal / 2)


class RetryBudgetExhausted(Exception):
    """Every attempt failed with a transient error and the budget is spent."""

    def __init__(self, last_error: BaseException, attempts: int, elapsed: float) -> None:
        super().__init__(f"{describe_error(last_error)} (after {attempts} attempts over {elapsed:.1f} s)")
        self.last_error = last_error
        self.attempts = attempts
        self.elapsed = elapsed


def is_connection_error(exc: BaseException) -> bool:
    """Whether ``exc`` means the server could not be reached or the connection broke or timed out."""
    return isinstance(
        exc,
        urllib3.exceptions.NewConnectionError
        | urllib3.exceptions.TimeoutError
        | urllib3.exceptions.ProtocolError
        | urllib3.exceptions.MaxRetryError
        | ConnectionError
        | TimeoutError,
    )


def _http_status(exc: BaseException) -> int:
    if isinstance(exc, ServerError):
        return exc.status_code
    if isinstance(exc, InvalidResponseError):
        return int(getattr(exc, "_code", 0) or 0)
    if isinstance(exc, S3Error):
        return int(getattr(exc.response, "status", 0) or 0)
    return 0


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the same request may succeed: network trouble, HTTP 5xx, S3 throttling codes."""
    if is_connection_error(exc):
        return True
    if isinstance(exc, S3Error) and exc.code in TRANSIENT_S3_CODES:
        return True
    return _http_status(exc) >= 500


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
) -> T:
    """Call ``fn()`` until it succeeds, a non-transient error occurs, or the budget is spent.

    ``fn`` must be safe to repeat (every storage operation here is: PUTs replace whole objects). ``url``
    names what is being accessed, for the retry log lines. Non-transient errors propagate unchanged;
    exhausting the budget raises :class:`RetryBudgetExhausted` from the last error. ``sleep`` and
    ``clock`` exist for tests.
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
            elapsed = clock() - start
            remaining = policy.max_seconds - elapsed
            if attempt >= policy.max_attempts or remaining <= 0:
                raise RetryBudgetExhausted(exc, attempt, elapsed) from exc
            delay = min(policy.delay(attempt), remaining)
            log.warning(
                "storage_retry", url=url, attempt=attempt, error=describe_error(exc), delay_s=round(delay, 3)
            )
            sleep(delay)
