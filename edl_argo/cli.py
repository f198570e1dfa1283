"""The ``edl-argo`` command line.

Each subcommand lives in its own module, which provides ``register(subparsers)``: it adds the command's
parser and sets ``run=<callable(args) -> int>``. :data:`COMMANDS` names those modules; ``main`` imports
only the one being run, while :func:`build_parser` registers them all, so tests and the Argo template
checks can parse any step's command line exactly as the real program would.

**Quiet and fast.** Importing a command module never imports TensorFlow (its modules import it inside
the functions that run): ``edl-argo --help``, ``COMMAND --help``, ``data``, ``templates`` and ``pipeline
render`` answer without it. Before anything else, :func:`quiet_native_logs` keeps TensorFlow's C++
start-up notices (absl, oneDNN, CPU features) out of the output unless ``--log-level DEBUG``; pods run
this same entry, so theirs are quiet too.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterable, Mapping, Sequence
from typing import NoReturn

from edl_argo import __version__, log
from edl_argo.cpu_limit import size_tensorflow_threads
from edl_argo.errors import EdlError
from edl_argo.flags import command_in
from edl_argo.native_logs import hide_notices_while_importing
from edl_argo.run_dir import warm_dir
from edl_argo.stop import TERMINATED_EXIT_CODE, Terminated, exit_now
from edl_argo.tensorflow_import import import_tensorflow

#: command -> (module providing ``register``, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "data": ("edl_argo.data.commands", "prepare and inspect RecordIO datasets"),
    "train": ("edl_argo.master.command", "run an elastic training job (this process is its master)"),
    "worker": ("edl_argo.worker.main", "run one worker of a job (started by the master)"),
    "ps": ("edl_argo.ps.server", "run one parameter server of a job (started by the master)"),
    "evaluate": ("edl_argo.inference", "compute a trained model's metrics on shards"),
    "predict": ("edl_argo.inference", "write a trained model's predictions for shards"),
    "scale": ("edl_argo.master.scale", "change the number of workers of a running job"),
    "cleanup": ("edl_argo.pods.cleanup", "delete a Kubernetes job's pods, Services and NetworkPolicy"),
    "templates": ("edl_argo.hera.render", "render templates/ (WorkflowTemplates, RBAC) from components/"),
    "pipeline": ("edl_argo.pipeline.commands", "run a pipeline here, render it, or submit it to Argo"),
    "sql": ("edl_argo.sqlflow.command", "run a SQLFlow statement (SELECT ... TO TRAIN|PREDICT|EVALUATE)"),
    "warm": ("edl_argo.pods.warm", "keep TensorFlow imported for your next train, evaluate, predict, sql"),
}


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are a single line naming the flag at fault."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def quiet_native_logs(log_level: str | None) -> None:
    """Hide TensorFlow's C++ log lines below ERROR unless ``log_level`` (else ``$EDL_LOG_LEVEL``) is DEBUG.

    Must run before TensorFlow is imported. A ``TF_CPP_MIN_LOG_LEVEL`` already in the environment wins
    (set by hand, or inherited from the master by a local pod, whose log level is the master's); it also
    decides which of the notices TensorFlow's import writes are kept (:mod:`edl_argo.native_logs`).
    """
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = native_min_log_level(log_level, os.environ)
    # The level above does not reach the lines TensorFlow writes before absl's logging starts (on some
    # CPUs: oneDNN's notice, twice, with absl's preamble); those are filtered from the import's output.
    hide_notices_while_importing("tensorflow")


def native_min_log_level(log_level: str | None, environ: Mapping[str, str]) -> str:
    """The ``TF_CPP_MIN_LOG_LEVEL`` that :func:`quiet_native_logs` gives a process with this environment
    and ``--log-level``: the environment's own, else ``0`` at DEBUG (``log_level``, else ``EDL_LOG_LEVEL``)
    and ``2`` otherwise."""
    if "TF_CPP_MIN_LOG_LEVEL" in environ:
        return environ["TF_CPP_MIN_LOG_LEVEL"]
    level = (log_level or environ.get("EDL_LOG_LEVEL") or "INFO").upper()
    return "0" if level == "DEBUG" else "2"


def log_level_in(argv: Sequence[str]) -> str | None:
    """The value of ``--log-level`` in ``argv`` (any command's), without parsing the rest."""
    for i, arg in enumerate(argv):
        if arg == "--log-level" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--log-level="):
            return arg.split("=", 1)[1]
    return None


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The parser with ``commands`` registered (all of them by default).

    The other commands get a bare entry (name and help), so the top-level help and a mistyped command's
    error still list them all without importing their modules."""
    parser = OneLineArgumentParser(
        prog="edl-argo",
        description="Elastic, fault-tolerant TensorFlow training as an Argo Workflows step.",
        epilog="commands: " + "; ".join(f"{name}: {text}" for name, (_, text) in COMMANDS.items()),
    )
    parser.add_argument("--version", action="version", version=f"edl-argo {__version__}")
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=OneLineArgumentParser
    )
    chosen = COMMANDS if commands is None else commands
    for module in dict.fromkeys(COMMANDS[name][0] for name in chosen):
        importlib.import_module(module).register(subparsers)
    for name, (_, text) in COMMANDS.items():
        if name not in subparsers.choices:
            subparsers.add_parser(name, help=text)
    return parser


def main(argv: Sequence[str] | None = None, warm: bool = False) -> int:
    """Run ``edl-argo ARGV`` in this process: its exit status. With ``warm`` (the ``edl-argo`` program's
    way, :func:`entry_point`), a command this user's warm server serves runs there instead
    (:func:`edl_argo.pods.warm.run_in_warm_server`), its output going to this process's descriptors."""
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_native_logs(log_level_in(argv))
    chosen = command_in(argv)
    if warm and any(warm_dir().glob("*.sock")):  # cheap: nothing more is imported without a server
        from edl_argo.pods.warm import run_in_warm_server

        code = run_in_warm_server(argv, chosen)
        if code is not None:
            return code
    parser = build_parser([chosen] if chosen in COMMANDS else [])
    args = parser.parse_args(argv)
    log.configure(getattr(args, "log_level", None))
    if args.command in POD_COMMANDS:
        import_tensorflow()
        size_tensorflow_threads()
    try:
        return int(args.run(args) or 0)
    except EdlError as error:
        print(f"edl-argo {args.command}: error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print(f"edl-argo {args.command}: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print(f"edl-argo {args.command}: terminated", file=sys.stderr)
        return TERMINATED_EXIT_CODE


#: Commands that a pod runs. Their process ends as soon as the command returns, without the interpreter's
#: teardown: with TensorFlow loaded that takes 1.5-2 s of a core (its thread pools and modules), during which
#: the pod holds its resources and the master, which waits for its pods, waits too. A pod command returns
#: only when its work is done and saved, and runs no thread whose work the teardown would finish.
POD_COMMANDS = frozenset({"worker", "ps"})


def entry_point() -> NoReturn:
    """The ``edl-argo`` program: :func:`main`, then the exit (at once for :data:`POD_COMMANDS`)."""
    code = main(warm=True)
    if command_in(sys.argv[1:]) in POD_COMMANDS:
        exit_now(code)
    sys.exit(code)


def run_forked(argv: Sequence[str]) -> NoReturn:
    """A command (``argv``: a pod's ``worker ...`` or ``ps ...``, or a warm server's ``train ...``) in a
    process forked from the pod template or warm server (:mod:`edl_argo.zygote`), ended as
    :func:`entry_point` ends it when it runs as its own program: a pod command's status at once, another's
    once the interpreter's last steps before its teardown ran (its other threads joined, its ``atexit``
    handlers); for what escapes :func:`main`, what the interpreter would do (a ``SystemExit``'s status, a
    traceback and 1, death by SIGINT for a ``KeyboardInterrupt``)."""
    try:
        code = main(argv, warm=False)
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130
    except BaseException:
        traceback.print_exc()
        code = 1
    if command_in(argv) not in POD_COMMANDS:
        threading._shutdown()  # type: ignore[attr-defined]  # what sys.exit does: join the other threads
        atexit._run_exitfuncs()
    exit_now(code)


if __name__ == "__main__":
    entry_point()
