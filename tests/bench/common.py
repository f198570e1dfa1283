"""What every benchmark shares: repeated measurements, result rows, the run context, child processes."""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

#: The repository root (the benchmarks run from there, as ``python -m tests.bench.run``).
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Stat:
    """One quantity measured several times; shown as ``median [min–max]``."""

    values: tuple[float, ...]

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat:
        if not values:
            raise ValueError("a Stat needs at least one value")
        return cls(tuple(float(v) for v in values))

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)

    def format(self, digits: int | None = None) -> str:
        """``1,234 [1,100–1,300]``; ``digits`` decimals (default: by magnitude), no range for one value."""
        places = digits if digits is not None else _default_places(self.median)
        text = f"{self.median:,.{places}f}"
        if len(self.values) > 1:
            text += f" [{self.low:,.{places}f}–{self.high:,.{places}f}]"
        return text

    def to_json(self) -> dict[str, Any]:
        return {"median": self.median, "min": self.low, "max": self.high, "values": list(self.values)}


def _default_places(value: float) -> int:
    magnitude = abs(value)
    if magnitude >= 100:
        return 0
    if magnitude >= 10:
        return 1
    return 2


def ratio_stat(numerators: Sequence[float], denominators: Sequence[float]) -> Stat:
    """Per-repeat ratios ``numerators[i] / denominators[i]`` (pairs measured next to each other)."""
    return Stat.of([n / d for n, d in zip(numerators, denominators, strict=True)])


#: One row of a result table: column name -> cell (a :class:`Stat`, a number or text).
Row = dict[str, Any]


@dataclass(frozen=True)
class Goal:
    """A target from the issue, e.g. ``reader ≥ 0.8× raw``, checked against a measured ratio."""

    what: str
    measured: Stat
    threshold: float
    #: True for a ceiling (``peak memory ≤ 400 MB``): met when the median is at most the threshold.
    at_most: bool = False

    @property
    def met(self) -> bool:
        if self.at_most:
            return self.measured.median <= self.threshold
        return self.measured.median >= self.threshold


@dataclass
class BenchResult:
    """What one benchmark function returns: its rows, how they were measured and the goals it checks."""

    name: str
    title: str
    method: str
    columns: list[str]
    rows: list[Row] = field(default_factory=list)
    goals: list[Goal] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class BenchContext:
    """Settings shared by the benchmarks of one run."""

    #: Short smoke mode: tiny sizes, one or two repeats.
    quick: bool
    #: A fresh temporary folder for this run's data; removed at the end of the run.
    workdir: Path
    #: How many times each measurement is repeated (full mode).
    repeats: int = 3
    log: Callable[[str], None] = field(default=lambda message: print(message, file=sys.stderr, flush=True))

    def folder(self, name: str) -> Path:
        """A new subfolder of :attr:`workdir`."""
        path = self.workdir / name
        path.mkdir(parents=True, exist_ok=False)
        return path


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a benchmark's child process: ours, quiet TensorFlow, the repo importable."""
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time process ``pid`` has used so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` now, bytes (Linux ``/proc``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def start_announcing_child(
    module: str, args: Sequence[str], log: IO[bytes], *, what: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], list[str]]:
    """Run ``python -m module *args`` in a session of its own (its output after the first line to ``log``)
    and return it with the words of the first line it prints, which must start with ``PORT`` (e.g.
    ``PORT 4711``); killed, with a RuntimeError naming ``what``, if it does not."""
    process = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        stderr=log,
        stdin=subprocess.DEVNULL,
        cwd=ROOT,
        env=env or child_env(),
        start_new_session=True,
    )
    assert process.stdout is not None
    words = process.stdout.readline().decode().split()
    if len(words) < 2 or words[0] != "PORT":
        kill_group(process)
        raise RuntimeError(f"the {what} did not start (see {log.name})")
    return process, words[1:]


def kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process group of ``process`` (started with ``start_new_session``) and reap it."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def tail(path: Path, lines: int = 25) -> str:
    """The last ``lines`` lines of a log file, for error messages."""
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return f"no log at {path}"
    return f"end of {path}:\n" + "\n".join(text)


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set inside the block, as it was after it."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
