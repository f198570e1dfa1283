"""What one setting is, and what is generated from it.

A :class:`Setting` is one flag of ``edl-argo train``, ``worker`` or ``ps`` (the *roles* that receive it),
declared once in :mod:`edl_argo.settings.table`: its name, type, one default, help, choices and ElasticDL
aliases, and whether the Argo ``elastic-train`` step exposes it. From the table come:

* the argparse flags of each role (:func:`add_settings`), dash and underscore spellings both accepted;
* the argument lists the master gives its worker and PS pods (:func:`pod_arguments`);
* the fields of the configurations that hold the values (:func:`settings_dataclass`: ``TrainConfig``,
  ``ModelOptions``);
* the input parameters of the Hera ``elastic_train`` step, named like the flag (:func:`argo_settings`,
  used by :mod:`edl_argo.hera.elastic_train`), and so the rendered template's parameters.

**Booleans** are ``--x`` (true), ``--x true|false`` (what the Argo step passes) or ``--no-x``.
**Repeated** settings (``--toleration``) may be given several times; one occurrence may also hold several
values separated by ``;`` (ElasticDL's ``--volume "a;b"``, and how one Argo parameter carries a list);
an empty occurrence adds nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: The commands a setting may be a flag of. ``train`` is the master; ``worker`` and ``ps`` are its pods,
#: which get their values from the master (:func:`pod_arguments`); ``model`` marks the model flags that
#: every command loading a model takes (``evaluate`` and ``predict`` too, :func:`add_settings`).
ROLES = ("train", "worker", "ps")
POD_ROLES = ("worker", "ps")
#: Where a train setting's value lands: a field of ``TrainConfig`` (``job``), of ``ModelOptions``
#: (``model``), of ``KubernetesConfig`` (``kubernetes``, via ``kubernetes_config_from_args``), or read by
#: the ``train`` command itself (``command``).
SECTIONS = ("job", "model", "kubernetes", "command")
#: Separator of several values in one occurrence of a repeated setting.
LIST_SEPARATOR = ";"
TRUE_WORDS = ("true", "yes", "1", "t", "y")
FALSE_WORDS = ("false", "no", "0", "f", "n")


@dataclass(frozen=True)
class Argo:
    """How the ``elastic-train`` step exposes a setting: an input parameter named like the flag.

    ``default``: the step's own default when it must differ from the setting's (the cluster's image,
    PriorityClasses, ...); :data:`SAME` keeps the setting's. ``description``: the input's description
    (default: the setting's help)."""

    description: str = ""
    default: Any = None


#: ``Argo.default`` meaning "the setting's default".
SAME = None


@dataclass(frozen=True)
class Setting:
    """One setting: a flag and everything generated from it (see the module docstring)."""

    flag: str
    """``--num-epochs``: the name on every command line, and (without dashes) the Argo input's name."""
    type: type
    """``str``, ``int``, ``float`` or ``bool`` (a list of them when :attr:`repeated`)."""
    default: Any
    help: str
    roles: tuple[str, ...] = ("train",)
    section: str = "job"
    group: str = "job"
    """The heading of ``--help`` it is listed under."""
    parse: Callable[[str], Any] | None = None
    """argparse ``type=`` when stricter than :attr:`type` (``positive_int``)."""
    choices: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    """Other names (ElasticDL's ``--num-ps-pods``); each is also accepted with underscores."""
    metavar: str | None = None
    required: tuple[str, ...] = ()
    """The roles in which the flag must be given."""
    repeated: bool = False
    argo: Argo | None = None
    """How the Argo step exposes it; None: it does not (the step sets it itself, or it is a pod's)."""
    from_master: bool = False
    """A pod setting whose value the master works out for each pod (an address, an id), not a train
    setting it passes on."""

    def __post_init__(self) -> None:
        if not self.flag.startswith("--") or "_" in self.flag:
            raise ValueError(f"setting {self.flag!r}: a flag is --dash-form")
        unknown = set(self.roles) - {*ROLES} or set(self.required) - set(self.roles)
        if unknown or self.section not in SECTIONS:
            raise ValueError(
                f"setting {self.flag}: unknown role or section {sorted(unknown) or self.section}"
            )
        if self.type is bool and (self.default is not False or self.repeated):
            raise ValueError(f"setting {self.flag}: a boolean defaults to False and is not repeated")

    @property
    def name(self) -> str:
        """``num-epochs``: the Argo input parameter."""
        return self.flag[2:]

    @property
    def dest(self) -> str:
        """``num_epochs``: the attribute of parsed arguments and of the configuration."""
        return self.name.replace("-", "_")

    @property
    def argo_default(self) -> Any:
        """The default of the step's input parameter."""
        if self.argo is None or self.argo.default is SAME:
            return self.default
        return self.argo.default

    def spellings(self) -> list[str]:
        """Every name argparse accepts: the flag, its aliases, each also with underscores."""
        names: list[str] = []
        for flag in (self.flag, *self.aliases):
            for spelling in (flag, "--" + flag[2:].replace("-", "_")):
                if spelling not in names:
                    names.append(spelling)
        return names

    def add_to(self, parser: argparse.ArgumentParser | argparse._ArgumentGroup, role: str) -> None:
        """Add the flag to ``parser`` as the command ``role`` takes it."""
        common: dict[str, Any] = {"dest": self.dest, "help": self.help, "default": self.default}
        if self.metavar:
            common["metavar"] = self.metavar
        if self.type is bool:
            parser.add_argument(
                *self.spellings(), nargs="?", const=True, type=parse_bool, metavar="true|false", **common
            )
            negations = ["--no-" + s[2:] for s in self.spellings() if "_" not in s]
            parser.add_argument(*negations, dest=self.dest, action="store_false", help=argparse.SUPPRESS)
            return
        if self.choices:
            common["choices"] = self.choices
        if role in self.required:
            common["required"] = True
            del common["default"]
        common["type"] = self.parse or self.type
        if self.repeated:
            common["default"] = list(self.default)
            common["action"] = ExtendSplitting
        parser.add_argument(*self.spellings(), **common)

    def arguments(self, value: Any) -> list[str]:
        """``value`` as command-line arguments (nothing for a false boolean)."""
        if self.type is bool:
            return [self.flag] if value else []
        if self.repeated:
            return [token for item in value for token in (self.flag, str(item))]
        return [self.flag, str(value)]


def parse_bool(text: str) -> bool:
    """``true``/``false`` (also yes/no, 1/0, any case), as Argo and ElasticDL pass booleans."""
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not true or false")


class ExtendSplitting(argparse.Action):
    """A repeated flag: each occurrence adds its ``;``-separated values (an empty one adds nothing)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: Any = None
    ) -> None:
        items = list(getattr(namespace, self.dest, None) or [])
        parse = self._parse or str
        if isinstance(values, str):
            values = [parse(part) for part in (p.strip() for p in values.split(LIST_SEPARATOR)) if part]
        else:
            values = [values]
        setattr(namespace, self.dest, items + values)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._parse = kwargs.pop("type", None)  # each value after splitting, not the whole text
        super().__init__(*args, **kwargs)


def settings_of(settings: Iterable[Setting], role: str) -> list[Setting]:
    """The settings ``role`` takes, in table order."""
    return [s for s in settings if role in s.roles]


def add_settings(
    parser: argparse.ArgumentParser,
    settings: Iterable[Setting],
    role: str,
    *,
    groups: bool = True,
) -> None:
    """Add the flags of ``role`` to ``parser``, under their ``--help`` headings when ``groups``."""
    headings: dict[str, argparse._ArgumentGroup] = {}
    for setting in settings_of(settings, role):
        target: argparse.ArgumentParser | argparse._ArgumentGroup = parser
        if groups:
            if setting.group not in headings:
                headings[setting.group] = parser.add_argument_group(setting.group)
            target = headings[setting.group]
        setting.add_to(target, role)


def pod_arguments(settings: Iterable[Setting], role: str, values: Mapping[str, Any]) -> list[str]:
    """The flags the master gives a ``role`` pod: every setting of that role with a value in ``values``
    (by :attr:`Setting.dest`) other than its default; a value of None is left out. A flag the pod
    requires must have a value (ValueError otherwise: a bug in the master, not bad input)."""
    arguments: list[str] = []
    for setting in settings_of(settings, role):
        value = values.get(setting.dest)
        if value is None or (value == setting.default and role not in setting.required):
            if role in setting.required:
                raise ValueError(f"the master gives {role} pods no value for {setting.flag}")
            continue
        arguments += setting.arguments(value)
    return arguments


def settings_dataclass(
    name: str,
    settings: Iterable[Setting],
    section: str,
    *,
    base: type,
    module: str,
    extra: Sequence[tuple[str, Any, Any]] = (),
) -> type:
    """A frozen dataclass with one field per train setting of ``section`` (type and default from the
    setting; a setting ``train`` requires comes first, without default), subclassing ``base`` (its
    methods and docstring), plus ``extra`` fields ``(name, type, dataclasses.field(...))``."""
    chosen = [s for s in settings if "train" in s.roles and s.section == section]
    required = [(s.dest, s.type) for s in chosen if "train" in s.required]
    optional = [(s.dest, _field_type(s), _field_default(s)) for s in chosen if "train" not in s.required]
    made = dataclasses.make_dataclass(name, [*required, *optional, *extra], bases=(base,), frozen=True)
    made.__module__ = module  # so that it pickles, and reads as that module's class
    made.__doc__ = base.__doc__
    return made


def _field_type(setting: Setting) -> Any:
    return tuple[setting.type, ...] if setting.repeated else setting.type


def _field_default(setting: Setting) -> Any:
    if setting.repeated:
        return dataclasses.field(default=tuple(setting.default))
    return dataclasses.field(default=setting.default)
