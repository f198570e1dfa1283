"""Chaos scenarios of the Kubernetes API itself (the stand-in's, the master reaching it with the official
client): an eviction storm, an API server answering errors, a watch cut mid-stream, a pod quota exhausted.
Each is one trial of the :data:`~tests.chaos.scenarios.CHAOS_JOB` on the Kubernetes backend (see
:func:`~tests.chaos.scenarios.run_in_process`) and returns its
:class:`~tests.chaos.scenarios.TrialResult`."""

from __future__ import annotations

import random
import time

from edl_argo.pods import PodRole
from tests.chaos.scenarios import (
    KUBERNETES,
    STEP_TIMEOUT_SECONDS,
    ChaosEnv,
    Trial,
    TrialResult,
    run_in_process,
)

#: How long the API server answers errors (``api_errors``) or refuses pods for quota (``pod_quota``).
OUTAGE_SECONDS = (4.0, 10.0)
#: How long watches are refused after being cut (``watch_cut``): long enough for a pod to be deleted
#: and gone meanwhile, so that only a resumed watch (or, after 410 Gone, a new listing) can tell.
WATCH_DOWN_SECONDS = 3.0


def eviction_storm(env: ChaosEnv, rng: random.Random) -> TrialResult:
    """Four workers; at a random point between 20% and 70% of the tasks half of them (two, drawn at
    random) evicted at once, as a scheduler preempting for a bigger job does."""

    def inject(trial: Trial) -> None:
        trial.wait_for_progress(rng.uniform(0.20, 0.70))
        trial.wait_for(lambda: len(trial.live_workers()) == 4, "four workers")
        victims = sorted(rng.sample(trial.live_workers(), 2))
        for worker in victims:
            trial.pods.evict(PodRole.WORKER, worker)
        trial.fault(f"evicted workers {victims} at once")

    return run_in_process("eviction_storm", env, rng, inject, backend=KUBERNETES, num_workers=4)


def api_errors(env: ChaosEnv, rng: random.Random) -> TrialResult:
    """At a random point between 20% and 70% of the tasks the API server answers every request with 429,
    500 or 503 in turn for 4-10 s (its open watches cut); a worker pod is deleted as it starts, so the
    master must notice and replace it through the errors."""
    cluster = env.cluster()

    def inject(trial: Trial) -> None:
        trial.wait_for_progress(rng.uniform(0.20, 0.70))
        seconds = rng.uniform(*OUTAGE_SECONDS)
        cluster.fail_for(seconds)
        worker = rng.choice(trial.live_workers())
        cluster.delete("pods", worker_pod(trial, worker))
        trial.fault(f"API server answering 429/500/503 for {seconds:.1f} s, worker-{worker} deleted")
        time.sleep(seconds)  # the length of the fault, not a wait for a result

    return run_in_process("api_errors", env, rng, inject, backend=KUBERNETES)


def watch_cut(env: ChaosEnv, rng: random.Random, *, gone: bool = False) -> TrialResult:
    """At a random point between 20% and 70% of the tasks the master's watch is cut mid-stream (no final
    chunk) and watches are refused (503) for a few seconds, during which a worker pod is deleted and goes;
    with ``gone``, the API server's history is then compacted, so the resumed watch gets ``410 Gone`` and
    the master must list again to notice the missing pod."""
    cluster = env.cluster()
    scenario = "watch_cut_410" if gone else "watch_cut"

    def inject(trial: Trial) -> None:
        trial.wait_for_progress(rng.uniform(0.20, 0.70))
        cluster.fail_requests("watch", "pods", 503, "stand-in: watch refused", count=10**6)
        try:
            cluster.cut_watches()
            worker = rng.choice(trial.live_workers())
            name = worker_pod(trial, worker)
            cluster.delete("pods", name)
            cluster.wait_for(lambda: cluster.pod(name) is None, STEP_TIMEOUT_SECONDS, f"pod {name} to go")
            time.sleep(WATCH_DOWN_SECONDS)  # the length of the fault, not a wait for a result
            if gone:
                cluster.store.compact()
        finally:
            cluster.clear_failures()
        trial.fault(f"watch cut, worker-{worker} deleted meanwhile" + (", history compacted (410)" * gone))

    return run_in_process(scenario, env, rng, inject, backend=KUBERNETES)


def watch_cut_410(env: ChaosEnv, rng: random.Random) -> TrialResult:
    """:func:`watch_cut` with the history compacted: the resumed watch gets ``410 Gone``."""
    return watch_cut(env, rng, gone=True)


def pod_quota(env: ChaosEnv, rng: random.Random) -> TrialResult:
    """At a random point between 20% and 70% of the tasks pod creation is refused (403, exceeded quota)
    for 4-10 s and a worker pod is deleted through the API meanwhile: its replacement is created once the
    quota allows."""
    cluster = env.cluster()

    def inject(trial: Trial) -> None:
        trial.wait_for_progress(rng.uniform(0.20, 0.70))
        seconds = rng.uniform(*OUTAGE_SECONDS)
        message = 'pods "x" is forbidden: exceeded quota: compute, requested: pods=1, limited: pods=3'
        cluster.fail_requests("create", "pods", 403, message, count=10**6)
        try:
            worker = trial.remove_worker("delete")
            trial.fault(f"pod creation refused for quota for {seconds:.1f} s, worker-{worker} deleted")
            time.sleep(seconds)  # the length of the fault, not a wait for a result
        finally:
            cluster.clear_failures()

    return run_in_process("pod_quota", env, rng, inject, backend=KUBERNETES)


def worker_pod(trial: Trial, worker: int) -> str:
    """The name of the pod of worker ``worker`` of the trial's job."""
    return f"{trial.job.config.job_name}-worker-{worker}"
