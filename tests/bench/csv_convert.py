"""``edl-argo data convert`` of a large CSV file: peak memory and time.

A CSV file of about 200 MB (quick mode: 5 MB) is generated in the run's temporary folder: a header and
rows of 8 integer columns, 4 decimal columns, one text column and an integer label (about 120 bytes a
row). It is converted by ``edl-argo data convert --from FILE --label-column label --output DIR --shards 4``
in a child process; its peak resident memory is the child's own high-water mark (``VmHWM`` of
``/proc/self/status`` as it exits), its time the child's wall time. The converter reads the file twice
(types first, then records), streaming, and writes each shard through a local temporary file, so its
memory should not grow with the file.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

from tests.bench.common import BenchContext, BenchResult, Goal, Stat, child_env

#: Size of the generated CSV file (full mode).
FILE_BYTES = 200 * 10**6
#: The goal of issue 23: converting a 200 MB CSV peaks below this.
PEAK_GOAL_MB = 400.0


def write_csv(path: Path, target_bytes: int, seed: int = 0) -> int:
    """Write the benchmark's CSV file of about ``target_bytes``; returns the number of data rows."""
    rng = random.Random(seed)
    header = [f"i{n}" for n in range(8)] + [f"f{n}" for n in range(4)] + ["text", "label"]
    rows = 0
    with path.open("w", encoding="utf-8", newline="") as file:
        file.write(",".join(header) + "\n")
        while file.tell() < target_bytes:
            lines = []
            for _ in range(10_000):
                ints = [str(rng.randrange(-(10**9), 10**9)) for _ in range(8)]
                floats = [f"{rng.uniform(-1000, 1000):.4f}" for _ in range(4)]
                text = f"word{rng.randrange(10_000)}"
                lines.append(",".join([*ints, *floats, text, str(rng.randrange(2))]))
            file.write("\n".join(lines) + "\n")
            rows += len(lines)
    return rows


#: Runs ``edl-argo`` and, as it exits, writes its peak resident memory (``VmHWM``, in kB) to ``argv[1]``.
#: ``VmHWM`` belongs to the process image, so unlike ``ru_maxrss`` it does not count the forked copy of
#: the (large) benchmark process that ran before ``exec``.
PEAK_REPORTER = """
import atexit, re, sys
from pathlib import Path
report = Path(sys.argv[1])
def peak():
    status = Path("/proc/self/status").read_text()
    report.write_text(re.search(r"VmHWM:\\s+(\\d+) kB", status).group(1))
atexit.register(peak)
from edl_argo.cli import main
sys.exit(main(sys.argv[2:]))
"""


def convert(source: Path, output: Path, log: Path) -> tuple[float, float]:
    """Run ``edl-argo data convert`` in a child process: (peak RSS in MB, wall seconds)."""
    report = log.with_suffix(".peak")
    argv = [sys.executable, "-c", PEAK_REPORTER, str(report), "data", "convert", "--from", str(source)]
    argv += ["--label-column", "label", "--output", str(output), "--shards", "4"]
    started = time.perf_counter()
    with log.open("wb") as sink:
        child = subprocess.run(argv, stdout=sink, stderr=subprocess.STDOUT, env=child_env(), check=False)
    code = child.returncode
    seconds = time.perf_counter() - started
    if code != 0:
        raise RuntimeError(f"data convert exited {code}: {log.read_text()[-500:]}")
    return int(report.read_text()) / 1024, seconds


def csv_convert(ctx: BenchContext) -> BenchResult:
    folder = ctx.folder("csv_convert")
    source = folder / "big.csv"
    rows = write_csv(source, 5 * 10**6 if ctx.quick else FILE_BYTES)
    megabytes = source.stat().st_size / 10**6
    repeats = 1  # one conversion of 200 MB takes minutes; peak memory hardly varies between runs
    peaks, seconds = [], []
    for repeat in range(repeats):
        peak, wall = convert(source, folder / f"out-{repeat}", folder / f"convert-{repeat}.log")
        peaks.append(peak)
        seconds.append(wall)
    peak_stat = Stat.of(peaks)
    result = BenchResult(
        name="csv_convert",
        title="CSV conversion (`edl-argo data convert`): peak memory",
        method=__doc__ or "",
        columns=["CSV file", "rows", "peak RSS (MB)", "seconds", "rows/s"],
        rows=[
            {
                "CSV file": f"{megabytes:,.0f} MB",
                "rows": f"{rows:,}",
                "peak RSS (MB)": peak_stat,
                "seconds": Stat.of(seconds),
                "rows/s": Stat.of([rows / s for s in seconds]),
            }
        ],
        notes=[f"{repeats} repeat(s)."],
    )
    result.goals.append(
        Goal(
            f"convert a {megabytes:,.0f} MB CSV: peak RSS ≤ {PEAK_GOAL_MB:.0f} MB",
            peak_stat,
            PEAK_GOAL_MB,
            True,
        )
    )
    return result
