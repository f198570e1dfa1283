"""``edl-argo train`` flags (ElasticDL's names) and the validated job configuration they make."""

from __future__ import annotations

import argparse
import dataclasses
import re
import uuid
from dataclasses import dataclass
from typing import Any

from edl_argo.collective.flags import ALLREDUCE, PARAMETER_SERVER, STRATEGIES, add_collective_flags
from edl_argo.errors import ConfigError
from edl_argo.flags import add_flag, add_rpc_timeout_flag, non_negative_int, positive_int
from edl_argo.model.contract import ModelOptions, add_model_flags, model_options_from_args
from edl_argo.pods.kubernetes_config import (
    KubernetesConfig,
    add_kubernetes_flags,
    kubernetes_config_from_args,
)
from edl_argo.pods.manifests import fit_job_name
from edl_argo.rpc.channel import RPC_TIMEOUT_SECONDS
from edl_argo.rpc.master_watch import DEFAULT_MASTER_TIMEOUT_SECONDS, add_master_timeout_flag

#: ``--nan-loss``: what a worker does with a minibatch whose loss is NaN or infinite. ``fail``: the job
#: fails at once, naming the model version, task and shard; ``skip``: the minibatch is not pushed, and
#: ``nan_batches_skipped`` in metrics.json counts it.
NAN_LOSS_POLICIES = ("fail", "skip")
MAX_PORT = 65535
#: What a local job's name must look like: it names files (the job registry), so no '/' and no spaces. On
#: Kubernetes, where it names pods, the backend requires a DNS label (``manifests.validate_job_name``).
_JOB_NAME = re.compile(r"^[A-Za-z0-9][-A-Za-z0-9_.]{0,62}$")


#: The most workers a job may scale to when ``--max-workers`` is not given (or ``--num-workers``, if more).
DEFAULT_MAX_WORKERS = 64


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training job needs; built from flags by :func:`config_from_args`."""

    model_def: str
    training_data: str
    output: str
    model_options: ModelOptions = dataclasses.field(default_factory=ModelOptions)
    """ElasticDL's other model flags: model zoo, model params, renamed functions."""
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
    checkpoint_dir: str = ""
    """URL of the checkpoints (:attr:`checkpoints_url`); empty: ``<output>/checkpoints``."""
    shuffle: bool = False
    seed: int = 0
    max_task_retries: int = 3
    nan_loss: str = "fail"
    max_worker_relaunches: int = 16
    max_workers: int = 0
    """The most workers the job may run (``ScaleWorkers``' bound); 0: :attr:`worker_limit`'s default."""
    max_ps_relaunches: int = 8
    min_task_timeout_seconds: int = 60
    rpc_timeout_seconds: int = RPC_TIMEOUT_SECONDS
    """Deadline of every gRPC call a worker (or the master) makes; a hung peer costs at most this long."""
    """A task held longer than max(this, 5 x the longest of the last 100 task durations) is reclaimed."""
    master_timeout: int = DEFAULT_MASTER_TIMEOUT_SECONDS
    """A worker or PS that cannot reach the master this long ends (:mod:`edl_argo.rpc.master_watch`)."""
    job_name: str = ""
    backend: str = "local"
    master_port: int = 0
    log_level: str = "INFO"
    master_state: str = ""
    """URL of the master's saved state (:mod:`edl_argo.master.state_store`); empty: ``output``."""
    distribution_strategy: str = "ParameterServerStrategy"
    collective_timeout_seconds: int = 60
    scale_lr_by_world_size: bool = False
    kubernetes: KubernetesConfig | None = None
    """With ``backend == "kubernetes"``: how pods run there (:mod:`edl_argo.pods.kubernetes_config`)."""

    @property
    def allreduce(self) -> bool:
        """Whether workers average gradients among themselves (no parameter servers)."""
        return self.distribution_strategy == ALLREDUCE

    @property
    def worker_limit(self) -> int:
        """``--max-workers``; when 0, the larger of :data:`DEFAULT_MAX_WORKERS` and ``--num-workers``."""
        return self.max_workers or max(DEFAULT_MAX_WORKERS, self.num_workers)

    @property
    def records_per_task(self) -> int:
        return self.minibatch_size * self.num_minibatches_per_task

    @property
    def checkpoints_url(self) -> str:
        """Where the PSes (or the AllreduceStrategy group) keep their checkpoints."""
        return self.checkpoint_dir or self.output.rstrip("/") + "/checkpoints"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    job = parser.add_argument_group("job")
    add_model_flags(job)
    add_flag(
        job, "--training-data", required=True, metavar="URL", help="folder or s3://bucket/prefix of shards"
    )
    add_flag(job, "--validation-data", default="", metavar="URL", help="shards to evaluate on")
    add_flag(
        job, "--output", required=True, metavar="URL", help="where the model, metrics and checkpoints go"
    )
    add_flag(job, "--job-name", default="", help="name of the job (default: a random edl-XXXXXXXX)")
    add_flag(
        job,
        "--master-state",
        default="",
        metavar="URL",
        help="where the master keeps the job's state, so that a master started again with the same job name "
        "continues the job (default: --output; use durable storage when --output is a pod's own disk)",
    )
    add_flag(job, "--backend", choices=["local", "kubernetes"], default="local", help="where pods run")
    add_flag(job, "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    training = parser.add_argument_group("training")
    add_flag(training, "--num-epochs", type=positive_int, default=1)
    add_flag(training, "--minibatch-size", type=positive_int, default=64)
    add_flag(training, "--num-minibatches-per-task", type=positive_int, default=8)
    add_flag(training, "--shuffle", action="store_true", help="shuffle task order each epoch")
    add_flag(training, "--seed", type=int, default=0)
    add_flag(
        training,
        "--nan-loss",
        choices=NAN_LOSS_POLICIES,
        default="fail",
        help="a minibatch whose loss is NaN: fail the job at once (default), or skip the minibatch",
    )
    add_flag(
        training, "--evaluation-steps", type=non_negative_int, default=0, help="evaluate every N versions"
    )
    add_flag(
        training,
        "--checkpoint-steps",
        type=non_negative_int,
        default=0,
        help="checkpoint the model every N versions (each PS, or with AllreduceStrategy the group)",
    )
    add_flag(
        training,
        "--checkpoint-dir",
        default="",
        metavar="URL",
        help="where checkpoints go (default OUTPUT/checkpoints); with --backend kubernetes an s3:// URL",
    )

    cluster = parser.add_argument_group("workers and parameter servers")
    add_flag(
        cluster,
        "--distribution-strategy",
        choices=STRATEGIES,
        default=PARAMETER_SERVER,
        help="ParameterServerStrategy: variables on PS pods (sparse and large models); AllreduceStrategy: "
        "full replicas on workers that average gradients every step (dense models, synchronous SGD)",
    )
    add_collective_flags(cluster)
    add_flag(cluster, "--num-workers", type=positive_int, default=2)
    add_flag(cluster, "--num-ps", aliases=("--num-ps-pods",), type=positive_int, default=1)
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
    add_flag(
        cluster,
        "--max-workers",
        type=non_negative_int,
        default=0,
        help=f"the most workers `edl-argo scale` may ask for (default: {DEFAULT_MAX_WORKERS}, or "
        "--num-workers if more)",
    )
    add_flag(cluster, "--max-ps-relaunches", type=non_negative_int, default=8)
    add_flag(
        cluster,
        "--min-task-timeout-seconds",
        type=positive_int,
        default=60,
        help="reclaim a task held longer than max(this, 5 x the longest recent task) and replace its worker",
    )
    add_rpc_timeout_flag(cluster)
    add_flag(cluster, "--master-port", type=non_negative_int, default=0, help="0: any free port")
    add_master_timeout_flag(cluster)
    add_kubernetes_flags(parser)


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
    if args.max_workers and args.num_workers > args.max_workers:
        raise ConfigError(f"--num-workers {args.num_workers} is more than --max-workers {args.max_workers}")
    if args.master_port > MAX_PORT:
        raise ConfigError(f"--master-port {args.master_port}: a port is at most {MAX_PORT}")
    if args.backend == "local" and args.job_name and not _JOB_NAME.match(args.job_name):
        raise ConfigError(
            f"--job-name {args.job_name!r}: at most 63 letters, digits, '-', '_' and '.', starting with a"
            " letter or digit (it names the job's files)"
        )
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["job_name"] = args.job_name or f"edl-{uuid.uuid4().hex[:8]}"
    values["model_options"] = model_options_from_args(args)
    if args.backend == "kubernetes":
        values["job_name"] = fit_job_name(values["job_name"])  # <workflow>-<task> may be too long
    if args.distribution_strategy == ALLREDUCE:
        values["num_ps"] = 0
    if args.yaml and args.backend != "kubernetes":
        raise ConfigError("--yaml prints Kubernetes manifests: it needs --backend kubernetes")
    values["kubernetes"] = kubernetes_config_from_args(args) if args.backend == "kubernetes" else None
    return TrainConfig(**values)
