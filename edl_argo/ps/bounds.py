"""The bounds a parameter server puts on what it accepts, checked at the service boundary.

Every check here runs before a request changes anything, and raises with a one-line reason naming the field,
variable or table at fault:

* :class:`~edl_argo.ps.parameters.InvalidRequestError` (``INVALID_ARGUMENT``) for values no correct worker
  sends: a version or step beyond :data:`MAX_VERSION` (so that ``version + 1`` always fits the int64 of the
  reply), more than :data:`MAX_EXAMPLES` examples in one push, a pusher id longer than
:data:`MAX_PUSHER_ID_CHARS` (or a push number below 1 with one), a learning-rate scale that is not a finite
  number >= 0, and gradients or values that are NaN or infinite (:class:`NonFiniteGradientError`: the worker
  decides what the job does with its ``--nan-gradients`` policy);
* :class:`ResourceLimitError` (``RESOURCE_EXHAUSTED``) for requests that would make the server hold or send
  more than its bounds: a pull whose reply would exceed :data:`MAX_REPLY_BYTES`, or new embedding rows
  beyond ``--max-embedding-rows`` per table.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from edl_argo.proto import ps_pb2
from edl_argo.ps.errors import InvalidRequestError, NonFiniteGradientError, ResourceLimitError
from edl_argo.rpc.channel import MAX_MESSAGE_BYTES

if TYPE_CHECKING:
    from edl_argo.ps.parameters import Gradients

#: The largest model version or step a request may carry: far beyond any job (2**62 steps), and its
#: successor still fits an int64.
MAX_VERSION = 2**62
#: The most examples one push may say it averages (its weight in a synchronous step).
MAX_EXAMPLES = 2**31
#: The largest reply a pull may ask for (the gRPC message limit, less room for the envelope).
MAX_REPLY_BYTES = MAX_MESSAGE_BYTES - 1024 * 1024
#: The longest pusher id a push may carry (a UUID in hex is 32 characters).
MAX_PUSHER_ID_CHARS = 64


def check_version(field: str, value: int) -> int:
    """``value`` of the version-like ``field``, unless it is beyond :data:`MAX_VERSION`."""
    if value > MAX_VERSION:
        raise InvalidRequestError(
            f"{field} {value} is beyond the largest version a job reaches ({MAX_VERSION})"
        )
    return value


def check_push_fields(request: ps_pb2.PushGradientsRequest, ps_id: int) -> float:
    """Check the scalar fields of a push to PS ``ps_id``; returns its learning-rate scale (1 when unset).

    Only the other PS take an ``authority_step`` (PS 0's decision): PS 0 decides itself, and a push
    carrying one would skip its staleness check."""
    lr_scale = float(request.learning_rate_scale) or 1.0
    if not math.isfinite(lr_scale) or lr_scale < 0:
        raise InvalidRequestError(f"learning_rate_scale must be a finite number >= 0, got {lr_scale}")
    if not 0 <= request.examples <= MAX_EXAMPLES:
        raise InvalidRequestError(f"examples must be in [0, {MAX_EXAMPLES}], got {request.examples}")
    check_version("version", request.version)
    check_version("authority_step", request.authority_step)
    if len(request.pusher_id) > MAX_PUSHER_ID_CHARS:
        raise InvalidRequestError(
            f"pusher_id of {len(request.pusher_id)} characters; at most {MAX_PUSHER_ID_CHARS} are accepted"
        )
    if request.pusher_id and request.sequence < 1:
        raise InvalidRequestError(f"sequence must be at least 1 with a pusher_id, got {request.sequence}")
    if ps_id == 0 and request.authority_step > 0:
        raise InvalidRequestError(
            f"authority_step {request.authority_step} sent to PS 0, which decides the steps itself"
        )
    return lr_scale


def check_finite(gradients: Gradients) -> None:
    """Refuse gradients (dense, embedding rows) or changes of non-trainable variables that hold a NaN or an
    infinity."""
    named = [
        *(("gradient for dense variable", name, value) for name, value in gradients.dense.items()),
        *(("gradient for embedding table", name, rows) for name, (_, rows) in gradients.embeddings.items()),
        *(("change of non-trainable variable", name, c) for name, c in gradients.state_changes.items()),
    ]
    for what, name, value in named:
        if value.size and not np.isfinite(value).all():
            bad = np.asarray(value).reshape(-1)[~np.isfinite(np.asarray(value).reshape(-1))][0]
            raise NonFiniteGradientError(
                f"{what} {name!r} is not finite (holds {bad}); the push is refused and counted"
            )


def check_reply_size(table: str, count: int, row_bytes: int) -> None:
    """Refuse a pull of ``count`` rows of ``row_bytes`` each whose reply would exceed
    :data:`MAX_REPLY_BYTES` (before any row is created)."""
    if count * row_bytes > MAX_REPLY_BYTES:
        raise ResourceLimitError(
            f"embedding table {table!r}: a pull of {count} ids would answer {count * row_bytes} bytes,"
            f" more than {MAX_REPLY_BYTES}; pull fewer ids per request"
        )


def check_row_limit(table: str, held: int, new: int, limit: int) -> None:
    """Refuse ``new`` rows more in a table holding ``held`` when that exceeds ``limit`` (0: no limit)."""
    if limit and held + new > limit:
        raise ResourceLimitError(
            f"embedding table {table!r}: {new} new ids would make {held + new} rows on this server,"
            f" more than --max-embedding-rows {limit}"
        )
