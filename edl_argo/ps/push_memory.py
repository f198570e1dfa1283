"""What a parameter server remembers of each pusher's last push, so that a retried push is applied once.

A worker's call to ``PushGradients`` has a deadline. When the PS applies the push but answers after the
deadline (a replacement PS compiling its first update, a PS under load), the worker retries the same push.
Without memory the PS would apply that minibatch twice. Each push therefore carries the pusher's id and
its number among that pusher's pushes (``pusher_id``, ``sequence`` in ``ps.proto``); a pusher has at most
one push in flight to a PS, so the PS need only remember each pusher's last push and its outcome:

* the same number again: a retry. It is not applied; it gets the outcome of the first (accepted or not,
  and the step), with the parameters as they are now;
* a lower number: an attempt the pusher gave up on, delivered late. It is neither applied nor accepted;
  the pusher no longer waits for its answer;
* a higher number: a new push, decided as usual.

The memory is bounded (:data:`MAX_PUSHERS`, least recently seen forgotten first) and lives in the PS
process: a PS restored from a checkpoint starts with none, and its version check (synchronous SGD) or the
job's rollback accounting (asynchronous) covers the pushes of before the restart.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

#: Pushers remembered per PS: every worker incarnation of a job, with room to spare.
MAX_PUSHERS = 4096


@dataclass(frozen=True)
class PushOutcome:
    """How the PS decided one push."""

    sequence: int
    accepted: bool
    step: int = 0


class PushMemory:
    """The last push of each pusher (not thread-safe: the PS calls it under its lock)."""

    def __init__(self, max_pushers: int = MAX_PUSHERS) -> None:
        self._last: OrderedDict[str, PushOutcome] = OrderedDict()
        self._max_pushers = max_pushers
        #: Pushes answered from memory instead of being applied.
        self.repeated = 0

    def recall(self, pusher_id: str, sequence: int) -> PushOutcome | None:
        """The outcome to answer a push with that was decided before (a retry, or a late attempt: refused),
        or None for a new push (or one without a pusher id)."""
        if not pusher_id:
            return None
        last = self._last.get(pusher_id)
        if last is None or sequence > last.sequence:
            return None
        self._last.move_to_end(pusher_id)
        self.repeated += 1
        return last if sequence == last.sequence else PushOutcome(sequence, accepted=False)

    def remember(self, pusher_id: str, outcome: PushOutcome) -> None:
        """Record how a new push of ``pusher_id`` was decided."""
        if not pusher_id:
            return
        self._last[pusher_id] = outcome
        self._last.move_to_end(pusher_id)
        while len(self._last) > self._max_pushers:
            self._last.popitem(last=False)
