"""Chaos scenarios of AllreduceStrategy jobs (no PS: the model lives in the workers, which average their
gradients in a collective), on either pod backend. Each runs one trial of the
:data:`~tests.chaos.scenarios.CHAOS_JOB` with :data:`ALLREDUCE_JOB` and returns its
:class:`~tests.chaos.scenarios.TrialResult`; the job's own ``allreduce_replicas`` (every surviving
member's final weights compared) must show bit-identical replicas (see
:func:`~tests.chaos.scenarios.check_outcome`)."""

from __future__ import annotations

import random
import signal
from typing import Any

from edl_argo.pods import PodRole
from tests.chaos.scenarios import (
    ALLREDUCE,
    HUNG_TASK_TIMEOUT_SECONDS,
    LOCAL,
    ChaosEnv,
    Trial,
    TrialResult,
    run_in_process,
    scale_1_4_1,
)

#: The settings every AllreduceStrategy trial adds: no PS, and a collective timeout that detects a silent
#: member well within a trial.
ALLREDUCE_JOB: dict[str, Any] = {
    "distribution_strategy": ALLREDUCE,
    "num_ps": 0,
    "collective_timeout_seconds": 15,
}
#: Checkpoint interval (model versions) of :func:`allreduce_all_lost`.
CHECKPOINT_STEPS = 10


def members(trial: Trial) -> list[int]:
    """The worker ids of the group's current round (empty before the first)."""
    rendezvous = trial.job.rendezvous
    return [] if rendezvous is None else [m.worker_id for m in rendezvous.current.members]


def allreduce_kill(env: ChaosEnv, rng: random.Random, *, backend: str = LOCAL) -> TrialResult:
    """A member of a group of two SIGKILLed at a random point between 15% and 85% of the tasks (the group
    spends most of its time in allreduces): the survivor re-forms the group alone, the replacement joins
    with the survivor's state."""

    def inject(trial: Trial) -> None:
        trial.wait_for_progress(rng.uniform(0.15, 0.85))
        trial.wait_for(lambda: len(members(trial)) >= 2, "a group of two")
        worker = rng.choice(members(trial))
        trial.pods.signal(PodRole.WORKER, worker, signal.SIGKILL)
        trial.fault(f"SIGKILL member worker-{worker}")

    return run_in_process("allreduce_kill", env, rng, inject, backend=backend, **ALLREDUCE_JOB)


def allreduce_hang(env: ChaosEnv, rng: random.Random, *, backend: str = LOCAL) -> TrialResult:
    """A member of a group of two SIGSTOPped at a random point between 20% and 70% of the tasks and left
    stopped: its peer's collective times out (``--collective-timeout-seconds``) and blames it, the group
    re-forms without it, a task it held is reclaimed on timeout, and the master restarts it as stuck
    (replaced, or only deleted once training is over)."""

    def inject(trial: Trial) -> None:
        trial.wait_for_progress(rng.uniform(0.20, 0.70))
        trial.wait_for(lambda: len(members(trial)) >= 2, "a group of two")
        worker = rng.choice(members(trial))
        trial.pods.signal(PodRole.WORKER, worker, signal.SIGSTOP)
        trial.fault(f"SIGSTOP member worker-{worker}")
        trial.wait_for(lambda: worker not in members(trial), f"the group to re-form without worker-{worker}")

    return run_in_process(
        "allreduce_hang",
        env,
        rng,
        inject,
        backend=backend,
        min_task_timeout_seconds=HUNG_TASK_TIMEOUT_SECONDS,
        **ALLREDUCE_JOB,
    )


def allreduce_scale(env: ChaosEnv, rng: random.Random, *, backend: str = LOCAL) -> TrialResult:
    """:func:`~tests.chaos.scenarios.scale_1_4_1` with AllreduceStrategy: new members receive the state
    of a member of the group, the members removed leave it. The lone member, which trains without a
    collective and so ends the job in seconds, is paused only until the first added worker has started:
    paused longer, it would miss the round that worker forms with it, and be blamed and replaced."""
    return scale_1_4_1(
        env, rng, backend=backend, scenario="allreduce_scale_1_4_1", resume_when=any, **ALLREDUCE_JOB
    )


def allreduce_all_lost(env: ChaosEnv, rng: random.Random, *, backend: str = LOCAL) -> TrialResult:
    """Checkpoints every 10 versions; at a random point between 30% and 70% of the tasks every member
    SIGKILLed at once: nobody holds the model, so the replacements start from the newest checkpoint."""

    def inject(trial: Trial) -> None:
        trial.wait_for_progress(rng.uniform(0.30, 0.70))
        trial.wait_for(lambda: len(members(trial)) >= 2, "a group of two")
        victims = sorted(trial.live_workers())
        for worker in victims:
            trial.pods.signal(PodRole.WORKER, worker, signal.SIGKILL)
        trial.fault(f"SIGKILL every member {victims}")

    return run_in_process(
        "allreduce_all_lost",
        env,
        rng,
        inject,
        backend=backend,
        checkpoint_steps=CHECKPOINT_STEPS,
        **ALLREDUCE_JOB,
    )
