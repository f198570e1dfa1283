"""A client-side request budget: the token bucket that paces a master's calls to the Kubernetes API.

client-go paces every client it builds the same way (``rest.Config.QPS`` and ``Burst``): a bucket holds up
to ``burst`` tokens and gains ``qps`` tokens a second; every request takes one. :class:`RequestBudget` is
that bucket. The contract:

* **The budget holds over any window.** In any window of ``t`` seconds at most ``qps * t + burst`` tokens
  are granted: a full bucket allows a burst, after which requests are spaced ``1 / qps`` seconds apart.
* **Every request counts**, whatever it is (create, delete, get, list, patch, a log read, a retry, the
  start of a watch): :class:`~edl_argo.pods.kubernetes_api.JobApi` takes a token before each.
* **Waiting is bounded.** :meth:`RequestBudget.acquire` is given a deadline. A caller reserves the next
  token in turn (first come, first served, as golang.org/x/time/rate's ``Wait``, which client-go uses),
  then sleeps until it is due; if it would be due after the deadline, nothing is reserved and
  :class:`RequestBudgetTimeout` is raised at once. That error is a :class:`TimeoutError`, so callers treat
  it as a request that timed out (a transient failure, retried within their own deadline).
* **Thread-safe**, one lock held for a few arithmetic operations (never while sleeping).

The clock and the sleep are parameters, so tests drive the bucket with a fake clock.

The master's defaults (``--k8s-qps 50``, ``--k8s-burst 100``) are kube-scheduler's (client-go's own 5 and
10 would take over three minutes to create 1,000 workers): 1,000 workers are created in about
``(1000 - 100) / 50 = 18`` s (twice that with the job's per-worker credentials, each one more request),
300 preempted workers are replaced in about 4 s, and a job's steady load (a watch, an occasional log read
or relaunch) is far below it. A cluster whose API server is shared by many jobs can lower both.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from edl_argo.settings.table import K8S_BURST, K8S_QPS

#: ``--k8s-qps`` and ``--k8s-burst`` defaults (see the module docstring for why).
DEFAULT_QPS: float = K8S_QPS
DEFAULT_BURST: int = K8S_BURST


class RequestBudgetTimeout(TimeoutError):
    """No token could be had before the request's deadline (the request is not sent)."""


class RequestBudget:
    """A token bucket of ``burst`` tokens refilled at ``qps`` tokens a second, starting full.

    Args:
        qps: tokens gained per second; > 0.
        burst: most tokens held (requests that may be sent at once); >= 1.
        clock: monotonic seconds (default :func:`time.monotonic`); deadlines are on this clock.
        sleep: sleeps that many seconds on ``clock`` (default :func:`time.sleep`).

    Raises:
        ValueError: ``qps`` <= 0 or ``burst`` < 1.
    """

    def __init__(
        self,
        qps: float,
        burst: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not qps > 0:
            raise ValueError(f"qps must be more than 0, not {qps}")
        if burst < 1:
            raise ValueError(f"burst must be at least 1, not {burst}")
        self.qps = float(qps)
        self.burst = int(burst)
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._tokens = float(burst)  # below 0: tokens reserved by callers still waiting for them
        self._updated = clock()
        self.granted = 0
        """Tokens granted so far (requests let through)."""

    def acquire(self, deadline: float) -> float:
        """Take a token, waiting for it until ``deadline`` (on the budget's clock) at most; returns the
        seconds waited.

        Raises:
            RequestBudgetTimeout: the token would come after ``deadline``; none is taken.
        """
        with self._lock:
            now = self._clock()
            tokens = min(float(self.burst), self._tokens + (now - self._updated) * self.qps)
            wait = max(0.0, (1.0 - tokens) / self.qps)
            if now + wait > deadline:
                self._tokens, self._updated = tokens, now
                raise RequestBudgetTimeout(
                    f"no request budget before the deadline: the next token is {wait:.1f} s away"
                    f" (--k8s-qps {self.qps:g}, --k8s-burst {self.burst})"
                )
            self._tokens, self._updated = tokens - 1.0, now
            self.granted += 1
        if wait > 0:
            self._sleep(wait)
        return wait

    def available(self) -> float:
        """Tokens in the bucket now (negative: owed to callers waiting for them)."""
        with self._lock:
            return min(float(self.burst), self._tokens + (self._clock() - self._updated) * self.qps)
