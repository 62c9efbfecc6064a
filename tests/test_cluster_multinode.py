"""A real two-node Ray cluster on this machine: a head (``ray start --head`` on a free port, not
6379) advertising one unit of ``strata_worker`` and a second node joined with ``ray start --address``
advertising four, each with a temp dir of its own and token auth. The scenario itself
(``tests/multinode_scenario.py``) runs in a fresh pytest process connected to that cluster (this
process may already be a driver of the suite's local Ray): two replicas placed on both nodes serve
completions over HTTP, a killed replica is routed around and comes back, flush and rollout jobs reach
and verify every replica, and a replica restarted with an empty cache is served from L3.

Teardown kills only this cluster's processes, by PID (those whose command line names its temp
dirs); ``ray stop`` would stop every Ray on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
SCENARIO = REPO / "tests" / "multinode_scenario.py"
CHILD_ENV = "STRATA_MULTINODE_ADDRESS"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ports() -> list[str]:
    """Every port Ray would otherwise take at a fixed default (other clusters run on this machine)."""
    names = ("--node-manager-port", "--object-manager-port", "--metrics-export-port", "--runtime-env-agent-port",
             "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port")
    return [f"{name}={_free_port()}" for name in names]


class LocalCluster:
    """A head and one worker node started with ``ray start``; ``stop`` kills their processes by PID."""

    def __init__(self) -> None:
        self.dirs = [Path(tempfile.mkdtemp(prefix="strata-mn-h-")), Path(tempfile.mkdtemp(prefix="strata-mn-w-"))]
        self.l3 = Path(tempfile.mkdtemp(prefix="strata-mn-l3-"))
        token = self.dirs[0] / "auth_token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        self.port = _free_port()
        while self.port == 6379:
            self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")]),
            "STRATA_L3_URL": self.l3.as_uri(), "STRATA_TEST_HOOKS": "1",
            "STRATA_LOAD_POLICY": "always_load",  # the L3 check: a tiny model recomputes faster than it loads
        }
        for key in ("RAY_ADDRESS", "STRATA_RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
            self.env.pop(key, None)

    def _start(self, argv: list[str]) -> None:
        out = subprocess.run([RAY, "start", *argv], env=self.env, cwd=REPO, capture_output=True, text=True,
                             timeout=180)
        assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])

    def start(self) -> LocalCluster:
        common = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--object-store-memory=100000000",
                  "--disable-usage-stats"]
        self._start(["--head", f"--port={self.port}", *common, f"--temp-dir={self.dirs[0]}",
                     "--include-dashboard=false", f"--dashboard-port={_free_port()}",
                     "--resources", json.dumps({"strata_worker": 1}),
                     *_ports()])
        self._start([f"--address={self.address}", *common, f"--temp-dir={self.dirs[1]}",
                     "--resources", json.dumps({"strata_worker": 4}), *_ports()])
        return self

    def pids(self) -> list[int]:
        marks = [str(d).encode() for d in self.dirs]
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if any(mark in cmdline for mark in marks):
                found.append(int(proc.name))
        return found

    def stop(self) -> list[int]:
        """SIGTERM, then SIGKILL after a grace period, to this cluster's processes only; returns any
        still alive after that (none expected)."""
        for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + grace
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.2)
        return self.pids()


@pytest.fixture
def cluster():
    c = LocalCluster()
    try:
        yield c.start()
    finally:
        left = c.stop()
        for path in (*c.dirs, c.l3):
            shutil.rmtree(path, ignore_errors=True)
        assert left == [], f"processes of the test cluster outlived it: {left}"


@pytest.mark.slow
def test_replicas_on_a_two_node_cluster_serve_fail_over_and_take_jobs(cluster):
    env = {**cluster.env, CHILD_ENV: cluster.address}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(SCENARIO)],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout.splitlines()[-1], out.stdout[-2000:]


def test_the_launcher_prints_how_a_node_joins_as_a_cache_worker_node():
    from workers import actor, launcher

    command = launcher.join_command("10.0.0.5", 6380, "/tmp/token", slots=4)
    assert "ray start --address=10.0.0.5:6380" in command and "RAY_AUTH_TOKEN_PATH=/tmp/token" in command
    assert f"--resources='{json.dumps({actor.WORKER_RESOURCE: 4})}'" in command
    assert launcher.WORKER_RESOURCE == actor.WORKER_RESOURCE
