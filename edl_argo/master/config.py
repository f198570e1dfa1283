"""``edl-argo train`` flags (ElasticDL's names) and the validated job configuration they make."""

from __future__ import annotations

import argparse
import dataclasses
import uuid
from dataclasses import dataclass
from typing import Any

from edl_argo.errors import ConfigError
from edl_argo.flags import add_flag, non_negative_int, positive_int
from edl_argo.pods.kubernetes_config import (
    KubernetesConfig,
    add_kubernetes_flags,
    kubernetes_config_from_args,
)


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training job needs; built from flags by :func:`config_from_args`."""

    model_def: str
    training_data: str
    output: str
    validation_data: str = ""
    num_epochs: int = 1
    minibatch_size: int = 64
    num_minibatches_per_task: int = 8
    num_workers: int = 2
    num_ps: int = 1
    grads_to_wait: int = 1
    use_async: bool = False
    lr_staleness_modulation: bool = False
    pipelined: bool = False
    sync_version_tolerance: int = 0
    evaluation_steps: int = 0
    checkpoint_steps: int = 0
    shuffle: bool = False
    seed: int = 0
    max_task_retries: int = 3
    max_worker_relaunches: int = 16
    max_ps_relaunches: int = 8
    job_name: str = ""
    backend: str = "local"
    master_port: int = 0
    log_level: str = "INFO"
    kubernetes: KubernetesConfig | None = None
    """With ``backend == "kubernetes"``: how pods run there (:mod:`edl_argo.pods.kubernetes_config`)."""

    @property
    def records_per_task(self) -> int:
        return self.minibatch_size * self.num_minibatches_per_task

    @property
    def checkpoint_dir(self) -> str:
        return self.output.rstrip("/") + "/checkpoints"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    job = parser.add_argument_group("job")
    add_flag(job, "--model-def", required=True, help="path/to/model.py[:custom_model] or package.module.fn")
    add_flag(
        job, "--training-data", required=True, metavar="URL", help="folder or s3://bucket/prefix of shards"
    )
    add_flag(job, "--validation-data", default="", metavar="URL", help="shards to evaluate on")
    add_flag(
        job, "--output", required=True, metavar="URL", help="where the model, metrics and checkpoints go"
    )
    add_flag(job, "--job-name", default="", help="name of the job (default: a random edl-XXXXXXXX)")
    add_flag(job, "--backend", choices=["local", "kubernetes"], default="local", help="where pods run")
    add_flag(job, "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    training = parser.add_argument_group("training")
    add_flag(training, "--num-epochs", type=positive_int, default=1)
    add_flag(training, "--minibatch-size", type=positive_int, default=64)
    add_flag(training, "--num-minibatches-per-task", type=positive_int, default=8)
    add_flag(training, "--shuffle", action="store_true", help="shuffle task order each epoch")
    add_flag(training, "--seed", type=int, default=0)
    add_flag(
        training, "--evaluation-steps", type=non_negative_int, default=0, help="evaluate every N versions"
    )
    add_flag(
        training,
        "--checkpoint-steps",
        type=non_negative_int,
        default=0,
        help="PS checkpoint every N versions",
    )

    cluster = parser.add_argument_group("workers and parameter servers")
    add_flag(cluster, "--num-workers", type=positive_int, default=2)
    add_flag(cluster, "--num-ps", type=positive_int, default=1)
    add_flag(
        cluster, "--grads-to-wait", type=positive_int, default=1, help="synchronous SGD: average K pushes"
    )
    add_flag(cluster, "--use-async", action="store_true", help="asynchronous SGD: apply each push on arrival")
    add_flag(cluster, "--lr-staleness-modulation", action="store_true", help="async: scale lr by 1/staleness")
    add_flag(
        cluster,
        "--pipelined",
        action="store_true",
        help="async: push and pull while the next minibatch computes (faster, one more step of staleness)",
    )
    add_flag(cluster, "--sync-version-tolerance", type=non_negative_int, default=0)
    add_flag(cluster, "--max-task-retries", type=positive_int, default=3)
    add_flag(cluster, "--max-worker-relaunches", type=non_negative_int, default=16)
    add_flag(cluster, "--max-ps-relaunches", type=non_negative_int, default=8)
    add_flag(cluster, "--master-port", type=non_negative_int, default=0, help="0: any free port")
    add_kubernetes_flags(parser)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The validated configuration; :class:`ConfigError` names the flag at fault."""
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
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["job_name"] = args.job_name or f"edl-{uuid.uuid4().hex[:8]}"
    if args.yaml and args.backend != "kubernetes":
        raise ConfigError("--yaml prints Kubernetes manifests: it needs --backend kubernetes")
    values["kubernetes"] = kubernetes_config_from_args(args) if args.backend == "kubernetes" else None
    return TrainConfig(**values)
