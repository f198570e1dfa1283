"""TensorFlow's thread pools sized to a pod's CPU limit (edl_argo/cpu_limit.py).

The quota is read from cgroup trees written here as files (v1 and v2, a container that sees its own cgroup
as its mount's root, a quota on an ancestor); the sizes are then applied in a fresh interpreter, before its
first operation; and every pod command logs the sizes it runs with.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from edl_argo.cpu_limit import INTER_OP_ENV, INTRA_OP_ENV, ThreadPools, cgroup_cpu_limit, thread_pools
from tests.engine_helpers import DIGITS_MODEL

_V1_MOUNT = "35 25 0:30 {root} {mount_point} rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
_V2_MOUNT = "36 25 0:31 {root} {mount_point} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
_OTHER_MOUNTS = (
    "22 1 0:21 / /proc rw,nosuid - proc proc rw\n"
    "37 25 0:32 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n"
)


def proc_self(tmp_path: Path, cgroup: str, mounts: str) -> Path:
    """A ``/proc/self`` with ``cgroup`` and ``mountinfo`` as given."""
    folder = tmp_path / "proc-self"
    folder.mkdir()
    (folder / "cgroup").write_text(cgroup)
    (folder / "mountinfo").write_text(_OTHER_MOUNTS + mounts)
    return folder


def write(folder: Path, **files: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("__", ".")).write_text(text + "\n")


def environment_without_pool_variables() -> dict[str, str]:
    """This process's environment without the variables that name TensorFlow's pool sizes."""
    return {name: value for name, value in os.environ.items() if name not in (INTRA_OP_ENV, INTER_OP_ENV)}


def v1_quota(folder: Path, quota_us: int, period_us: int = 100_000) -> None:
    write(folder, cgroup__procs="", cpu__cfs_quota_us=str(quota_us), cpu__cfs_period_us=str(period_us))


def test_a_v1_quota_is_read_in_the_process_cgroup_and_the_smallest_of_its_ancestors_wins(
    tmp_path: Path,
) -> None:
    mount = tmp_path / "cpu"
    v1_quota(mount, -1)
    v1_quota(mount / "kubepods", 400_000)  # the pods' 4 CPUs
    v1_quota(mount / "kubepods" / "pod1", 250_000, 100_000)  # the pod: 2.5 CPUs
    v1_quota(mount / "kubepods" / "pod1" / "c1", -1)  # the container: no quota of its own
    memberships = "4:memory:/kubepods/pod1/c1\n3:cpu,cpuacct:/kubepods/pod1/c1\n0::/\n"
    proc = proc_self(tmp_path, memberships, _V1_MOUNT.format(root="/", mount_point=mount))

    assert cgroup_cpu_limit(proc) == 2.5


def test_a_container_that_sees_its_own_cgroup_as_the_mount_root_reads_its_quota_there(
    tmp_path: Path,
) -> None:
    """Docker and Kubernetes without a cgroup namespace: ``/proc/self/cgroup`` names the host's path, the
    mount shows that cgroup itself (its ``root`` field is the same path)."""
    mount = tmp_path / "cpu"
    v1_quota(mount, 50_000)
    proc = proc_self(
        tmp_path,
        "3:cpu,cpuacct:/docker/abc\n",
        _V1_MOUNT.format(root="/docker/abc", mount_point=mount),
    )

    assert cgroup_cpu_limit(proc) == 0.5


@pytest.mark.parametrize(("cpu_max", "limit"), [("150000 100000", 1.5), ("max 100000", None)])
def test_a_v2_quota_is_read_from_cpu_max(tmp_path: Path, cpu_max: str, limit: float | None) -> None:
    mount = tmp_path / "unified"
    write(mount, cgroup__procs="")
    write(mount / "pod" / "ctr", cgroup__procs="", cpu__max=cpu_max)
    proc = proc_self(tmp_path, "0::/pod/ctr\n", _V2_MOUNT.format(root="/", mount_point=mount))

    assert cgroup_cpu_limit(proc) == limit


def test_no_quota_anywhere_or_nothing_readable_is_no_limit(tmp_path: Path) -> None:
    mount = tmp_path / "cpu"
    v1_quota(mount, -1)
    v1_quota(mount / "job", -1)
    unlimited = proc_self(tmp_path, "3:cpu,cpuacct:/job\n", _V1_MOUNT.format(root="/", mount_point=mount))

    assert cgroup_cpu_limit(unlimited) is None
    assert cgroup_cpu_limit(tmp_path / "no-proc") is None


def test_pools_are_the_limit_rounded_up_within_the_cpus_and_a_named_pool_is_left_to_its_variable() -> None:
    assert thread_pools(2.5, 32, {}) == ThreadPools(3, 3, "cpu_limit", 2.5)
    assert thread_pools(0.2, 32, {}) == ThreadPools(1, 1, "cpu_limit", 0.2)
    assert thread_pools(2.0, 32, {}) == ThreadPools(2, 2, "cpu_limit", 2.0)
    assert thread_pools(16.0, 4, {}) == ThreadPools(4, 4, "cpu_limit", 16.0)
    assert thread_pools(None, 32, {}) == ThreadPools(0, 0, "cores", None)
    assert thread_pools(2.0, 32, {INTRA_OP_ENV: "6"}) == ThreadPools(0, 2, "cpu_limit", 2.0)
    assert thread_pools(2.0, 32, {INTRA_OP_ENV: "6", INTER_OP_ENV: "1"}) == ThreadPools(
        0, 0, "environment", 2.0
    )


_APPLY = (
    "import sys\n"
    "from pathlib import Path\n"
    "from edl_argo.tensorflow_import import import_tensorflow\n"
    "import_tensorflow()\n"
    "import tensorflow as tf\n"
    "from edl_argo.cpu_limit import size_tensorflow_threads\n"
    "if sys.argv[2] == 'late':\n"
    "    tf.ones([1])\n"
    "print(size_tensorflow_threads(proc_self=Path(sys.argv[1])).source)\n"
    "print(float(tf.reduce_sum(tf.ones([4]))))\n"
    "print(tf.config.threading.get_intra_op_parallelism_threads(),"
    " tf.config.threading.get_inter_op_parallelism_threads())\n"
    "from tensorflow.python.eager import context\n"
    "print('spinning', 'off' if context.context().config.experimental.disable_thread_spinning else 'on')\n"
)


@pytest.mark.parametrize(
    ("when", "environ", "expected"),
    [
        ("first", {}, ["cpu_limit", "4.0", "1 1", "spinning off"]),
        ("first", {INTER_OP_ENV: "2"}, ["cpu_limit", "4.0", "1 0", "spinning off"]),
        ("first", {INTRA_OP_ENV: "2", INTER_OP_ENV: "2"}, ["environment", "4.0", "0 0", "spinning off"]),
        ("late", {}, ["started", "4.0", "0 0", "spinning on"]),
    ],
)
def test_a_process_under_a_quota_runs_its_operations_with_the_pools_sized_to_it(
    tmp_path: Path, when: str, environ: dict[str, str], expected: list[str]
) -> None:
    """Sized before the first operation, their idle threads not spinning; after it, left as they are, and
    the process goes on."""
    mount = tmp_path / "cpu"
    v1_quota(mount, 100_000)
    proc = proc_self(tmp_path, "3:cpu,cpuacct:/\n", _V1_MOUNT.format(root="/", mount_point=mount))
    base = environment_without_pool_variables()
    done = subprocess.run(
        [sys.executable, "-c", _APPLY, str(proc), when],
        env={**base, **environ},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == expected


@pytest.mark.parametrize("command", ["worker", "ps", "evaluate", "predict"])
def test_every_command_that_runs_a_model_sizes_its_pools_first(command: str, tmp_path: Path) -> None:
    """The pod commands size the pools as they start, the evaluate and predict steps once the model file
    is imported (here, each on a configuration it then refuses), and each says with what: on this machine,
    what its own cgroup gives."""
    absent = str(tmp_path / "absent")
    pod = ["--model-def", "m.py", "--tls-dir", absent, "--log-level", "DEBUG"]
    step = ["--model-def", DIGITS_MODEL, "--model", absent, "--data", absent, "--log-level", "DEBUG"]
    flags = {
        "worker": ["worker", "--worker-id", "0", "--master-addr", "127.0.0.1:1", *pod],
        "ps": ["ps", *pod],
        "evaluate": ["evaluate", *step],
        "predict": ["predict", *step, "--output", str(tmp_path / "predictions")],
    }[command]
    base = environment_without_pool_variables()
    done = subprocess.run(
        [sys.executable, "-m", "edl_argo.cli", *flags],
        env=base,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    assert done.returncode == 2, done.stderr
    expected = thread_pools(cgroup_cpu_limit(), len(os.sched_getaffinity(0)), base)
    events = [line for line in done.stderr.splitlines() if " tensorflow_threads " in line]
    assert len(events) == 1, done.stderr
    assert f"source={expected.source} cpu_limit={expected.cpu_limit}" in events[0]
    assert "thread_spinning=off" in events[0]
