"""The settings of ``edl-argo train``, ``worker`` and ``ps``, declared once (:mod:`.table`), and what is
generated from them (:mod:`.schema`): flags, pod argument lists, configuration fields, Argo step inputs.

The functions here read :data:`edl_argo.settings.table.SETTINGS` when called, so every consumer sees the
same table.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from edl_argo.settings import table
from edl_argo.settings.schema import Argo, Setting, add_settings, parse_bool, pod_arguments, settings_of


def add_role_settings(parser: argparse.ArgumentParser, role: str, *, groups: bool = True) -> None:
    """Add every flag of ``role`` (``train``, ``worker``, ``ps``) to ``parser``."""
    add_settings(parser, table.SETTINGS, role, groups=groups)


def add_model_settings(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--model-def`` and ElasticDL's model flags, for the commands that load a model without being a
    role of a job (``evaluate``, ``predict``)."""
    for setting in table.SETTINGS:
        if setting.group == table.MODEL:
            setting.add_to(parser, "train")


def add_data_settings(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--data-format`` and ``--data-options``, for the commands that read data without being a role of
    a job (``evaluate``, ``predict``, ``data inspect``)."""
    for setting in table.SETTINGS:
        if setting.group == table.DATA:
            setting.add_to(parser, "train")


def role_arguments(role: str, values: Mapping[str, Any]) -> list[str]:
    """The flags the master gives a ``role`` pod for ``values`` (see :func:`.schema.pod_arguments`)."""
    return pod_arguments(table.SETTINGS, role, values)


def argo_settings() -> list[Setting]:
    """The settings the ``elastic-train`` step exposes as input parameters, in table order."""
    return [s for s in table.SETTINGS if s.argo is not None]


__all__ = [
    "Argo",
    "Setting",
    "add_data_settings",
    "add_model_settings",
    "add_role_settings",
    "argo_settings",
    "parse_bool",
    "role_arguments",
    "settings_of",
    "table",
]
