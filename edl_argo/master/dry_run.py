"""``edl-argo train --backend kubernetes --yaml``: the manifests a job would create, without a cluster.

The pods' commands are built by :class:`~edl_argo.master.job.TrainingJob` itself, so the output is
exactly what the master would submit, except for two values only known at run time: the master's address
(its pod IP, printed as :data:`MASTER_ADDRESS`) and the PS Services' cluster IPs (printed as the
equivalent DNS names, ``<job>-ps-<id>.<namespace>.svc:<port>``). Nothing is read or contacted: no data,
no storage, no API server.
"""

from __future__ import annotations

from edl_argo.master.config import TrainConfig
from edl_argo.master.job import TrainingJob
from edl_argo.pods import manifests
from edl_argo.pods.kubernetes import render_job_manifests

#: Stands for the master's ``<pod IP>:<port>`` in printed worker commands.
MASTER_ADDRESS = "<master-pod-ip>:<master-port>"


class _SpecOnlyJob(TrainingJob):
    """A job that only builds pod specs: it skips :class:`TrainingJob`'s constructor (which reads the
    data and creates a backend) and sets the few attributes the spec builders use."""

    def __init__(self, config: TrainConfig) -> None:  # deliberately no super().__init__()
        assert config.kubernetes is not None
        self.config = config
        self.ps_ports = [config.kubernetes.ps_port_of(i) for i in range(config.num_ps)]
        self._master_address = MASTER_ADDRESS

    def _ps_addresses(self) -> str:
        assert self.config.kubernetes is not None
        return ",".join(
            manifests.service_dns_address(self.config.job_name, self.config.kubernetes, i)
            for i in range(self.config.num_ps)
        )


def render_train_manifests(config: TrainConfig) -> str:
    """Multi-document YAML: each PS's Service and Pod, then the workers' Pods, as the job starts them."""
    assert config.kubernetes is not None, "config_from_args requires --backend kubernetes for --yaml"
    job = _SpecOnlyJob(config)
    specs = [job.ps_spec(i) for i in range(config.num_ps)]
    specs += [job.worker_spec(i) for i in range(config.num_workers)]
    return render_job_manifests(config.job_name, config.kubernetes, specs)
