"""The data readers measured (``make bench``): the worker's input wait when the MNIST-style CNN trains from
each file format on S3, and the memory of indexing and reading a large CSV or Parquet file.

``readers_s3``: the same generated records as RecordIO, TFRecord, CSV (one column per pixel) and Parquet
files on the S3 stand-in; one local job (1 worker + 1 PS, sync) per format, timed windows as in the
training benchmarks; the worker's input wait (``STEP_TIMERS`` "input": time its training loop waited for
the next minibatch, which includes the model's ``feed``) as a share of its step, and the time its task
stream spent reading the records (``read_us`` of each task report; on its own thread, one task ahead) as a
share of its step. The goal is issue 33's: under 5% for every format.

``readers_memory``: a child process generates a CSV and a Parquet file of ``--quick``-dependent size (1 GiB
in full mode), then opens each through its reader (the master's index) and reads every record through the
worker's ranged reads, 4,096 rows at a time; it reports its peak resident memory above what it held after
importing the readers (sampled every 5 ms). The goal: under 300 MB.
"""

from __future__ import annotations

import json
import subprocess
import sys

from edl_argo.data.file_writers import write_records_as
from tests.bench.common import ROOT, BenchContext, BenchResult, Goal, Stat, child_env, environment
from tests.bench.data import mnist_like_records
from tests.bench.step_breakdown import breakdown, read_ms_per_step
from tests.bench.training import BATCH, MODELS, ModelCase, OurJob, Timing, Window

FORMATS = ("recordio", "tfrecord", "csv", "parquet")
INPUT_WAIT_CEILING = 5.0
MEMORY_CEILING_MB = 300.0
CNN_ANY_FORMAT = ModelCase(
    name="readers_s3",
    title="MNIST-style CNN fed from each file format",
    model_def=MODELS / "mnist_cnn_columns.py",
    num_ps=1,
    records=lambda quick: mnist_like_records(1024 if quick else 4096),
)


def readers_s3(ctx: BenchContext) -> BenchResult:
    """Input wait of the CNN job per file format, read from the S3 stand-in."""
    from edl_argo.data.commands import write_dataset
    from edl_argo.recordio import Compressor
    from edl_argo.storage import S3Storage
    from tests.s3_stand_in import S3StandIn

    folder = ctx.folder("readers_s3")
    records = CNN_ANY_FORMAT.records(ctx.quick)
    timing = Timing.of(ctx)
    repeats = 1 if ctx.quick else ctx.repeats
    result = BenchResult(
        name="readers_s3",
        title="Data readers: the CNN's input wait per file format, read from S3 (the stand-in, on loopback)",
        method=(
            f"{len(records):,} generated 28×28 records (`mnist_like_records`) written as 4 files of each "
            "format (CSV and Parquet: one float column per pixel and `label`) to the S3 stand-in; model "
            "file `tests/bench/models/mnist_cnn_columns.py` (the CNN benchmark's model, its columns stacked "
            f"per 256 rows); one local job per format, 1 worker + 1 PS, sync, batch 64, {repeats} timed "
            f"window(s) of ≥ {timing.target_seconds:g} s after a warm-up. Input wait: the worker's wait for "
            "its next minibatch, as a share of its step."
        ),
        columns=["format", "examples/s", "input wait (% of step)", "read (% of step)", "bytes on S3"],
    )
    bucket = "bench"
    with S3StandIn() as server, environment({**server.env(), "AWS_SESSION_TOKEN": ""}):
        server.create_bucket(bucket)
        storage = S3Storage(f"s3://{bucket}")
        for fmt in FORMATS:
            if fmt == "recordio":
                write_dataset(storage, fmt, records, 4, Compressor.SNAPPY, overwrite=False)
            else:
                write_records_as(fmt, storage, fmt, records, 4)
            size = sum(info.size for info in storage.list(f"{fmt}/"))
            ctx.log(f"  readers_s3: {fmt}")
            with (folder / f"{fmt}.log").open("a") as log:
                job = OurJob(
                    CNN_ANY_FORMAT,
                    folder,
                    folder,
                    log,
                    overrides={"training_data": f"s3://{bucket}/{fmt}"},
                    name=f"bench-readers-{fmt}",
                )
                try:
                    job.start()
                    windows = [job.window(timing.target_seconds, first=i == 0) for i in range(repeats)]
                finally:
                    job.stop()
            waits = Stat.of(job.input_wait_percents(windows))
            reads = Stat.of([read_percent(job, window) for window in windows])
            result.rows.append(
                {
                    "format": fmt,
                    "examples/s": Stat.of([w.examples_per_s for w in windows]),
                    "input wait (% of step)": waits,
                    "read (% of step)": reads,
                    "bytes on S3": f"{size / 1e6:.1f} MB",
                }
            )
            result.goals.append(
                Goal(
                    f"{fmt}: input wait < {INPUT_WAIT_CEILING:g}% of the step (%)",
                    waits,
                    INPUT_WAIT_CEILING,
                    at_most=True,
                )
            )
            result.goals.append(
                Goal(
                    f"{fmt}: reading < {INPUT_WAIT_CEILING:g}% of the step (%)",
                    reads,
                    INPUT_WAIT_CEILING,
                    at_most=True,
                )
            )
            result.notes.append(job.breakdown_note(fmt, windows))
    return result


def read_percent(job: OurJob, window: Window) -> float:
    """The time the worker's task stream spent reading the window's records, as a share of its steps."""
    steps = max(1, window.records // BATCH)
    per_step = breakdown(job.tap, window.task_ids, steps)
    return 100.0 * read_ms_per_step(job.tap, window.task_ids, steps) / (sum(per_step.values()) or 1.0)


def readers_memory(ctx: BenchContext) -> BenchResult:
    """Peak reader memory of indexing and reading a large CSV and Parquet file (child process)."""
    folder = ctx.folder("readers_memory")
    target_mb = 64 if ctx.quick else 1024
    result = BenchResult(
        name="readers_memory",
        title="Data readers: memory of indexing and reading a large CSV and Parquet file",
        method=(
            f"`python -m tests.bench.readers_memory_child write|measure FORMAT FOLDER {target_mb}`: one "
            f"child process writes a {target_mb} MiB file (10 float64 columns and an int label per row; "
            "Parquet: uncompressed row groups of 64k rows); a fresh one imports the readers (and pyarrow), "
            "notes its resident memory, opens the file through the reader (the master's index) and reads "
            "every row through the worker's ranged reads, 4,096 rows at a time, sampling its resident "
            "memory every 5 ms; the figure is the peak above the one before opening."
        ),
        columns=[
            "format",
            "file size",
            "rows",
            "index + read peak above baseline",
            "seconds to index",
            "seconds to read",
        ],
    )
    for fmt in ("csv", "parquet"):
        ctx.log(f"  readers_memory: {fmt} ({target_mb} MB)")
        outputs = [
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "tests.bench.readers_memory_child",
                    mode,
                    fmt,
                    str(folder / fmt),
                    str(target_mb),
                ],
                cwd=ROOT,
                env=child_env(),
                capture_output=True,
                text=True,
                timeout=3600,
                check=True,
            ).stdout
            for mode in ("write", "measure")
        ]
        measured = json.loads(outputs[-1].strip().splitlines()[-1])
        peak = Stat.of([measured["peak_mb"]])
        result.rows.append(
            {
                "format": fmt,
                "file size": f"{measured['bytes'] / 2**20:,.0f} MiB",
                "rows": f"{measured['rows']:,}",
                "index + read peak above baseline": peak.format(0) + " MB",
                "seconds to index": f"{measured['index_seconds']:.1f}",
                "seconds to read": f"{measured['read_seconds']:.1f}",
            }
        )
        result.goals.append(
            Goal(f"{fmt}: reader memory < {MEMORY_CEILING_MB:g} MB", peak, MEMORY_CEILING_MB, at_most=True)
        )
    return result
