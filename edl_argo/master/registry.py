"""Where a running job's master can be found on this machine, for ``edl-argo scale JOB``.

The master of a local job writes ``<run dir>/jobs/<job>.json`` (its gRPC address, pid and, readable by its
owner only, the job's secret, with which ``edl-argo scale`` authenticates, and the folder of its TLS files
if it serves TLS) when it starts and removes it when
it ends. The run dir: :func:`edl_argo.run_dir.run_dir`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from edl_argo.errors import ConfigError
from edl_argo.rpc.auth import JobSecret
from edl_argo.run_dir import run_dir


def _entry(job_name: str) -> Path:
    return run_dir() / "jobs" / f"{job_name}.json"


def register_master(
    job_name: str, address: str, secret: JobSecret | None = None, *, tls_dir: str = ""
) -> None:
    """Write the job's entry: its master's ``address``, ``secret`` and ``tls_dir`` (the folder of its TLS
    files, a path only: ``edl-argo scale`` reads the files itself)."""
    path = _entry(job_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    entry = {"address": address, "pid": os.getpid()} | ({"secret": secret.hex()} if secret else {})
    entry |= {"tls_dir": tls_dir} if tls_dir else {}
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(json.dumps(entry))
    os.replace(temporary, path)


def unregister_master(job_name: str) -> None:
    _entry(job_name).unlink(missing_ok=True)


def master_address(job_name: str) -> str:
    return str(_read_entry(job_name)["address"])


def master_tls_dir(job_name: str) -> str:
    """The ``--tls-dir`` of the job's local master; ``""``: it serves plaintext."""
    return str(_read_entry(job_name).get("tls_dir") or "")


def master_secret(job_name: str) -> JobSecret | None:
    """The secret of the job's local master, if its entry holds one."""
    text = _read_entry(job_name).get("secret")
    return JobSecret.from_hex(str(text), str(_entry(job_name))) if text else None


def _read_entry(job_name: str) -> dict[str, Any]:
    path = _entry(job_name)
    try:
        entry: dict[str, Any] = json.loads(path.read_text())
        if "address" not in entry:
            raise KeyError("address")
        return entry
    except FileNotFoundError:
        raise ConfigError(f"no running job named {job_name!r} on this machine (looked for {path})") from None
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"job registry entry {path} is unreadable; is the job still running?") from None
