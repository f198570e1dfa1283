"""``edl-argo train --backend kubernetes --yaml``: the manifests a job would create, without a cluster.

The pods' commands are built by :class:`~edl_argo.master.job.TrainingJob` itself, so the output is
exactly what the master would submit, except for the Services' cluster IPs, only known at run time,
printed as the equivalent DNS names (``<job>-ps-<id>.<namespace>.svc:<port>``). With ``--master-port``
(as the elastic-train step runs it) the master's Service comes first and the workers reach the master
through its DNS name; without, the master serves on a port it picks and the workers get its pod address,
printed as :data:`MASTER_ADDRESS`. Nothing is read or contacted: no data, no storage, no API server.
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
        self._master_address = (
            manifests.master_service_dns_address(config.job_name, config.kubernetes, config.master_port)
            if config.master_port
            else MASTER_ADDRESS
        )

    def _ps_addresses(self) -> str:
        assert self.config.kubernetes is not None
        return ",".join(
            manifests.service_dns_address(self.config.job_name, self.config.kubernetes, i)
            for i in range(self.config.num_ps)
        )


def render_train_manifests(config: TrainConfig) -> str:
    """Multi-document YAML: the NetworkPolicy, the master's Service (with ``--master-port``), each PS's
    Service and Pod, then the workers' Pods, as the job creates them."""
    assert config.kubernetes is not None, "config_from_args requires --backend kubernetes for --yaml"
    job = _SpecOnlyJob(config)
    specs = [job.ps_spec(i) for i in range(config.num_ps)]
    specs += [job.worker_spec(i) for i in range(config.num_workers)]
    return render_job_manifests(config.job_name, config.kubernetes, specs, master_port=config.master_port)
