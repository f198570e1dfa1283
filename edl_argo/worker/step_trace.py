"""An opt-in trace of which minibatches formed each applied update: a debugging and verification aid.

With several workers the master hands tasks to whichever worker asks, so which records a synchronous update
averaged is known only after the fact. With ``EDL_STEP_TRACE=<folder>`` in a worker's environment (local
pods inherit the master's; the Kubernetes backend does not pass it on: a tool for local jobs), each worker
appends one JSON line per minibatch it trained to ``<folder>/worker-<id>.jsonl``
(:class:`TracedMinibatch`): the task's shard and record range, the minibatch's index within the task (with a
``feed`` that neither shuffles nor drops records, :meth:`TracedMinibatch.records` is its record range), its
examples, and the update it belongs to:

* ParameterServerStrategy, synchronous: the step PS 0 assigned to the accepted push (``PushResult.step``;
  a push refused as stale and recomputed is traced once, with the step that took it). Every push of a step
  was computed at the parameters of version ``step - 1``, and the step applies their mean weighted by
  examples; the pushes still waiting when training ends form the last, partial step.
* AllreduceStrategy: the group's model version after the step; every member with a minibatch in that step
  traces it with the same version (an idle member traces nothing).
* -1 where there is no such update: asynchronous PS updates, and a step ``LossScaleOptimizer`` skipped
  (its gradients were not finite under the dynamic loss scale: nothing was pushed).

Minibatches whose training raised (a non-finite loss or gradients, skipped or fatal; a failed task's) are
not traced. Off by default: without the variable, a worker holds no trace and pays nothing. A line is
written with one ``write`` to a file opened for appending, so it is never interleaved with another and is in
the file as soon as the minibatch's update is (no buffering); a relaunched worker appends to the same file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

#: The environment variable naming the folder of the trace (a local path); unset or empty: no trace.
STEP_TRACE_ENV = "EDL_STEP_TRACE"


@dataclass(frozen=True)
class TracedMinibatch:
    """One applied minibatch: who trained it, which records, and which update it joined."""

    worker: int
    task: int
    epoch: int
    shard: str
    #: The task's records ``[start, end)`` of ``shard``.
    start: int
    end: int
    #: The minibatch's index within its task, from 0.
    minibatch: int
    examples: int
    #: The synchronous step (PS) or group version (allreduce) the minibatch's update was applied in; -1: none.
    update: int

    def records(self, minibatch_size: int) -> range:
        """The minibatch's records of ``shard`` (for a ``feed`` that keeps records in order, one example
        per record)."""
        first = self.start + self.minibatch * minibatch_size
        return range(first, min(self.end, first + minibatch_size))


class StepTrace:
    """The trace file of one worker process (see the module's docstring)."""

    def __init__(self, folder: str | os.PathLike[str], worker_id: int) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        self.path = Path(folder) / f"worker-{worker_id}.jsonl"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    @classmethod
    def from_env(cls, worker_id: int, environ: Mapping[str, str] | None = None) -> StepTrace | None:
        """The trace :data:`STEP_TRACE_ENV` asks for, or None when it is unset or empty."""
        folder = (os.environ if environ is None else environ).get(STEP_TRACE_ENV, "")
        return cls(folder, worker_id) if folder else None

    def record(self, minibatch: TracedMinibatch) -> None:
        """Append ``minibatch`` as one line, in one write."""
        os.write(self._fd, (json.dumps(asdict(minibatch), separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


def read_trace(folder: str | os.PathLike[str]) -> list[TracedMinibatch]:
    """Every line of every worker's trace in ``folder``, by worker id, each worker's in the order written."""
    files = sorted(Path(folder).glob("worker-*.jsonl"), key=lambda p: int(p.stem.removeprefix("worker-")))
    return [
        TracedMinibatch(**json.loads(line))
        for path in files
        for line in path.read_text().splitlines()
        if line
    ]
