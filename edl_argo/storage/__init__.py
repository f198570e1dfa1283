"""Where edl-argo reads data and writes checkpoints and models: local folders or S3-compatible storage.

Open a location with :func:`open_storage` and use the :class:`Storage` interface (see
:mod:`edl_argo.storage.base` for its guarantees). Accepted locations:

* ``s3://bucket/prefix`` -- :class:`~edl_argo.storage.s3.S3Storage`, configured from the environment;
* ``file:///absolute/path`` or a plain path -- :class:`~edl_argo.storage.local.LocalStorage`. A string
  that starts like a URL scheme (``name:``) is never taken as a path, so ``s3:/bucket`` is an error.

:mod:`edl_argo.storage.s3` is imported when S3 is first used (``open_storage("s3://...")`` or
``edl_argo.storage.S3Storage``): its client library, minio, and the cryptography minio loads take about
0.1 s to import, which a process that uses folders only (a local job's master, its pod template) skips.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import unquote, urlsplit

from edl_argo.errors import StorageError
from edl_argo.storage.base import (
    TREE_COMPLETE_MARKER,
    ObjectChangedError,
    ObjectInfo,
    ObjectNotFoundError,
    Storage,
    join_url,
)
from edl_argo.storage.local import LocalStorage

if TYPE_CHECKING:
    from edl_argo.storage.s3 import S3Storage

__all__ = [
    "TREE_COMPLETE_MARKER",
    "LocalStorage",
    "ObjectChangedError",
    "ObjectInfo",
    "ObjectNotFoundError",
    "S3Storage",
    "Storage",
    "StorageError",
    "join_url",
    "open_reachable_storage",
    "open_storage",
    "reached",
]


def __getattr__(name: str) -> Any:
    """``S3Storage``, imported when first asked for (see the module's docstring)."""
    if name == "S3Storage":
        from edl_argo.storage.s3 import S3Storage

        return S3Storage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_ACCEPTED = "use s3://bucket/prefix, file:///absolute/path or a local path"
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


def open_storage(url: str) -> Storage:
    """The storage rooted at ``url``; StorageError naming ``url`` if it is not an accepted form.

    Only the form is checked here: nothing is contacted, and a local folder need not exist yet.
    """
    text = url.strip()
    scheme_match = _SCHEME.match(text)
    scheme = scheme_match.group(1).lower() if scheme_match else ""
    if scheme and not text[len(scheme) + 1 :].startswith("//"):
        scheme = "?"  # "s3:/bucket", "s3:bucket": a mistyped URL, not a folder name
    if scheme == "s3":
        from edl_argo.storage.s3 import S3Storage

        return S3Storage(text)
    if scheme == "file":
        parts = urlsplit(text)
        if parts.netloc not in ("", "localhost") or not parts.path or parts.query or parts.fragment:
            raise StorageError(
                f"invalid storage URL {url!r}: file URLs look like file:///absolute/path; {_ACCEPTED}"
            )
        return LocalStorage(unquote(parts.path), url=text)
    if scheme:
        raise StorageError(f"unsupported storage URL {url!r}: {_ACCEPTED}")
    if not text:
        raise StorageError(f"empty storage URL: {_ACCEPTED}")
    return LocalStorage(text, url=text)


#: A kind of :class:`Storage` (:func:`reached` gives back the kind it is given).
StorageT = TypeVar("StorageT", bound=Storage)


def open_reachable_storage(url: str, flag: str) -> Storage:
    """:func:`open_storage` of ``url``, reached now (:func:`reached`)."""
    return reached(open_storage(url), flag)


def reached(storage: StorageT, flag: str, given: str | None = None) -> StorageT:
    """``storage``, reached now (:meth:`Storage.check_reachable`): a command's output that cannot be
    written fails before the command's work, with a StorageError naming ``flag`` and what it was given
    (default: the storage's URL; e.g. the file whose folder ``storage`` is)."""
    try:
        storage.check_reachable()
    except StorageError as error:
        raise StorageError(f"{flag} {storage.url if given is None else given}: {error}") from None
    return storage
