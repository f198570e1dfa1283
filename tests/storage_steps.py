"""Count the storage steps a command makes and "kill" it before any one of them.

A *step* is one request to the store: every request an :class:`S3Storage` sends (each goes through
``S3Storage._call``), and every call of a :class:`LocalStorage` method that reads or changes the folder. While
:func:`steps` is active, from step ``kill_at`` on every step raises :class:`Killed` instead of reaching the
store: the store sees exactly what it would have seen had the process been SIGKILLed before that step, and
no clean-up code that runs after it (``except``/``finally`` blocks) reaches the store either.

:func:`snapshot` and :func:`restore` put a storage back as it was between two trials.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from edl_argo.storage import LocalStorage, S3Storage, Storage

#: LocalStorage methods that touch the folder (the ones absent from a version of the code are skipped).
LOCAL_STEPS = ("list", "stat", "read", "read_version", "write", "write_file", "delete", "download")


class Killed(BaseException):
    """The process "died" before this step (a BaseException, so that no ``except Exception`` absorbs it)."""


@dataclass
class Steps:
    """The steps seen so far, as ``(backend, operation, key)``; ``kill_at`` is 1-based (0: never)."""

    kill_at: int = 0
    seen: list[tuple[str, str, str]] | None = None

    def __post_init__(self) -> None:
        self.seen = []

    def step(self, backend: str, operation: str, key: str) -> None:
        assert self.seen is not None
        self.seen.append((backend, operation, key))
        if self.kill_at and len(self.seen) >= self.kill_at:
            raise Killed(f"killed before step {len(self.seen)}: {backend} {operation} {key}")

    @property
    def count(self) -> int:
        return len(self.seen or [])


@contextmanager
def steps(monkeypatch: pytest.MonkeyPatch, kill_at: int = 0) -> Iterator[Steps]:
    """Count (and with ``kill_at``, kill at) every storage step made inside the ``with`` block."""
    counter = Steps(kill_at)
    with monkeypatch.context() as patch:
        for name in LOCAL_STEPS:
            method = getattr(LocalStorage, name, None)
            if method is not None:
                patch.setattr(LocalStorage, name, _counted(counter, "local", name, method))
        call = S3Storage._call

        def s3_call(self: S3Storage, key: str, fn: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
            counter.step("s3", getattr(fn, "__name__", "request"), key)
            return call(self, key, fn, *args, **kwargs)

        patch.setattr(S3Storage, "_call", s3_call)
        yield counter


def _counted(counter: Steps, backend: str, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(self: LocalStorage, *args: Any, **kwargs: Any) -> Any:
        counter.step(backend, name, str(args[0]) if args else "")
        return method(self, *args, **kwargs)

    return wrapper


def snapshot(storage: Storage) -> dict[str, bytes]:
    """Every object of ``storage``, by key."""
    return {info.key: storage.read(info.key) for info in storage.list()}


def restore(storage: Storage, objects: dict[str, bytes]) -> None:
    """Make ``storage`` hold exactly ``objects`` again (local folders: left-over temporaries removed too)."""
    for info in storage.list():
        if info.key not in objects:
            storage.delete(info.key)
    for key, data in objects.items():
        if not storage.exists(key) or storage.read(key) != data:
            storage.write(key, data)
    if isinstance(storage, LocalStorage) and storage.root.exists():
        for path in sorted(storage.root.rglob("*"), reverse=True):
            if path.name.startswith(".edl-tmp-"):
                _remove(path)
            elif path.is_dir() and not any(path.iterdir()):
                path.rmdir()


def _remove(path: Any) -> None:
    import shutil

    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
