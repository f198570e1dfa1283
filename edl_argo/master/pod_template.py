"""A local job's pod template, started as early as its master can: :func:`early_pod_template`.

Importing TensorFlow in the template (:mod:`edl_argo.pods.prefork`) is the longest wait before a local job's
first step, so ``edl-argo train`` starts it right after parsing its command line
(:mod:`edl_argo.master.command`), before it imports the master's own modules; ``TrainingJob.load`` calls it
too, for jobs run without the command (the same template is returned: one per process).
"""

from __future__ import annotations

import os

from edl_argo.master.config import TrainConfig
from edl_argo.pods.prefork import PodTemplate, prefork_enabled, process_template


def early_pod_template(config: TrainConfig) -> PodTemplate | None:
    """For a local job, the pod template of this process (:func:`~edl_argo.pods.prefork.process_template`),
    starting in the background now if it has not yet; None if it is switched off, or the job's pods run on
    Kubernetes."""
    if config.backend == "kubernetes" or not prefork_enabled(os.environ):
        return None
    return process_template(config.job_name)
