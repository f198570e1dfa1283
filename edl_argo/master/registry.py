"""Where a running job's master can be found on this machine, for ``edl-argo scale JOB``.

The master of a local job writes ``<run dir>/jobs/<job>.json`` (its gRPC address and pid) when it starts
and removes it when it ends. The run dir is ``$EDL_RUN_DIR``, or ``edl-argo-<uid>`` in the system's
temporary folder.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from edl_argo.errors import ConfigError


def run_dir() -> Path:
    default = Path(tempfile.gettempdir()) / f"edl-argo-{os.getuid()}"
    return Path(os.environ.get("EDL_RUN_DIR") or default)


def _entry(job_name: str) -> Path:
    return run_dir() / "jobs" / f"{job_name}.json"


def register_master(job_name: str, address: str) -> None:
    path = _entry(job_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps({"address": address, "pid": os.getpid()}))
    os.replace(temporary, path)


def unregister_master(job_name: str) -> None:
    _entry(job_name).unlink(missing_ok=True)


def master_address(job_name: str) -> str:
    path = _entry(job_name)
    try:
        return str(json.loads(path.read_text())["address"])
    except FileNotFoundError:
        raise ConfigError(f"no running job named {job_name!r} on this machine (looked for {path})") from None
    except (ValueError, KeyError):
        raise ConfigError(f"job registry entry {path} is unreadable; is the job still running?") from None
