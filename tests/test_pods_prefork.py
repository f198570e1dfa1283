"""Local pods forked from the pod template (``edl_argo.pods.prefork``, ``edl_argo.zygote``).

A forked pod must be what the exec path makes: the real ``edl-argo worker`` CLI with its own environment,
argv and directory, the same process group, files and exit statuses, adoptable by a later backend. The
pods here run ``edl-argo worker --model-def PROBE``: the worker loads the model file first, and the probe
reports the process that loads it, then exits, waits or starts a child as ``PROBE_THEN`` says. One
template serves the whole module (its import takes seconds), so each test uses pod ids of its own.
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edl_argo.master.pod_template import early_pod_template
from edl_argo.pods import LocalProcessBackend, PodPhase, PodReason, PodRole, PodSpec, PodStatus
from edl_argo.pods.prefork import PREFORK_ENV, process_template
from tests.engine_helpers import digits_config
from tests.test_pods_local import collect, is_gone, live_children, terminal, wait_for

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]

WORKER = PodRole.WORKER

PROBE = '''
"""A model file that reports the process loading it, then does what PROBE_THEN says."""
import json, os, signal, subprocess, sys, time
report = {
    "env": dict(os.environ),
    "argv": sys.argv,
    "cwd": os.getcwd(),
    "pid": os.getpid(),
    "pgid": os.getpgid(0),
    "ppid": os.getppid(),
    "cmdline": open("/proc/self/cmdline", "rb").read().decode(errors="replace"),
    "signals": [str(signal.getsignal(number)) for number in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE)],
    "tensorflow": "tensorflow" in sys.modules,
}
then = os.environ.get("PROBE_THEN", "exit 0").split()
if then[0] == "child":
    report["child"] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]).pid
path = os.environ["PROBE_OUT"]
with open(path + ".tmp", "w") as f:
    json.dump(report, f)
os.replace(path + ".tmp", path)
print("probe on stdout", flush=True)
print("probe on stderr", file=sys.stderr, flush=True)
if then[0] == "exit":
    sys.exit(int(then[1]))
deadline = time.time() + 50
while time.time() < deadline and not os.path.exists(path + ".go"):
    time.sleep(0.02)
sys.exit(0)
'''

_pod_ids = itertools.count()


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("probe") / "probe.py"
    path.write_text(PROBE)
    return path


@pytest.fixture(scope="module")
def forking() -> Iterator[tuple[LocalProcessBackend, io.StringIO]]:
    """A backend whose template serves the module's tests, and its log sink."""
    sink = io.StringIO()
    with LocalProcessBackend("prefork-job", log_sink=sink) as backend:
        yield backend, sink


def probe_pod(probe: Path, out: Path, then: str = "exit 0", pod_id: int | None = None, **env: str) -> PodSpec:
    """An ``edl-argo worker`` pod loading the probe, which writes its report to ``out``."""
    command = (
        "edl-argo",
        "worker",
        "--model-def",
        str(probe),
        "--worker-id",
        "0",
        "--master-addr",
        "127.0.0.1:9",
    )
    pod_id = next(_pod_ids) if pod_id is None else pod_id
    return PodSpec(WORKER, pod_id, command, env={"PROBE_OUT": str(out), "PROBE_THEN": then, **env})


def report(out: Path) -> dict[str, Any]:
    wait_for(out.exists, timeout=60, what=f"the probe to write {out.name}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def forked(record: dict[str, Any]) -> bool:
    """Whether the probe ran in a process forked from the template (its command line is the template's)."""
    return "edl_argo.zygote" in record["cmdline"]


def test_a_forked_pod_runs_the_cli_with_the_environment_argv_and_signals_of_an_exec_one(
    forking: tuple[LocalProcessBackend, io.StringIO],
    probe: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend, sink = forking
    spec = probe_pod(probe, tmp_path / "fork.json", then="exit 3", EDL_PROBE_EXTRA="x y")
    backend.start(spec)
    event = terminal(collect(backend, spec.name, timeout=60), spec.name)
    assert (event.phase, event.exit_code) == (PodPhase.FAILED, 3)
    assert event.message.endswith("probe on stderr")
    assert f"[{spec.name}] probe on stdout" in sink.getvalue().splitlines()

    monkeypatch.setenv(PREFORK_ENV, "0")
    with LocalProcessBackend("prefork-job", log_sink=io.StringIO(), pods_dir=tmp_path / "pods") as execing:
        same = probe_pod(
            probe, tmp_path / "exec.json", then="exit 3", pod_id=spec.pod_id, EDL_PROBE_EXTRA="x y"
        )
        execing.start(same)
        event = terminal(collect(execing, same.name, timeout=60), same.name)
        assert (event.phase, event.exit_code) == (PodPhase.FAILED, 3)
        assert execing._template.pid is None  # switched off: never started

    fork, exec_ = report(tmp_path / "fork.json"), report(tmp_path / "exec.json")
    assert forked(fork) and not forked(exec_)
    assert fork["pgid"] == fork["ppid"] != os.getpgid(0)  # the group of its supervisor
    for name in ("PROBE_OUT", PREFORK_ENV):
        fork["env"].pop(name, None)
        exec_["env"].pop(name, None)
    assert fork["env"] == exec_["env"]
    assert fork["argv"] == exec_["argv"] and fork["argv"][1:3] == ["worker", "--model-def"]
    assert fork["cwd"] == exec_["cwd"] == os.getcwd()
    assert fork["signals"] == exec_["signals"]
    assert fork["tensorflow"] and exec_["tensorflow"]


def test_a_master_that_ignores_sigint_has_pods_that_ignore_it_forked_as_with_exec(
    probe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ignored signal stays ignored across exec: started with SIGINT ignored (a shell script's
    background job), a master's exec'd pods ignore it, and so must its forked ones."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with LocalProcessBackend("sigint-job", log_sink=io.StringIO(), pods_dir=tmp_path / "f") as backend:
            spec = probe_pod(probe, tmp_path / "fork.json")
            backend.start(spec)  # its template starts now, as this process ignores SIGINT
            terminal(collect(backend, spec.name, timeout=60), spec.name)
        monkeypatch.setenv(PREFORK_ENV, "0")
        with LocalProcessBackend("sigint-job", log_sink=io.StringIO(), pods_dir=tmp_path / "e") as backend:
            spec = probe_pod(probe, tmp_path / "exec.json")
            backend.start(spec)
            terminal(collect(backend, spec.name, timeout=60), spec.name)
    finally:
        signal.signal(signal.SIGINT, previous)
    fork, exec_ = report(tmp_path / "fork.json"), report(tmp_path / "exec.json")
    assert forked(fork) and not forked(exec_)
    assert fork["signals"][0] == exec_["signals"][0] == str(signal.SIG_IGN)


@pytest.mark.parametrize("how", ["kill", "delete", "sigint"])
def test_signals_reach_a_forked_pod_as_an_exec_one(
    forking: tuple[LocalProcessBackend, io.StringIO], probe: Path, tmp_path: Path, how: str
) -> None:
    backend, _ = forking
    spec = probe_pod(probe, tmp_path / "out.json", then="child")
    backend.start(spec)
    record = report(tmp_path / "out.json")
    assert forked(record)
    if how == "kill":
        backend.kill(WORKER, spec.pod_id)
        expected = (PodPhase.FAILED, PodReason.KILLED, 137)
    elif how == "delete":
        backend.delete(WORKER, spec.pod_id, grace_seconds=5)
        expected = (PodPhase.DELETED, PodReason.DELETED, 143)
    else:  # SIGINT raises KeyboardInterrupt in the command; the CLI says "interrupted" and exits 130
        backend.kill(WORKER, spec.pod_id, signal.SIGINT)
        expected = (PodPhase.FAILED, PodReason.ERROR, 130)
    event = terminal(collect(backend, spec.name, timeout=30), spec.name)
    assert (event.phase, event.reason, event.exit_code) == expected
    wait_for(lambda: is_gone(record["child"]) and is_gone(record["pid"]), what="the pod's processes to end")


def test_pause_and_resume_a_forked_pod(
    forking: tuple[LocalProcessBackend, io.StringIO], probe: Path, tmp_path: Path
) -> None:
    backend, _ = forking
    out = tmp_path / "out.json"
    spec = probe_pod(probe, out, then="wait")
    backend.start(spec)
    pid = report(out)["pid"]
    backend.pause(WORKER, spec.pod_id)
    wait_for(lambda: Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T", what="stop")
    backend.resume(WORKER, spec.pod_id)
    Path(f"{out}.go").touch()
    event = terminal(collect(backend, spec.name, timeout=30), spec.name)
    assert (event.phase, event.exit_code) == (PodPhase.SUCCEEDED, 0)


def test_other_programs_and_other_import_time_settings_use_exec(
    forking: tuple[LocalProcessBackend, io.StringIO], probe: Path, tmp_path: Path
) -> None:
    backend, _ = forking
    other = PodSpec(WORKER, next(_pod_ids), (sys.executable, "-c", "import sys; print(sys.argv)"))
    differs = probe_pod(probe, tmp_path / "out.json", TF_CPP_MIN_LOG_LEVEL="1")
    backend.start(other)
    backend.start(differs)
    events = collect(backend, other.name, differs.name, timeout=60)
    assert terminal(events, other.name).exit_code == 0
    assert terminal(events, differs.name).exit_code == 0
    record = report(tmp_path / "out.json")
    assert not forked(record) and record["env"]["TF_CPP_MIN_LOG_LEVEL"] == "1"


def test_the_template_runs_no_other_thread_when_it_forks(
    forking: tuple[LocalProcessBackend, io.StringIO], probe: Path, tmp_path: Path
) -> None:
    """Between requests, when it forks, the template is one thread: OpenBLAS's pool, started by NumPy's
    import, was shut down, and nothing else started one."""
    backend, _ = forking
    spec = probe_pod(probe, tmp_path / "out.json")
    backend.start(spec)
    assert forked(report(tmp_path / "out.json"))
    pid = backend._template.pid
    assert pid is not None
    assert os.listdir(f"/proc/{pid}/task") == [str(pid)]
    collect(backend, spec.name, timeout=60)


EXITING_THREAD = """
import threading, time
from edl_argo import zygote
# OpenBLAS's shutdown returns once its threads were told to end: one may still be listed a moment later
# (1 template in 24 here said "it runs 2 threads" and every pod of its job started with exec).
stop_openblas_threads = zygote.stop_openblas_threads


def stop_then_start(seconds):
    stop_openblas_threads()
    threading.Thread(target=time.sleep, args=(seconds,), daemon=True).start()


zygote.stop_openblas_threads = lambda: stop_then_start(0.2)
template, error = zygote.prepare()
print(template is not None, error)
zygote.stop_openblas_threads = lambda: stop_then_start(60)
template, error = zygote.prepare()
print(template is not None, error, flush=True)
"""


def test_the_template_waits_a_moment_for_a_thread_ending_but_not_for_one_that_runs_on() -> None:
    done = subprocess.run(
        [sys.executable, "-c", EXITING_THREAD], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "True ",
        "False it runs 2 threads once its modules are imported",
    ]


TEMPLATE_OWNER = """
import os, sys, time
from pathlib import Path
from edl_argo.pods import LocalProcessBackend, PodSpec, PodRole
backend = LocalProcessBackend("owner-job", log_sink=open(os.devnull, "w"), pods_dir=Path(sys.argv[1]))
env = {"PROBE_OUT": sys.argv[2], "PROBE_THEN": "wait"}
backend.start(PodSpec(PodRole.WORKER, 0, tuple(sys.argv[3:]), env=env))
print(backend._template.pid, flush=True)
time.sleep(120)
"""


def test_the_template_dies_with_its_master_and_a_new_backend_adopts_its_pods(
    probe: Path, tmp_path: Path
) -> None:
    pods_dir, out = tmp_path / "pods", tmp_path / "out.json"
    command = probe_pod(probe, out).command
    master = subprocess.Popen(
        [sys.executable, "-c", TEMPLATE_OWNER, str(pods_dir), str(out), *command],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[1],
    )
    try:
        assert master.stdout is not None
        template = int(master.stdout.readline())
        assert forked(report(out))
    finally:
        master.kill()
        master.wait()
    wait_for(lambda: is_gone(template), timeout=5, what="the template to exit with its master")

    sink = io.StringIO()
    with LocalProcessBackend("owner-job", log_sink=sink, pods_dir=pods_dir) as backend:
        assert backend.adopt() == [PodStatus(WORKER, 0, PodPhase.RUNNING)]
        Path(f"{out}.go").touch()
        event = terminal(collect(backend, "worker-0", timeout=30), "worker-0")
        assert (event.phase, event.exit_code) == (PodPhase.SUCCEEDED, 0)
    assert not pods_dir.exists()


def test_a_dead_template_makes_the_next_pods_start_with_exec(
    probe: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="edl_argo.pods.prefork")
    sink = io.StringIO()
    others = set(live_children())
    with LocalProcessBackend("dead-template", log_sink=sink, pods_dir=tmp_path / "pods") as backend:
        backend.start(probe_pod(probe, tmp_path / "first.json", pod_id=0))
        assert forked(report(tmp_path / "first.json"))
        template = backend._template.pid
        assert template is not None
        os.kill(template, signal.SIGKILL)
        wait_for(lambda: is_gone(template), what="the template to die")
        backend.start(probe_pod(probe, tmp_path / "second.json", pod_id=1))
        events = collect(backend, "worker-0", "worker-1", timeout=60)
        assert [terminal(events, f"worker-{i}").exit_code for i in range(2)] == [0, 0]
        assert not forked(report(tmp_path / "second.json"))
        assert backend._template.pid is None
    (said,) = [r for r in caplog.records if r.getMessage() == "pod_template_unavailable"]
    assert said.fields["consequence"] == "pods start with exec"  # type: ignore[attr-defined]
    assert set(live_children()) - others == set()


def test_a_template_closed_while_it_is_being_started_is_killed_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``edl-argo train`` with a missing model file said so at once, then waited 5 s to exit: its template,
    closed just as it was started, was waited for (:data:`prefork.STOP_SECONDS`) instead of killed, while it
    imported TensorFlow."""
    from edl_argo.pods import prefork

    monkeypatch.setattr(prefork, "STOP_SECONDS", 120.0)
    template = prefork.PodTemplate("closed-while-starting", dict)
    started: list[subprocess.Popen[bytes]] = []
    popen = subprocess.Popen

    def start_then_close(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        started.append(popen(*args, **kwargs))
        template._usable = False  # what close() does first, in the thread that closes it
        return started[0]

    monkeypatch.setattr(prefork.subprocess, "Popen", start_then_close)
    begun = time.monotonic()
    template.warm_up()
    assert time.monotonic() - begun < 60
    assert started[0].returncode == -signal.SIGKILL
    assert not template.serves(prefork.template_program())


def test_the_supervisor_program_is_the_standard_library_only() -> None:
    """The exec path runs it with ``python -I -S``: it must import nothing of the project."""
    from edl_argo.pods import local

    code = textwrap.dedent(f"""
        import runpy, sys
        sys.argv = ["supervisor", "/nonexistent"]
        before = set(sys.modules)
        runpy.run_path({local.SUPERVISOR!r}, run_name="not_main")
        print(sorted(m for m in set(sys.modules) - before if m.startswith("edl_argo")))
    """)
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_the_jobs_of_one_process_share_its_template_which_outlives_each_job(
    probe: Path, tmp_path: Path
) -> None:
    """Local jobs run by one process (a notebook, the test suite) fork their pods from one template, the
    process's: the second job's pods do not wait for a template to import TensorFlow again, and a job's
    end (its backend closed) leaves the template serving the next."""
    configs = [digits_config(tmp_path, tmp_path / name) for name in ("first", "second")]
    template = early_pod_template(configs[0])
    assert template is not None and early_pod_template(configs[1]) is template is process_template("any")
    pids = []
    for name in ("first", "second"):
        with LocalProcessBackend(
            f"{name}-job", log_sink=io.StringIO(), pods_dir=tmp_path / name, pod_template=template
        ) as backend:
            backend.start(probe_pod(probe, tmp_path / f"{name}.json", pod_id=0))
            assert terminal(collect(backend, "worker-0", timeout=60), "worker-0").exit_code == 0
            record = report(tmp_path / f"{name}.json")
            assert forked(record) and record["env"]["EDL_JOB_NAME"] == f"{name}-job"
        pids.append(template.pid)
    assert pids[0] is not None and pids == [pids[0], pids[0]] and not is_gone(pids[0])
