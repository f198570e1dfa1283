"""Errors a user can act on.

Every failure caused by input (a flag, a file, a shard, a URL, credentials) is raised as an
:class:`EdlError` subclass whose message is one line that names the thing at fault and says what to do.
The CLI prints that line and exits with :attr:`EdlError.exit_code`; it never prints a traceback for one.
Anything else that escapes is a bug in edl-argo and is reported as such.
"""

from __future__ import annotations

from collections.abc import Sequence

#: How many of a list of causes an error message names (:func:`first_few`); the rest it counts.
NAMED_CAUSES = 5


class EdlError(Exception):
    """A failure the user can fix. ``str(error)`` is the whole message, on one line."""

    exit_code: int = 2

    def __str__(self) -> str:
        return " ".join(super().__str__().split())


class ConfigError(EdlError):
    """A flag, environment variable or model definition is invalid."""


class StorageError(EdlError):
    """A storage location cannot be read or written (missing, denied, unreachable)."""


class DataFormatError(EdlError):
    """Input data is malformed (corrupt RecordIO, unparsable CSV, ...)."""


class JobFailedError(EdlError):
    """A training, evaluation or prediction job ran but could not finish."""

    exit_code = 1


def first_few(causes: Sequence[str], more: str) -> str:
    """``causes`` joined by "; " for one line of an error, the first :data:`NAMED_CAUSES` named and the rest
    counted: ``"; and 1,234 <more>"`` (a list with a cause per epoch or per worker has no bound)."""
    named = "; ".join(causes[:NAMED_CAUSES])
    left = len(causes) - NAMED_CAUSES
    return named if left <= 0 else f"{named}; and {left:,} {more}"
