"""Run the benchmarks and write the markdown report (``make bench``).

Usage: ``python -m tests.bench.run --output docs/benchmarks.md [--only NAME[,NAME...]] [--quick]``.

Options: ``--only NAME[,NAME...]`` runs a subset (names below; ``recordio``, ``training``, ``suite`` (the
dense model suite, both strategies against ``fit``) and ``allreduce`` name groups), ``--quick`` is a short
smoke mode with tiny sizes and one repeat (without ``--only`` it leaves out the CNN and CTR training cases,
the suite and the AllreduceStrategy training jobs, which take minutes even when tiny), ``--keep-workdir``
keeps the temporary folder with the data and the child processes' logs. A benchmark that fails is reported
as failed and the others still run; the exit status is then 1. The report is written atomically
(temporary file + rename).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before anything imports TensorFlow; children inherit it

from tests.bench.common import ROOT, BenchContext, BenchResult, Stat

Benchmark = Callable[[BenchContext], BenchResult]

NAMES = (
    "recordio_local",
    "recordio_s3",
    "csv_convert",
    "dispatch",
    "training_cnn",
    "training_ctr",
    "training_digits",
    "training_stability",
    "suite_big_mlp",
    "suite_resnet_bn",
    "suite_transformer",
    "suite_lstm",
    "allreduce_throughput",
    "allreduce_cnn",
    "allreduce_recovery",
    "k8s_relaunch",
    "readers_s3",
    "readers_memory",
)
GROUPS = {
    "recordio": NAMES[:2],
    "training": NAMES[4:8],
    "suite": tuple(name for name in NAMES if name.startswith("suite_")),
    "allreduce": tuple(name for name in NAMES if name.startswith("allreduce_")),
    "readers": ("readers_s3", "readers_memory"),
}


def benchmarks() -> dict[str, Benchmark]:
    """Every benchmark by name, in report order (imported here: training imports TensorFlow)."""
    from tests.bench.allreduce import allreduce_cnn, allreduce_recovery, allreduce_throughput
    from tests.bench.csv_convert import csv_convert
    from tests.bench.dispatch import dispatch
    from tests.bench.k8s_relaunch import k8s_relaunch
    from tests.bench.readers import readers_memory, readers_s3
    from tests.bench.recordio_bench import recordio_local, recordio_s3
    from tests.bench.stability import training_stability
    from tests.bench.training import SUITE_BENCHMARKS, training_cnn, training_ctr, training_digits

    return {
        "recordio_local": recordio_local,
        "recordio_s3": recordio_s3,
        "csv_convert": csv_convert,
        "dispatch": dispatch,
        "training_cnn": training_cnn,
        "training_ctr": training_ctr,
        "training_digits": training_digits,
        "training_stability": training_stability,
        **SUITE_BENCHMARKS,
        "allreduce_throughput": allreduce_throughput,
        "allreduce_cnn": allreduce_cnn,
        "allreduce_recovery": allreduce_recovery,
        "k8s_relaunch": k8s_relaunch,
        "readers_s3": readers_s3,
        "readers_memory": readers_memory,
    }


#: What ``--quick`` runs without ``--only``: the CNN and CTR cases need minutes even when tiny (TensorFlow
#: start-up and model builds in four processes), the digits case exercises the same harness in one; so do
#: the AllreduceStrategy jobs, while the allreduce bandwidth needs no TensorFlow.
QUICK_DEFAULT = (
    "recordio_local",
    "recordio_s3",
    "csv_convert",
    "dispatch",
    "training_digits",
    "allreduce_throughput",
)


def select(only: str | None, quick: bool = False) -> list[str]:
    """The benchmark names ``--only`` asks for (default: all, or :data:`QUICK_DEFAULT`), in report order."""
    if not only:
        return list(QUICK_DEFAULT if quick else NAMES)
    wanted: set[str] = set()
    for name in (part.strip() for part in only.split(",") if part.strip()):
        if name in GROUPS:
            wanted.update(GROUPS[name])
        elif name in NAMES:
            wanted.add(name)
        else:
            raise SystemExit(f"unknown benchmark {name!r}; choose from {', '.join((*NAMES, *GROUPS))}")
    return [name for name in NAMES if name in wanted]


# --------------------------------------------------------------------------------------------- report


def machine() -> dict[str, str]:
    """What the figures were measured on."""
    import grpc
    import keras
    import numpy
    import tensorflow as tf

    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        memory = f"{pages / 2**30:.0f} GiB"
    except (ValueError, OSError):
        memory = "unknown"
    return {
        "code": code_version(),
        "nproc": str(os.cpu_count()),
        "cpu": cpu,
        "memory": memory,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "grpcio": grpc.__version__,
        "numpy": numpy.__version__,
    }


def code_version() -> str:
    """The commit measured, and whether the working tree had changes (read-only git commands)."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "edl_argo"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git)"
    files = len(changed.splitlines())
    return f"commit {commit}" + (
        f" with uncommitted changes to {files} files under edl_argo/" if files else ""
    )


def _cell(value: Any) -> str:
    if isinstance(value, Stat):
        return value.format()
    if isinstance(value, float):
        return f"{value:,.2f}"
    return str(value)


def _table(columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(_cell(row.get(column, "")) for column in columns) + " |" for row in rows]
    return lines


def render(
    command: str,
    started: datetime,
    seconds: float,
    quick: bool,
    info: dict[str, str],
    loads: tuple[float, float],
    results: list[BenchResult],
    failures: dict[str, str],
) -> str:
    """The markdown report."""
    out = [
        "# Benchmarks",
        "",
        f"Generated by `{command}` (`make bench`) on {started:%Y-%m-%d %H:%M} UTC"
        + (" in **quick (smoke) mode: tiny sizes, not figures to quote**" if quick else "")
        + f"; the run took {seconds / 60:.1f} min.",
        "",
        f"Code: {info['code']}.",
        "",
        f"Machine: nproc {info['nproc']}, {info['cpu']}, {info['memory']}, {info['os']}; Python "
        f"{info['python']}, TensorFlow {info['tensorflow']}, Keras {info['keras']}, grpcio {info['grpcio']}, "
        f"numpy {info['numpy']}. Load average (1 min) at start {loads[0]:.1f}, at end {loads[1]:.1f}: the "
        "machine is shared, so absolute figures move with other work; compare the **ratios**, which pair "
        "measurements taken next to each other in this run.",
        "",
        "Every figure is `median [min–max]` over the repeats stated in its section; a ratio is computed per "
        "repeat from the two measurements of that repeat, then summarised the same way.",
        "",
        "## Goals",
        "",
    ]
    goals = [goal for result in results for goal in result.goals]
    out += _table(
        ["goal", "measured (median [min–max])", "met"],
        [
            {"goal": g.what, "measured (median [min–max])": g.measured, "met": "yes" if g.met else "**no**"}
            for g in goals
        ],
    )
    for name, error in failures.items():
        out += ["", f"**{name} failed**: `{error}`"]
    for result in results:
        out += ["", f"## {result.title}", "", f"`--only {result.name}`, {result.seconds:.0f} s.", ""]
        out += [rst_to_markdown(result.method), ""]
        out += _table(result.columns, result.rows)
        if result.notes:
            out += [""] + [f"- {note}" for note in result.notes]
    if any(result.name.startswith("training_") or result.name == "allreduce_cnn" for result in results):
        from tests.bench import train_baselines, training

        out += ["", "## How the training benchmarks measure", ""]
        out += [rst_to_markdown(training.__doc__ or ""), "", rst_to_markdown(train_baselines.__doc__ or "")]
    raw = {
        result.name: [
            {k: v.to_json() if isinstance(v, Stat) else v for k, v in row.items()} for row in result.rows
        ]
        for result in results
    }
    out += [
        "",
        "<details><summary>Raw values per repeat</summary>",
        "",
        "```json",
        json.dumps(raw, indent=1, ensure_ascii=False),
        "```",
        "",
        "</details>",
        "",
    ]
    return "\n".join(out)


def rst_to_markdown(text: str) -> str:
    """A module docstring as markdown: inline literals and Sphinx roles become code spans."""
    text = re.sub(r":[a-z]+:`~([^`]+)`", lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", text)
    text = re.sub(r":[a-z]+:`([^`]+)`", r"`\1`", text)
    return text.replace("``", "`").replace("\\ ", "").strip()


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary sibling and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


# ----------------------------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--output", type=Path, required=True, help="markdown report to write")
    parser.add_argument("--only", help=f"comma-separated: {', '.join((*NAMES, *GROUPS))}")
    parser.add_argument("--quick", action="store_true", help="smoke mode: tiny sizes, seconds per benchmark")
    parser.add_argument("--keep-workdir", action="store_true", help="keep the data and logs folder")
    args = parser.parse_args(argv)
    names = select(args.only, args.quick)
    command = shlex.join(["python", "-m", "tests.bench.run", *(sys.argv[1:] if argv is None else argv)])
    started = datetime.now(timezone.utc)
    began = time.perf_counter()
    load_start = os.getloadavg()[0]
    workdir = Path(tempfile.mkdtemp(prefix="edl-bench-"))
    os.environ["EDL_RUN_DIR"] = str(workdir / "run")  # our masters' registry entries stay in the workdir
    os.environ["EDL_NO_PROGRESS_BAR"] = "1"
    ctx = BenchContext(quick=args.quick, workdir=workdir)
    results: list[BenchResult] = []
    failures: dict[str, str] = {}
    try:
        available = benchmarks()
        for name in names:
            ctx.log(f"[bench] {name} ...")
            t0 = time.perf_counter()
            load = os.getloadavg()[0]
            try:
                result = available[name](ctx)
            except Exception as error:
                traceback.print_exc()
                failures[name] = f"{type(error).__name__}: {error}".splitlines()[0][:300]
                continue
            result.seconds = time.perf_counter() - t0
            result.notes.append(
                f"Load average (1 min) before / after: {load:.1f} / {os.getloadavg()[0]:.1f}."
            )
            results.append(result)
            ctx.log(f"[bench] {name} done in {result.seconds:.0f} s")
        info = machine()
    finally:
        if args.keep_workdir:
            ctx.log(f"[bench] data and logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    report = render(
        command,
        started,
        time.perf_counter() - began,
        args.quick,
        info,
        (load_start, os.getloadavg()[0]),
        results,
        failures,
    )
    write_atomically(args.output, report)
    ctx.log(f"[bench] report written to {args.output}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
