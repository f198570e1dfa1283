"""A pod's CPU limit, and TensorFlow's thread pools sized to it.

TensorFlow sizes its two thread pools (intra-op: the parallel loops of one kernel; inter-op: kernels run
side by side) to the CPUs the process may be scheduled on (``sched_getaffinity``). A Kubernetes CPU limit
(Docker's ``--cpus``) is not an affinity but a CFS bandwidth quota, which TensorFlow does not read
(tensorflow/tensorflow#17206): a pod limited to 2 CPUs on a 32-core node runs 32 threads in each pool; they
use up the quota early in each scheduling period and are throttled for the rest of it. Measured on a
2-core machine in a cgroup with a 1-CPU quota, ``model.fit`` of the dense suite's models ran 1.2-1.6× faster
with both pools sized to one thread than with TensorFlow's default of two (``docs/benchmarks.md``, *CPU
limits*).

:func:`cgroup_cpu_limit` reads the quota of the process's own cgroup and of its ancestors (cgroup v2
``cpu.max``, v1 ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``), as ``/proc/self/cgroup`` and
``/proc/self/mountinfo`` locate them; :func:`thread_pools` turns it into pool sizes; and
:func:`size_tensorflow_threads` applies them before the process's first TensorFlow operation: in each pod
command (``worker``, ``ps``) as it starts, and in the ``evaluate`` and ``predict`` steps once the model
file is imported. Where no quota is set (a machine of one's own, the local backend), TensorFlow's defaults
stay. A pool named by ``TF_NUM_INTRAOP_THREADS`` or ``TF_NUM_INTEROP_THREADS`` is left to that variable.
With or without a quota, the pools' idle threads do not spin (:func:`_stop_thread_spinning`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from edl_argo.log import get_logger

log = get_logger(__name__)

#: The variables through which TensorFlow takes each pool's size from the environment (they win).
INTRA_OP_ENV = "TF_NUM_INTRAOP_THREADS"
INTER_OP_ENV = "TF_NUM_INTEROP_THREADS"


@dataclass(frozen=True)
class ThreadPools:
    """Sizes of TensorFlow's pools (0: TensorFlow's own choice) and why (``source``)."""

    intra_op: int
    inter_op: int
    #: ``cpu_limit`` (sized to the quota), ``cores`` (no quota: TensorFlow's defaults), ``environment``
    #: (both pools named by their variables) or ``started`` (too late: TensorFlow's pools were made).
    source: str
    #: The quota in CPUs, or None when none is set.
    cpu_limit: float | None


def cgroup_cpu_limit(proc_self: Path = Path("/proc/self")) -> float | None:
    """The smallest CPU quota (in CPUs: quota ÷ period) set on this process's cgroup or an ancestor that
    its cgroup mount shows, in cgroup v2 or v1; None where none is set or nothing can be read."""
    limits = [
        limit for mount_point, relative in cpu_cgroups(proc_self) for limit in _quotas(mount_point, relative)
    ]
    return min(limits, default=None)


def thread_pools(
    cpu_limit: float | None, schedulable_cpus: int, environ: Mapping[str, str] = os.environ
) -> ThreadPools:
    """The pool sizes for a process that may run on ``schedulable_cpus`` CPUs under ``cpu_limit``: both
    pools at the limit rounded up (at least 1, at most ``schedulable_cpus``), except a pool its variable
    names (0: TensorFlow reads the variable)."""
    named = {name: bool(environ.get(name, "").strip()) for name in (INTRA_OP_ENV, INTER_OP_ENV)}
    if all(named.values()):
        return ThreadPools(0, 0, "environment", cpu_limit)
    if cpu_limit is None:
        return ThreadPools(0, 0, "cores", None)
    threads = max(1, min(schedulable_cpus, math.ceil(cpu_limit - 1e-9)))
    return ThreadPools(
        0 if named[INTRA_OP_ENV] else threads, 0 if named[INTER_OP_ENV] else threads, "cpu_limit", cpu_limit
    )


def size_tensorflow_threads(
    environ: Mapping[str, str] = os.environ, proc_self: Path = Path("/proc/self")
) -> ThreadPools:
    """Size TensorFlow's pools to this process's CPU limit (:func:`thread_pools`). Call it before the
    process's first TensorFlow operation: the pools are made then, once (after it, TensorFlow's pools stay
    as they are: a model file that ran an operation as it was imported, say; the log says so). Logs the
    sizes (``tensorflow_threads``; at DEBUG level when TensorFlow's defaults stay)."""
    import tensorflow as tf

    pools = thread_pools(cgroup_cpu_limit(proc_self), len(os.sched_getaffinity(0)), environ)
    try:
        if pools.intra_op:
            tf.config.threading.set_intra_op_parallelism_threads(pools.intra_op)
        if pools.inter_op:
            tf.config.threading.set_inter_op_parallelism_threads(pools.inter_op)
    except RuntimeError:  # "... cannot be modified after initialization"
        log.warning("tensorflow_threads_not_sized", reason="operations ran before", cpu_limit=pools.cpu_limit)
        return ThreadPools(0, 0, "started", pools.cpu_limit)
    spinning_off = _stop_thread_spinning()
    report = log.debug if pools.source == "cores" else log.info
    report(
        "tensorflow_threads",
        intra_op=pools.intra_op or "default",
        inter_op=pools.inter_op or "default",
        source=pools.source,
        cpu_limit=pools.cpu_limit,
        thread_spinning="off" if spinning_off else "on",
    )
    return pools


def _stop_thread_spinning() -> bool:
    """Make TensorFlow's pool threads sleep as soon as they run out of work, instead of spinning on a core
    for a while first (``ConfigProto.experimental.disable_thread_spinning``); call before the first
    operation. Whether it is off.

    A pod is not TensorFlow alone: its input prefetch, RPC and supervision threads, and under a CPU quota
    the quota itself, pay for the cores idle pool threads spin on. Measured on a 2-core machine (the dense
    suite's Transformer, ``docs/profile.md``): a lone AllreduceStrategy worker used 8.0-8.2 ms of CPU per
    step without spinning against 9.3-11.5 ms with it, a 1-worker + 1-PS worker 9.4-9.9 ms against
    10.3-11.8 ms, at the same throughput within the machine's noise. TensorFlow has no public call for it:
    the eager context's configuration is set before the context starts; if its private attribute changes,
    spinning stays on."""
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.eager import context

    eager = context.context()
    if getattr(eager, "_context_handle", True) is not None or not hasattr(eager, "_config"):
        return False  # started already (an operation ran), or not the context this was written for
    config = config_pb2.ConfigProto()
    if eager._config is not None:
        config.CopyFrom(eager._config)
    config.experimental.disable_thread_spinning = True
    eager._config = config
    return True


def cpu_cgroups(proc_self: Path = Path("/proc/self")) -> list[tuple[Path, Path]]:
    """Where this process's CPU quota may be set: for each cgroup mount that carries the ``cpu``
    controller (v2: the unified hierarchy), its mount point and the process's cgroup below it (none where
    ``proc_self``'s files cannot be read)."""
    try:
        memberships = (proc_self / "cgroup").read_text().splitlines()
        mounts = (proc_self / "mountinfo").read_text().splitlines()
    except OSError:
        return []
    return list(_cpu_cgroups(memberships, mounts))


def _cpu_cgroups(memberships: list[str], mounts: list[str]) -> Iterator[tuple[Path, Path]]:
    paths: dict[str, str] = {}  # "" for the v2 hierarchy, else each v1 controller: the process's cgroup
    for line in memberships:
        fields = line.split(":", 2)
        if len(fields) == 3:
            for controller in fields[1].split(",") if fields[1] else [""]:
                paths[controller] = fields[2]
    for line in mounts:
        before, separator, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if not separator or len(fields) < 5 or len(tail) < 3:
            continue
        root, mount_point, fstype = fields[3], Path(fields[4]), tail[0]
        if fstype == "cgroup2":
            path = paths.get("")
        elif fstype == "cgroup" and "cpu" in tail[2].split(","):
            path = paths.get("cpu")
        else:
            continue
        if path is not None:
            yield mount_point, Path(_relative(path, root))


def _relative(path: str, root: str) -> str:
    """``path`` below the mount's ``root``: "." where the mount shows the process's cgroup itself, or
    where ``path`` is outside it (a container that sees its own cgroup as the mount's root)."""
    relative = os.path.relpath(path, root)
    return "." if relative.startswith("..") else relative


def _quotas(mount_point: Path, relative: Path) -> Iterator[float]:
    """The CPU quotas set on the cgroup ``relative`` below ``mount_point`` and on its ancestors up to the
    mount point (in a container whose mount shows its own cgroup, the cgroups above it are not visible:
    Kubernetes sets a container's limit on the container's cgroup itself)."""
    for ancestor in (relative, *relative.parents):
        limit = _quota(mount_point / ancestor)
        if limit is not None:
            yield limit


def _quota(folder: Path) -> float | None:
    """The quota set on one cgroup folder (v2 ``cpu.max``, else v1), in CPUs; None where there is none."""
    try:
        fields = (folder / "cpu.max").read_text().split()
        if len(fields) == 2 and fields[0] != "max":
            return int(fields[0]) / int(fields[1])
        if fields:
            return None
    except (OSError, ValueError):
        pass
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None
