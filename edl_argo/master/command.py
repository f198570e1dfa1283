"""``edl-argo train``: its flags and its run.

Apart from :mod:`edl_argo.master.job` so that the command line is parsed, and a local job's pod template
started (:func:`~edl_argo.master.pod_template.early_pod_template`), before the master's own modules are
imported: importing them takes 0.2-0.25 s, during which the template is now importing TensorFlow, the
longest wait before a local job's first step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from edl_argo.errors import ConfigError, JobFailedError
from edl_argo.log import get_logger
from edl_argo.master.config import add_train_flags, config_from_args
from edl_argo.master.pod_template import early_pod_template
from edl_argo.stop import stop_on_sigterm
from edl_argo.storage import LocalStorage, reached

log = get_logger(__name__)


def metrics_file(path: str) -> tuple[LocalStorage, str]:
    """Where ``--metrics-output PATH`` goes: (the storage of its folder, its name), checked now, before the
    job, so that a path the final metrics cannot be written to fails at once with one line naming it."""
    target = Path(path)
    folder = reached(LocalStorage(target.parent), "--metrics-output", path)
    if os.path.isdir(target):  # (False where it cannot be looked at: the write says why)
        raise ConfigError(f"--metrics-output {path}: a folder; name the JSON file to write")
    return folder, target.name


def run_train(args: Any) -> int:
    config = config_from_args(args)
    metrics_output = metrics_file(args.metrics_output) if args.metrics_output else None
    if args.yaml:
        from edl_argo.master.dry_run import render_train_manifests

        print(render_train_manifests(config), end="")
        return 0
    if config.backend == "local":
        # Local pods are this master's to stop. On Kubernetes a SIGTERM may be a node drain after which
        # Argo retries the master, which then adopts the pods: they stay (the step's exit hook and
        # --master-timeout remove them once the step has ended for good).
        stop_on_sigterm()
    early_pod_template(config)
    from edl_argo.master.job import TrainingJob  # the master's modules, while the template imports

    try:
        metrics = TrainingJob.load(config).run()
    except JobFailedError as error:
        log.error("job_failed", job=config.job_name, error=str(error))
        raise
    if metrics_output is not None:
        folder, name = metrics_output
        folder.write(name, json.dumps(metrics["final_metrics"], sort_keys=True).encode())
    final = " ".join(f"{k}={v:.4f}" for k, v in metrics["final_metrics"].items())
    print(f"job {config.job_name} succeeded: model at {config.output.rstrip('/')}/model {final}")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("train", help="run an elastic training job (this process is the master)")
    add_train_flags(parser)
    parser.set_defaults(run=run_train)
