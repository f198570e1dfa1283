"""The local runner's artifact repository: step outputs kept for the steps that consume them.

Any :mod:`edl_argo.storage` location serves (a folder by default, ``s3://bucket/prefix`` for MinIO). An
artifact is published as one tree at ``<workflow>/<task>/<artifact>`` (complete or absent, see
:mod:`edl_argo.storage.trees`) whose only entry is the artifact itself, a file or a folder, under its own
name: the ``model`` of task ``train`` is ``<workflow>/train/model/<version>/model/``, a model tree (its
pointer and version folder) that ``edl-argo evaluate --model`` reads as it is. Files are kept exactly,
the pointers and markers of nested trees included.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from edl_argo.errors import StorageError
from edl_argo.storage import Storage, open_storage
from edl_argo.storage.trees import publish_tree


class ArtifactStore:
    """Saves artifacts from step sandboxes and loads them into others."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.storage: Storage = open_storage(url)

    def save(self, key: str, path: Path) -> str:
        """Publish the file or folder ``path`` at ``key``; returns the URL of the saved artifact."""
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".artifact-") as staging:
            moved = Path(staging) / path.name
            os.rename(path, moved)  # the tree's only entry, without copying
            try:
                tree = publish_tree(self.storage, Path(staging), key)
            finally:
                os.rename(moved, path)
        return self.storage.describe(tree.file_key(path.name))

    def load(self, key: str, path: Path) -> None:
        """Put the artifact saved at ``key`` at ``path`` (a file or a folder, as it was saved)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".artifact-") as staging:
            self.storage.get_tree(key, Path(staging))
            entries = list(Path(staging).iterdir())
            if len(entries) != 1:
                raise StorageError(
                    f"{self.storage.describe(key)} is not an artifact saved by the local runner"
                )
            os.rename(entries[0], path)
