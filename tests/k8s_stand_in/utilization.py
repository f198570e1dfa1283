"""TEST-ONLY: how much of the stand-in cluster's CPU its pods hold, over time.

Utilization here is requests-based, as in issue 32's figures: the CPU *requested* by the pods bound to a
node and not terminated (a pod being deleted counts until its process is gone, as the scheduler counts it),
over the CPU *allocatable* on the nodes -- not the CPU the processes actually burn. Only nodes with a CPU
capacity count (the default node's is unlimited), and only the pods on them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction

from tests.k8s_stand_in.scheduler import allocatable, holds_resources, pod_requests
from tests.k8s_stand_in.selectors import matches, parse_selector
from tests.k8s_stand_in.server import KubernetesStandIn


@dataclass(frozen=True)
class CpuSample:
    """The cluster at ``time`` (the recorder's clock): ``requested`` CPU cores of the pods holding resources
    (all of them, and per group: per PriorityClass name as ``class:<name>``, '' for none, and per selector
    the recorder was given, under its name) and ``allocatable`` cores."""

    time: float
    requested: Fraction
    allocatable: Fraction
    groups: Mapping[str, Fraction]


class UtilizationRecorder:
    """Samples the CPU requested and allocatable in ``cluster`` every ``interval`` seconds while started
    (use as a context manager, or call :meth:`sample` yourself). ``selectors``: name -> label selector of
    pod groups to follow too. ``clock``: the samples' time (default ``time.monotonic``)."""

    def __init__(
        self,
        cluster: KubernetesStandIn,
        interval: float = 0.1,
        selectors: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cluster = cluster
        self.interval = interval
        self.clock = clock
        self._selectors = {name: parse_selector(text) for name, text in (selectors or {}).items()}
        self.samples: list[CpuSample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> CpuSample:
        """Record the cluster as it is now; returns the sample."""
        store = self.cluster.store
        with store.lock:
            cores = {name: allocatable(node).get("cpu") for (_, _, name), node in store.items("nodes")}
            counted = {name: amount for name, amount in cores.items() if amount is not None}
            groups = dict.fromkeys(self._selectors, Fraction(0))
            requested = Fraction(0)
            for _, pod in store.items("pods"):
                if not holds_resources(pod) or pod["spec"]["nodeName"] not in counted:
                    continue
                cpu = pod_requests(pod)["cpu"]
                requested += cpu
                group = f"class:{pod['spec'].get('priorityClassName', '')}"
                groups[group] = groups.get(group, Fraction(0)) + cpu
                for name, selector in self._selectors.items():
                    if matches(selector, pod["metadata"].get("labels")):
                        groups[name] += cpu
            taken = CpuSample(self.clock(), requested, sum(counted.values(), Fraction(0)), groups)
        self.samples.append(taken)
        return taken

    def utilization(self, start: float, end: float, group: str | None = None) -> float:
        """Allocated CPU-seconds over available CPU-seconds from ``start`` to ``end`` (the recorder's
        clock): the samples integrated as a step function, each holding until the next (the last until
        ``end``). ``group``: only that group's requests (see :class:`CpuSample`). ValueError if no sample
        was taken at or before ``start``, or nothing was allocatable."""
        return cpu_utilization(self.samples, start, end, group)

    def start(self) -> UtilizationRecorder:
        """Sample every :attr:`interval` seconds in a thread, from now until :meth:`stop`."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="utilization-recorder", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> UtilizationRecorder:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval):
                return


def cpu_utilization(samples: list[CpuSample], start: float, end: float, group: str | None = None) -> float:
    """See :meth:`UtilizationRecorder.utilization`; ``samples`` in time order."""
    if not samples or samples[0].time > start or end <= start:
        raise ValueError(f"no sample at or before {start}, or an empty interval")
    used = available = 0.0
    for sample, following in zip(samples, [*samples[1:], None], strict=True):
        begin = max(sample.time, start)
        until = min(following.time if following is not None else end, end)
        if until <= begin:
            continue
        requested = sample.requested if group is None else sample.groups.get(group, Fraction(0))
        used += float(requested) * (until - begin)
        available += float(sample.allocatable) * (until - begin)
    if not available:
        raise ValueError("no CPU was allocatable between start and end")
    return used / available
