"""The distribution strategies and AllreduceStrategy's flags, shared by ``edl-argo train`` and
``edl-argo worker``."""

from __future__ import annotations

import argparse

from edl_argo.flags import add_flag, positive_int

PARAMETER_SERVER = "ParameterServerStrategy"
ALLREDUCE = "AllreduceStrategy"
STRATEGIES = (PARAMETER_SERVER, ALLREDUCE)


def add_collective_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """AllreduceStrategy's flags, shared by ``edl-argo train`` and ``edl-argo worker``."""
    add_flag(
        parser,
        "--collective-timeout-seconds",
        type=positive_int,
        default=60,
        help="AllreduceStrategy: a member silent this long in a collective step is dropped from the group",
    )
    add_flag(
        parser,
        "--scale-lr-by-world-size",
        action="store_true",
        help="AllreduceStrategy: multiply the learning rate by the number of workers (linear scaling rule)",
    )
