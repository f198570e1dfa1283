"""The errors a parameter server turns into gRPC statuses (see :mod:`edl_argo.ps.servicer`)."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request that does not fit this server's parameters (unknown name, wrong shape or dtype, ...)."""


class NotInitializedError(RuntimeError):
    """A request that needs the model before any worker pushed it."""


class ResourceLimitError(RuntimeError):
    """A request that would take the server beyond one of its resource bounds (``RESOURCE_EXHAUSTED``)."""


class NonFiniteGradientError(InvalidRequestError):
    """A push carrying NaN or infinite gradients or values; refused, and counted by the server."""
