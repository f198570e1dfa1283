"""The Kubernetes backend at scale (issue 34, part 4): ``python -m tests.scale.k8s_backend [--workers 1000]
[--storm 300] [--qps 50] [--burst 100] [--outage 5]``.

Runs the real :class:`~edl_argo.pods.kubernetes.KubernetesBackend`, driven by the master's real
:class:`~edl_argo.master.pod_manager.PodManager` (its relaunch policy, with a
:class:`~edl_argo.master.task_dispatcher.TaskDispatcher` that hands out no task: no worker trains), against
the Kubernetes stand-in (``tests/k8s_stand_in``) holding its pods cheaply (``run_processes=False``: a
pod is reported running and runs nothing). The master's loop is :meth:`Scenario.step`, as
``edl_argo.master.job`` does it: the backend's events handed to the pod manager. With ``--job-secret`` the
job has a job secret (as every real job), so each worker's token goes into the job's Secret before its pod
is created: the tokens of the workers created together share a patch (:mod:`edl_argo.pods.secret_tokens`).
Phases:

1. **start**: the job starts ``--workers`` workers; until all run.
2. **storm**: the cluster preempts ``--storm`` of them at once (DisruptionTarget, then deletion); the
   pod manager relaunches each (new ids); until all ``--workers`` run again.
3. **storm + outage**: the same, and as soon as the master sees the first preemption the API server
   answers every request with 429, 500 or 503 (``Retry-After: 1`` on 429 and 503) for ``--outage`` s.

For each phase, counted from the stand-in's log of the master's requests (by User-Agent): requests, the
most in any 1 s window, the mean rate, whether the budget (``qps * t + burst`` in any ``t`` s) was ever
exceeded, and the time taken. The whole run is also checked against the budget as one stretch. Prints a
markdown table.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from edl_argo.log import configure
from edl_argo.master.pod_manager import PodManager, PodPolicy
from edl_argo.master.task_dispatcher import DispatcherConfig, TaskDispatcher
from edl_argo.pods import PodRole, PodSpec
from edl_argo.pods.kubernetes import API_URL_ENV, KubernetesBackend
from edl_argo.pods.kubernetes_config import KubernetesConfig
from edl_argo.rpc.auth import JobSecret
from tests.k8s_helpers import MASTER_USER_AGENT, job_selector
from tests.k8s_stand_in import KubernetesStandIn

#: How late a request may reach the server after the budget let it go (a thread woken late, the HTTP
#: round trip), in seconds: the server-side count of any window is held to ``qps * (t + this) + burst``.
TRANSIT_SECONDS = 0.1
#: The events of the many pods must all stay in the stand-in's history (a watch resumes from it).
HISTORY = 200_000


def budget_excess(arrivals: Sequence[float], qps: float, burst: int, slack_seconds: float = 0.0) -> float:
    """By how much the busiest window of sorted ``arrivals`` exceeds the budget: the largest ``count -
    (qps * (t + slack_seconds) + burst)`` over every window of ``t`` seconds that starts and ends at an
    arrival; 0 or less when the budget was never exceeded. O(n)."""
    worst, lowest = -math.inf, math.inf
    for index, arrival in enumerate(arrivals):
        level = index - qps * arrival  # count(i..j) - qps * (t_j - t_i) = level(j) - level(i) + 1
        lowest = min(lowest, level)
        worst = max(worst, level - lowest + 1)
    return worst - burst - qps * slack_seconds if arrivals else -float(burst)


def max_in_window(arrivals: Sequence[float], seconds: float = 1.0) -> int:
    """The most of sorted ``arrivals`` in any window of ``seconds``."""
    most, start = 0, 0
    for end, arrival in enumerate(arrivals):
        while arrival - arrivals[start] >= seconds:
            start += 1
        most = max(most, end - start + 1)
    return most


@dataclass(frozen=True)
class PhaseReport:
    """What one phase measured (rates from the stand-in's request log)."""

    name: str
    seconds: float
    requests: int
    max_per_second: int
    mean_per_second: float
    budget_exceeded: bool
    goal_seconds: float

    def row(self) -> str:
        met = "yes" if self.seconds <= self.goal_seconds else "no"
        exceeded = "yes" if self.budget_exceeded else "no"
        return (
            f"| {self.name} | {self.requests} | {self.max_per_second} | {self.mean_per_second:.1f} |"
            f" {exceeded} | {self.seconds:.1f} | {self.goal_seconds:.1f} ({met}) |"
        )


TABLE_HEAD = (
    "| phase | requests | max req/s (any 1 s) | mean req/s | budget exceeded | seconds | goal s (met) |\n"
    "|---|---|---|---|---|---|---|"
)


class LatenessProbe:
    """The longest this process's threads were kept from running since it started: a thread that sleeps
    :attr:`period` seconds over and over notes by how much more it slept. The stand-in's threads and the
    backend's run in this process: requests the budget let go apart may reach the stand-in together, that
    much later."""

    def __init__(self, period: float = 0.01) -> None:
        self.period = period
        self._worst = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lateness-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            time.sleep(self.period)
            self._worst = max(self._worst, time.monotonic() - began - self.period)

    def worst(self) -> float:
        return self._worst

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1.0)


class Scenario:
    """A job of ``workers`` workers on ``stand_in``, its backend paced by ``qps`` and ``burst``, with a
    job secret if ``job_secret``. The budget is checked at the server, with ``transit_seconds`` of slack
    (see :data:`TRANSIT_SECONDS`), or :data:`TRANSIT_SECONDS` plus the worst lateness of this process's
    threads during the run (:class:`LatenessProbe`) when that is more."""

    def __init__(
        self,
        stand_in: KubernetesStandIn,
        workers: int,
        qps: float,
        burst: int,
        job_secret: bool = False,
        transit_seconds: float = TRANSIT_SECONDS,
    ) -> None:
        self.stand_in = stand_in
        self.workers = workers
        self.qps, self.burst = qps, burst
        self.transit_seconds = transit_seconds
        self.job = f"scale-{uuid.uuid4().hex[:6]}"
        os.environ[API_URL_ENV] = stand_in.url
        config = KubernetesConfig(image="edl-argo:scale", k8s_qps=qps, k8s_burst=burst)
        self.backend = KubernetesBackend(self.job, config)
        self.secret = JobSecret.generate() if job_secret else None
        if self.secret is not None:
            self.backend.use_job_secret(self.secret)
        dispatcher = TaskDispatcher({"shard": 1}, DispatcherConfig(records_per_task=1, num_epochs=1))
        self.manager = PodManager(
            self.backend,
            PodPolicy(num_workers=workers, num_ps=0, max_worker_relaunches=10 * workers),
            dispatcher,
            worker_spec=lambda worker_id: PodSpec(PodRole.WORKER, worker_id, ("sleep", "infinity")),
            ps_spec=lambda ps_id: PodSpec(PodRole.PS, ps_id, ("sleep", "infinity")),
        )
        self.reports: list[PhaseReport] = []
        self.lateness = LatenessProbe()
        self.began = time.time()

    def slack_seconds(self) -> float:
        """How late a request may reach the stand-in after the budget let it go, as far as this run shows."""
        return max(self.transit_seconds, TRANSIT_SECONDS + self.lateness.worst())

    def step(self) -> None:
        """One turn of the master's loop: the backend's events to the pod manager."""
        self.manager.handle(self.backend.events(timeout=0.05))

    def run_until(self, done: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not done after {timeout:.0f} s ({self.manager.worker_counts()})")
            self.step()

    def all_running(self, relaunches: int = 0) -> bool:
        """Whether every worker runs, after at least ``relaunches`` relaunches."""
        manager = self.manager
        return manager.worker_relaunches >= relaunches and manager.worker_counts().running == self.workers

    def measure(
        self, name: str, goal_seconds: float, action: Callable[[], None], timeout: float, relaunches: int = 0
    ) -> None:
        """Run ``action``, then the master's loop until every worker runs after ``relaunches`` relaunches
        in all; record the phase."""
        began = time.time()
        action()
        self.run_until(lambda: self.all_running(relaunches), timeout, name)
        ended = time.time()
        arrivals = self.stand_in.arrivals(MASTER_USER_AGENT, since=began)
        self.reports.append(
            PhaseReport(
                name,
                ended - began,
                len(arrivals),
                max_in_window(arrivals),
                len(arrivals) / max(ended - began, 1e-9),
                budget_excess(arrivals, self.qps, self.burst, self.slack_seconds()) > 0,
                goal_seconds,
            )
        )

    def start(self, timeout: float) -> None:
        goal = self.workers / self.qps + 5
        self.measure("start", goal, self.manager.start, timeout)

    def storm(self, count: int, timeout: float, outage_seconds: float = 0.0) -> None:
        """The cluster preempts ``count`` running workers at once (and, with ``outage_seconds``, the API
        server fails every request for that long from when the master sees the first preemption)."""
        victims = self.manager.live_workers[:count]
        relaunches = self.manager.worker_relaunches + count

        def preempt() -> None:
            for worker_id in victims:
                self.stand_in.cluster.evict("default", f"{self.job}-worker-{worker_id}")
            if outage_seconds:
                self.run_until(lambda: not self.all_running(), 30, "the master sees the storm begin")
                self.stand_in.fail_for(outage_seconds, (429, 500, 503), retry_after=1)

        goal = outage_seconds + count / self.qps + 5
        name = f"storm: {count} preempted" + (f", API failing {outage_seconds:g} s" if outage_seconds else "")
        self.measure(name, goal, preempt, timeout, relaunches)

    def whole_run_excess(self) -> float:
        """By how many requests the whole run exceeded the budget at its busiest (0 or less: never)."""
        arrivals = self.stand_in.arrivals(MASTER_USER_AGENT, since=self.began)
        return budget_excess(arrivals, self.qps, self.burst, self.slack_seconds())

    def close(self) -> None:
        self.lateness.close()
        self.backend.close(grace_seconds=1)


def run(
    workers: int, storm: int, qps: float, burst: int, outage: float, job_secret: bool = False
) -> tuple[list[PhaseReport], bool]:
    """Run the three phases (see the module docstring); returns their reports and whether the budget was
    exceeded over the whole run."""
    timeout = 120 + 3 * workers / qps
    with KubernetesStandIn(echo_logs=False, history=HISTORY, run_processes=False) as stand_in:
        scenario = Scenario(stand_in, workers, qps, burst, job_secret)
        try:
            scenario.start(timeout)
            scenario.storm(storm, timeout)
            if outage:
                scenario.storm(storm, timeout, outage_seconds=outage)
            exceeded = scenario.whole_run_excess() > 0
        finally:
            scenario.close()
        assert not stand_in.objects("pods", job_selector(scenario.job)), "pods left after close"
    return scenario.reports, exceeded


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.scale.k8s_backend", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--storm", type=int, default=300, help="workers preempted at once")
    parser.add_argument("--qps", type=float, default=50.0)
    parser.add_argument("--burst", type=int, default=100)
    parser.add_argument("--outage", type=float, default=5.0, help="seconds the API fails (0: no such phase)")
    parser.add_argument("--job-secret", action="store_true", help="workers' tokens in the job's Secret")
    args = parser.parse_args(argv)
    configure("ERROR")
    began = time.monotonic()
    reports, exceeded = run(args.workers, args.storm, args.qps, args.burst, args.outage, args.job_secret)
    secret = ", with a job secret" if args.job_secret else ""
    print(f"{args.workers} workers, --k8s-qps {args.qps:g} --k8s-burst {args.burst}{secret}:\n")
    print(TABLE_HEAD)
    for report in reports:
        print(report.row())
    verdict = "yes" if exceeded else "no"
    print(f"\nbudget exceeded over the whole run: {verdict}; {time.monotonic() - began:.0f} s in all")
    return 1 if exceeded else 0


if __name__ == "__main__":
    sys.exit(main())
