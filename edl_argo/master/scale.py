"""``edl-argo scale JOB --workers N``: change the number of workers of a running job.

The call presents the job's credential as ``admin``: that of ``EDL_JOB_SECRET`` (on Kubernetes, key
``job-secret`` of the Secret ``<job>-auth``), else, for a local job, the secret its master registered on
this machine (:mod:`edl_argo.master.registry`). A master serving TLS (:mod:`edl_argo.rpc.tls`) is reached
with the files of ``--tls-dir``, else, for a local job, those its master registered."""

from __future__ import annotations

import argparse

import grpc

from edl_argo.errors import ConfigError
from edl_argo.flags import add_flag, non_negative_int
from edl_argo.master.registry import master_address, master_secret, master_tls_dir
from edl_argo.master.state_store import COMMIT_WAIT_SECONDS
from edl_argo.proto import master_pb2, master_pb2_grpc
from edl_argo.rpc.auth import ADMIN_IDENTITY, ClientCredential, credential_from_env
from edl_argo.rpc.channel import make_channel
from edl_argo.rpc.tls import TlsFiles, load_tls_dir

#: How long `edl-argo scale` waits for the master's answer. The master answers once the request is saved
#: (:class:`~edl_argo.master.state_store.DurableMasterServicer`), which takes at most
#: :data:`~edl_argo.master.state_store.COMMIT_WAIT_SECONDS`; a job saves nothing before its pods have
#: started, so a request made while they start (a local pod template still importing) waits for them.
#: The margin covers the request's own work and a loaded machine.
SCALE_DEADLINE_SECONDS = COMMIT_WAIT_SECONDS + 15.0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("scale", help="change the number of workers of a running job")
    parser.add_argument("job", help="the job's name (--job-name of `edl-argo train`)")
    add_flag(parser, "--workers", type=non_negative_int, required=True, help="target number of workers")
    add_flag(parser, "--master-addr", default="", help="host:port of the master (default: look the job up)")
    add_flag(
        parser,
        "--tls-dir",
        default="",
        help="folder of the TLS files of a master that serves TLS (tls.crt, optionally ca.crt; default: "
        "those a local job's master registered)",
    )
    parser.set_defaults(run=run_scale)


def scale_workers(
    address: str,
    workers: int,
    timeout: float = SCALE_DEADLINE_SECONDS,
    credential: ClientCredential | None = None,
    tls: TlsFiles | None = None,
) -> int:
    stub = master_pb2_grpc.MasterStub(make_channel(address, credential, tls))
    try:
        response = stub.ScaleWorkers(master_pb2.ScaleWorkersRequest(num_workers=workers), timeout=timeout)
    except grpc.RpcError as error:
        raise ConfigError(f"master at {address} did not accept the request: {error.details()}") from None
    return response.num_workers


def run_scale(args: argparse.Namespace) -> int:
    address = args.master_addr or master_address(args.job)
    credential = credential_from_env()
    if credential is None and not args.master_addr:
        secret = master_secret(args.job)
        credential = secret.credential(ADMIN_IDENTITY) if secret is not None else None
    tls_dir = args.tls_dir or ("" if args.master_addr else master_tls_dir(args.job))
    tls = load_tls_dir(tls_dir, server=False) if tls_dir else None
    target = scale_workers(address, args.workers, credential=credential, tls=tls)
    print(f"job {args.job}: target workers {target}")
    return 0
