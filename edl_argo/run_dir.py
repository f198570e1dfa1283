"""The run dir of this machine: where local jobs keep their files.

``$EDL_RUN_DIR``, or ``edl-argo-<uid>`` in the system's temporary folder. Local masters register under
``<run dir>/jobs`` (:mod:`edl_argo.master.registry`); the local pod backend keeps its pods' files under
``<run dir>/pods`` (:mod:`edl_argo.pods.local`); a warm server listens under ``<run dir>/warm``
(:mod:`edl_argo.pods.warm`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def run_dir() -> Path:
    """The run dir, read from the environment on every call (tests point it at their own folder)."""
    default = Path(tempfile.gettempdir()) / f"edl-argo-{os.getuid()}"
    return Path(os.environ.get("EDL_RUN_DIR") or default)


def warm_dir() -> Path:
    """Where warm servers listen (:mod:`edl_argo.pods.warm`)."""
    return run_dir() / "warm"
