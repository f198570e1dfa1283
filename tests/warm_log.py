"""What the warm server of a run dir logs (test code): the suite's own, one per test process
(``tests/conftest.py``), and those the pipeline tests start."""

from __future__ import annotations

import re
import time

from edl_argo.pods.warm import socket_path


class WarmLog:
    """What the warm server of the run dir in force (``EDL_RUN_DIR``) logs from now on (one log per
    installation)."""

    def __init__(self) -> None:
        self.path = socket_path().with_suffix(".log")
        self.start = self.path.stat().st_size if self.path.exists() else 0

    def text(self) -> str:
        if not self.path.exists():
            return ""
        with self.path.open(errors="replace") as file:
            file.seek(self.start)
            return file.read()

    def commands(self) -> list[str]:
        return re.findall(r"warm_command_started command=(\S+)", self.text())

    def wait_for(self, event: str, seconds: float = 30.0) -> None:
        deadline = time.monotonic() + seconds
        while event not in self.text():
            assert time.monotonic() < deadline, f"no {event} in {self.path} within {seconds} s: {self.text()}"
            time.sleep(0.2)

    def orphaned(self) -> list[str]:
        """The commands the server sent SIGTERM because their client died (``warm_command_orphaned``)."""
        return [line for line in self.text().splitlines() if "warm_command_orphaned" in line]
