"""``edl-argo warm``: commands and their pods forked from a server that has imported TensorFlow
(``edl_argo.pods.warm``, ``edl_argo.pods.warm_server``, ``edl_argo.zygote.main_warm``).

A command run warm must be what it is cold: the same output on the caller's descriptors, exit status and
one-line errors; signals to the caller reach it; a caller that dies takes it down. Each server imports
TensorFlow (seconds), so one serves the module; the tests that stop a server start one of their own. Every
server runs under a run dir of its own (``EDL_RUN_DIR``), which no other test's commands use.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from edl_argo.pods.prefork import connect_template, receive_message
from edl_argo.storage.local import LocalStorage
from tests.bench.pod_start import train_command
from tests.engine_helpers import write_digits_dataset

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Unix sockets with SO_PEERCRED"),
]

PROGRAM = str(Path(sys.executable).parent / "edl-argo")
#: Every bounded wait of these tests.
WAIT_SECONDS = 60.0


class Server:
    """A warm server under a run dir of its own, and how to run commands beside it."""

    def __init__(self, idle_minutes: float = 5.0) -> None:
        # A short folder: a Unix socket's path has at most 107 bytes.
        self.run_dir = Path(tempfile.mkdtemp(prefix="edlw", dir="/tmp"))
        self.env = dict(os.environ, EDL_RUN_DIR=str(self.run_dir), EDL_NO_PROGRESS_BAR="1", EDL_WARM="1")
        started = self.run("warm", "--idle-minutes", str(idle_minutes))
        assert started.returncode == 0, started.stderr
        found = re.search(r"ready \(pid (\d+), (\S+?)\)", started.stdout)
        assert found, started.stdout
        self.pid, self.socket = int(found[1]), Path(found[2])

    def run(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        """``edl-argo ARGS`` (with ``env`` added to the environment), to its end."""
        return subprocess.run(
            [PROGRAM, *args],
            env={**self.env, **env},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=WAIT_SECONDS * 3,
        )

    def log(self) -> str:
        return self.socket.with_suffix(".log").read_text()

    def commands(self) -> dict[int, str]:
        """The pid and command of each command the server forked, from its log."""
        return {
            int(pid): command
            for command, pid in re.findall(r"warm_command_started command=(\S+) pid=(\d+)", self.log())
        }

    def exit_code(self, pid: int) -> int | None:
        found = re.search(rf"warm_command_ended pid={pid} exit_code=(-?\d+)", self.log())
        return int(found[1]) if found else None

    def stop(self) -> None:
        stopped = self.run("warm", "--stop")
        assert stopped.returncode == 0 and f"(pid {self.pid})" in stopped.stdout, stopped
        wait_for(lambda: not alive(self.pid), f"the warm server (pid {self.pid}) to exit")


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_for(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + WAIT_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"waited {WAIT_SECONDS:g} s for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    started = Server()
    yield started
    started.stop()


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("digits")
    write_digits_dataset(LocalStorage(root))
    return root


def test_a_job_runs_in_the_server_and_its_pods_fork_from_it(
    server: Server, digits: Path, tmp_path: Path
) -> None:
    before = set(server.commands())
    done = server.run(*train_command(digits, tmp_path / "out", "warm-job")[1:])
    assert done.returncode == 0, done.stderr[-3000:]
    accuracy = re.search(r"job warm-job succeeded: model at \S+ accuracy=([\d.]+)", done.stdout)
    assert accuracy and float(accuracy[1]) > 0.9, done.stdout
    assert list((tmp_path / "out" / "model").glob("v-*/saved_model/saved_model.pb"))
    (master,) = set(server.commands()) - before
    assert server.commands()[master] == "train" and server.exit_code(master) == 0
    # The job's pod template is the server (not a template of its own), and every pod was forked.
    assert re.search(rf"pod_template_ready job=warm-job pid={server.pid} ", done.stderr), done.stderr[-3000:]
    started = re.findall(r"pod_started job=warm-job pod=(\S+) pid=\d+ forked=(\w+)", done.stderr)
    assert sorted(started) == [("ps-0", "True"), ("worker-0", "True"), ("worker-1", "True")]


def test_a_failing_command_says_what_it_says_cold(server: Server, tmp_path: Path) -> None:
    args = ("train", "--model-def", str(tmp_path / "missing.py"), "--training-data", str(tmp_path))
    args += ("--output", str(tmp_path / "out"))
    before = set(server.commands())
    warm = server.run(*args)
    cold = server.run(*args, EDL_WARM="0")
    assert len(set(server.commands()) - before) == 1  # the first ran in the server, the second did not
    assert warm.returncode == cold.returncode != 0
    # Cold, the job's pod template (importing in the background) may say it is ready before the error.
    cold_lines = [line for line in cold.stderr.splitlines() if "pod_template_ready" not in line]
    assert warm.stderr.splitlines() == cold_lines and len(cold_lines) == 1, (warm.stderr, cold.stderr)
    assert "missing.py" in warm.stderr


@pytest.mark.parametrize("command", ["predict", "sql"])
def test_python_m_runs_in_the_server_as_the_program(server: Server, command: str) -> None:
    """``python -m edl_argo.cli`` (how ``edl-argo pipeline run`` starts its steps) runs warm too, as the
    installation's program (``sys.argv[0]``, ``sys.path[0]``: not the package's own folder)."""
    before = set(server.commands())
    helped = subprocess.run(
        [sys.executable, "-m", "edl_argo.cli", command, "--help"],
        env=server.env,
        capture_output=True,
        text=True,
        timeout=WAIT_SECONDS,
    )
    assert helped.returncode == 0 and helped.stdout.startswith(f"usage: edl-argo {command}"), helped
    (pid,) = set(server.commands()) - before
    assert server.commands()[pid] == command and server.exit_code(pid) == 0


def command_record(server: Server, **changes: object) -> dict[str, object]:
    """A request the server runs (``edl-argo evaluate --help`` in its own environment), with ``changes``."""
    return {"run": [PROGRAM, "evaluate", "--help"], "env": server.env, "cwd": "/", "umask": 0o22, **changes}


def pod_record(server: Server, **changes: object) -> dict[str, object]:
    return {"argv": [PROGRAM, "worker", "--help"], "env": server.env, "cwd": "/", "folder": "/", **changes}


#: Each request, as bytes or as a record, with how many descriptors it carries. A record differs from
#: one the server runs (:func:`command_record`, checked below) in the one field its name says.
BAD_REQUESTS: dict[str, tuple[Callable[[Server], bytes | dict[str, object]], int]] = {
    "not JSON": (lambda _: b"\xff not json", 0),
    "not an object": (lambda _: b"[1, 2]", 3),
    "argv not a list": (lambda server: command_record(server, run="evaluate"), 3),
    "a number in env": (lambda server: command_record(server, env={**server.env, "EDL_NUMBER": 1}), 3),
    "umask out of range": (lambda server: command_record(server, umask=99999), 3),
    "sigint_ignored not a boolean": (lambda server: command_record(server, sigint_ignored="no"), 3),
    "no descriptors": (command_record, 0),
    "a check of nothing": (lambda _: {"check": True, "run": 5}, 0),
    "a pod without argv": (lambda server: {k: v for k, v in pod_record(server).items() if k != "argv"}, 1),
    "a pod with env a list": (lambda server: pod_record(server, env=[]), 1),
}


def send_request(server: Server, request: bytes | dict[str, object], descriptors: int) -> dict[str, object]:
    """The server's answer to ``request`` sent with ``descriptors`` descriptors (of /dev/null); for a
    command it runs, with its ``exit`` status (the connection stays open until it ends)."""
    message = request if isinstance(request, bytes) else json.dumps(request).encode()
    channel, pid = connect_template(server.socket, WAIT_SECONDS)
    with channel:
        assert pid == server.pid
        sent = [os.open(os.devnull, os.O_RDWR) for _ in range(descriptors)]
        try:
            socket.send_fds(channel, [message], sent)
        finally:
            for descriptor in sent:
                os.close(descriptor)
        reply = json.loads(receive_message(channel, WAIT_SECONDS))
        if "pid" in reply:
            reply.update(json.loads(receive_message(channel, WAIT_SECONDS, what="the command's exit")))
        return reply


def test_the_request_the_bad_ones_differ_from_is_run(server: Server) -> None:
    reply = send_request(server, command_record(server), 3)
    assert sorted(reply) == ["exit", "pid"] and reply["exit"] == 0, reply


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_a_request_the_server_cannot_read_is_declined_and_it_serves_on(server: Server, name: str) -> None:
    make, descriptors = BAD_REQUESTS[name]
    reply = send_request(server, make(server), descriptors)
    assert list(reply) == ["exec"], reply
    before = set(server.commands())
    helped = server.run("evaluate", "--help")
    assert helped.returncode == 0 and len(set(server.commands()) - before) == 1


def test_another_import_time_environment_runs_cold(server: Server) -> None:
    before = set(server.commands())
    helped = server.run("evaluate", "--help", PYTHONHASHSEED="7")
    assert helped.returncode == 0 and "--model-def" in helped.stdout
    assert set(server.commands()) == before
    refused = server.run("warm", PYTHONHASHSEED="7")
    assert refused.returncode != 0 and len(refused.stderr.splitlines()) == 1
    assert "does not serve this environment" in refused.stderr and "PYTHONHASHSEED" in refused.stderr
    assert alive(server.pid)


def _start_job(server: Server, digits: Path, folder: Path, name: str) -> tuple[subprocess.Popen[bytes], int]:
    """A long job of the digits dataset started through the server, once all three pods started: the
    client and the command's pid."""
    command = train_command(digits, folder / "out", name)
    command[command.index("--num-epochs") + 1] = "1000"
    log = folder / "client.log"
    before = set(server.commands())
    with open(log, "wb") as out:
        client = subprocess.Popen(command, env=server.env, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    wait_for(lambda: log.read_text().count(f"pod_started job={name}") == 3, "the job's three pods")
    (pid,) = set(server.commands()) - before
    return client, pid


@pytest.mark.parametrize(
    ("number", "code", "last_line"),
    [(signal.SIGTERM, 128 + signal.SIGTERM, "terminated"), (signal.SIGINT, 130, "interrupted")],
    ids=["sigterm", "sigint"],
)
def test_a_signal_to_the_caller_stops_the_job(
    server: Server, digits: Path, tmp_path: Path, number: int, code: int, last_line: str
) -> None:
    client, master = _start_job(server, digits, tmp_path, "warm-signal")
    client.send_signal(number)
    assert client.wait(WAIT_SECONDS) == code
    text = (tmp_path / "client.log").read_text()
    assert text.rstrip().endswith(f"edl-argo train: {last_line}"), text[-2000:]
    assert len(re.findall(r"pod_exited job=warm-signal pod=\S+ phase=Deleted", text)) == 3
    assert server.exit_code(master) == code and not alive(master)


def test_a_dead_caller_takes_its_command_down(server: Server, digits: Path, tmp_path: Path) -> None:
    client, master = _start_job(server, digits, tmp_path, "warm-kill")
    client.kill()
    client.wait(WAIT_SECONDS)
    wait_for(lambda: server.exit_code(master) is not None, "the orphaned command to end")
    assert f"warm_command_orphaned pid={master} consequence=SIGTERM" in server.log()
    assert server.exit_code(master) == 128 + signal.SIGTERM
    text = (tmp_path / "client.log").read_text()
    assert len(re.findall(r"pod_exited job=warm-kill pod=\S+ phase=Deleted", text)) == 3, text[-2000:]


def test_a_server_stops_when_asked_or_idle() -> None:
    asked = Server()
    again = asked.run("warm")
    assert again.returncode == 0 and f"runs already (pid {asked.pid}" in again.stdout
    asked.stop()
    assert not asked.socket.exists()
    idle = Server(idle_minutes=0.05)
    wait_for(lambda: not alive(idle.pid), "the idle server to exit")
    assert not idle.socket.exists() and "warm_server_idle" in idle.log()
    # Without a server, a command runs as it does cold.
    helped = idle.run("evaluate", "--help")
    assert helped.returncode == 0 and "--model-def" in helped.stdout


def test_a_retired_server_takes_no_new_command_and_exits_once_its_commands_end(tmp_path: Path) -> None:
    """What a pipeline run asks of the server it started as it ends (``ScopedServer.retire``)."""
    retiring = Server()
    ready, go = tmp_path / "ready", tmp_path / "go"
    model = tmp_path / "waits.py"
    model.write_text(
        "import pathlib, time\n"
        f"pathlib.Path({str(ready)!r}).touch()\n"
        "deadline = time.monotonic() + 60\n"
        f"while not pathlib.Path({str(go)!r}).exists() and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "raise ValueError('the model file ends here')\n"
    )
    args = ["train", "--model-def", str(model), "--training-data", str(tmp_path)]
    args += ["--output", str(tmp_path / "o")]
    client = subprocess.Popen(
        [PROGRAM, *args], env=retiring.env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    wait_for(ready.exists, "the command to run")
    (command,) = retiring.commands()

    assert send_request(retiring, {"retire": True}, 0) == {"retiring": retiring.pid}
    assert not retiring.socket.exists() and alive(retiring.pid)  # no new command; the running one goes on
    assert retiring.run("evaluate", "--help").returncode == 0  # a new command runs cold
    assert list(retiring.commands()) == [command]
    go.touch()
    _, stderr = client.communicate(timeout=WAIT_SECONDS)
    # The command ended as it would have: its own error and status, not the server's end.
    assert "the model file ends here" in stderr and "warm server ended" not in stderr, stderr
    assert client.returncode == retiring.exit_code(command) not in (None, 0, 128 + signal.SIGTERM)
    wait_for(lambda: not alive(retiring.pid), "the retired server to exit")


def test_a_command_that_ignores_sigterm_is_killed_after_its_caller_died(
    server: Server, tmp_path: Path
) -> None:
    model = tmp_path / "stubborn.py"
    ready = tmp_path / "ignoring"
    model.write_text(
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"open({str(ready)!r}, 'w').close()\n"
        "time.sleep(600)\n"
    )
    args = [
        "train",
        "--model-def",
        str(model),
        "--training-data",
        str(tmp_path),
        "--output",
        str(tmp_path / "o"),
    ]
    before = set(server.commands())
    client = subprocess.Popen([PROGRAM, *args], env=server.env, stdin=subprocess.DEVNULL)
    wait_for(ready.exists, "the model file to ignore SIGTERM")
    (master,) = set(server.commands()) - before
    client.kill()
    client.wait(WAIT_SECONDS)
    wait_for(lambda: server.exit_code(master) is not None, "the command to be killed")
    assert server.exit_code(master) == 128 + signal.SIGKILL
    assert f"warm_command_killed pid={master}" in server.log()


def test_a_server_killed_under_a_command_ends_its_caller_and_the_command(
    digits: Path, tmp_path: Path
) -> None:
    doomed = Server()
    client, master = _start_job(doomed, digits, tmp_path, "warm-orphan")
    os.kill(doomed.pid, signal.SIGKILL)
    assert client.wait(WAIT_SECONDS) == 1
    wait_for(lambda: not alive(master), "the command to stop after its SIGTERM")
    text = (tmp_path / "client.log").read_text()
    assert f"edl-argo: error: the warm server ended while running the command (pid {master})" in text
    exited = re.compile(r"pod_exited job=warm-orphan pod=\S+ phase=Deleted")
    wait_for(lambda: len(exited.findall((tmp_path / "client.log").read_text())) == 3, "the job's pods to end")
    # A command after it runs cold (the socket is left behind, and refuses).
    helped = doomed.run("evaluate", "--help")
    assert helped.returncode == 0 and "--model-def" in helped.stdout


NOBODY = 65534
as_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root, to act as another user (uid 65534)")

#: A server of another user: greets, then prints every message it receives.
FAKE_SERVER = """
import json, os, socket, sys
listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
listener.bind(sys.argv[1])
listener.listen(4)
print("listening", flush=True)
while True:
    channel, _ = listener.accept()
    channel.send(json.dumps({"ready": os.getpid()}).encode())
    message = channel.recv(65536)
    print("received", len(message), flush=True)
"""


@as_root
def test_a_warm_folder_of_another_user_is_refused(tmp_path: Path) -> None:
    run_dir = Path(tempfile.mkdtemp(prefix="edlw", dir="/tmp"))
    (run_dir / "warm").mkdir()
    os.chown(run_dir / "warm", NOBODY, NOBODY)
    started = subprocess.run(
        [PROGRAM, "warm"],
        env=dict(os.environ, EDL_RUN_DIR=str(run_dir)),
        capture_output=True,
        text=True,
        timeout=WAIT_SECONDS,
    )
    assert started.returncode == 2 and len(started.stderr.splitlines()) == 1, started
    assert f"{run_dir / 'warm'} belongs to user {NOBODY}" in started.stderr
    assert not list((run_dir / "warm").iterdir())


#: An interpreter the other user may run (this test's own lies under root's home).
SYSTEM_PYTHON = "/usr/bin/python3"


@as_root
@pytest.mark.skipif(not os.path.exists(SYSTEM_PYTHON), reason=f"needs {SYSTEM_PYTHON} for the other user")
def test_a_command_does_not_talk_to_another_users_server(tmp_path: Path) -> None:
    run_dir = Path(tempfile.mkdtemp(prefix="edlw", dir="/tmp"))
    env = dict(os.environ, EDL_RUN_DIR=str(run_dir), EDL_WARM="1")
    path = subprocess.run(
        [sys.executable, "-c", "from edl_argo.pods.warm import socket_path; print(socket_path())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=WAIT_SECONDS,
    ).stdout.strip()
    Path(path).parent.mkdir(parents=True)
    os.chmod(run_dir, 0o711)  # for the other user to bind there
    os.chmod(Path(path).parent, 0o777)
    fake = subprocess.Popen(
        [SYSTEM_PYTHON, "-c", FAKE_SERVER, path],
        stdout=subprocess.PIPE,
        text=True,
        user=NOBODY,
    )
    try:
        assert fake.stdout is not None and fake.stdout.readline().strip() == "listening"
        helped = subprocess.run(
            [PROGRAM, "evaluate", "--help"], env=env, capture_output=True, text=True, timeout=WAIT_SECONDS
        )
        assert helped.returncode == 0 and "--model-def" in helped.stdout  # run here, cold
    finally:
        fake.kill()
        output, _ = fake.communicate(timeout=WAIT_SECONDS)
    assert "received" not in output  # neither the environment nor the descriptors went to it
