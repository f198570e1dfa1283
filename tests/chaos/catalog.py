"""Every chaos scenario variant that ``make chaos`` runs, by name: the fault, the pod backend and the
distribution strategy. A name without a suffix runs on the local backend; ``_k8s`` on the Kubernetes
stand-in. Scenarios whose name starts with ``allreduce_`` run AllreduceStrategy, the others
ParameterServerStrategy."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass

from tests.chaos import allreduce, cluster_faults, scenarios
from tests.chaos.scenarios import ALLREDUCE, KUBERNETES, LOCAL, PS_STRATEGY, ChaosEnv, TrialResult


@dataclass(frozen=True)
class Variant:
    """One scenario on one backend with one strategy. ``doc`` describes the fault."""

    name: str
    run: Callable[[ChaosEnv, random.Random], TrialResult]
    backend: str
    strategy: str
    doc: str


def _variants() -> dict[str, Variant]:
    found: dict[str, Variant] = {}

    def add(
        name: str, function: Callable[..., TrialResult], backends: tuple[str, ...], **kwargs: object
    ) -> None:
        strategy = ALLREDUCE if name.startswith("allreduce_") else PS_STRATEGY
        for backend in backends:
            key = name if backend == LOCAL else f"{name}_k8s"
            extra = {"backend": backend} if len(backends) > 1 else {}
            run = functools.partial(function, **extra, **kwargs)
            found[key] = Variant(key, run, backend, strategy, function.__doc__ or "")

    both = (LOCAL, KUBERNETES)
    add("worker_kills", scenarios.worker_kills, both)
    add("ps_kill", scenarios.ps_kill, both)
    add("master_restart", scenarios.master_restart, both)
    add("s3_outage", scenarios.s3_outage, (LOCAL,))
    add("scale_1_4_1", scenarios.scale_1_4_1, (LOCAL,))
    add("hung_worker", scenarios.hung_worker, (LOCAL,))
    add("eviction_storm", cluster_faults.eviction_storm, (KUBERNETES,))
    add("api_errors", cluster_faults.api_errors, (KUBERNETES,))
    add("watch_cut", cluster_faults.watch_cut, (KUBERNETES,))
    add("watch_cut_410", cluster_faults.watch_cut_410, (KUBERNETES,))
    add("pod_quota", cluster_faults.pod_quota, (KUBERNETES,))
    add("allreduce_kill", allreduce.allreduce_kill, both)
    add("allreduce_hang", allreduce.allreduce_hang, both)
    add("allreduce_scale_1_4_1", allreduce.allreduce_scale, both)
    add("allreduce_all_lost", allreduce.allreduce_all_lost, both)
    add("allreduce_master_restart", scenarios.master_restart, both, strategy=ALLREDUCE)
    return found


#: Every variant, in report order.
VARIANTS: dict[str, Variant] = _variants()
