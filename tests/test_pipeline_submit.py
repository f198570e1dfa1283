"""``edl-argo pipeline submit``: a pipeline reaches an Argo Server through Hera's ``WorkflowsService``.

The server is a loopback stand-in of the Argo Server's create-workflow endpoint
(``POST /api/v1/workflows/{namespace}``): it checks the bearer token, records the request and answers
with the workflow, named, as the real server does.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.manifests import ROOT, validate
from tests.test_cli import error_lines, run_cli

pytestmark = pytest.mark.filterwarnings("ignore:The `json` method is deprecated")  # in Hera's service

TOKEN = "v2:t0ken-for-the-test"
DIGITS = str(ROOT / "examples" / "pipelines" / "digits_pipeline.py")


class ArgoServerStandIn(ThreadingHTTPServer):
    """Accepts ``POST /api/v1/workflows/<namespace>`` with the right token; keeps what it was sent."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[dict[str, Any]] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: ArgoServerStandIn

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(
            {"path": self.path, "authorization": self.headers["Authorization"], "body": body}
        )
        if self.headers["Authorization"] != f"Bearer {TOKEN}":
            return self._reply(401, {"code": 16, "message": "token not valid"})
        if not self.path.startswith("/api/v1/workflows/"):
            return self._reply(404, {"code": 5, "message": "not found"})
        workflow = body["workflow"]
        workflow["metadata"] = {
            **workflow["metadata"],
            "name": workflow["metadata"]["generateName"] + "x7k2p",
        }
        return self._reply(200, workflow)

    def _reply(self, status: int, document: dict[str, Any]) -> None:
        data = json.dumps(document).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def argo_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[ArgoServerStandIn]:
    server = ArgoServerStandIn()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("ARGO_SERVER", server.address)
    monkeypatch.setenv("ARGO_SECURE", "false")
    monkeypatch.setenv("ARGO_NAMESPACE", "ml")
    yield server
    server.shutdown()
    server.server_close()


def test_submit_creates_a_valid_workflow(capsys, monkeypatch, argo_server: ArgoServerStandIn) -> None:
    monkeypatch.setenv("ARGO_TOKEN", TOKEN)
    code, out, err = run_cli(capsys, "pipeline", "submit", DIGITS, "-p", "data=s3://datasets/digits")

    assert code == 0, err
    assert out.strip() == f"submitted workflow digits-x7k2p to http://{argo_server.address}"
    (request,) = argo_server.requests
    assert request["path"] == "/api/v1/workflows/ml" and request["authorization"] == f"Bearer {TOKEN}"
    manifest = request["body"]["workflow"]
    validate(manifest)
    parameters = {p["name"]: p["value"] for p in manifest["spec"]["arguments"]["parameters"]}
    assert parameters["data"] == "s3://datasets/digits"
    assert TOKEN not in out + err


def test_a_refused_submission_is_one_line_without_the_token(capsys, monkeypatch, argo_server) -> None:
    monkeypatch.setenv("ARGO_TOKEN", "v2:wrong-token")
    code, out, err = run_cli(capsys, "pipeline", "submit", DIGITS)

    assert code == 1
    (line,) = error_lines(err)
    assert (
        f"Argo Server at http://{argo_server.address} refused the workflow" in line
        and "token not valid" in line
    )
    assert "wrong-token" not in out + err
