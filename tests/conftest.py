"""Shared fixtures. Servers are started once per session; per-test state lives in fresh buckets/folders."""

from __future__ import annotations

import importlib
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from s3_stand_in import SERVER_DIR, S3StandIn

from edl_argo.cli import native_min_log_level
from edl_argo.pods.warm import ScopedServer
from edl_argo.storage import LocalStorage
from tests.engine_helpers import JobThread, write_digits_dataset
from tests.warm_log import WarmLog

# The native log level every command gives itself (edl_argo.cli.quiet_native_logs), set once for the whole
# session: the first command a test runs in this process would set it midway, so that the processes the
# suite starts before it (a warm server, a pod template) and after it would differ in an import-time
# variable, and the server or template would decline what comes after (edl_argo.pods.prefork).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", native_min_log_level(None, os.environ))
# For the same reason, scikit-learn (the digits fixtures' source) is imported before anything starts: its
# import sets KMP_DUPLICATE_LIB_OK and KMP_INIT_AT_FORK here, and every pod and command of a job started after
# a test first used it would otherwise be declined by the server and the template, and start with exec.
importlib.import_module("sklearn")

# Run from a shell script's background job, pytest starts with SIGINT ignored, and so would every pod and
# command the tests start (an ignored signal stays ignored in what a process starts): the tests that
# interrupt them need Python's own handler. (test_pods_prefork checks the ignored case on purpose.)
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def jobs_end_with_their_test() -> Iterator[None]:
    """A job a test started in a thread and did not see to the end (the test failed first) is stopped with
    the test, so that its pods neither load the machine nor get adopted by the next job of its name."""
    yield
    JobThread.stop_all()


@pytest.fixture(scope="session", autouse=True)
def private_run_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Local masters' registry entries and pod files in this session's own folder (``EDL_RUN_DIR``).

    The default run dir is per user, so two suites running at once (or a suite beside a real job) would
    adopt or delete each other's pods when they use the same job name.
    """
    run_dir = tmp_path_factory.mktemp("run")
    previous = os.environ.get("EDL_RUN_DIR")
    os.environ["EDL_RUN_DIR"] = str(run_dir)
    yield run_dir
    if previous is None:
        os.environ.pop("EDL_RUN_DIR", None)
    else:
        os.environ["EDL_RUN_DIR"] = previous


@pytest.fixture(scope="session", autouse=True)
def warm_server_of_the_session(private_run_dir: Path) -> Iterator[None]:
    """A warm server (``edl-argo warm``, :mod:`edl_argo.pods.warm`) for this session's run dir: the pipelines
    the tests run use it instead of starting one each, and the ``edl-argo train``, ``evaluate``,
    ``predict`` and ``sql`` programs they start and the pods of the jobs this process runs are forked from
    it instead of importing TensorFlow (``docs/profile.md``, session 38). What runs in a server behaves as
    it does cold (tests/test_warm_server.py), but for what a signal sent to the program's own process does:
    a SIGKILL or SIGSTOP reaches the client, not the command. A test that sends one runs its program cold
    (``EDL_WARM=0``, or a run dir of its own); :func:`no_warm_command_orphaned` holds every test to it."""
    with ScopedServer.around(wanted=True) as server:
        server.wait_until_ready()
        yield


@pytest.fixture(autouse=True)
def no_warm_command_orphaned(warm_server_of_the_session: None) -> Iterator[None]:
    """Fails a test during which a program whose command ran in the session's warm server was killed: the
    command was then sent SIGTERM by the server, and did not undergo what the test meant to do to it. (The
    server logs it as it notices, at once: a program killed as the previous test of this process ended may
    be counted here.)"""
    warm = WarmLog()
    yield
    orphaned = warm.orphaned()
    if orphaned:
        pytest.fail(
            f"a program running in the suite's warm server was killed ({orphaned[0]}), by this test or the "
            "previous one of this process: a test that kills a program runs it with EDL_WARM=0",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def digits_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """scikit-learn's digits as ``train/`` (4 snappy shards) and ``test/`` (2 gzip shards), made once."""
    root = tmp_path_factory.mktemp("digits")
    write_digits_dataset(LocalStorage(root))
    return root


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3StandIn]:
    """The test-only S3 server (s3rver behind a SigV4 check), shared by the whole session."""
    if not (SERVER_DIR / "node_modules").is_dir():
        pytest.fail(f"{SERVER_DIR / 'node_modules'} is missing: run `make test-servers`", pytrace=False)
    with S3StandIn() as server:
        yield server


@pytest.fixture
def s3_env(s3_server: S3StandIn, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Point S3Storage at the stand-in (environment variables) and yield ``s3://<fresh bucket>/prefix``."""
    s3_server.start()  # in case an earlier test stopped it
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    bucket = f"test-{uuid.uuid4().hex[:16]}"
    s3_server.create_bucket(bucket)
    yield f"s3://{bucket}/prefix"
