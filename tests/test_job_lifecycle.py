"""A job ends when its step ends: SIGTERM stops a local job, and pods whose master is gone for good end
after ``--master-timeout``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.k8s_helpers import job_selector, kubernetes_ps_port, role_rules
from tests.k8s_stand_in import KubernetesStandIn
from tests.test_master_failover import no_pods_left_behind, saved_state, train_command, training_progress


def live_processes_of_groups(groups: set[int]) -> list[int]:
    """Pids of the processes (zombies excluded) whose process group is one of ``groups``."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] not in ("Z", "X") and int(fields[2]) in groups:
            alive.append(int(entry.name))
    return alive


def pod_groups(run_dir: Path) -> set[int]:
    """The process groups of the local pods recorded under ``run_dir``."""
    import json

    groups = set()
    for record in run_dir.glob("pods/*/*/supervisor"):
        try:
            groups.add(int(json.loads(record.read_text())["pgid"]))
        except (OSError, ValueError, KeyError):
            continue
    return groups


def start_until_training(command: list[str], env: dict[str, str], output: Path, log: Path, progress: float):
    """Start ``command`` and return it once ``progress`` of the training tasks are done."""
    with open(log, "w") as sink:
        master = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while training_progress(saved_state(output)) < progress:
        if master.poll() is not None or time.monotonic() > deadline:
            master.kill()
            pytest.fail(f"the job never reached {progress:.0%} of its tasks:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    return master


def wait_until_gone(groups: set[int], seconds: float) -> float:
    """Seconds until no process of ``groups`` is left; fails after ``seconds``."""
    started = time.monotonic()
    while live_processes_of_groups(groups):
        assert time.monotonic() - started < seconds, f"still running: {live_processes_of_groups(groups)}"
        time.sleep(0.2)
    return time.monotonic() - started


@pytest.mark.timeout(300)
def test_sigterm_stops_a_local_job_and_every_pod_within_30_seconds(digits_data: Path, tmp_path: Path) -> None:
    output, run_dir = tmp_path / "job", tmp_path / "run"
    env = {**os.environ, "EDL_RUN_DIR": str(run_dir), "TF_CPP_MIN_LOG_LEVEL": "2"}
    with no_pods_left_behind(run_dir):
        master = start_until_training(
            train_command(digits_data, output), env, output, tmp_path / "master.log", 0.1
        )
        groups = pod_groups(run_dir)
        assert len(groups) == 3  # 2 workers, 1 PS
        master.send_signal(signal.SIGTERM)
        assert master.wait(30) == 143, (tmp_path / "master.log").read_text()[-3000:]
        wait_until_gone(groups, 30)
    log = (tmp_path / "master.log").read_text()
    assert "stop_requested" in log and "edl-argo train: terminated" in log


@pytest.mark.timeout(300)
def test_pods_of_a_sigkilled_local_master_end_after_the_master_timeout(
    digits_data: Path, tmp_path: Path
) -> None:
    output, run_dir = tmp_path / "job", tmp_path / "run"
    env = {**os.environ, "EDL_RUN_DIR": str(run_dir), "TF_CPP_MIN_LOG_LEVEL": "2"}
    timeout = 8
    flags = ("--master-timeout", str(timeout), "--checkpoint-steps", "5")
    with no_pods_left_behind(run_dir):
        master = start_until_training(
            train_command(digits_data, output, *flags), env, output, tmp_path / "master.log", 0.1
        )
        groups = pod_groups(run_dir)
        assert len(groups) == 3
        master.kill()
        master.wait()
        killed = time.monotonic()
        time.sleep(timeout / 2)
        assert len(live_processes_of_groups(groups)) >= 3, "the pods must wait --master-timeout for a master"
        wait_until_gone(groups, timeout + 30 - (time.monotonic() - killed))
    ps_log = next(run_dir.glob("pods/*/ps-0.*/stderr")).read_text()
    assert "ps_stopping" in ps_log and "reason=master_lost" in ps_log and "ps_stopped" in ps_log
    for worker in (0, 1):
        worker_log = next(run_dir.glob(f"pods/*/worker-{worker}.*/stderr")).read_text()
        assert "master_lost" in worker_log


# -- Kubernetes (the stand-in) -------------------------------------------------------------------------


def kubernetes_env(cluster: KubernetesStandIn, run_dir: Path) -> dict[str, str]:
    env = {
        **os.environ,
        "EDL_RUN_DIR": str(run_dir),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "EDL_KUBERNETES_API": cluster.url,
    }
    for name in ("EDL_POD_NAME", "EDL_POD_UID", "EDL_WORKFLOW_NAME", "EDL_WORKFLOW_UID", "POD_IP"):
        env.pop(name, None)
    return env


KUBERNETES_FLAGS = ("--backend", "kubernetes", "--image", "edl-argo:test")


def running_pods(cluster: KubernetesStandIn, job: str) -> list[str]:
    return [
        pod["metadata"]["name"]
        for pod in cluster.objects("pods", job_selector(job))
        if (pod.get("status") or {}).get("phase") in ("Pending", "Running")
    ]


def unrelated_objects(cluster: KubernetesStandIn) -> dict[str, list[str]]:
    """Create objects of another job and of nobody, which a clean-up must leave alone; returns their names."""
    other = {"app.kubernetes.io/name": "edl-argo", "app.kubernetes.io/instance": "failover-2"}
    ps = {**other, "edl-argo/role": "ps", "edl-argo/id": "0"}
    cluster.create(
        "services", {"metadata": {"name": "failover-2-ps-0", "labels": ps}, "spec": {"ports": [{"port": 1}]}}
    )
    cluster.create("services", {"metadata": {"name": "unrelated"}, "spec": {"ports": [{"port": 1}]}})
    cluster.create(
        "networkpolicies",
        {"metadata": {"name": "failover-2-grpc", "labels": other}, "spec": {"podSelector": {}}},
    )
    cluster.create("secrets", {"metadata": {"name": "edl-argo-storage"}, "stringData": {"a": "b"}})
    return {
        "services": ["failover-2-ps-0", "unrelated"],
        "networkpolicies": ["failover-2-grpc"],
        "secrets": ["edl-argo-storage"],
    }


def names(cluster: KubernetesStandIn, resource: str, selector: str = "") -> list[str]:
    return sorted(o["metadata"]["name"] for o in cluster.objects(resource, selector))


@pytest.mark.timeout(400)
def test_the_exit_hook_of_a_stopped_step_removes_the_job_and_nothing_else(
    digits_data: Path, tmp_path: Path
) -> None:
    output = tmp_path / "job"
    with KubernetesStandIn(tmp_path / "k8s", echo_logs=False) as cluster:
        cluster.enforce_rules(role_rules())
        env = kubernetes_env(cluster, tmp_path / "run")
        flags = (*KUBERNETES_FLAGS, "--ps-port", str(kubernetes_ps_port()))
        keep = unrelated_objects(cluster)
        master = start_until_training(
            train_command(digits_data, output, *flags), env, output, tmp_path / "master.log", 0.1
        )
        master.send_signal(signal.SIGTERM)  # argo stop: the step's container gets SIGTERM ...
        assert master.wait(30) != 0
        assert len(running_pods(cluster, "failover")) == 3  # ... and the master leaves its pods (adoption)
        assert names(cluster, "networkpolicies", job_selector("failover")) == ["failover-grpc"]
        hook = subprocess.run(
            [str(Path(sys.executable).parent / "edl-argo"), "cleanup", "--job-name", "failover"],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert hook.returncode == 0, hook.stderr[-3000:]
        for resource in ("pods", "services", "networkpolicies"):
            assert names(cluster, resource, job_selector("failover")) == [], resource
        for resource, kept in keep.items():
            assert set(kept) <= set(names(cluster, resource)), resource
        deleted = {(c.resource, c.name) for c in cluster.calls if c.verb == "delete"}
        assert {name for resource, name in deleted if resource == "pods"} == {
            "failover-worker-0",
            "failover-worker-1",
            "failover-ps-0",
        }
        assert not {name for _, name in deleted} & {n for kept in keep.values() for n in kept}


@pytest.mark.slow  # 50 s; the same timeout ends the pods of a local master in make test
@pytest.mark.timeout(400)
def test_pods_of_a_sigkilled_master_on_kubernetes_end_after_the_master_timeout(
    digits_data: Path, tmp_path: Path
) -> None:
    output = tmp_path / "job"
    timeout = 8
    with KubernetesStandIn(tmp_path / "k8s", echo_logs=False) as cluster:
        cluster.enforce_rules(role_rules())
        env = kubernetes_env(cluster, tmp_path / "run")
        flags = (*KUBERNETES_FLAGS, "--ps-port", str(kubernetes_ps_port()), "--master-timeout", str(timeout))
        master = start_until_training(
            train_command(digits_data, output, *flags), env, output, tmp_path / "master.log", 0.1
        )
        assert len(running_pods(cluster, "failover")) == 3
        master.kill()
        master.wait()
        killed = time.monotonic()
        time.sleep(timeout / 2)
        assert len(running_pods(cluster, "failover")) == 3, "the pods must wait --master-timeout for a master"
        cluster.wait_for(
            lambda: not running_pods(cluster, "failover"),
            timeout + 30 - (time.monotonic() - killed),
            "the pods to end",
        )
