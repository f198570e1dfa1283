"""The distribution strategies (their flag, ``--distribution-strategy``, is declared in
:mod:`edl_argo.settings.table` with AllreduceStrategy's other settings)."""

from __future__ import annotations

from edl_argo.settings.table import ALLREDUCE, PARAMETER_SERVER, STRATEGIES

__all__ = ["ALLREDUCE", "PARAMETER_SERVER", "STRATEGIES"]
