"""A job of many shards and epochs, as the master sees it (issue 34, part 3): ``python -m
tests.scale.many_shards [--shards 10000] [--epochs 100] [--run-epochs 3] [--store folder|s3]`` prints a
markdown table.

In this process, no RPC: a RecordIO dataset of ``--shards`` shards (a manifest naming tiny files that claim
``--shard-records`` records each: the master reads the manifest and lists the shards, never their records)
is opened as ``edl-argo train`` opens it (:func:`~edl_argo.readers.open_data`); a :class:`TaskDispatcher`
of ``--epochs`` epochs of 512-record tasks is made over it, with the ledger a master keeps; then
``--run-epochs`` epochs are handed out and reported by 1,000 workers in turn (the dispatcher's and the
ledger's calls of a GetTask and a ReportTaskResult, no servicer). Measured: the seconds to open the dataset
and make the dispatcher; per epoch, the get_task that creates the epoch (cutting and shuffling its tasks),
microseconds per task handed out and reported, and the process's resident memory after it (the ledger
folds an epoch done :data:`~edl_argo.master.ledger.FOLD_AFTER_SECONDS` ago, as the master's loop has it
do, the clock taken to move 1,000 s an epoch); and one state save at the end (a snapshot, then one
segment).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from edl_argo.master.config import TrainConfig
from edl_argo.master.ledger import TrainingLedger
from edl_argo.master.state_store import MasterStateStore, job_fingerprint
from edl_argo.master.task_dispatcher import DispatcherConfig, TaskDispatcher
from edl_argo.readers import open_data
from edl_argo.recordio.dataset import MANIFEST_NAME
from edl_argo.storage import open_storage
from tests.bench.common import environment, process_rss_bytes
from tests.scale.load_master import MINIBATCH_SIZE
from tests.scale.master_load import state_location

RECORDS_PER_TASK = 512
WORKERS = 1_000
SHARD_BYTES = b"not records: the master never reads them"


def write_dataset(url: str, shards: int, shard_records: int) -> None:
    """A manifest naming ``shards`` tiny files of ``shard_records`` records each, and the files."""
    storage = open_storage(url)
    entries = []
    for number in range(shards):
        key = f"v-20261129T000000Z-00000000/data-{number:05d}"
        storage.write(key, SHARD_BYTES)
        entries.append({"key": key, "records": shard_records, "bytes": len(SHARD_BYTES), "sha256": ""})
    manifest = {
        "format": "edl-argo-dataset",
        "version": 1,
        "created": "2026-11-29T00:00:00Z",
        "records": shards * shard_records,
        "shards": entries,
    }
    storage.write(MANIFEST_NAME, json.dumps(manifest).encode())


def mib() -> float:
    return process_rss_bytes(os.getpid()) / 2**20


def rows(args: argparse.Namespace) -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="edl-many-shards-") as folder:
        location = state_location(args.store, Path(folder))
        with location as (url, env), environment(env):
            data_url = f"{url}/data"
            write_dataset(data_url, args.shards, args.shard_records)
            before, started = mib(), time.perf_counter()
            data = open_data(data_url, "recordio", {}, what="--training-data")
            opened = time.perf_counter() - started
            yield "| step | seconds | µs per task | resident MiB |"
            yield "|---|---|---|---|"
            what = f"open the dataset ({len(data.records):,} shards; {before:.0f} MiB before)"
            yield f"| {what} | {opened:.2f} | | {mib():.0f} |"
            started = time.perf_counter()
            config = DispatcherConfig(records_per_task=RECORDS_PER_TASK, num_epochs=args.epochs, shuffle=True)
            dispatcher = TaskDispatcher(data.records, config)
            ledger = TrainingLedger(MINIBATCH_SIZE)
            made = time.perf_counter() - started
            yield f"| make the dispatcher ({args.epochs} epochs), the ledger | {made:.3f} | | {mib():.0f} |"
            holder, started = 0, time.perf_counter()
            assignment = dispatcher.get_task(holder)
            creation = time.perf_counter() - started  # the first get_task of an epoch cuts and shuffles it
            for epoch in range(args.run_epochs):
                tasks, started = 0, time.perf_counter()
                while assignment.task is not None and assignment.task.epoch == epoch:
                    task = assignment.task
                    counters = {"records": task.num_records, "steps": -(-task.num_records // MINIBATCH_SIZE)}
                    ledger.add(task, counters, holder)
                    dispatcher.report(task.task_id, holder, True)
                    tasks += 1
                    holder = tasks % WORKERS
                    asked = time.perf_counter()
                    assignment = dispatcher.get_task(holder)
                    last_call = time.perf_counter() - asked
                per_task = (time.perf_counter() - started - last_call) / tasks * 1e6
                # The master's loop folds the ledger's epochs done long enough ago (an epoch: 1,000 s here).
                ledger.fold_complete_epochs(dispatcher.accounting(), now=1_000.0 * epoch)
                yield f"| epoch {epoch}: cut and shuffle its {tasks:,} tasks | {creation:.3f} | | |"
                seconds = tasks * per_task / 1e6
                yield f"| epoch {epoch}: hand out, report | {seconds:.1f} | {per_task:.1f} | {mib():.0f} |"
                creation = last_call
            yield from _save(url, data.records, dispatcher, ledger)


def _save(
    url: str, shards: dict[str, int], dispatcher: TaskDispatcher, ledger: TrainingLedger
) -> Iterator[str]:
    config = TrainConfig(model_def="m.py", training_data="d", output=url)
    store = MasterStateStore(open_storage(url), "many", job_fingerprint(config, shards, {}))
    for what in ("state save: snapshot (a compaction)", "state save: one segment"):
        started = time.perf_counter()
        parts = {"dispatcher": dispatcher.snapshot(), "ledger": ledger.snapshot()}
        store.save(parts)
        yield f"| {what} | {time.perf_counter() - started:.3f} | | {mib():.0f} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--shards", type=int, default=10_000)
    parser.add_argument("--shard-records", type=int, default=5_120)
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--run-epochs", type=int, default=3)
    parser.add_argument("--store", choices=["folder", "s3"], default="folder")
    for line in rows(parser.parse_args(argv)):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
