"""The master's state as a log: a snapshot plus numbered segments of changes, compacted now and then
(:mod:`edl_argo.master.state_store`). What a save costs must not grow with the job's tasks, epochs or
workers, and a restarted master must read back exactly what was saved, on a folder and on S3."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from edl_argo.errors import DataFormatError
from edl_argo.master.config import TrainConfig
from edl_argo.master.failover import STATE_PARTS
from edl_argo.master.ledger import TrainingLedger
from edl_argo.master.state_store import MasterStateStore, job_fingerprint
from edl_argo.master.task_dispatcher import DispatcherConfig, TaskDispatcher
from edl_argo.storage import LocalStorage, Storage, open_storage

RECORDS_PER_TASK = 8


class CountingStorage(LocalStorage):
    """A folder that counts the bytes written to it."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.written: list[int] = []

    def write(self, key: str, data: bytes) -> None:
        super().write(key, data)
        self.written.append(len(data))


def store_on(storage: Storage, shards: dict[str, int]) -> MasterStateStore:
    config = TrainConfig(model_def="m.py", training_data="data/train", output="out")
    return MasterStateStore(storage, "job", job_fingerprint(config, shards, {}))


class Job:
    """A dispatcher and ledger with workers taking and reporting tasks, and the state they make."""

    def __init__(self, tasks_per_epoch: int, workers: int = 4, epochs: int = 3) -> None:
        self.shards = {f"s{i}": RECORDS_PER_TASK * 10 for i in range(tasks_per_epoch // 10)}
        config = DispatcherConfig(records_per_task=RECORDS_PER_TASK, num_epochs=epochs, shuffle=True)
        self.dispatcher = TaskDispatcher(self.shards, config)
        self.ledger = TrainingLedger(minibatch_size=RECORDS_PER_TASK)
        self.workers = workers
        for worker in range(workers):
            self.dispatcher.get_task(worker)

    def step(self, worker: int) -> None:
        """``worker`` reports the task it holds and takes the next."""
        task = self.dispatcher.oldest_held_task(worker)
        assert task is not None
        counters = {"records": task.num_records, "steps": 1}
        self.ledger.add(task, counters, worker)
        assert self.dispatcher.report(task.task_id, worker, True)
        self.dispatcher.get_task(worker)

    def state(self) -> dict[str, Any]:
        parts: dict[str, Any] = {part: {"marker": 0} for part in STATE_PARTS}
        parts["dispatcher"] = self.dispatcher.snapshot()
        parts["ledger"] = self.ledger.snapshot()
        return parts


def bytes_per_commit(tmp_path: Path, tasks_per_epoch: int, *, done: int = 0, workers: int = 4) -> float:
    """Mean bytes written per save, over saves each after one report, once ``done`` tasks were done."""
    job = Job(tasks_per_epoch, workers)
    for number in range(done):
        job.step(number % workers)
    storage = CountingStorage(tmp_path / f"{tasks_per_epoch}-{done}-{workers}")
    store = store_on(storage, job.shards)
    store.save(job.state())  # the first save of a master writes everything
    storage.written.clear()
    for number in range(20):
        job.step(number % workers)
        store.save(job.state())
    return sum(storage.written) / len(storage.written)


def test_bytes_per_commit_do_not_grow_with_the_tasks_queued(tmp_path: Path) -> None:
    few, many = bytes_per_commit(tmp_path, 1_000), bytes_per_commit(tmp_path, 10_000)
    assert many < few * 1.2 + 200, (few, many)


def test_bytes_per_commit_do_not_grow_with_the_tasks_done_or_the_workers(tmp_path: Path) -> None:
    fresh = bytes_per_commit(tmp_path, 1_000)
    assert bytes_per_commit(tmp_path, 1_000, done=2_000) < fresh * 1.2 + 200
    assert bytes_per_commit(tmp_path, 1_000, workers=400) < fresh * 1.2 + 200
