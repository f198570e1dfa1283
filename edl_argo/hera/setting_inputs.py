"""The ``elastic-train`` step's input parameters that are settings of ``edl-argo train``, generated from
:mod:`edl_argo.settings.table`.

:func:`with_setting_inputs` gives a step function one keyword argument per setting the step exposes
(:attr:`~edl_argo.settings.schema.Setting.argo`), named like the flag (``use_async`` ->
``use-async`` -> ``--use-async``), annotated ``Annotated[T, Input(...)]`` as
:mod:`edl_argo.hera.inputs` expects, with the setting's step default (a setting the train command
requires has none: the parameter is required). A boolean is ``true``/``false`` (Argo passes
``--shuffle true``); a repeated setting is one text, its values separated by ``;`` (a Python list is
joined).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Annotated, Any

from edl_argo.hera.inputs import Bool, Input, Int, Text, argument_text
from edl_argo.settings.schema import Setting


def setting_input(setting: Setting) -> Any:
    """The ``Annotated[T, Input(...)]`` of ``setting``'s step argument."""
    assert setting.argo is not None
    kind = Int if setting.type is int else Bool if setting.type is bool else Text
    enum = ("true", "false") if setting.type is bool else setting.choices
    return Annotated[kind, Input(setting.argo.description or setting.help, enum=enum)]


def setting_default(setting: Setting) -> Any:
    """The step argument's default; ``inspect.Parameter.empty`` when the train command requires it."""
    if "train" in setting.required:
        return inspect.Parameter.empty
    return argument_text(setting.argo_default)


def with_setting_inputs(settings: Iterable[Setting]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a step function ``f(name, *, <own keyword arguments>, **settings)``: its signature gains
    one keyword argument per setting (before its own), and it is called with every argument bound
    (defaults applied), so ``values`` it hands to ``Step.task`` hold them all. An unknown keyword is a
    TypeError naming it, as for any function."""
    chosen = [s for s in settings if s.argo is not None]

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        own = inspect.signature(function)
        positional = [p for p in own.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
        keywords = [p for p in own.parameters.values() if p.kind is p.KEYWORD_ONLY]
        generated = [
            inspect.Parameter(s.dest, inspect.Parameter.KEYWORD_ONLY, default=setting_default(s))
            for s in chosen
        ]
        signature = own.replace(parameters=[*positional, *generated, *keywords])

        @functools.wraps(function)
        def step(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return function(**bound.arguments)

        step.__signature__ = signature  # type: ignore[attr-defined]
        annotations = dict(getattr(function, "__annotations__", {}))
        annotations.update({s.dest: setting_input(s) for s in chosen})
        step.__annotations__ = annotations
        return step

    return decorate
