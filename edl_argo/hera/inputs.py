"""A step's input parameters, declared once: as the typed, documented arguments of its Python function.

The function a pipeline author calls (``elastic_train(num_workers=4, ...)``) is also the definition of the
step template's ``inputs.parameters``. Every keyword argument annotated ``Annotated[T, Input("...")]``
becomes an input parameter named like the argument in dash form (``num_workers`` -> ``num-workers``), with
the argument's default as the parameter's default (no default: the parameter is required) and the
:class:`Input` description as its description. An input with ``flag=True`` (the default) is also the
``edl-argo`` flag of the same name: :meth:`StepInputs.flags` renders it as
``--num-workers {{inputs.parameters.num-workers}}`` for the template's command.

Values may be plain Python values or Argo references: ``"{{workflow.parameters.epochs}}"``, or the
:class:`~hera.workflows.Parameter` that ``task.get_parameter(...)`` returns.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hera.workflows import Parameter

#: A string argument: a value, an Argo ``{{...}}`` reference, or another step's output parameter.
Text = str | Parameter
#: An integer argument, or a reference to one (``"{{workflow.parameters.epochs}}"``).
Int = int | str | Parameter
#: A number argument, or a reference to one.
Float = float | str | Parameter
#: A boolean argument (``true``/``false`` in Argo), or a reference to one.
Bool = bool | str | Parameter


@dataclass(frozen=True)
class Input:
    """Marks a step function's argument as an input parameter of the step's template.

    ``flag``: the parameter is passed to the command as the flag of the same name. ``enum``: the only
    values Argo accepts.
    """

    description: str
    flag: bool = True
    enum: tuple[str, ...] = ()


@dataclass(frozen=True)
class InputParameter:
    """One input parameter of a step template, derived from one argument of its function."""

    argument: str
    """The Python argument name (``num_workers``)."""
    name: str
    """The parameter name (``num-workers``), also the flag name when :attr:`flag` is set."""
    description: str
    default: str | None
    """The default as Argo stores it (a string); None when the parameter is required."""
    flag: bool
    enum: tuple[str, ...]

    @property
    def reference(self) -> str:
        """``{{inputs.parameters.<name>}}``: the parameter's value inside its template."""
        return f"{{{{inputs.parameters.{self.name}}}}}"

    def declaration(self) -> Parameter:
        """The template's ``inputs.parameters`` entry."""
        optional = {"default": self.default} if self.default is not None else {}
        return Parameter(
            name=self.name, description=self.description, enum=list(self.enum) or None, **optional
        )


def argument_text(value: Any) -> str:
    """An argument value as Argo passes it: a string (a Parameter stands for its ``value``)."""
    if isinstance(value, Parameter):
        return str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):  # a repeated setting: one text, values separated by ';'
        return ";".join(argument_text(item) for item in value)
    return str(value)


@dataclass(frozen=True)
class StepInputs:
    """The input parameters of one step template, in the order of its function's arguments."""

    parameters: tuple[InputParameter, ...]

    @classmethod
    def of(cls, function: Callable[..., Any]) -> StepInputs:
        """The parameters that ``function``'s ``Input``-annotated arguments declare."""
        hints = typing.get_type_hints(function, include_extras=True)
        parameters = []
        for argument in inspect.signature(function).parameters.values():
            metadata = getattr(hints.get(argument.name), "__metadata__", ())
            marker = next((m for m in metadata if isinstance(m, Input)), None)
            if marker is None:
                continue
            default = None if argument.default is inspect.Parameter.empty else argument_text(argument.default)
            parameters.append(
                InputParameter(
                    argument=argument.name,
                    name=argument.name.replace("_", "-"),
                    description=marker.description,
                    default=default,
                    flag=marker.flag,
                    enum=marker.enum,
                )
            )
        return cls(tuple(parameters))

    def __getitem__(self, name: str) -> InputParameter:
        for parameter in self.parameters:
            if parameter.name == name:
                return parameter
        raise KeyError(f"no input parameter {name!r}; declared: {', '.join(p.name for p in self.parameters)}")

    def __contains__(self, name: object) -> bool:
        return any(parameter.name == name for parameter in self.parameters)

    def ref(self, name: str) -> str:
        """``{{inputs.parameters.<name>}}``; KeyError if the step declares no such parameter."""
        return self[name].reference

    def flags(self) -> list[str]:
        """``--<name> {{inputs.parameters.<name>}}`` for every flag parameter, in declaration order."""
        return [token for p in self.parameters if p.flag for token in (f"--{p.name}", p.reference)]

    def declarations(self) -> list[Parameter]:
        """The template's ``inputs.parameters``."""
        return [p.declaration() for p in self.parameters]

    def arguments(self, values: Mapping[str, Any]) -> list[Parameter]:
        """Task arguments for the values a caller gave (by Python argument name).

        A value equal to the parameter's default is left out (the template's default applies); a
        required parameter is always passed.
        """
        arguments = []
        for p in self.parameters:
            text = argument_text(values[p.argument])
            if text != p.default:
                arguments.append(Parameter(name=p.name, value=text))
        return arguments
