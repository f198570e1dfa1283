"""Version folders: how datasets and published trees (models, predictions) are written beside the previous
version and switched to by one small object written last (a dataset's manifest, a tree's pointer).

A version folder is named ``v-<UTC time>-<8 hex digits>``; a writer makes a fresh one for every version, so
nothing of a version is ever overwritten, and what no switch object names any more can be deleted by name.
"""

from __future__ import annotations

import re
import time
import uuid

from edl_argo.storage.base import ObjectInfo, Storage, normalize_key

__all__ = ["VERSION_FOLDER", "new_version_folder", "objects_by_version", "utc_now"]

#: A version folder's name: ``v-<UTC time>-<8 hex digits>``.
VERSION_FOLDER = re.compile(r"^v-\d{8}T\d{6}Z-[0-9a-f]{8}$")


def new_version_folder() -> str:
    """A fresh version folder name (the time orders them for people; the random part makes it unique)."""
    return f"v-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:8]}"


def utc_now() -> str:
    """The time a switch object records, ``2026-11-25T14:39:00Z``."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def objects_by_version(storage: Storage, prefix: str) -> dict[str, list[ObjectInfo]]:
    """Every object in a version folder directly below ``prefix`` (at any depth inside it), by folder name.

    One listing of ``prefix``; objects of ``prefix`` that are not in a version folder are left out.
    """
    base = normalize_key(prefix)
    base = base + "/" if base else ""
    found: dict[str, list[ObjectInfo]] = {}
    for info in storage.list(base):
        folder, separator, _ = info.key[len(base) :].partition("/")
        if separator and VERSION_FOLDER.match(folder):
            found.setdefault(folder, []).append(info)
    return found
