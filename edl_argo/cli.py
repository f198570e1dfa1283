"""The ``edl-argo`` command line.

Each subcommand lives in its own module and contributes a ``register(subparsers)`` function that adds its
parser and sets ``run=<callable(args) -> int>``. :func:`build_parser` is public so that tests (and the Argo
template checks) can parse a step's command line exactly as the real program would.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from edl_argo import __version__, log
from edl_argo.errors import EdlError


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are a single line naming the flag at fault."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _register_all(subparsers: argparse._SubParsersAction) -> None:
    from edl_argo.data import commands as data_commands

    registrars: list[Callable[[argparse._SubParsersAction], None]] = [data_commands.register]
    for register in registrars:
        register(subparsers)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog="edl-argo",
        description="Elastic, fault-tolerant TensorFlow training as an Argo Workflows step.",
    )
    parser.add_argument("--version", action="version", version=f"edl-argo {__version__}")
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=OneLineArgumentParser
    )
    _register_all(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    log.configure(getattr(args, "log_level", None))
    try:
        return int(args.run(args) or 0)
    except EdlError as error:
        print(f"edl-argo {args.command}: error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print(f"edl-argo {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
