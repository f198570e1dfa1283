"""Flag helpers shared by every subcommand: ElasticDL's names in dash form, underscore aliases accepted."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any, NoReturn

from edl_argo.errors import ConfigError


def command_in(argv: Sequence[str]) -> str | None:
    """The command ``argv`` (an ``edl-argo`` command line less the program) names: its first word that
    is not an option, if any."""
    return next((a for a in argv if not a.startswith("-")), None)


def add_flag(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    name: str,
    aliases: tuple[str, ...] = (),
    **kwargs: Any,
) -> None:
    """Add ``--some-flag`` and its alias ``--some_flag``, plus each of ``aliases`` in both spellings (other
    names of the same flag, e.g. ElasticDL's ``--num-ps-pods`` for ``--num-ps``)."""
    names: list[str] = []
    for flag in (name, *aliases):
        for spelling in (flag, flag.replace("-", "_").replace("__", "--", 1)):
            if spelling not in names:
                names.append(spelling)
    kwargs.setdefault("dest", name.lstrip("-").replace("-", "_"))
    parser.add_argument(*names, **kwargs)


class BuiltArgumentParser(argparse.ArgumentParser):
    """A parser of an argument list a command builds (``sql``'s ``edl-argo train`` arguments), not of its
    own command line: it prints nothing and never exits. An argument's bad value raises
    ``argparse.ArgumentError`` (its ``argument_name`` says which flag), any other error (an unrecognized
    argument, a missing one) :class:`ConfigError` with argparse's message; the caller adds what the user wrote
    that went into the list. No ``-h`` and no abbreviations: every flag is given by one of its names."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog=prog, add_help=False, allow_abbrev=False, exit_on_error=False)

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def _bounded_int(minimum: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is less than {minimum}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


#: argparse ``type=`` for integers >= 1 and >= 0.
positive_int = _bounded_int(1)
non_negative_int = _bounded_int(0)

#: The largest TCP port number.
MAX_PORT = 65535


def port_number(text: str) -> int:
    """argparse ``type=`` for a TCP port, 0 (none, or any free one) to :data:`MAX_PORT`."""
    value = non_negative_int(text)
    if value > MAX_PORT:
        raise argparse.ArgumentTypeError(f"{value} is more than {MAX_PORT}, the largest port")
    return value


port_number.__name__ = "port"


def optional_port(text: str) -> int:
    """argparse ``type=`` for a TCP port that may be turned off: -1 (none), 0 (any free one) to
    :data:`MAX_PORT`."""
    return -1 if text.strip() == "-1" else port_number(text)


optional_port.__name__ = "port or -1"


def fraction(text: str) -> float:
    """argparse ``type=`` for a number from 0 to 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{value} is not between 0 and 1")
    return value


fraction.__name__ = "number from 0 to 1"


def positive_number(text: str) -> float:
    """argparse ``type=`` for a finite number more than 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a number more than 0")
    return value


positive_number.__name__ = "number > 0"


def pod_host() -> str:
    """The address this pod's servers bind to: ``POD_IP`` in Kubernetes, loopback on one machine."""
    return os.environ.get("POD_IP") or "127.0.0.1"
