"""The launcher's process supervision, with harmless children (sleep, sh) instead of Ray/Celery/uvicorn.

Pins: a stop ends every child, its grandchildren and a descendant that left the child's process group;
SIGTERM (or Ctrl-C) to the launcher ends all of them and the launcher itself; one child dying brings
the others down; a child that ignores SIGTERM is killed after the grace period.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from workers.launcher import REPO_ROOT, Config, Launcher, free_port
from workers.supervisor import Supervisor, _alive

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and setsid")


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def read_pids(path: Path, count: int) -> list[int]:
    assert wait_for(lambda: path.exists() and len(path.read_text().split()) >= count), f"{path} never filled"
    return [int(p) for p in path.read_text().split()]


def all_gone(pids) -> bool:
    return not any(_alive(p) for p in pids)


@pytest.fixture
def sup():
    s = Supervisor(stop_timeout=3, log=lambda _msg: None)
    yield s
    s.stop()  # never leave a sleep behind, even when an assertion failed


def test_stop_ends_children_grandchildren_and_escaped_descendants(sup, tmp_path):
    pidfile = tmp_path / "pids"
    plain = sup.start("plain", ["sleep", "300"])
    # A grandchild in the child's process group, and one that left it with setsid.
    tree = sup.start("tree", ["sh", "-c", f"sleep 300 & echo $! >> {pidfile}; "
                                          f"setsid sleep 300 & echo $! >> {pidfile}; wait"])
    grandchild, escaped = read_pids(pidfile, 2)
    assert all(_alive(p) for p in (plain.pid, tree.pid, grandchild, escaped))
    assert os.getpgid(escaped) != tree.pid and os.getpgid(grandchild) == tree.pid

    sup.stop()

    assert all_gone([plain.pid, tree.pid, grandchild, escaped])
    assert sup.children == []


def test_a_dying_child_is_reported_and_stop_brings_the_others_down(sup):
    long_a = sup.start("long-a", ["sleep", "300"])
    short = sup.start("short", ["sh", "-c", "sleep 0.3; exit 3"])
    long_b = sup.start("long-b", ["sleep", "300"])

    dead = sup.watch(poll=0.05)

    assert dead is short and dead.proc.returncode == 3
    assert _alive(long_a.pid) and _alive(long_b.pid)  # watch only reports; stop() acts
    sup.stop()
    assert all_gone([long_a.pid, long_b.pid])


def test_watch_returns_none_when_a_stop_is_requested(sup):
    child = sup.start("c", ["sleep", "300"])
    sup.request_stop("SIGTERM")
    assert sup.watch(poll=0.05) is None
    sup.request_stop("later reason")
    assert sup.stop_reason == "SIGTERM"  # the first reason wins
    sup.stop()
    assert not _alive(child.pid)


def test_a_child_ignoring_sigterm_is_killed_after_the_grace_period(sup):
    stubborn = sup.start("stubborn", ["sh", "-c", "trap '' TERM; sleep 300 & wait; sleep 300"])
    time.sleep(0.3)  # let the trap be installed
    t0 = time.monotonic()
    sup.stop()
    elapsed = time.monotonic() - t0
    assert not _alive(stubborn.pid)
    assert sup.stop_timeout - 0.5 <= elapsed < sup.stop_timeout + 10
    assert stubborn.proc.returncode == -signal.SIGKILL


def test_stop_is_fast_for_well_behaved_children_and_idempotent(sup):
    children = [sup.start(f"c{i}", ["sleep", "300"]) for i in range(3)]
    t0 = time.monotonic()
    sup.stop()
    assert time.monotonic() - t0 < 2
    assert all_gone([c.pid for c in children])
    sup.stop()  # nothing left: a no-op


def test_run_returns_exit_code_and_stops_on_request(sup, tmp_path):
    log = tmp_path / "one.log"
    assert sup.run("ok", ["sh", "-c", "echo hello"], log_path=log) == 0
    assert log.read_text().strip() == "hello"
    assert sup.run("fails", ["sh", "-c", "exit 7"]) == 7
    assert sup.run("slow", ["sleep", "300"], timeout=0.3) is None
    assert sup.children == []


# ------------------------------------------------------------------ the launcher process as a whole
# A Launcher whose steps start sleeps instead of migrate/Ray/Celery/uvicorn; same run() and signal
# handling as `python -m workers.launcher`.
FAKE_LAUNCHER = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from workers.launcher import Config, Launcher, stop_on_signals

    home, port, pidfile, web_exit = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]

    class Fake(Launcher):
        def migrate(self):
            self._one_shot("migrate", ["true"], "migrate", timeout=30)

        def start_ray(self):
            self.sup.start("ray-head", ["sh", "-c", "sleep 300 & setsid sleep 300 & wait"],
                           log_path=self._log("ray-head"))

        def start_celery(self):
            self.sup.start("celery", ["sleep", "300"], log_path=self._log("celery"))

        def start_web(self):
            cmd = "sleep 1; exit 5" if web_exit == "dies" else "sleep 300"
            self.sup.start("web", ["sh", "-c", cmd], log_path=self._log("web"))

        def banner(self):
            super().banner()
            import time
            time.sleep(0.3)  # let the shells fork their sleeps
            self.sup._remember_descendants()
            pids = [c.pid for c in self.sup.children]
            for c in self.sup.children:
                pids += sorted(c.known)
            pidfile.write_text(json.dumps(pids))

    launcher = Fake(Config(home=home, port=port, demo=False, verbose=False, ray_address=None))
    stop_on_signals(launcher.sup)
    sys.exit(launcher.run())
""")


def start_fake(tmp_path: Path, web: str = "stays") -> tuple[subprocess.Popen, Path]:
    pidfile = tmp_path / "pids.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", FAKE_LAUNCHER, str(tmp_path / "home"), str(free_port()), str(pidfile), web],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    return proc, pidfile


def fake_pids(proc: subprocess.Popen, pidfile: Path) -> list[int]:
    if not wait_for(pidfile.exists, 20):
        proc.kill()
        pytest.fail(f"fake launcher never came up:\n{proc.communicate()[0]}")
    return json.loads(pidfile.read_text())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_launcher_stops_every_process_it_started(tmp_path, sig):
    proc, pidfile = start_fake(tmp_path)
    pids = fake_pids(proc, pidfile)
    assert len(pids) >= 5  # 3 children + the 2 sleeps of the "ray-head" shell
    assert all(_alive(p) for p in pids)

    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)

    assert proc.returncode == 0, out
    assert all_gone(pids), out
    assert f"{sig.name}: stopping" in out and "[strata] stopped" in out


def test_a_dying_child_brings_the_launcher_and_the_others_down(tmp_path):
    proc, pidfile = start_fake(tmp_path, web="dies")
    pids = fake_pids(proc, pidfile)

    out, _ = proc.communicate(timeout=30)

    assert proc.returncode == 1, out
    assert "web exited unexpectedly (code 5)" in out
    assert all_gone(pids), out


def test_config_reads_port_home_and_demo_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("STRATA_HOME", str(tmp_path / "h"))
    monkeypatch.setenv("PORT", "8765")
    monkeypatch.setenv("STRATA_DEMO", "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = Config.from_env([])
    assert (cfg.home, cfg.port, cfg.demo, cfg.ray_address) == (tmp_path / "h", 8765, True, None)

    monkeypatch.setenv("STRATA_DEMO", "0")
    monkeypatch.delenv("PORT")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6380")
    cfg = Config.from_env([])
    assert (cfg.port, cfg.demo, cfg.ray_address) == (8000, False, "10.0.0.5:6380")
    assert Config.from_env(["--demo", "--port", "9000"]).demo is True


def test_children_get_the_source_roots_and_the_state_dir(tmp_path):
    launcher = Launcher(Config(home=tmp_path, port=1, demo=False, verbose=False, ray_address=None))
    paths = launcher.env["PYTHONPATH"].split(os.pathsep)
    assert str(REPO_ROOT) in paths and str(REPO_ROOT / "platform") in paths
    assert launcher.env["STRATA_HOME"] == str(tmp_path)
