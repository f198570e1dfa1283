"""The master's state as a log: a snapshot plus numbered segments of changes, compacted now and then
(:mod:`edl_argo.master.state_store`). What a save costs must not grow with the job's tasks, epochs or
workers, and a restarted master must read back exactly what was saved, on a folder and on S3."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from edl_argo.errors import DataFormatError, StorageError
from edl_argo.master import state_store
from edl_argo.master.config import TrainConfig
from edl_argo.master.ledger import TrainingLedger
from edl_argo.master.state_store import LOG_PREFIX, STATE_KEY, MasterStateStore, job_fingerprint
from edl_argo.storage import LocalStorage, Storage, open_storage
from tests.scale.load_master import MINIBATCH_SIZE
from tests.scale.state_saves import SavingJob


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


def small_job(tasks_per_epoch: int, workers: int = 4) -> SavingJob:
    """A job of three epochs, its parts saved as a master saves them."""
    return SavingJob(tasks_per_epoch, workers, epochs=3)


def bytes_per_commit(tmp_path: Path, tasks_per_epoch: int, *, done: int = 0, workers: int = 4) -> float:
    """Mean bytes written per save, over saves each after one report, once ``done`` tasks were done."""
    job = small_job(tasks_per_epoch, workers)
    for _ in range(done):
        job.report()
    storage = CountingStorage(tmp_path / f"{tasks_per_epoch}-{done}-{workers}")
    store = store_on(storage, job.shards)
    store.save(job.state())  # the first save of a master writes everything
    storage.written.clear()
    for _ in range(20):
        job.report()
        store.save(job.state())
    return sum(storage.written) / len(storage.written)


def test_bytes_per_commit_do_not_grow_with_the_tasks_queued(tmp_path: Path) -> None:
    few, many = bytes_per_commit(tmp_path, 1_000), bytes_per_commit(tmp_path, 10_000)
    assert many < few * 1.2 + 200, (few, many)


def test_bytes_per_commit_do_not_grow_with_the_tasks_done_or_the_workers(tmp_path: Path) -> None:
    fresh = bytes_per_commit(tmp_path, 1_000)
    assert bytes_per_commit(tmp_path, 1_000, done=2_500) < fresh * 1.2 + 200
    assert bytes_per_commit(tmp_path, 1_000, workers=400) < fresh * 1.2 + 200


def saves_and_loads_back(
    storage: Storage, saves: int, *, one_at_a_time: bool = False
) -> tuple[MasterStateStore, dict[str, Any]]:
    """A store on ``storage`` that saved ``saves`` states of a job; the last state it saved.
    ``one_at_a_time``: each save waits for the compaction it started, if any (so which saves compact does
    not depend on how fast a compaction is)."""
    job = small_job(100)
    store = store_on(storage, job.shards)
    for _ in range(saves):
        job.report()
        store.save(job.state())
        if one_at_a_time:
            assert store.wait_for_compaction()
    return store, job.last


def loaded(store: MasterStateStore) -> dict[str, Any]:
    """What a new master's store reads back from ``store``'s storage (a job of :func:`small_job` (100))."""
    state = store_on(store.storage, small_job(100).shards).load()
    assert state is not None
    return state


def same_parts(state: dict[str, Any], parts: dict[str, Any]) -> bool:
    return json.loads(json.dumps({part: state[part] for part in parts})) == json.loads(json.dumps(parts))


@pytest.mark.parametrize("backend", ["folder", "s3"])
def test_a_restart_reads_the_snapshot_and_every_segment_after_it(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    storage = (
        LocalStorage(tmp_path) if backend == "folder" else open_storage(request.getfixturevalue("s3_env"))
    )
    store, last = saves_and_loads_back(storage, 12)
    assert store.wait_for_compaction() and store.compactions == 1
    assert len(storage.list(LOG_PREFIX)) == 11  # the first save is a snapshot, then one segment each
    assert same_parts(loaded(store), last)
    store.remove()
    assert storage.list("master/") == []


def test_a_restarted_master_starts_with_a_snapshot_numbered_past_every_segment(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    saves_and_loads_back(storage, 5)
    second = store_on(storage, small_job(100).shards)
    restored = second.load()
    assert restored is not None
    job = small_job(100)
    job.report()
    second.save(job.state())  # compacts: the old segments are ignored, then swept
    second.save(job.state())
    assert same_parts(loaded(second), job.last)
    assert second.compactions == 1
    assert _segment_numbers(storage, [4]) == [4]  # 0..3, the first master's, swept; the new one writes 4


def _segment_numbers(storage: Storage, expected: list[int]) -> list[int]:
    """The log's segment numbers, once they are ``expected`` (old ones are swept in the background) or
    after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        numbers = [int(info.key.rsplit("/", 1)[1].split(".")[0]) for info in storage.list(LOG_PREFIX)]
        if numbers == expected or time.monotonic() > deadline:
            return numbers
        time.sleep(0.05)


def test_an_unreadable_last_segment_is_a_save_that_never_completed(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    saves_and_loads_back(storage, 6)
    before_last = store_on(storage, small_job(100).shards)
    last_key = storage.list(LOG_PREFIX)[-1].key
    complete = storage.read(last_key)
    storage.write(last_key, complete[: len(complete) // 2])  # torn
    state = before_last.load()
    assert state is not None
    storage.write(last_key, complete)
    full = store_on(storage, small_job(100).shards).load()
    assert full is not None and state["saved_at"] < full["saved_at"]


def test_an_unreadable_or_missing_segment_before_others_is_corrupt(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    saves_and_loads_back(storage, 6)
    keys = [info.key for info in storage.list(LOG_PREFIX)]
    storage.write(keys[1], b'{"segment": 1, "pat')
    with pytest.raises(DataFormatError, match=r"cannot be restored \(segment .*000000000001\.json: "):
        store_on(storage, small_job(100).shards).load()
    storage.delete(keys[1])
    with pytest.raises(DataFormatError, match="segment 1 of its log is missing"):
        store_on(storage, small_job(100).shards).load()


def test_a_save_compacts_after_so_many_segments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state_store, "COMPACT_SEGMENTS", 4)
    storage = LocalStorage(tmp_path)
    store, last = saves_and_loads_back(storage, 11, one_at_a_time=True)
    # 1 a snapshot; 2-5 segments 0-3, then a compaction of 5; 6-9 segments 4-7, a compaction of 9; 10-11 8-9
    assert store.compactions == 3
    assert _segment_numbers(storage, [8, 9]) == [8, 9]
    assert same_parts(loaded(store), last)


def test_a_failed_segment_write_is_written_again_with_every_change_since(tmp_path: Path) -> None:
    storage = FlakyStorage(tmp_path)
    job = small_job(100)
    store = store_on(storage, job.shards)
    store.save(job.state())
    job.report()
    storage.fail_next = True
    with pytest.raises(StorageError):
        store.save(job.state())
    job.report()
    store.save(job.state())  # the same segment number, both changes
    assert same_parts(loaded(store), job.last)


class FlakyStorage(LocalStorage):
    """A folder whose next write fails when ``fail_next`` is set."""

    fail_next = False

    def write(self, key: str, data: bytes) -> None:
        if self.fail_next:
            self.fail_next = False
            raise StorageError(f"{key}: injected failure")
        super().write(key, data)


def test_a_ledger_snapshot_makes_again_only_the_buckets_that_changed() -> None:
    job = small_job(10_000, workers=1)
    for _ in range(3_000):
        job.report()
    before = job.parts.ledger.snapshot()["task_buckets"]
    job.report()
    after = job.parts.ledger.snapshot()["task_buckets"]
    remade = [bucket for bucket in after if before.get(bucket) is not after[bucket]]
    assert len(before) >= 3 and remade == [max(after, key=int)]
    restored = TrainingLedger(minibatch_size=MINIBATCH_SIZE)
    restored.restore(json.loads(json.dumps(job.parts.ledger.snapshot())))
    assert restored.snapshot() == job.parts.ledger.snapshot()
    assert restored.records_per_epoch() == job.parts.ledger.records_per_epoch()


class HeldSnapshots(LocalStorage):
    """A folder whose snapshot writes wait for :attr:`release` while :attr:`hold` is set."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.hold = False
        self.release = threading.Event()

    def write(self, key: str, data: bytes) -> None:
        if key == STATE_KEY and self.hold:
            assert self.release.wait(10), "the test never released the snapshot"
        super().write(key, data)


def test_no_save_waits_for_a_compaction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(state_store, "COMPACT_SEGMENTS", 2)
    storage = HeldSnapshots(tmp_path)
    job = small_job(100)
    store = store_on(storage, job.shards)
    store.save(job.state())
    storage.hold = True
    started = time.monotonic()
    for _ in range(6):  # the second starts a compaction, held; the others write segments meanwhile
        job.report()
        store.save(job.state())
    assert time.monotonic() - started < 5 and not store.wait_for_compaction(0.1)
    storage.release.set()
    assert store.wait_for_compaction()
    assert same_parts(loaded(store), job.last)
