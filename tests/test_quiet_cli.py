"""A quiet, fast command line: no TensorFlow where none is needed, no native start-up notices, and a
failed pod reported by its error's own last line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edl_argo.master.pod_manager import PodManager, PodPolicy
from edl_argo.master.task_dispatcher import DispatcherConfig, TaskDispatcher
from edl_argo.pods import PodEvent, PodPhase, PodReason, PodRole, PodSpec
from edl_argo.pods.base import failure_line, is_native_notice

ROOT = Path(__file__).resolve().parents[1]

#: What TensorFlow 2.16+ writes to stderr when it starts (C++ logging through absl), verbatim.
TF_NOTICES = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1795617865.911643   11482 cpu_feature_guard.cc:227] This TensorFlow binary is optimized"
    " to use available CPU instructions in performance-critical operations.",
    "To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow with the"
    " appropriate compiler flags.",
    "2026-05-04 10:11:12.345678: I tensorflow/core/util/port.cc:153] oneDNN custom operations are on. You"
    " may see slightly different numerical results due to floating-point round-off errors from different"
    " computation orders. To turn them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.",
    "I0000 00:00:1795617866.000001   11482 port.cc:153] oneDNN custom operations are on. You may see"
    " slightly different numerical results due to floating-point round-off errors.",
]

#: (what the command line does, argv): none of these needs TensorFlow.
LIGHT_COMMANDS = [
    ["--help"],
    ["--version"],
    *([name, "--help"] for name in ("data", "train", "worker", "ps", "evaluate", "predict", "scale")),
    *([name, "--help"] for name in ("templates", "pipeline")),
    ["templates", "render", "--help"],
    ["pipeline", "render", "--help"],
]


def run_isolated(code: str, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    """Run ``code`` in a fresh interpreter (this checkout first on sys.path); return its stdout."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=environment,
        timeout=timeout,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def modules_after(argv_list: list[list[str]]) -> dict[str, bool]:
    """For each argv: whether TensorFlow or Keras was imported by running ``edl-argo <argv>`` in-process."""
    code = f"""
import json, subprocess, sys
from edl_argo import cli
results = {{}}
for argv in {argv_list!r}:
    try:
        cli.main(argv)
    except SystemExit:
        pass
    results[" ".join(argv)] = any(m.split(".")[0] in ("tensorflow", "keras") for m in sys.modules)
print(json.dumps(results))
"""
    return json.loads(run_isolated(code).strip().splitlines()[-1])


def test_help_and_light_commands_do_not_import_tensorflow() -> None:
    imported = modules_after(LIGHT_COMMANDS)
    assert imported == dict.fromkeys(imported, False), [argv for argv, tf in imported.items() if tf]


def test_data_templates_and_pipeline_render_do_not_import_tensorflow(tmp_path: Path) -> None:
    argvs = [
        ["data", "digits", "--output", str(tmp_path / "data"), "--num-shards", "1"],
        ["data", "inspect", str(tmp_path / "data" / "train")],
        ["templates", "render", "--output", str(tmp_path / "templates")],
        ["pipeline", "render", str(ROOT / "examples" / "pipelines" / "digits_pipeline.py")],
    ]
    imported = modules_after(argvs)
    assert len(imported) == len(argvs)
    assert not any(imported.values()), [argv for argv, tf in imported.items() if tf]
    assert (tmp_path / "templates" / "elastic-train.yaml").is_file()  # the commands did run


def test_invalid_command_still_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    from edl_argo import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["trian"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'trian'" in err and "train" in err and len(err.strip().splitlines()) == 1


#: A package that writes native notices to file descriptor 2 when imported, as TensorFlow does on some CPUs,
#: between a line of its own before and after them.
NOISY_PACKAGE = f"""
import os
lines = ["noisy: before"] + {TF_NOTICES!r} + [
    "E0000 00:00:1795617866.000002   11482 port.cc:9] an error line",
    "noisy: after",
]
os.write(2, ("\\n".join(lines) + "\\n").encode())
"""


def run_quiet_entry(code: str, log_level: str | None, path: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """A process that runs the CLI's start (:func:`cli.quiet_native_logs`), then ``code``, with ``path``
    and this checkout on ``sys.path``, and no log level in its environment."""
    program = f"import sys\nfrom edl_argo import cli\ncli.quiet_native_logs({log_level!r})\n{code}"
    environment = {k: v for k, v in os.environ.items() if k not in ("TF_CPP_MIN_LOG_LEVEL", "EDL_LOG_LEVEL")}
    return subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        env={**environment, "PYTHONPATH": os.pathsep.join([str(ROOT), str(path)])},
        timeout=300,
        cwd=ROOT,
    )


def stderr_of_quiet_entry(code: str, log_level: str | None, path: Path = ROOT) -> list[str]:
    """The stderr lines of :func:`run_quiet_entry`, which must succeed."""
    result = run_quiet_entry(code, log_level, path)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stderr.splitlines()


def test_tensorflow_start_up_lines_hidden_on_this_cpu() -> None:
    """Whatever this CPU makes TensorFlow write before absl's logging starts (oneDNN's notice on an Intel
    CPU with AVX-512, nothing on others), a process that went through the CLI's start shows none of it."""
    stderr = stderr_of_quiet_entry("import tensorflow as tf\n(tf.zeros([2]) + 1).numpy()", None)
    assert [line for line in stderr if is_native_notice(line)] == []


@pytest.mark.parametrize("via", ["import noisy", "import uses_noisy"])
def test_notices_written_by_an_import_are_hidden_below_the_log_level(tmp_path: Path, via: str) -> None:
    """The same on any CPU: a package that writes the notices when imported (directly, or by another
    package's import) leaves only its own lines and the ERROR line; at DEBUG, everything."""
    (tmp_path / "noisy.py").write_text(NOISY_PACKAGE)
    (tmp_path / "uses_noisy.py").write_text("import noisy\n")
    hook = "from edl_argo.native_logs import hide_notices_while_importing as hide\nhide('noisy')\n"
    after = f"{hook}{via}\nprint('program: after the import', file=sys.stderr)"
    shown = [
        "noisy: before",
        "E0000 00:00:1795617866.000002   11482 port.cc:9] an error line",
        "noisy: after",
    ]
    assert stderr_of_quiet_entry(after, "INFO", tmp_path) == [*shown, "program: after the import"]
    debug = stderr_of_quiet_entry(after, "DEBUG", tmp_path)
    assert debug == ["noisy: before", *TF_NOTICES, *shown[1:], "program: after the import"]


def test_an_import_that_fails_still_shows_its_error(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text(f"{NOISY_PACKAGE}\nraise ImportError('broken: needs libfoo.so')\n")
    code = (
        "from edl_argo.native_logs import hide_notices_while_importing\n"
        "hide_notices_while_importing('broken')\n"
        "try:\n    import broken\n"
        "except ImportError as error:\n    print(f'caught: {error}', file=sys.stderr)\n"
        "import broken as again\n"
    )
    result = run_quiet_entry(code, "INFO", tmp_path)
    lines = result.stderr.splitlines()
    assert result.returncode == 1
    assert "caught: broken: needs libfoo.so" in lines and lines[-1] == "ImportError: broken: needs libfoo.so"
    assert not any(is_native_notice(line) and not line.startswith("E") for line in lines)


def test_failure_line_is_the_errors_own_last_line() -> None:
    assert all(is_native_notice(line) for line in TF_NOTICES)
    tail = ["Traceback (most recent call last):", '  File "x.py", line 1', "ValueError: bad feed", ""]
    assert failure_line(tail) == "ValueError: bad feed"
    assert failure_line(["boom: the reason", *TF_NOTICES]) == "boom: the reason"  # notices at exit
    assert failure_line(TF_NOTICES) == ""
    assert failure_line([]) == ""


@pytest.mark.parametrize(
    ("message", "summary"),
    [
        (
            "exited with status 1; last lines of stderr:\n" + "\n".join(["boom", *TF_NOTICES]),
            "exited with status 1: boom",
        ),
        ("exited with status 1; last lines of stderr:\n" + "\n".join(TF_NOTICES), "exited with status 1"),
        ("killed by SIGKILL", "killed by SIGKILL"),
        (
            "exit code 2: Error; last lines of its log:\nedl-argo worker: error: bad",
            "exit code 2: Error: edl-argo worker: error: bad",
        ),
        ("", ""),
        (
            "...m-defs/sha256-0a.tar attempt=3 error=x\nedl-argo ps: error: cannot read it",
            "edl-argo ps: error: cannot read it",
        ),
    ],
)
def test_event_summary_is_one_line(message: str, summary: str) -> None:
    event = PodEvent(PodRole.WORKER, 0, PodPhase.FAILED, 1, PodReason.ERROR, message, 0.0)
    assert event.summary == summary


def worker_spec(worker_id: int) -> PodSpec:
    return PodSpec(PodRole.WORKER, worker_id, ("true",))


class NoPods:
    """A backend that only records starts: the policy's reactions are all this test looks at."""

    def __init__(self) -> None:
        self.started: list[str] = []

    def start(self, spec: PodSpec) -> None:
        self.started.append(spec.name)


def test_master_reports_a_failed_worker_by_its_error_line(caplog: pytest.LogCaptureFixture) -> None:
    """A worker that exits with ``SystemExit('...')`` after TensorFlow's notices: the relaunch record,
    the log and the job's failure name the error, not a notice."""
    dispatcher = TaskDispatcher({"shard": 10}, DispatcherConfig(records_per_task=10, num_epochs=1))
    manager = PodManager(
        NoPods(),  # type: ignore[arg-type]
        PodPolicy(num_workers=1, num_ps=0, max_worker_relaunches=1),
        dispatcher,
        worker_spec,
        worker_spec,
    )
    manager.start()
    reason = "model file s3://models/m.py: feed() must return (features, labels)"
    stderr = ["exited with status 1; last lines of stderr:", *TF_NOTICES[:3], reason, *TF_NOTICES[3:]]
    for worker_id in (0, 1):
        event = PodEvent(
            PodRole.WORKER, worker_id, PodPhase.FAILED, 1, PodReason.ERROR, "\n".join(stderr), 0.0
        )
        manager.handle([event])
    assert [record.message for record in manager.relaunches] == [f"exited with status 1: {reason}"]
    assert manager.failure is not None and str(manager.failure).endswith(f"exited with status 1: {reason}")
