"""Argo's ``{{...}}`` variables, replaced the way Argo does, from the values the local runner knows.

The runner resolves simple tags only (``{{workflow.name}}``, ``{{inputs.parameters.epochs}}``,
``{{tasks.train.outputs.parameters.metrics}}``, ...). A tag it has no value for, or an expression tag
(``{{=...}}``), is refused with an error that names the tag and where it is, so that nothing runs with a
value Argo would have computed differently.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from edl_argo.errors import ConfigError

_TAG = re.compile(r"\{\{\s*(.*?)\s*\}\}")


def substitute(value: Any, scope: Mapping[str, str], where: str) -> Any:
    """``value`` (a string, or lists and dicts of them) with every tag replaced from ``scope``.

    Raises:
        ConfigError: a tag with no value in ``scope``, or an expression tag; ``where`` says whose.
    """
    if isinstance(value, str):
        return _TAG.sub(lambda match: _lookup(match.group(1), scope, where), value)
    if isinstance(value, list):
        return [substitute(item, scope, where) for item in value]
    if isinstance(value, dict):
        return {key: substitute(item, scope, where) for key, item in value.items()}
    return value


def tag_name(text: str) -> str | None:
    """``"tasks.a.outputs.artifacts.b"`` for ``"{{tasks.a.outputs.artifacts.b}}"``; None if not one tag."""
    match = _TAG.fullmatch(text.strip())
    return match.group(1) if match else None


def _lookup(name: str, scope: Mapping[str, str], where: str) -> str:
    if name.startswith("="):
        raise ConfigError(f"{where}: expression tags such as {{{{{name}}}}} cannot be run locally")
    if name not in scope:
        raise ConfigError(
            f"{where}: {{{{{name}}}}} has no value here (the local runner knows {_known(scope)})"
        )
    return scope[name]


def _known(scope: Mapping[str, str]) -> str:
    prefixes = sorted({name.rsplit(".", 1)[0] + ".*" if "." in name else name for name in scope})
    return ", ".join(prefixes) or "no variables"
