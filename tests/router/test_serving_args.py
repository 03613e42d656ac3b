"""``kvserve serve --replicas N``: each replica's own arguments."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvserve.errors import ConfigError
from kvserve.router.serving import ReplicaProcesses, disk_dir_of_replica, free_port


def test_each_replica_gets_a_disk_tier_directory_of_its_own() -> None:
    argv = ["--model", "m", "--kv-disk-dir", "/data/kv", "--kv-disk-gb", "4"]
    assert disk_dir_of_replica(argv, 1) == ["--model", "m", "--kv-disk-dir", os.path.join("/data/kv", "replica-1"),
                                             "--kv-disk-gb", "4"]
    assert disk_dir_of_replica(["--kv-disk-dir=/d"], 0) == ["--kv-disk-dir=" + os.path.join("/d", "replica-0")]
    assert disk_dir_of_replica(["--model", "m"], 3) == ["--model", "m"]  # no disk tier: unchanged


def _replicas(*programs: str) -> ReplicaProcesses:
    """ReplicaProcesses over stand-in processes, each told its port as its one argument."""
    replicas = ReplicaProcesses.__new__(ReplicaProcesses)
    ports = [free_port() for _ in programs]
    replicas.procs = [subprocess.Popen([sys.executable, "-c", program, str(port)])
                      for program, port in zip(programs, ports, strict=True)]
    replicas.urls = [f"http://127.0.0.1:{port}" for port in ports]
    return replicas


LISTENS = ("import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); "
           "time.sleep(60)")


def test_the_start_up_wait_ends_when_every_replica_listens_or_one_has_exited() -> None:
    """A replica that exits at start-up (a model path mistyped) ended the gateway's wait only after its 180 s
    deadline, with "did not answer"; now at once, with its status."""
    replicas = _replicas(LISTENS, "import sys, time; time.sleep(0.5); sys.exit(2)")
    try:
        with pytest.raises(ConfigError, match=r"replica 1 \(http://127.0.0.1:\d+\) exited with status 2"):
            replicas.wait_until_listening(poll_s=0.05)
    finally:
        replicas.stop(timeout_s=5)
    replicas = _replicas(LISTENS, LISTENS)
    try:
        replicas.wait_until_listening(poll_s=0.05)
        assert all(proc.poll() is None for proc in replicas.procs)
    finally:
        replicas.stop(timeout_s=5)


def test_the_gateway_gives_requests_in_flight_its_grace_period(monkeypatch) -> None:
    """It cut them after a fixed 5 s whatever --shutdown-grace-period said."""
    from kvserve.router import serving
    from kvserve.router.gateway import Gateway
    from kvserve.serving_config import RouterConfig

    async def nothing(self) -> None:
        return None

    graces: list[float | None] = []

    async def serve(self) -> None:
        graces.append(self.config.timeout_graceful_shutdown)

    monkeypatch.setattr(Gateway, "start", nothing)
    monkeypatch.setattr(Gateway, "stop", nothing)
    monkeypatch.setattr(serving._Server, "serve", serve)
    serving.run_router(RouterConfig(replicas=("http://127.0.0.1:9",), shutdown_grace_period_s=42.0))
    assert graces == [42.0]
