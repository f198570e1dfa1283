"""``edl-argo train`` flags (ElasticDL's names, declared in :mod:`edl_argo.settings.table`) and the
validated job configuration they make."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import uuid
from typing import Any

from edl_argo.errors import ConfigError
from edl_argo.model.contract import ModelOptions, model_options_from_args
from edl_argo.pods.kubernetes_config import KubernetesConfig, kubernetes_config_from_args
from edl_argo.pods.manifests import kubernetes_job_name
from edl_argo.settings import add_role_settings, table
from edl_argo.settings.schema import settings_dataclass
from edl_argo.settings.table import ALLREDUCE, NAN_LOSS_POLICIES

__all__ = ["NAN_LOSS_POLICIES", "TrainConfig", "add_train_flags", "config_from_args"]
#: What a local job's name must look like: it names files (the job registry), so no '/' and no spaces. On
#: Kubernetes, where it names pods, the backend requires a DNS label (``manifests.validate_job_name``).
#: The most workers a job may scale to when ``--max-workers`` is not given (or ``--num-workers``, if more).
DEFAULT_MAX_WORKERS = 64
_JOB_NAME = re.compile(r"^[A-Za-z0-9][-A-Za-z0-9_.]{0,62}$")


class _TrainConfigMethods:
    """Everything one training job needs; built from flags by :func:`config_from_args`.

    One field per setting of section ``job`` in :mod:`edl_argo.settings.table` (its type and default
    from there), plus ``model_options`` (ElasticDL's other model flags: model zoo, model params, renamed
    functions) and ``kubernetes`` (with ``backend == "kubernetes"``: how pods run there,
    :mod:`edl_argo.pods.kubernetes_config`). ``checkpoint_dir`` empty: ``<output>/checkpoints``
    (:attr:`checkpoints_url`); ``master_state`` empty: ``output``.
    """

    distribution_strategy: str
    minibatch_size: int
    num_minibatches_per_task: int
    checkpoint_dir: str
    output: str
    max_workers: int
    num_workers: int

    @property
    def allreduce(self) -> bool:
        """Whether workers average gradients among themselves (no parameter servers)."""
        return self.distribution_strategy == ALLREDUCE

    @property
    def worker_limit(self) -> int:
        """``--max-workers``; when 0, the larger of :data:`DEFAULT_MAX_WORKERS` and ``--num-workers``."""
        return self.max_workers or max(DEFAULT_MAX_WORKERS, self.num_workers)

    @property
    def growth_limit(self) -> int:
        """The most workers the job grows to by itself: ``--max-workers``, or ``--num-workers`` when 0."""
        return self.max_workers or self.num_workers

    @property
    def records_per_task(self) -> int:
        return self.minibatch_size * self.num_minibatches_per_task

    @property
    def checkpoints_url(self) -> str:
        """Where the PSes (or the AllreduceStrategy group) keep their checkpoints."""
        return self.checkpoint_dir or self.output.rstrip("/") + "/checkpoints"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]


TrainConfig = settings_dataclass(
    "TrainConfig",
    table.SETTINGS,
    "job",
    base=_TrainConfigMethods,
    module=__name__,
    extra=[
        ("model_options", ModelOptions, dataclasses.field(default_factory=ModelOptions)),
        ("kubernetes", KubernetesConfig | None, dataclasses.field(default=None)),
    ],
)


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    """Every flag of ``edl-argo train`` (:mod:`edl_argo.settings.table`, role ``train``)."""
    add_role_settings(parser, "train")


def _check_allreduce(args: argparse.Namespace) -> None:
    if args.distribution_strategy != ALLREDUCE:
        if args.scale_lr_by_world_size:
            raise ConfigError("--scale-lr-by-world-size needs --distribution-strategy AllreduceStrategy")
        return
    conflicts = {
        "--use-async": args.use_async,
        "--grads-to-wait": args.grads_to_wait > 1,
        "--pipelined": args.pipelined,
        "--lr-staleness-modulation": args.lr_staleness_modulation,
    }
    for flag, used in conflicts.items():
        if used:
            raise ConfigError(
                f"{flag} configures parameter servers; --distribution-strategy AllreduceStrategy has none"
            )


def _check_tls(args: argparse.Namespace) -> None:
    """Each backend has its own way to name the TLS files (:mod:`edl_argo.rpc.tls`)."""
    if args.tls_secret and args.backend != "kubernetes":
        raise ConfigError(
            "--tls-secret names a Kubernetes Secret: it needs --backend kubernetes (locally, use --tls-dir"
            " DIR)"
        )
    if args.tls_dir and args.backend == "kubernetes":
        raise ConfigError(
            "--tls-dir is for --backend local: on Kubernetes name the kubernetes.io/tls Secret with"
            " --tls-secret (the master mounts it into its pods)"
        )


def _check_worker_range(args: argparse.Namespace) -> None:
    """``--min-workers`` <= ``--num-workers`` <= ``--max-workers`` (when given)."""
    if args.max_workers and args.min_workers > args.max_workers:
        raise ConfigError(f"--min-workers {args.min_workers} is more than --max-workers {args.max_workers}")
    if args.max_workers and args.num_workers > args.max_workers:
        raise ConfigError(f"--num-workers {args.num_workers} is more than --max-workers {args.max_workers}")
    if args.num_workers < args.min_workers:
        raise ConfigError(
            f"--num-workers {args.num_workers} is less than --min-workers {args.min_workers}: the job starts"
            " that many workers"
        )


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The validated configuration; :class:`ConfigError` names the flag at fault."""
    _check_allreduce(args)
    if args.use_async and args.grads_to_wait > 1:
        raise ConfigError(
            "--use-async applies each gradient on arrival; it cannot be combined with --grads-to-wait > 1"
        )
    if args.lr_staleness_modulation and not args.use_async:
        raise ConfigError("--lr-staleness-modulation needs --use-async")
    if args.pipelined and not args.use_async:
        raise ConfigError("--pipelined needs --use-async: synchronous SGD cannot compute ahead of its pushes")
    if args.evaluation_steps and not args.validation_data:
        raise ConfigError("--evaluation-steps needs --validation-data")
    checkpoints = args.checkpoint_dir or args.output.rstrip("/") + "/checkpoints"
    if args.backend == "kubernetes" and args.checkpoint_steps and not checkpoints.startswith("s3://"):
        raise ConfigError(
            f"--checkpoint-steps with --backend kubernetes: {checkpoints} would be each pod's own disk;"
            " set --checkpoint-dir s3://bucket/prefix"
        )
    _check_worker_range(args)
    if args.backend == "local" and args.job_name and not _JOB_NAME.match(args.job_name):
        raise ConfigError(
            f"--job-name {args.job_name!r}: at most 63 letters, digits, '-', '_' and '.', starting with a"
            " letter or digit (it names the job's files)"
        )
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["job_name"] = args.job_name or f"edl-{uuid.uuid4().hex[:8]}"
    values["model_options"] = model_options_from_args(args)
    # Local pods run in folders of their own: they get the TLS folder as an absolute path.
    values["tls_dir"] = os.path.abspath(args.tls_dir) if args.tls_dir else ""
    if args.backend == "kubernetes":
        values["job_name"] = kubernetes_job_name(values["job_name"])  # <workflow>-<task> may be too long
    if args.distribution_strategy == ALLREDUCE:
        values["num_ps"] = 0
    _check_tls(args)
    if args.yaml and args.backend != "kubernetes":
        raise ConfigError("--yaml prints Kubernetes manifests: it needs --backend kubernetes")
    values["kubernetes"] = kubernetes_config_from_args(args) if args.backend == "kubernetes" else None
    return TrainConfig(**values)
