"""Run a parameter server: ``edl-argo ps``.

The server restores the newest checkpoint of its ``--ps-id`` from ``--checkpoint-dir`` when there is one
(logging ``ps_restored``), serves ``edl_argo.ParameterServer`` on ``--host:--port`` and runs until SIGTERM
or SIGINT, or until its master (``--master-addr``) has been unreachable for ``--master-timeout`` seconds
(:mod:`edl_argo.rpc.master_watch`). It then stops accepting requests, lets running ones finish, saves a
last checkpoint when checkpoints are on and the state changed since the last one, and exits 0.

``--checkpoint-dir`` without ``--checkpoint-steps`` only restores; ``--checkpoint-steps`` needs a
``--checkpoint-dir``.
"""

from __future__ import annotations

import argparse
import signal
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from edl_argo import log
from edl_argo.addresses import join_host_port
from edl_argo.checkpoint import open_checkpoint_storage
from edl_argo.errors import ConfigError
from edl_argo.flags import pod_host
from edl_argo.model.contract import ModelOptions, model_options_from_args
from edl_argo.proto import ps_pb2_grpc
from edl_argo.ps.serving import add_chunked_service, ps_server_limits, start_tensor_port
from edl_argo.rpc.auth import SECRET_ENV, JobSecret, secret_from_env, server_interceptor
from edl_argo.rpc.channel import RPC_TIMEOUT_SECONDS, make_server
from edl_argo.rpc.health import add_health_service
from edl_argo.rpc.master_watch import MasterWatch
from edl_argo.rpc.tensor_port import TensorPortServer
from edl_argo.rpc.tls import TlsFiles, add_port, load_tls_dir
from edl_argo.settings import add_role_settings
from edl_argo.storage.base import Storage

if TYPE_CHECKING:  # TensorFlow: imported when a server is created, not for --help (see edl_argo.cli)
    from edl_argo.model.optimizer import OptimizerFactory
    from edl_argo.ps.servicer import ParameterServerServicer

_log = log.get_logger(__name__)

#: Seconds running requests get to finish after SIGTERM, and the last checkpoint to be written.
STOP_GRACE_SECONDS = 10.0


@dataclass(frozen=True)
class PSConfig:
    """The settings of one parameter server (the flags of ``edl-argo ps``)."""

    model_def: str | None = None
    model_options: ModelOptions = field(default_factory=ModelOptions)
    ps_id: int = 0
    num_ps: int = 1
    host: str = field(default_factory=pod_host)
    port: int = 2222
    grads_to_wait: int = 1
    use_async: bool = False
    lr_staleness_modulation: bool = False
    sync_version_tolerance: int = 0
    max_embedding_rows: int = 0
    checkpoint_dir: str | None = None
    checkpoint_steps: int = 0
    rpc_timeout_seconds: float = RPC_TIMEOUT_SECONDS
    #: The most workers the job may have (0: unknown): the calls admitted at once follow it.
    max_workers: int = 0
    #: The tensor port's port (0: any free port; None: no tensor port).
    tensor_port: int | None = None


def create_servicer(
    config: PSConfig, optimizer_factory: OptimizerFactory | None = None, storage: Storage | None = None
) -> ParameterServerServicer:
    """The servicer of ``config``, restored from the newest checkpoint if there is one.

    ``optimizer_factory`` defaults to ``optimizer()`` of ``config.model_def`` (with the learning rate of its
    ``LearningRateScheduler``, if ``callbacks()`` returns one); ``storage`` to
    ``open_storage(config.checkpoint_dir)`` (None when there is no checkpoint dir).
    Raises :class:`ConfigError` for inconsistent settings.
    """
    from edl_argo.ps.checkpoint import ps_checkpointer, restore_latest
    from edl_argo.ps.servicer import ParameterServerServicer

    if config.checkpoint_steps < 0:
        raise ConfigError(f"--checkpoint-steps must be at least 0, got {config.checkpoint_steps}")
    learning_rate_at = None
    if optimizer_factory is None:
        if not config.model_def:
            raise ConfigError("--model-def is required: the parameter server builds the model's optimizer()")
        from edl_argo.model.loader import load_model_spec

        spec = load_model_spec(config.model_def, config.model_options)
        optimizer_factory, learning_rate_at = spec.optimizer, spec.learning_rate_at
    if storage is None:
        storage = open_checkpoint_storage(config.checkpoint_dir, config.checkpoint_steps)
    state = None
    checkpointer = None
    if storage is not None:
        state = restore_latest(storage, config.ps_id)
        if state is not None:
            _log.info(
                "ps_restored", version=state.version, checkpoint=storage.describe(f"ps-{config.ps_id}/")
            )
        checkpointer = ps_checkpointer(storage, config.ps_id, config.checkpoint_steps)
    return ParameterServerServicer(
        optimizer_factory,
        ps_id=config.ps_id,
        num_ps=config.num_ps,
        use_async=config.use_async,
        grads_to_wait=config.grads_to_wait,
        lr_staleness_modulation=config.lr_staleness_modulation,
        sync_version_tolerance=config.sync_version_tolerance,
        max_embedding_rows=config.max_embedding_rows,
        checkpointer=checkpointer,
        initial_state=state,
        learning_rate_at=learning_rate_at,
    )


class ServingPS:
    """A parameter server's gRPC server and its tensor port (if any), stopped together; otherwise the gRPC
    server's methods."""

    def __init__(self, server: grpc.Server, tensor_port: TensorPortServer | None) -> None:
        self._server = server
        self.tensor_port = tensor_port

    def stop(self, grace: float | None) -> threading.Event:
        """Stop the gRPC server as ``grpc.Server.stop`` does, and the tensor port as it: the calls being
        served get ``grace`` seconds to finish and answer. Returns when the tensor port is closed."""
        stopped = self._server.stop(grace)
        if self.tensor_port is not None:
            self.tensor_port.stop(grace or 0.0)
        return stopped

    def __getattr__(self, name: str) -> object:
        return getattr(self._server, name)


def start_server(
    servicer: ParameterServerServicer,
    host: str,
    port: int,
    secret: JobSecret | None = None,
    service: str = "ps",
    rpc_timeout_seconds: float = RPC_TIMEOUT_SECONDS,
    tls: TlsFiles | None = None,
    max_workers: int = 0,
    tensor_port: int | None = None,
) -> tuple[ServingPS, int]:
    """Serve ``servicer`` on ``host:port`` (port 0 picks a free one); returns the server and its port.
    With the job's ``secret``, only calls with a credential of that job are served
    (:mod:`edl_argo.rpc.auth`); with ``tls``, over TLS only (:mod:`edl_argo.rpc.tls`). The server bounds its
    clients as :func:`~edl_argo.ps.serving.ps_server_limits` says for callers whose deadline is
    ``rpc_timeout_seconds``, of a job of ``max_workers`` workers at most. With a ``tensor_port`` (0: any
    free port), the push and the dense pull are served on it too (:mod:`edl_argo.rpc.tensor_port`), TLS
    with ``tls``."""
    limits = ps_server_limits(rpc_timeout_seconds, max_workers)
    server = make_server(
        limits=limits, interceptors=[server_interceptor(secret, service)] if secret is not None else []
    )
    ps_pb2_grpc.add_ParameterServerServicer_to_server(servicer, server)
    add_chunked_service(server, servicer, limits)
    add_health_service(server)  # the master's liveness check (edl_argo.master.ps_watch)
    address = join_host_port(host, port)
    try:
        bound = add_port(server, address, tls)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise ConfigError(f"cannot listen on {address}: the address is in use or not local")
    server.start()
    tensors = None
    if tensor_port is not None:
        tensors = start_tensor_port(servicer, host, tensor_port, secret, limits, tls)
    _log.info(
        "ps_started",
        address=join_host_port(host, bound),
        version=servicer.version,
        tls=tls is not None,
        tensor_port=servicer.tensor_port,
    )
    return ServingPS(server, tensors), bound


def serve(
    config: PSConfig, optimizer_factory: OptimizerFactory | None = None, storage: Storage | None = None
) -> ServingPS:
    """Start the parameter server of ``config`` (see :func:`create_servicer`); returns the started server."""
    servicer = create_servicer(config, optimizer_factory, storage)
    server, _ = start_server(
        servicer,
        config.host,
        config.port,
        rpc_timeout_seconds=config.rpc_timeout_seconds,
        max_workers=config.max_workers,
        tensor_port=config.tensor_port,
    )
    return server


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``edl-argo ps``."""
    parser = subparsers.add_parser(
        "ps",
        help="run a parameter server",
        description="Serve one partition of the model's parameters to the workers until SIGTERM.",
    )
    add_role_settings(parser, "ps")
    parser.set_defaults(run=run_ps)


def run_ps(args: argparse.Namespace) -> int:
    """Run ``edl-argo ps`` until SIGTERM or SIGINT; returns the exit code."""
    log.configure(args.log_level, component=f"ps-{args.ps_id}")
    config = PSConfig(
        model_def=args.model_def,
        model_options=model_options_from_args(args),
        ps_id=args.ps_id,
        num_ps=args.num_ps,
        host=args.host or pod_host(),
        port=args.port,
        grads_to_wait=args.grads_to_wait,
        use_async=args.use_async,
        lr_staleness_modulation=args.lr_staleness_modulation,
        sync_version_tolerance=args.sync_version_tolerance,
        max_embedding_rows=args.max_embedding_rows,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_steps=args.checkpoint_steps,
        rpc_timeout_seconds=args.rpc_timeout_seconds,
        max_workers=args.max_workers,
        tensor_port=None if args.tensor_port < 0 else args.tensor_port,
    )
    secret = secret_from_env()
    if secret is None:
        raise ConfigError(
            f"{SECRET_ENV} is not set: a parameter server serves only the job whose master started it"
            " (the master hands its pods the job's secret)"
        )
    tls = load_tls_dir(args.tls_dir) if args.tls_dir else None
    servicer = create_servicer(config)
    server, _ = start_server(
        servicer,
        config.host,
        config.port,
        secret,
        f"ps-{config.ps_id}",
        config.rpc_timeout_seconds,
        tls,
        config.max_workers,
        config.tensor_port,
    )
    stop = threading.Event()

    def request_stop(signum: int, _frame: object) -> None:
        _log.info("ps_stopping", signal=signal.Signals(signum).name)
        stop.set()

    def master_lost() -> None:
        _log.info("ps_stopping", reason="master_lost")
        stop.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    watch = (
        MasterWatch(args.master_addr, args.master_timeout, master_lost, tls=tls) if args.master_addr else None
    )
    if watch is not None:
        watch.start()
    try:
        while not stop.wait(1.0):
            pass
    finally:
        if watch is not None:
            watch.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.stop(STOP_GRACE_SECONDS).wait()
        if not servicer.save_checkpoint(timeout=STOP_GRACE_SECONDS):
            _log.warning("ps_last_checkpoint_unfinished", version=servicer.version)
    _log.info("ps_stopped", version=servicer.version)
    return 0
