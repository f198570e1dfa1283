"""Changes between two saves of the master's state, as JSON patches (pure: no I/O).

A state is JSON data whose every object is a ``dict`` with string keys. :func:`diff` gives the patch that
turns one state into the next; :func:`apply` applies it to the first (as read back from JSON) and gives the
second. A patch of a dict is ``{"set": {key: value}, "del": [key], "sub": {key: patch}}`` (each member
only when not empty): values set whole, keys deleted, and dicts patched in turn. Anything that is not a dict
(a list, a number) is set whole when it changed, so a part whose big collections change a little at a time
keeps them as dicts (the dispatcher's held tasks, the ledger's tasks: see their ``snapshot`` methods).

Cost: :func:`diff` walks only the dicts that changed (an unchanged value is skipped by identity or ``==``,
compared in C), so its time and its patch's size follow the change, plus the keys of each dict on the path
to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Patch = dict[str, Any]


def diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> Patch:
    """The patch from ``old`` to ``new`` (``{}`` when they are equal)."""
    patch: Patch = {}
    nested: dict[str, Patch] = {}
    missing = object()
    # Unchanged values are mostly the very same objects (parts keep what did not change): one quick pass
    # by identity, then a closer look at what it found.
    changed = {key: value for key, value in new.items() if old.get(key, missing) is not value}
    for key, value in list(changed.items()):
        before = old.get(key, missing)
        if before is missing:
            continue
        if before == value:
            del changed[key]
        elif isinstance(before, Mapping) and isinstance(value, Mapping):
            nested[key] = diff(before, value)
            del changed[key]
    deleted = sorted(old.keys() - new.keys())
    if changed:
        patch["set"] = changed
    if deleted:
        patch["del"] = deleted
    if nested:
        patch["sub"] = nested
    return patch


def apply(state: dict[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` changed in place by ``patch`` (from :func:`diff`), and returned.

    Raises:
        ValueError: ``patch`` is not a patch of ``state`` (a nested patch of a key that holds no dict).
    """
    if not isinstance(patch, Mapping) or not set(patch) <= {"set", "del", "sub"}:
        raise ValueError(f"not a state patch: {sorted(patch) if isinstance(patch, Mapping) else patch!r}")
    for key in patch.get("del", ()):
        state.pop(str(key), None)
    state.update(patch.get("set", {}))
    for key, nested in patch.get("sub", {}).items():
        target = state.get(key)
        if not isinstance(target, dict):
            raise ValueError(f"a patch of {key!r}, which holds no object")
        apply(target, nested)
    return state
