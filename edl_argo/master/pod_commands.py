"""The command lines the master gives its pods, generated from the settings table.

Each worker and PS gets the job's value of every setting of its role (:mod:`edl_argo.settings.table`)
that differs from the setting's default, plus what the master works out per pod (its id, addresses,
ports, the staged ``--model-def``). Pure: no I/O, so tests and ``--yaml`` call it directly.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from edl_argo.collective.transport import FRAME_CAP_ENV
from edl_argo.pods.base import PodRole, PodSpec
from edl_argo.rpc.tls import POD_TLS_DIR
from edl_argo.settings import role_arguments


def job_values(config: Any) -> dict[str, Any]:
    """Every setting value a :class:`~edl_argo.master.config.TrainConfig` holds, by ``dest``: its own
    fields and those of its ``model_options``."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    values.update(
        {f.name: getattr(config.model_options, f.name) for f in dataclasses.fields(config.model_options)}
    )
    return values


def pod_tls_dir(config: Any) -> str:
    """The ``--tls-dir`` of the job's pods: where the Kubernetes backend mounts ``--tls-secret``, else the
    master's own ``--tls-dir`` (local pods share its filesystem); ``""``: no TLS."""
    kubernetes = getattr(config, "kubernetes", None)
    if kubernetes is not None and kubernetes.tls_secret:
        return POD_TLS_DIR
    return str(config.tls_dir)


def ps_command(
    config: Any,
    ps_id: int,
    *,
    port: int,
    master_address: str,
    model_def: str,
    tensor_port: int | None = None,
) -> list[str]:
    """``edl-argo ps ...`` for parameter server ``ps_id`` of ``config``'s job; ``tensor_port``: its
    tensor port's (None: any free one)."""
    values = {
        **job_values(config),
        "ps_id": ps_id,
        "port": port,
        "tensor_port": tensor_port,
        "master_addr": master_address,
        "model_def": model_def,
        "tls_dir": pod_tls_dir(config),
        # Its calls admitted at once follow the most workers the job may have (edl_argo.ps.serving).
        "max_workers": config.worker_limit,
        # Without checkpoints a PS restores none: it gets no --checkpoint-dir at all.
        "checkpoint_dir": config.checkpoints_url if config.checkpoint_steps else None,
    }
    return ["edl-argo", "ps", *role_arguments("ps", values)]


def worker_command(
    config: Any,
    worker_id: int,
    *,
    master_address: str,
    model_def: str,
    ps_addresses: str,
    collective_port: int | None,
    training_data_spec: str = "",
) -> list[str]:
    """``edl-argo worker ...`` for worker ``worker_id`` of ``config``'s job. ``collective_port``
    (AllreduceStrategy): the port of its collective service (None: any free port).
    ``training_data_spec``: the training data's :class:`~edl_argo.readers.ReaderSpec` as JSON, which the
    worker's input pipeline is built for (empty: RecordIO)."""
    allreduce = config.allreduce
    values = {
        **job_values(config),
        "worker_id": worker_id,
        "master_addr": master_address,
        "model_def": model_def,
        "tls_dir": pod_tls_dir(config),
        "ps_addrs": None if allreduce else ps_addresses,
        "collective_port": collective_port if allreduce else None,
        "training_data_spec": training_data_spec or None,
        # The group's checkpoints (AllreduceStrategy); with parameter servers the PSes checkpoint.
        "checkpoint_steps": config.checkpoint_steps if allreduce else None,
        "checkpoint_dir": config.checkpoints_url if allreduce and config.checkpoint_steps else None,
    }
    return ["edl-argo", "worker", *role_arguments("worker", values)]


def ps_pod(config: Any, ps_id: int, *, port: int, master_address: str, model_def: str) -> PodSpec:
    """The pod of parameter server ``ps_id``: its command (:func:`ps_command`) and ports. In a cluster its
    tensor port is fixed (a container port the job's NetworkPolicy opens); on one machine any free one."""
    tensor_port = config.kubernetes.tensor_port_of(ps_id) if config.kubernetes else None
    command = ps_command(
        config, ps_id, port=port, master_address=master_address, model_def=model_def, tensor_port=tensor_port
    )
    return PodSpec(PodRole.PS, ps_id, tuple(command), port=port, tensor_port=tensor_port)


def worker_pod(
    config: Any,
    worker_id: int,
    *,
    master_address: str,
    model_def: str,
    ps_addresses: str,
    training_data_spec: str = "",
) -> PodSpec:
    """The pod of worker ``worker_id``: its command (:func:`worker_command`), its collective port and, with
    AllreduceStrategy, the master's frame cap (``FRAME_CAP_ENV``) if set."""
    # In a cluster every pod has its own address, so one declared port (which the job's NetworkPolicy
    # opens) serves every worker; on one machine each worker takes a free port.
    port = config.kubernetes.collective_port if config.allreduce and config.kubernetes else None
    command = worker_command(
        config,
        worker_id,
        master_address=master_address,
        model_def=model_def,
        ps_addresses="" if config.allreduce else ps_addresses,
        collective_port=port,
        training_data_spec=training_data_spec,
    )
    cap = os.environ.get(FRAME_CAP_ENV) if config.allreduce else None
    return PodSpec(
        PodRole.WORKER, worker_id, tuple(command), env={FRAME_CAP_ENV: cap} if cap else {}, port=port
    )
