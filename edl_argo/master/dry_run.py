"""``edl-argo train --backend kubernetes --yaml``: the manifests a job would create, without a cluster.

The pods' commands are built by :mod:`edl_argo.master.pod_commands`, as the master builds them, so the
output is exactly what the master would submit, except for the Services' cluster IPs, only known at run time,
printed as the equivalent DNS names (``<job>-ps-<id>.<namespace>.svc:<port>``). With ``--master-port``
(as the elastic-train step runs it) the master's Service comes first and the workers reach the master
through its DNS name; without, the master serves on a port it picks and the workers get its pod address,
printed as :data:`MASTER_ADDRESS`. Nothing is read or contacted: no data, no storage, no API server.
"""

from __future__ import annotations

from edl_argo.master.config import TrainConfig
from edl_argo.master.pod_commands import ps_pod, worker_pod
from edl_argo.pods import manifests
from edl_argo.pods.manifests import render_job_manifests

#: Stands for the master's ``<pod IP>:<port>`` in printed worker commands.
MASTER_ADDRESS = "<master-pod-ip>:<master-port>"


def render_train_manifests(config: TrainConfig) -> str:
    """Multi-document YAML: the NetworkPolicy, the master's Service (with ``--master-port``), each PS's
    Service and Pod, then the workers' Pods, as the job creates them."""
    k8s = config.kubernetes
    assert k8s is not None, "config_from_args requires --backend kubernetes for --yaml"
    master = (
        manifests.master_service_dns_address(config.job_name, k8s, config.master_port)
        if config.master_port
        else MASTER_ADDRESS
    )
    ps_addresses = ",".join(
        manifests.service_dns_address(config.job_name, k8s, i) for i in range(config.num_ps)
    )
    specs = [
        ps_pod(config, i, port=k8s.ps_port_of(i), master_address=master, model_def=config.model_def)
        for i in range(config.num_ps)
    ]
    specs += [
        worker_pod(config, i, master_address=master, model_def=config.model_def, ps_addresses=ps_addresses)
        for i in range(config.num_workers)
    ]
    return render_job_manifests(config.job_name, k8s, specs, master_port=config.master_port)
