"""TEST-ONLY: a local S3-compatible server for edl-argo's tests. Never use it for real data.

:class:`S3StandIn` runs ``tests/s3server/server.js`` -- s3rver 3.7.1 (a file-backed fake S3) behind a
front door that checks AWS Signature V4 and can inject failures -- as a ``node`` subprocess on 127.0.0.1.
Objects live in a temporary folder that survives :meth:`S3StandIn.stop` / :meth:`S3StandIn.start`, so a
test can take the server down mid-job and bring it back on the same port with the same data.

Install its dependencies once with ``npm ci --prefix tests/s3server`` (``make test-servers``).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

from minio import Minio

SERVER_DIR = Path(__file__).resolve().parent / "s3server"
_LISTENING = re.compile(r"S3_STANDIN_LISTENING [\d.]+:(\d+)")


class S3StandIn:
    """One stand-in server with its own random credentials and data folder.

    Use as a context manager, or call :meth:`start` and finally :meth:`close`.
    """

    def __init__(self, *, host: str = "127.0.0.1", startup_timeout: float = 20.0) -> None:
        if not (SERVER_DIR / "node_modules" / "s3rver").is_dir():
            raise RuntimeError(f"{SERVER_DIR / 'node_modules'} is missing: run `make test-servers`")
        node = shutil.which("node")
        if node is None:
            raise RuntimeError("the S3 stand-in needs `node` (Node.js >= 18) on PATH")
        self._node = node
        self.host = host
        self.port = 0  # chosen by the first start, kept for restarts
        self.access_key = "EDLTEST" + secrets.token_hex(6).upper()
        self.secret_key = secrets.token_urlsafe(24)
        self.region = "us-east-1"
        self._startup_timeout = startup_timeout
        self._workdir = Path(tempfile.mkdtemp(prefix="edl-s3-stand-in-"))
        self.data_dir = self._workdir / "data"
        self.data_dir.mkdir()
        self.log_path = self._workdir / "server.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:<port>`` (the value for ``EDL_S3_ENDPOINT``)."""
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def env(self) -> dict[str, str]:
        """The environment variables that point :class:`~edl_argo.storage.s3.S3Storage` at this server."""
        return {
            "EDL_S3_ENDPOINT": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
        }

    def client(self) -> Minio:
        """A plain minio client for test setup (no edl-argo code involved)."""
        return Minio(
            f"{self.host}:{self.port}",
            access_key=self.access_key,
            secret_key=self.secret_key,
            secure=False,
            region=self.region,
        )

    def create_bucket(self, name: str) -> None:
        self.client().make_bucket(name)

    def put_object(self, bucket: str, name: str, data: bytes) -> None:
        """Store an object directly, bypassing edl-argo (for fixtures)."""
        self.client().put_object(bucket, name, io.BytesIO(data), len(data))

    def inject_errors(self, count: int, *, status: int = 503, code: str = "SlowDown") -> None:
        """Make the next ``count`` S3 requests fail with ``status`` and S3 error ``code``."""
        self._control(f"inject?count={count}&status={status}&code={code}")

    @contextlib.contextmanager
    def slow_disk(self, delay: float) -> Iterator[None]:
        """Within the block, every write of object data to the server's folder waits ``delay`` s first."""
        self._control(f"slow-disk?ms={round(delay * 1000)}")
        try:
            yield
        finally:
            self._control("slow-disk?ms=0")

    def _control(self, query: str) -> None:
        request = urllib.request.Request(f"{self.endpoint}/_standin/{query}", method="POST")
        with urllib.request.urlopen(request, timeout=5):
            pass

    def start(self) -> None:
        """Start the server (on the port of the previous start, if any) and wait until it answers."""
        if self.running:
            return
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        env = {
            **os.environ,
            "S3_STANDIN_ACCESS_KEY": self.access_key,
            "S3_STANDIN_SECRET_KEY": self.secret_key,
        }
        args = [self._node, str(SERVER_DIR / "server.js"), "--directory", str(self.data_dir)]
        args += ["--address", self.host, "--port", str(self.port), "--parent-pid", str(os.getpid())]
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )
        deadline = time.monotonic() + self._startup_timeout
        while True:
            match = _LISTENING.search(self.log_path.read_bytes()[offset:].decode(errors="replace"))
            if match:
                self.port = int(match.group(1))
                break
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"S3 stand-in did not start; its log says:\n{self._log_tail(offset)}")
            time.sleep(0.02)
        self._wait_answering(deadline)

    def _wait_answering(self, deadline: float) -> None:
        while True:
            try:
                urllib.request.urlopen(self.endpoint + "/", timeout=1).close()
                return
            except urllib.error.HTTPError:
                return  # 403 for an unsigned request: it answers
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def stop(self) -> None:
        """Stop the server (the data folder is kept). Connections in flight are cut."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def close(self) -> None:
        """Stop the server and delete its data."""
        self.stop()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def _log_tail(self, offset: int) -> str:
        return self.log_path.read_bytes()[offset:][-4000:].decode(errors="replace")

    def __enter__(self) -> S3StandIn:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
