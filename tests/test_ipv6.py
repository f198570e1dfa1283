"""IPv6: every address is ``host:port`` with an IPv6 host in brackets, and a whole job runs on ``::1``."""

from __future__ import annotations

from pathlib import Path

import pytest

from edl_argo import log
from edl_argo.addresses import join_host_port, split_host_port
from edl_argo.master.job import TrainingJob
from tests.engine_helpers import assert_no_record_lost, digits_config


@pytest.mark.parametrize(
    ("host", "port", "address"),
    [
        ("10.1.2.3", 2222, "10.1.2.3:2222"),
        ("::1", 2222, "[::1]:2222"),
        ("fd00:10:244::5", "2221", "[fd00:10:244::5]:2221"),
        ("[::1]", 5, "[::1]:5"),
        ("job-ps-0.ns.svc", 2222, "job-ps-0.ns.svc:2222"),
    ],
)
def test_ipv6_hosts_are_joined_in_brackets_and_split_back(host: str, port: int | str, address: str) -> None:
    assert join_host_port(host, port) == address
    assert split_host_port(address) == (host.strip("[]"), int(port))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(  # PS addresses are gRPC's (join_host_port, tested above); the raw-socket
    # collective transport is the path that differs, so the PS variant is slow
    "strategy",
    [pytest.param("ParameterServerStrategy", marks=pytest.mark.slow), "AllreduceStrategy"],
)
def test_a_local_job_runs_on_ipv6_loopback(
    digits_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    strategy: str,
) -> None:
    log.configure("INFO")
    monkeypatch.setenv("POD_IP", "::1")  # the master, and the pods it starts, serve on ::1
    monkeypatch.setenv("EDL_RUN_DIR", str(tmp_path / "run"))  # this job's pods only
    num_ps = 1 if strategy == "ParameterServerStrategy" else 0
    config = digits_config(
        digits_data, tmp_path / "ipv6", num_epochs=1, distribution_strategy=strategy, num_ps=num_ps
    )
    metrics = TrainingJob.load(config).run()
    assert_no_record_lost(metrics)
    lines = capfd.readouterr().err.splitlines()
    started = [line for line in lines if "worker_started" in line]
    assert len(started) == 2 and all("master=[::1]:" in line for line in started), started
    if num_ps:
        assert all("ps=[::1]:" in line for line in started)
        assert any("ps_started address=[::1]:" in line for line in lines)
    else:
        assert all("collective=[::1]:" in line for line in started)
