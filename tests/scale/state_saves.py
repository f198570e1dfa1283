"""What one save of the master's state costs as the job grows (issue 34, part 2): ``python -m
tests.scale.state_saves [--store folder|s3]`` prints a markdown table.

In this process, no RPC: the parts a master saves (:func:`~edl_argo.master.failover.state_to_save`: the
dispatcher, an evaluation service, the ledger, the training loss, the pod manager of
:mod:`tests.scale.load_master`) of a job with a given number of tasks per epoch, tasks already done and
workers (each holding two tasks, as workers reading one ahead do), saved by a :class:`MasterStateStore` on
a folder or the S3 stand-in. The first save of a store writes everything; each of the next
:data:`SAVES` follows one task report, as under load. Per save: milliseconds (the snapshot of the parts
plus the write, median), and bytes written (median; the largest in brackets, a compaction when the store
makes one).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from edl_argo.master.config import TrainConfig
from edl_argo.master.evaluation import EvaluationService
from edl_argo.master.failover import MasterParts, state_to_save
from edl_argo.master.job import VersionTracker
from edl_argo.master.ledger import TrainingLedger
from edl_argo.master.pod_manager import PodManager, PodPolicy
from edl_argo.master.state_store import MasterStateStore, job_fingerprint
from edl_argo.master.task_dispatcher import DispatcherConfig, TaskDispatcher
from edl_argo.master.training_stats import TrainingLoss
from edl_argo.pods import PodRole, PodSpec
from edl_argo.storage import open_storage
from tests.bench.common import environment
from tests.scale.load_master import MINIBATCH_SIZE, MeteredStorage, SimulatedPods, shard_name
from tests.scale.master_load import state_location

RECORDS_PER_TASK = 512
SAVES = 30
#: (tasks per epoch, tasks done, workers) of each row.
CASES = (
    (1_000, 0, 10),
    (10_000, 0, 10),
    (100_000, 0, 10),
    (10_000, 100_000, 10),
    (10_000, 0, 1_000),
    (10_000, 0, 5_000),
)


class SavingJob:
    """A job's saved parts, with ``workers`` workers each holding two tasks (shared with
    ``tests/test_state_log.py``). :attr:`last` is the state :meth:`state` made last."""

    def __init__(self, tasks_per_epoch: int, workers: int, epochs: int = 100) -> None:
        self.shards = {shard_name(i): RECORDS_PER_TASK * 10 for i in range(tasks_per_epoch // 10)}
        self.dispatcher = TaskDispatcher(
            self.shards, DispatcherConfig(records_per_task=RECORDS_PER_TASK, num_epochs=epochs, shuffle=True)
        )
        evaluation = EvaluationService(dict, {}, 0, dispatcher=self.dispatcher)
        self.parts = MasterParts(
            self.dispatcher,
            evaluation,
            VersionTracker(),
            TrainingLoss(),
            TrainingLedger(MINIBATCH_SIZE),
            None,
        )
        self.pods = PodManager(
            SimulatedPods(),
            PodPolicy(num_workers=workers, num_ps=0),
            self.dispatcher,
            worker_spec=lambda i: PodSpec(PodRole.WORKER, i, ("simulated",)),
            ps_spec=lambda i: PodSpec(PodRole.PS, i, ("simulated",), port=1),
        )
        self.pods.start()
        self.workers = workers
        for worker in range(workers):
            self.dispatcher.get_task(worker)
            self.dispatcher.get_task(worker)
        self.reports = 0
        self.last: dict[str, Any] = {}

    def report(self) -> None:
        """The next worker reports the older of its tasks and takes another."""
        worker = self.reports % self.workers
        self.reports += 1
        task = self.dispatcher.oldest_held_task(worker)
        assert task is not None
        counters = {"records": task.num_records, "steps": -(-task.num_records // MINIBATCH_SIZE)}
        self.parts.ledger.add(task, counters, worker)
        self.dispatcher.report(task.task_id, worker, True)
        self.parts.training_loss.add(task.epoch, 0.5, counters["steps"])
        self.dispatcher.get_task(worker)

    def state(self) -> dict[str, Any]:
        self.last = state_to_save(self.parts, self.pods, started_at=0.0, master_port=1, ps_ports=[])
        return self.last


def measure(url: str, tasks_per_epoch: int, done: int, workers: int) -> tuple[float, float, int]:
    """Median ms and bytes per save, and the most bytes of one, for a job of this size."""
    job = SavingJob(tasks_per_epoch, workers)
    for _ in range(done):
        job.report()
    config = TrainConfig(model_def="m.py", training_data="s3://d/train", output=url)
    storage = MeteredStorage(open_storage(url))
    store = MasterStateStore(storage, "saves", job_fingerprint(config, job.shards, {}))  # type: ignore[arg-type]
    store.save(job.state())
    seconds, written = [], []
    for _ in range(SAVES):
        job.report()
        before, started = storage.bytes_written, time.perf_counter()
        store.save(job.state())
        seconds.append(time.perf_counter() - started)
        written.append(storage.bytes_written - before)
    return statistics.median(seconds) * 1e3, statistics.median(written), max(written)


def rows(store: str) -> Iterator[str]:
    yield "| tasks per epoch | tasks done | workers | ms per save (median) | bytes per save: median (max) |"
    yield "|---|---|---|---|---|"
    with tempfile.TemporaryDirectory(prefix="edl-state-saves-") as folder:
        for number, (tasks_per_epoch, done, workers) in enumerate(CASES):
            location = state_location(store, Path(folder) / str(number))
            with location as (url, env), environment(env):
                ms, median_bytes, most = measure(url, tasks_per_epoch, done, workers)
            size = f"| {tasks_per_epoch:,} | {done:,} | {workers:,}"
            yield f"{size} | {ms:.2f} | {median_bytes:,.0f} ({most:,}) |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--store", choices=["folder", "s3"], default="folder")
    args = parser.parse_args(argv)
    for line in rows(args.store):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
