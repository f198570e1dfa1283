"""Child of the ``readers_memory`` benchmark: ``python -m tests.bench.readers_memory_child write|measure
FORMAT FOLDER MB``.

``write`` writes a file of about ``MB`` megabytes in FORMAT (csv or parquet) into FOLDER. ``measure`` (a
fresh process, so that the writer's memory is not in its peak) imports the readers and the format's
library, takes its resident memory as the baseline, opens the file through its reader and reads every row in
ranges of :data:`READ_ROWS`, sampling its resident memory every 5 ms; it prints one JSON line: bytes,
rows, the peak resident memory above the baseline (MB),
and the seconds to index and to read.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

from edl_argo.readers import num_records, open_data

READ_ROWS = 4096
COLUMNS = tuple(f"c{i}" for i in range(10))
BLOCK_ROWS = 65_536


def resident_mb() -> float:
    """This process's resident memory now (``/proc/self/statm``)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class PeakSampler:
    """The highest :func:`resident_mb` seen, sampled every 5 ms on a thread (``ru_maxrss`` cannot be reset,
    so it cannot give the peak of one phase)."""

    def __init__(self) -> None:
        self.peak = resident_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, resident_mb())

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(5)
        return max(self.peak, resident_mb())


def write(fmt: str, folder: Path, megabytes: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    path = folder / f"big.{fmt}"
    target = megabytes * 2**20
    if fmt == "csv":
        with path.open("w") as file:
            file.write(",".join([*COLUMNS, "label"]) + "\n")
            while file.tell() < target:
                values = np.column_stack(
                    [rng.random((BLOCK_ROWS, len(COLUMNS))), rng.integers(0, 10, BLOCK_ROWS)]
                )
                np.savetxt(file, values, fmt=["%.9f"] * len(COLUMNS) + ["%d"], delimiter=",")
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([*(pa.field(c, pa.float64()) for c in COLUMNS), pa.field("label", pa.int64())])
    rows_wanted = target // (8 * (len(COLUMNS) + 1))
    with pq.ParquetWriter(path, schema, compression="none") as writer:
        for _ in range(0, rows_wanted, BLOCK_ROWS):
            columns = {c: rng.random(BLOCK_ROWS) for c in COLUMNS}
            writer.write_table(pa.table({**columns, "label": rng.integers(0, 10, BLOCK_ROWS)}, schema=schema))


def measure(fmt: str, folder: Path) -> dict[str, float]:
    if fmt == "parquet":
        import pyarrow.parquet  # noqa: F401 - the library's own memory is not the reader's
    gc.collect()
    baseline = resident_mb()
    sampler = PeakSampler()
    start = time.perf_counter()
    opened = open_data(str(folder))
    indexed = time.perf_counter()
    rows = 0
    for shard in opened.shards:
        for first in range(0, shard.records, READ_ROWS):
            rows += num_records(opened.read(shard.key, first, min(shard.records, first + READ_ROWS)))
    done = time.perf_counter()
    peak = sampler.stop()
    assert rows == sum(opened.records.values()), (rows, opened.records)
    return {
        "bytes": sum(p.stat().st_size for p in folder.iterdir()),
        "rows": rows,
        "peak_mb": max(0.0, peak - baseline),
        "baseline_mb": baseline,
        "index_seconds": indexed - start,
        "read_seconds": done - indexed,
    }


def main() -> None:
    mode, fmt, folder = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    if mode == "write":
        write(fmt, folder, int(sys.argv[4]))
    else:
        print(json.dumps(measure(fmt, folder)))


if __name__ == "__main__":
    main()
