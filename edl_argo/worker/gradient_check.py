"""Gradients a worker is about to push, checked for NaN and infinities (``--nan-gradients``).

A model can produce a non-finite gradient while its loss stays finite (the gradient of ``sqrt`` or of a
norm at zero is NaN), which ``--nan-loss`` never sees. The parameter server refuses such a push anyway
(:func:`edl_argo.ps.bounds.check_finite`); checking here first lets the worker apply the job's policy:
``fail`` reports the task as fatally failed, naming the variable, model version, task and shard; ``skip``
drops the minibatch and counts it (``nan_gradients_skipped`` per worker in metrics.json).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from edl_argo.errors import JobFailedError


class NonFiniteGradientError(JobFailedError):
    """The gradients of a minibatch hold a NaN or an infinity; raised before anything of it is pushed."""

    def __init__(self, variable: str, model_version: int) -> None:
        self.variable = variable
        self.model_version = model_version
        super().__init__(f"the gradient of {variable!r} is not finite at model version {model_version}")


def check_finite_gradients(
    dense: Mapping[str, np.ndarray],
    sparse: Mapping[str, tuple[np.ndarray, np.ndarray]],
    model_version: int,
) -> None:
    """Raise :class:`NonFiniteGradientError` naming the first variable or table whose gradient is not
    finite."""
    named = [*dense.items(), *((table, rows) for table, (_, rows) in sparse.items())]
    for name, gradient in named:
        if not np.isfinite(gradient).all():
            raise NonFiniteGradientError(name, model_version)
