"""How long to wait before relaunching a worker whose predecessors keep failing soon after they start: the
kubelet's CrashLoopBackOff, for the pods the master relaunches.

A worker and the replacements started for it form a *line*. A failure of the pod itself (exit status, killed
by a signal, out of memory: :data:`CRASH_REASONS`) of a pod that ran less than ``reset_seconds`` extends its
line's streak; a pod that ran that long, or a stop for another reason (preempted, deleted, scaled down),
ends it. The first failure of a streak is relaunched at once (a one-off crash costs nothing more than
today); the ``k``-th waits ``first_seconds * 2 ** (k - 2)``, at most ``cap_seconds``: 0, 10, 20, 40, ... s
by default. A deterministic error of the model's code fails the job before any of this
(:mod:`edl_argo.model.user_code`), and ``--max-worker-relaunches`` still bounds the relaunches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edl_argo.pods import PodReason

#: Why a pod stopped, when its stop may be a crash loop: the pod's own failures.
CRASH_REASONS = frozenset({PodReason.ERROR, PodReason.KILLED, PodReason.OOM_KILLED})
#: A pod that ran this long ends its line's streak (the kubelet's 10 minutes).
RESET_SECONDS = 600.0
#: The longest wait, as a multiple of the first (the kubelet's 10 s to 5 min).
CAP_FACTOR = 30


@dataclass
class RelaunchBackoff:
    """The streak of each line, by the id of its live pod; ``first_seconds`` 0 turns the backoff off."""

    first_seconds: float
    reset_seconds: float = RESET_SECONDS
    _streaks: dict[int, int] = field(default_factory=dict)

    @property
    def cap_seconds(self) -> float:
        return self.first_seconds * CAP_FACTOR

    def stopped(self, pod_id: int, reason: str, ran_seconds: float) -> tuple[float, int]:
        """Pod ``pod_id`` stopped for ``reason`` after running ``ran_seconds`` (0: it never ran): the seconds
        to wait before its replacement starts, and its line's streak of quick failures (0: none)."""
        streak = self._streaks.pop(pod_id, 0)
        quick_crash = reason in CRASH_REASONS and ran_seconds < self.reset_seconds
        streak = streak + 1 if quick_crash else 0
        if streak < 2 or self.first_seconds <= 0:
            return 0.0, streak
        return min(self.cap_seconds, self.first_seconds * 2 ** (streak - 2)), streak

    def replaced(self, new_id: int, streak: int) -> None:
        """Pod ``new_id`` continues a line whose streak is ``streak``."""
        if streak:
            self._streaks[new_id] = streak
