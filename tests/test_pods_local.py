"""Tests for the pod interface and its local backend (``edl_argo.pods``).

Pods here are tiny ``python -c`` programs, so the whole module runs in a few seconds. Linux only: process
states are read from ``/proc``.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from edl_argo.pods import (
    BackendClosedError,
    LocalProcessBackend,
    PodEvent,
    PodExistsError,
    PodPhase,
    PodReason,
    PodRole,
    PodSpec,
    PodStatus,
    find_free_port,
)

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]

WORKER, PS = PodRole.WORKER, PodRole.PS


def py(code: str) -> tuple[str, ...]:
    """A pod command running ``code`` with this interpreter."""
    return (sys.executable, "-c", textwrap.dedent(code))


def worker(pod_id: int, code: str, **env: str) -> PodSpec:
    return PodSpec(WORKER, pod_id, py(code), env=env)


def process_tree(pid_file: Path, *, ignore_sigterm: bool = False, then: str = "time.sleep(60)") -> str:
    """Code for a pod that starts a sleeping grandchild, writes both pids to ``pid_file``, runs ``then``."""
    return f"""
        import os, signal, subprocess, sys, time
        if {ignore_sigterm}:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        with open({str(pid_file) + ".tmp"!r}, "w") as f:
            f.write(f"{{os.getpid()}} {{child.pid}}")
        os.replace({str(pid_file) + ".tmp"!r}, {str(pid_file)!r})
        {then}
    """


def wait_for(condition: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def read_pids(pid_file: Path) -> list[int]:
    wait_for(pid_file.exists, what=f"{pid_file.name} to be written")
    return [int(pid) for pid in pid_file.read_text().split()]


def process_state(pid: int) -> str | None:
    """The /proc state letter of a process (R, S, T, Z, ...), or None if it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def is_gone(pid: int) -> bool:
    """Whether a process is dead (a zombie counts: PID 1 of a container may never reap it)."""
    return process_state(pid) in (None, "Z")


def live_children() -> list[int]:
    """Pids of this process's children that are still alive."""
    me = str(os.getpid())
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if fields[1] == me and fields[0] != "Z":
                children.append(int(entry.name))
    return children


def collect(backend: LocalProcessBackend, *names: str, timeout: float = 10.0) -> list[PodEvent]:
    """All events until each pod in ``names`` has had its terminal event."""
    events: list[PodEvent] = []
    pending = set(names)
    deadline = time.monotonic() + timeout
    while pending:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"no terminal event for {sorted(pending)}; got {events}"
        for event in backend.events(timeout=remaining):
            events.append(event)
            if event.phase.is_terminal:
                pending.discard(event.name)
    return events


def terminal(events: list[PodEvent], name: str) -> PodEvent:
    (event,) = [e for e in events if e.name == name and e.phase.is_terminal]
    return event


def wait_running(backend: LocalProcessBackend, name: str) -> list[PodEvent]:
    """All events until ``name`` runs (the whole last batch included)."""
    events: list[PodEvent] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        events += backend.events(timeout=0.1)
        assert not any(e.name == name and e.phase.is_terminal for e in events), events
        if any(e.name == name and e.phase is PodPhase.RUNNING for e in events):
            return events
    raise AssertionError(f"{name} never ran")


@pytest.fixture
def sink() -> io.StringIO:
    return io.StringIO()


@pytest.fixture
def backend(sink: io.StringIO) -> Iterator[LocalProcessBackend]:
    with LocalProcessBackend("test-job", log_sink=sink) as backend:
        yield backend


# -- the data types ------------------------------------------------------------------------------------


def test_pod_spec_is_immutable_and_validated() -> None:
    env = {"A": "1"}
    spec = PodSpec(PodRole("worker"), 3, ["edl-argo", "worker"], env=env)  # type: ignore[arg-type]
    env["A"] = "2"
    assert spec.name == "worker-3"
    assert spec.command == ("edl-argo", "worker")
    assert dict(spec.env) == {"A": "1"}
    assert hash(spec) == hash(PodSpec(WORKER, 3, ("edl-argo", "worker"), env={"A": "1"}))
    with pytest.raises(TypeError):
        spec.env["B"] = "x"  # type: ignore[index]
    for bad in (
        {"role": PS, "pod_id": 0, "command": ("x",)},  # a PS needs a port
        {"role": WORKER, "pod_id": -1, "command": ("x",)},
        {"role": WORKER, "pod_id": 0, "command": ()},
        {"role": WORKER, "pod_id": 0, "command": ("x",), "port": 70000},
        {"role": WORKER, "pod_id": 0, "command": ("x",), "env": {"A": 1}},
    ):
        with pytest.raises(ValueError):
            PodSpec(**bad)  # type: ignore[arg-type]


def test_terminal_phases() -> None:
    assert {phase for phase in PodPhase if phase.is_terminal} == {
        PodPhase.SUCCEEDED,
        PodPhase.FAILED,
        PodPhase.DELETED,
    }


def test_find_free_port_gives_distinct_bindable_ports() -> None:
    import socket

    ports = [find_free_port() for _ in range(20)]
    assert len(set(ports)) == len(ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))


def test_find_free_port_stays_out_of_the_range_outgoing_connections_draw_from() -> None:
    """Otherwise a client's connection could take the port between its choice and the PS binding it."""
    from pathlib import Path

    low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert all(not low <= find_free_port() <= high for _ in range(50))


def test_find_free_port_skips_a_port_something_listens_on(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from edl_argo.pods import ports

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        free = find_free_port()
        ports.release_ports("127.0.0.1", [free])
        monkeypatch.setattr(ports, "_candidate_ports", lambda _highest: [busy, busy, free])
        assert ports.find_free_port() == free
        ports.release_ports("127.0.0.1", [free])


def test_find_free_port_chooses_none_above_the_highest_asked() -> None:
    """A Kubernetes PS's tensor port is its port + 100: a port chosen for it must leave that room. Here the
    bound leaves 300 of the 27,000-odd candidate ports."""
    from edl_argo.pods import ports

    highest = 10_299
    chosen = [find_free_port(highest=highest) for _ in range(40)]
    ports.release_ports("127.0.0.1", chosen)
    assert len(set(chosen)) == 40 and max(chosen) <= highest


def test_a_port_another_process_chose_is_not_chosen_until_it_releases_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Two masters on one machine choose their PS ports before the PS bind them: a port one of them chose
    (claimed machine-wide) is skipped by the other, though nothing listens on it yet, until it is
    released or its process ends."""
    from edl_argo.pods import ports

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(ports.tempfile, "tempdir", None)  # read TMPDIR again
    first, second = find_free_port(), find_free_port()
    ports.release_ports("127.0.0.1", [first, second])
    monkeypatch.setattr(ports, "_candidate_ports", lambda _highest: [first, second])
    other = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from edl_argo.pods import ports; "
            f"ports._candidate_ports = lambda _highest: [{first}]; "
            "print(ports.find_free_port(), flush=True); "
            "sys.stdin.read()",
        ],
        env={**os.environ, "TMPDIR": str(tmp_path)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == str(first)
        assert find_free_port() == second  # nothing listens on the first yet: only its claim is seen
        ports.release_ports("127.0.0.1", [second])
    finally:
        other.communicate("", timeout=30)  # the other process ends: its claim goes with it
    assert find_free_port() == first
    ports.release_ports("127.0.0.1", [first])


# -- lifecycle and events -----------------------------------------------------------------------------


def test_exit_zero_runs_then_succeeds(backend: LocalProcessBackend) -> None:
    backend.start(worker(0, "print('done')"))
    events = collect(backend, "worker-0")
    assert [(e.phase, e.reason, e.exit_code) for e in events] == [
        (PodPhase.RUNNING, PodReason.STARTED, None),
        (PodPhase.SUCCEEDED, PodReason.COMPLETED, 0),
    ]
    assert events[0].timestamp <= events[1].timestamp
    assert backend.list_pods() == []


def test_nonzero_exit_fails_with_the_tail_of_stderr(backend: LocalProcessBackend) -> None:
    backend.start(
        worker(
            0,
            """
            import sys
            print("stdout is not quoted")
            for i in range(30):
                print(f"problem {i}", file=sys.stderr)
            sys.exit(3)
            """,
        )
    )
    event = terminal(collect(backend, "worker-0"), "worker-0")
    assert (event.phase, event.reason, event.exit_code) == (PodPhase.FAILED, PodReason.ERROR, 3)
    assert "exited with status 3" in event.message
    assert event.message.endswith("problem 29")
    assert "problem 19" not in event.message
    assert "stdout" not in event.message


@pytest.mark.parametrize("how", ["sigkill", "exit137"])
def test_sigkill_fails_as_killed(backend: LocalProcessBackend, how: str) -> None:
    code = "import time; time.sleep(60)" if how == "sigkill" else "import sys; sys.exit(137)"
    backend.start(worker(0, code))
    if how == "sigkill":
        wait_running(backend, "worker-0")
        backend.kill(WORKER, 0)
    event = terminal(collect(backend, "worker-0"), "worker-0")
    assert (event.phase, event.reason, event.exit_code) == (PodPhase.FAILED, PodReason.KILLED, 137)


def test_a_command_that_cannot_run_fails_without_running(backend: LocalProcessBackend) -> None:
    backend.start(PodSpec(WORKER, 0, ("/nonexistent/edl-argo", "worker")))
    events = collect(backend, "worker-0")
    assert [(e.phase, e.reason, e.exit_code) for e in events] == [(PodPhase.FAILED, PodReason.ERROR, None)]
    assert "cannot start" in events[0].message
    assert "/nonexistent/edl-argo" in events[0].message


@pytest.mark.parametrize("ignore_sigterm", [False, True], ids=["sigterm", "sigkill_after_grace"])
def test_delete_removes_the_whole_process_group(
    backend: LocalProcessBackend, tmp_path: Path, ignore_sigterm: bool
) -> None:
    pid_file = tmp_path / "pids"
    backend.start(worker(0, process_tree(pid_file, ignore_sigterm=ignore_sigterm)))
    pids = read_pids(pid_file)
    started = time.monotonic()
    backend.delete(WORKER, 0, reason=PodReason.PREEMPTED, grace_seconds=0.3)
    backend.delete(WORKER, 0, grace_seconds=0.3)  # idempotent; the first reason stays
    event = terminal(collect(backend, "worker-0"), "worker-0")
    assert (event.phase, event.reason) == (PodPhase.DELETED, PodReason.PREEMPTED)
    assert event.exit_code == (137 if ignore_sigterm else 143)
    assert (time.monotonic() - started >= 0.3) == ignore_sigterm
    wait_for(lambda: all(is_gone(pid) for pid in pids), timeout=5, what="the pod's processes to die")
    backend.delete(WORKER, 0)  # gone: nothing to do
    backend.delete(WORKER, 99)  # never started: nothing to do


def test_a_pod_started_when_an_interrupt_came_is_still_waited_for_by_close(
    sink: io.StringIO, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C (or the SIGTERM handler's exception) can land in the master's main thread right after a pod's
    process started and before its exit is watched. Closing the backend then still ends the pod and waits
    for it (a pod that ignores SIGTERM: SIGKILLed after the grace), and reports its exit."""
    pid_file = tmp_path / "pids"
    with LocalProcessBackend("test-job", log_sink=sink) as backend:
        watch = backend._watch

        def interrupted(*args: object) -> None:
            monkeypatch.setattr(backend, "_watch", watch)
            raise KeyboardInterrupt

        monkeypatch.setattr(backend, "_watch", interrupted)
        with pytest.raises(KeyboardInterrupt):
            backend.start(worker(0, process_tree(pid_file, ignore_sigterm=True)))
        pids = read_pids(pid_file)
        started = time.monotonic()
        backend.close(grace_seconds=0.3)
        assert time.monotonic() - started >= 0.3  # it waited for the pod through its grace
        assert terminal(collect(backend, "worker-0"), "worker-0").phase is PodPhase.DELETED
    wait_for(lambda: all(is_gone(pid) for pid in pids), timeout=5, what="the pod's processes to die")


def test_a_shorter_grace_on_a_second_delete_kills_sooner(
    backend: LocalProcessBackend, tmp_path: Path
) -> None:
    backend.start(worker(0, process_tree(tmp_path / "pids", ignore_sigterm=True)))
    read_pids(tmp_path / "pids")
    backend.delete(WORKER, 0, grace_seconds=30)
    backend.delete(WORKER, 0, grace_seconds=0)
    event = terminal(collect(backend, "worker-0", timeout=5), "worker-0")
    assert (event.phase, event.exit_code) == (PodPhase.DELETED, 137)


def test_processes_left_behind_by_the_main_process_are_killed(
    backend: LocalProcessBackend, tmp_path: Path
) -> None:
    pid_file = tmp_path / "pids"
    backend.start(worker(0, process_tree(pid_file, then="sys.exit(0)")))
    event = terminal(collect(backend, "worker-0"), "worker-0")
    assert event.phase is PodPhase.SUCCEEDED
    _, grandchild = read_pids(pid_file)
    wait_for(lambda: is_gone(grandchild), timeout=5, what="the grandchild to die")


def test_a_pod_is_relaunched_only_after_its_terminal_event_was_taken(backend: LocalProcessBackend) -> None:
    backend.start(worker(0, "import time; time.sleep(60)"))
    with pytest.raises(PodExistsError):
        backend.start(worker(0, "pass"))
    backend.kill(WORKER, 0)
    wait_for(lambda: backend.list_pods() == [PodStatus(WORKER, 0, PodPhase.FAILED)], what="the exit")
    with pytest.raises(PodExistsError):  # exited, but the master has not seen it yet
        backend.start(worker(0, "pass"))
    assert terminal(collect(backend, "worker-0"), "worker-0").reason == PodReason.KILLED
    backend.start(worker(0, "pass"))
    assert [e.phase for e in collect(backend, "worker-0")] == [PodPhase.RUNNING, PodPhase.SUCCEEDED]


def test_exactly_one_terminal_event_per_pod(backend: LocalProcessBackend) -> None:
    fates = {
        0: "pass",
        1: "import sys; sys.exit(1)",
        2: "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
        3: "import time; time.sleep(60)",  # deleted
        4: "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)",
    }
    for pod_id, code in fates.items():
        backend.start(worker(pod_id, code))
    backend.start(PodSpec(WORKER, 5, ("/nonexistent",)))
    events = wait_running(backend, "worker-3")
    backend.delete(WORKER, 3, grace_seconds=0)
    names = [f"worker-{i}" for i in range(6)]
    done = {e.name for e in events if e.phase.is_terminal}
    events += collect(backend, *(name for name in names if name not in done))
    events += backend.events(timeout=0.3)
    assert Counter(e.name for e in events if e.phase.is_terminal) == Counter(names)
    for name in names:
        phases = [e.phase for e in events if e.name == name]
        assert phases[-1].is_terminal and not any(p.is_terminal for p in phases[:-1]), (name, phases)
        assert phases.count(PodPhase.RUNNING) <= 1
    outcomes = {e.name: (e.phase, e.reason) for e in events if e.phase.is_terminal}
    assert outcomes == {
        "worker-0": (PodPhase.SUCCEEDED, PodReason.COMPLETED),
        "worker-1": (PodPhase.FAILED, PodReason.ERROR),
        "worker-2": (PodPhase.FAILED, PodReason.KILLED),
        "worker-3": (PodPhase.DELETED, PodReason.DELETED),
        "worker-4": (PodPhase.FAILED, PodReason.ERROR),
        "worker-5": (PodPhase.FAILED, PodReason.ERROR),
    }
    assert "SIGSEGV" in terminal(events, "worker-4").message
    assert terminal(events, "worker-4").exit_code == 128 + signal.SIGSEGV


def test_events_waits_at_most_the_timeout(backend: LocalProcessBackend) -> None:
    started = time.monotonic()
    assert backend.events(timeout=0.2) == []
    assert 0.15 <= time.monotonic() - started < 2
    assert backend.events(timeout=0) == []


def test_close_wakes_a_consumer_waiting_for_events(sink: io.StringIO) -> None:
    backend = LocalProcessBackend("test-job", log_sink=sink)
    taken: list[list[PodEvent]] = []
    consumer = threading.Thread(target=lambda: taken.append(backend.events(timeout=None)))
    consumer.start()
    time.sleep(0.05)
    backend.close()
    consumer.join(timeout=5)
    assert not consumer.is_alive()
    assert taken == [[]]


# -- what a pod sees and says ------------------------------------------------------------------------


def test_environment_and_program_lookup(
    backend: LocalProcessBackend, sink: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EDL_TEST_INHERITED", "from the master")
    monkeypatch.setenv("EDL_TEST_OVERRIDDEN", "master value")
    names = ["EDL_TEST_INHERITED", "EDL_TEST_OVERRIDDEN", "EDL_POD_NAME", "EDL_POD_ROLE", "EDL_POD_ID"]
    names.append("EDL_JOB_NAME")
    code = f"import json, os, sys; print(json.dumps([sys.executable, {{n: os.getenv(n) for n in {names}}}]))"
    # A bare program name resolves next to sys.executable, like `edl-argo` in real pod commands.
    backend.start(PodSpec(WORKER, 7, ("python", "-c", code), env={"EDL_TEST_OVERRIDDEN": "spec value"}))
    collect(backend, "worker-7")
    line = sink.getvalue().splitlines()[0]
    assert line.startswith("[worker-7] ")
    executable, env = json.loads(line.removeprefix("[worker-7] "))
    assert Path(executable).parent == Path(sys.executable).parent
    assert env == {
        "EDL_TEST_INHERITED": "from the master",
        "EDL_TEST_OVERRIDDEN": "spec value",
        "EDL_POD_NAME": "worker-7",
        "EDL_POD_ROLE": "worker",
        "EDL_POD_ID": "7",
        "EDL_JOB_NAME": "test-job",
    }


def test_logs_are_prefixed_per_pod_and_lines_stay_whole(
    backend: LocalProcessBackend, sink: io.StringIO
) -> None:
    lines = 300
    code = f"""
        import os, sys
        name = os.environ["EDL_POD_NAME"]
        for i in range({lines}):
            stream, tag = (sys.stdout, "out") if i % 3 else (sys.stderr, "err")
            stream.write(f"{{name}} {{tag}} {{i:04d}} " + "x" * 300 + "\\n")
        sys.stdout.write("no newline at the end")
    """
    for pod_id in (0, 1):
        backend.start(worker(pod_id, code))
    collect(backend, "worker-0", "worker-1")  # every line is out before the terminal event

    pattern = re.compile(r"\[(worker-\d)\] (?:(worker-\d) (out|err) (\d{4}) x{300}|no newline at the end)")
    seen: dict[tuple[str, str], list[int]] = {}
    for line in sink.getvalue().splitlines():
        match = pattern.fullmatch(line)
        assert match, f"mangled line: {line[:80]!r}..."
        pod, name, stream, index = match.groups()
        if name is not None:
            assert name == pod
            seen.setdefault((pod, stream), []).append(int(index))
    for pod in ("worker-0", "worker-1"):
        outs = [i for i in range(lines) if i % 3]
        assert seen[(pod, "out")] == outs  # complete and in order, per stream
        assert seen[(pod, "err")] == [i for i in range(lines) if not i % 3]
        assert f"[{pod}] no newline at the end" in sink.getvalue().splitlines()


# -- PS addresses, pause/resume, close --------------------------------------------------------------


def test_ps_address_is_stable_across_relaunches(backend: LocalProcessBackend) -> None:
    port = find_free_port()
    spec = PodSpec(PS, 0, py("import time; time.sleep(60)"), port=port)
    with pytest.raises(KeyError):
        backend.address(PS, 0)
    backend.start(spec)
    assert backend.address(PS, 0) == f"127.0.0.1:{port}"
    backend.delete(PS, 0, grace_seconds=0)
    collect(backend, "ps-0")
    assert backend.address(PS, 0) == f"127.0.0.1:{port}"
    with pytest.raises(ValueError, match="address must not change"):
        backend.start(PodSpec(PS, 0, spec.command, port=find_free_port()))
    backend.start(spec)
    assert backend.address(PS, 0) == f"127.0.0.1:{port}"
    assert backend.list_pods() == [PodStatus(PS, 0, PodPhase.RUNNING)]
    backend.start(worker(0, "import time; time.sleep(60)"))
    with pytest.raises(ValueError, match="does not listen"):
        backend.address(WORKER, 0)


def test_pause_and_resume(backend: LocalProcessBackend, tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    backend.start(worker(0, process_tree(pid_file, then="while True: time.sleep(0.01)")))
    pids = read_pids(pid_file)
    backend.pause(WORKER, 0)
    wait_for(lambda: all(process_state(pid) == "T" for pid in pids), what="the pod to stop")
    backend.resume(WORKER, 0)
    wait_for(lambda: all(process_state(pid) in ("R", "S") for pid in pids), what="the pod to continue")
    backend.pause(WORKER, 0)
    wait_for(lambda: process_state(pids[0]) == "T", what="the pod to stop")
    backend.delete(WORKER, 0, grace_seconds=30)  # a paused pod still gets its SIGTERM at once
    event = terminal(collect(backend, "worker-0", timeout=5), "worker-0")
    assert (event.phase, event.exit_code) == (PodPhase.DELETED, 143)
    with pytest.raises(KeyError):
        backend.pause(WORKER, 0)


def test_close_leaves_no_processes(sink: io.StringIO, tmp_path: Path) -> None:
    others = set(live_children())  # e.g. test servers that session fixtures started
    backend = LocalProcessBackend("test-job", log_sink=sink)
    backend.start(worker(0, process_tree(tmp_path / "w0", ignore_sigterm=True)))
    backend.start(worker(1, process_tree(tmp_path / "w1")))
    backend.start(PodSpec(PS, 0, py(process_tree(tmp_path / "ps0")), port=find_free_port()))
    pids = [pid for name in ("w0", "w1", "ps0") for pid in read_pids(tmp_path / name)]
    backend.pause(WORKER, 1)

    backend.close(grace_seconds=0.5)

    wait_for(lambda: all(is_gone(pid) for pid in pids), timeout=2, what="every process to die")
    assert set(live_children()) - others == set()
    events = backend.events(timeout=None)  # no waiting after close: the queued events, then []
    assert Counter(e.name for e in events if e.phase is PodPhase.DELETED) == Counter(
        ["worker-0", "worker-1", "ps-0"]
    )
    assert backend.events(timeout=None) == []
    assert backend.list_pods() == []
    with pytest.raises(BackendClosedError):
        backend.start(worker(2, "pass"))
    backend.close()  # idempotent


# -- adoption by the backend of a restarted master ---------------------------------------------------


def start_pods_in_a_doomed_master(pods_dir: Path, specs: list[PodSpec]) -> subprocess.Popen[str]:
    """A process that starts ``specs`` with its own backend, says ``ready`` and sleeps: a master to kill."""
    pods = json.dumps([[s.role.value, s.pod_id, list(s.command), s.port] for s in specs])
    code = f"""
        import json, os, sys, time
        from pathlib import Path
        from edl_argo.pods import LocalProcessBackend, PodSpec, PodRole
        sink, folder = open(os.devnull, "w"), Path({str(pods_dir)!r})
        backend = LocalProcessBackend("adopt-job", log_sink=sink, pods_dir=folder)
        for role, pod_id, command, port in json.loads({pods!r}):
            backend.start(PodSpec(PodRole(role), pod_id, tuple(command), port=port))
        print("ready", flush=True)
        time.sleep(120)
    """
    master = subprocess.Popen(py(code), stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1])
    assert master.stdout is not None and master.stdout.readline() == "ready\n"
    return master


def test_a_new_backend_adopts_the_pods_of_a_master_that_died(sink: io.StringIO, tmp_path: Path) -> None:
    pods_dir, port = tmp_path / "pods", find_free_port()
    go, go_early = tmp_path / "go", tmp_path / "go-early"
    wait_then = (
        "import os, sys, time\nwhile not os.path.exists({!r}) and time.time() < %r:\n time.sleep(0.02)\n"
    )
    wait_then %= time.time() + 50  # every pod ends by itself at the latest then, even if the test fails
    doomed = start_pods_in_a_doomed_master(
        pods_dir,
        [
            worker(
                0,
                "import sys; print('before the crash', file=sys.stderr, flush=True)\n"
                + wait_then.format(str(go))
                + "print('after', file=sys.stderr); sys.exit(3)",
            ),
            worker(1, "import time; time.sleep(60)"),  # killed
            worker(2, "import time; time.sleep(60)"),  # deleted
            worker(3, wait_then.format(str(go_early))),  # ends while no master watches
            PodSpec(PS, 0, py(wait_then.format(str(go)) + "print('ps done')"), port=port),
        ],
    )
    try:
        wait_for(lambda: len(list(pods_dir.glob("*/supervisor"))) == 5, what="every supervisor to start")
        wait_for(  # on a loaded machine the pod's interpreter can start well after its supervisor
            lambda: any(b"before the crash" in f.read_bytes() for f in pods_dir.glob("worker-0.*/stderr")),
            what="worker-0 to write its line before the crash",
        )
    finally:
        doomed.kill()
        doomed.wait()
    go_early.touch()
    wait_for(lambda: len(list(pods_dir.glob("worker-3.*/exit"))) == 1, what="worker-3 to end")

    with LocalProcessBackend("adopt-job", log_sink=sink, pods_dir=pods_dir) as backend:
        check_adoption(backend, sink, pods_dir, port, go)
    assert not pods_dir.exists()


def check_adoption(
    backend: LocalProcessBackend, sink: io.StringIO, pods_dir: Path, port: int, go: Path
) -> None:
    """What the backend that adopted the pods of the test above sees and does."""
    adopted = backend.adopt()
    assert adopted == [PodStatus(PS, 0, PodPhase.RUNNING)] + [
        PodStatus(WORKER, i, PodPhase.RUNNING) for i in (0, 1, 2)
    ]
    assert backend.list_pods() == adopted
    assert backend.address(PS, 0) == f"127.0.0.1:{port}"
    assert not list(pods_dir.glob("worker-3.*")), "the folder of a pod that ended is removed"
    assert backend.adopt() == []  # nothing new
    with pytest.raises(PodExistsError):
        backend.start(worker(1, "pass"))

    backend.kill(WORKER, 1)
    backend.delete(WORKER, 2, grace_seconds=5)
    go.touch()
    events = collect(backend, "worker-0", "worker-1", "worker-2", "ps-0")
    outcomes = {e.name: (e.phase, e.reason, e.exit_code) for e in events if e.phase.is_terminal}
    assert outcomes == {
        "worker-0": (PodPhase.FAILED, PodReason.ERROR, 3),
        "worker-1": (PodPhase.FAILED, PodReason.KILLED, 137),
        "worker-2": (PodPhase.DELETED, PodReason.DELETED, 143),
        "ps-0": (PodPhase.SUCCEEDED, PodReason.COMPLETED, 0),
    }
    assert terminal(events, "worker-0").message.endswith("before the crash\nafter")
    logged = sink.getvalue().splitlines()
    assert "[worker-0] after" in logged and "[ps-0] ps done" in logged
    assert "[worker-0] before the crash" not in logged  # written before the adoption: left in its file
