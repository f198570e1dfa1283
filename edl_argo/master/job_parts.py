"""What a training job reads before it starts, read once: :func:`load_job_parts`.

:class:`~edl_argo.master.job.TrainingJob` is built from these parts and does no I/O of its own when
constructed; ``TrainingJob.load(config)`` reads them and builds it. Reading them checks the job's input
before any pod starts: the model (staged and pinned when it is in storage, its ``optimizer()``, its
world-size scaling with AllreduceStrategy), the datasets (each shard's version pinned: tasks carry it,
workers read only that version), that ``--output`` is reachable, and what an earlier master of the job saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edl_argo.errors import ConfigError, EdlError
from edl_argo.flags import pod_host
from edl_argo.master.config import TrainConfig
from edl_argo.master.failover import check_saved_dispatcher
from edl_argo.master.state_store import MasterStateStore, job_fingerprint
from edl_argo.model import Mode, ModelSpec, load_model_spec
from edl_argo.model.loader import check_model_file
from edl_argo.model.source import StagedModel, pin_model_def, stage_model_def
from edl_argo.model.user_code import model_error_of
from edl_argo.pods import LocalProcessBackend, PodBackend, find_free_port
from edl_argo.pods.prefork import PodTemplate
from edl_argo.readers import OpenedDataset, open_data, parse_data_options
from edl_argo.storage import Storage, open_reachable_storage, open_storage
from edl_argo.tensorflow_import import import_tensorflow


@dataclass(frozen=True)
class JobParts:
    """Everything a :class:`~edl_argo.master.job.TrainingJob` needs that lives outside the process."""

    model: StagedModel | None
    """The model its pods run, when ``--model-def`` is in storage (:mod:`edl_argo.model.source`)."""
    spec: ModelSpec
    training_data: OpenedDataset
    validation_data: OpenedDataset | None
    output: Storage
    state_store: MasterStateStore
    saved: dict[str, Any] | None
    """What an earlier master of this job saved, if anything."""
    ps_ports: list[int]
    """The port of each PS: the saved ones of a continued job, else new ones."""


def load_job_parts(config: TrainConfig) -> JobParts:
    """Read the parts of ``config``'s job. A saved state whose dispatcher cannot be restored fails here,
    before any pod backend exists.

    Raises:
        ConfigError, DataFormatError, StorageError: one line naming the flag or file at fault.
    """
    # Where the job writes, reached first: a missing bucket, a denial or a file in the way fails here.
    output = open_reachable_storage(config.output, "--output")
    if config.checkpoint_steps:
        open_reachable_storage(
            config.checkpoints_url, "--checkpoint-dir" if config.checkpoint_dir else "--output"
        )
    state_url = config.master_state or config.output
    model = stage_model_def(config.model_def, state_url, shared=config.kubernetes is not None)
    if model is None:
        check_model_file(config.model_def, config.model_options.model_zoo)
    import_tensorflow()  # the model file's import of it, without what no master uses
    spec = load_model_spec(model.pod_model_def if model else config.model_def, config.model_options)
    check_optimizer(spec)
    if config.scale_lr_by_world_size:
        from edl_argo.collective.learning_rate import check_world_size_scaling  # TensorFlow: see cli

        check_world_size_scaling(spec.optimizer)
    pod_model_def = model.pod_model_def if model else config.model_def
    training = open_job_data(config, config.training_data, "--training-data", spec, pod_model_def)
    validation = (
        open_job_data(config, config.validation_data, "--validation-data", spec, pod_model_def)
        if config.validation_data
        else None
    )
    if config.allreduce and len(sample_batch(config, spec, training, Mode.TRAINING)) == 3:
        raise ConfigError(
            f"feed of {config.model_def} yields (features, labels, sample_weights) in training: "
            "AllreduceStrategy does not apply sample weights; use ParameterServerStrategy"
        )
    fingerprint = job_fingerprint(config, training.records, validation.records if validation else {})
    state_storage = open_storage(config.master_state) if config.master_state else output
    state_store = MasterStateStore(state_storage, config.job_name, fingerprint)
    saved = state_store.load()
    if saved is not None:
        check_saved_dispatcher(saved, state_store)  # before any pod starts
    if model is not None:  # a continued job keeps its model, even if the URL changed since
        staged = model
        model = pin_model_def(staged, state_url, config.job_name, continuing=saved is not None)
        if model != staged:
            spec = load_model_spec(model.pod_model_def)
    k8s = config.kubernetes
    ps_ports = (
        [int(port) for port in saved["ps_ports"]]
        if saved is not None
        else [k8s.ps_port_of(i) if k8s else find_free_port(pod_host()) for i in range(config.num_ps)]
    )
    return JobParts(
        model=model,
        spec=spec,
        training_data=training,
        validation_data=validation,
        output=output,
        state_store=state_store,
        saved=saved,
        ps_ports=ps_ports,
    )


def check_optimizer(spec: ModelSpec) -> None:
    """Call the model file's ``optimizer()`` once, before any pod does: one that raises, or returns no Keras
    optimizer, is a ConfigError naming the model file and function (else every worker and PS fails on it)."""
    try:
        spec.optimizer()
    except EdlError:
        raise
    except Exception as error:
        found = model_error_of(error)
        if found is None:
            raise
        raise ConfigError(str(found)) from None


def open_job_data(
    config: TrainConfig, url: str, flag: str, spec: ModelSpec | None = None, model_def: str = ""
) -> OpenedDataset:
    """The dataset at ``url`` (given by ``flag``) in the job's ``--data-format`` and ``--data-options``:
    listed, indexed and pinned (tasks carry each shard's version, workers read only that version).

    When the model ``spec`` has a custom data reader (``--custom-data-reader``, or the model file's
    ``custom_data_reader``), the data is read by it instead (format ``custom``,
    :mod:`edl_argo.readers.custom`): its workers load it from ``model_def`` (the pods' ``--model-def``;
    default ``config.model_def``), and the ``--data-options`` items are its keyword arguments."""
    options = parse_data_options(config.data_options)
    if spec is not None and spec.custom_data_reader:
        from edl_argo.readers.custom import custom_options

        options = custom_options(
            model_def or config.model_def,
            spec.custom_data_reader,
            model_zoo=config.model_options.model_zoo,
            params=options,
            records_per_task=config.minibatch_size * config.num_minibatches_per_task,
            task_type="evaluation" if flag == "--validation-data" else "training",
        )
        return open_data(url, "custom", options, what=flag)
    return open_data(url, config.data_format, options, what=flag)


def sample_batch(config: TrainConfig, spec: ModelSpec, data: OpenedDataset, mode: str) -> Any:
    """The first minibatch of ``data``, as ``feed`` makes it for ``mode``."""
    from edl_argo.readers import num_records
    from edl_argo.worker.data import make_batches  # TensorFlow: imported when run, not for --help

    shard = data.shards[0]
    records = data.read(shard.key, 0, min(config.minibatch_size, shard.records))
    return next(iter(make_batches(spec, records, data.schema, mode, num_records(records))))


def default_backend(config: TrainConfig, pod_template: PodTemplate | None = None) -> PodBackend:
    """Local processes (forking from ``pod_template`` if given:
    :func:`~edl_argo.master.pod_template.early_pod_template`), or with
    ``--backend kubernetes`` pods of the cluster."""
    if config.backend != "kubernetes":
        return LocalProcessBackend(config.job_name, host=pod_host(), pod_template=pod_template)
    if config.kubernetes is None:
        raise ConfigError("--backend kubernetes needs its settings (TrainConfig.kubernetes)")
    from edl_argo.pods.kubernetes import KubernetesBackend  # the client is slow to import: only when used

    return KubernetesBackend(config.job_name, config.kubernetes)
