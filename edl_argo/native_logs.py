"""TensorFlow's native start-up notices: recognising them, and keeping them out of a process's output.

TensorFlow's C++ code logs through absl. ``TF_CPP_MIN_LOG_LEVEL`` filters what it logs once absl's logging
is initialised, but not what it logs before: absl writes those lines straight to file descriptor 2, after
a preamble (``WARNING: All log messages before absl::InitializeLog() is called are written to STDERR``).
Which lines come that early depends on the CPU: on an Intel CPU with AVX-512, ``import tensorflow`` writes
the oneDNN notice twice, with its preamble; on others, nothing. Python's ``sys.stderr`` cannot see them.

:func:`hide_notices_while_importing` makes the import of TensorFlow itself quiet, whenever it happens in the
process: for that import only, descriptor 2 goes to a temporary file, and what was written there is then
copied to the real stderr less the native lines below ``TF_CPP_MIN_LOG_LEVEL``. Everything else (Python
warnings, an error that ends the import) still reaches stderr, a few seconds late and in order. Lines
written before a crash inside the import itself (a native abort) are lost with the process.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Sequence
from types import ModuleType

#: A native log line (absl or glog, as TensorFlow and gRPC write them) and its severity letter:
#: ``I0000 00:00:1795617865.911643   11482 cpu_feature_guard.cc:227] ...`` and
#: ``2026-05-04 10:11:12.345678: I tensorflow/core/util/port.cc:153] oneDNN ...``.
_NATIVE_LINE = re.compile(
    r"(?P<absl>[IWEF])\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ \S+:\d+\]"
    r"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: (?P<glog>[IWEF]) \S+:\d+\]"
)
#: Lines that belong to the notices without a severity of their own: absl's preamble to early lines, and
#: the continuation line of TensorFlow's CPU-feature notice (an INFO line).
_ABSL_PREAMBLE = "WARNING: All log messages before absl::InitializeLog() is called"
_CPU_FEATURE_CONTINUATION = re.compile(r"To enable the following instructions: .* rebuild TensorFlow")

_SEVERITIES = "IWEF"


def notice_severity(line: str) -> int | None:
    """The severity of a native notice (0 INFO, 1 WARNING, 2 ERROR, 3 FATAL, as ``TF_CPP_MIN_LOG_LEVEL``
    counts them), or None if ``line`` is not one. absl's preamble counts as INFO: it precedes early lines
    and says nothing of its own."""
    match = _NATIVE_LINE.match(line)
    if match is not None:
        return _SEVERITIES.index(match.group("absl") or match.group("glog"))
    if line.startswith(_ABSL_PREAMBLE) or _CPU_FEATURE_CONTINUATION.match(line):
        return 0
    return None


def is_native_notice(line: str) -> bool:
    """Whether ``line`` is a native library's log line (TensorFlow's C++ notices), not the program's."""
    return notice_severity(line) is not None


def min_log_level() -> int:
    """``TF_CPP_MIN_LOG_LEVEL`` as a number (0 when unset or not a number)."""
    value = os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0").strip()
    return int(value) if value.isdigit() else 0


def without_notices(lines: Sequence[str], min_level: int) -> list[str]:
    """``lines`` less the native notices whose severity is below ``min_level``."""
    kept = []
    for line in lines:
        severity = notice_severity(line)
        if severity is None or severity >= min_level:
            kept.append(line)
    return kept


@contextlib.contextmanager
def notices_hidden(min_level: int) -> Iterator[None]:
    """Inside the block, whatever is written to file descriptor 2 is held back; at its end (also when it
    raises) it goes to the real descriptor 2 less the native notices below ``min_level``. Not for blocks
    whose output someone waits to see while they run: nothing reaches stderr before the block ends."""
    if min_level <= 0:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            text = held.read().decode("utf-8", errors="replace")
            kept = without_notices(text.splitlines(keepends=True), min_level)
            if kept:
                os.write(2, "".join(kept).encode("utf-8"))


class _QuietLoader(importlib.abc.Loader):
    """A module's own loader, whose ``exec_module`` runs with the native notices hidden."""

    def __init__(self, loader: importlib.abc.Loader, min_level: int) -> None:
        self._loader = loader
        self._min_level = min_level

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # The module sees its own loader, as if this one had never been there.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        with notices_hidden(self._min_level):
            self._loader.exec_module(module)


class _QuietImportFinder(importlib.abc.MetaPathFinder):
    """Finds ``module`` through the other finders and gives it a :class:`_QuietLoader`. It stays in
    ``sys.meta_path``: an import that failed is quiet again when tried again, and one that succeeded never
    asks a finder again."""

    def __init__(self, module: str, min_level: int) -> None:
        self.module = module
        self._min_level = min_level
        self._finding = False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.module or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding = False
        if spec is not None and spec.loader is not None:
            spec.loader = _QuietLoader(spec.loader, self._min_level)
        return spec


def hide_notices_while_importing(module: str = "tensorflow") -> None:
    """Hide the native notices below ``TF_CPP_MIN_LOG_LEVEL`` that ``module``'s import writes, whenever
    this process first imports it (directly or through another package, such as Keras). Does nothing when
    it is imported already or the level shows every notice."""
    min_level = min_log_level()
    if module in sys.modules or min_level <= 0:
        return
    if any(isinstance(f, _QuietImportFinder) and f.module == module for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _QuietImportFinder(module, min_level))
