"""The launcher's process supervision, with harmless children (sleep, sh) instead of Ray/Celery/uvicorn.

Pins: a stop ends every child, its grandchildren and a descendant that left the child's process group;
SIGTERM (or Ctrl-C) to the launcher ends all of them and the launcher itself; one child dying brings
the others down; a child that ignores SIGTERM is killed after the grace period. Private state:
STRATA_HOME and logs/ are 0700 and every file in them 0600 (children run under umask 0077), the demo's
secrets are printed once and written to no file, and the local Ray head binds to 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from workers.launcher import REPO_ROOT, Config, Launcher, free_port, ray_bind_env
from workers.proc_table import alive
from workers.supervisor import Supervisor

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
    return not any(alive(p) for p in pids)


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
    assert all(alive(p) for p in (plain.pid, tree.pid, grandchild, escaped))
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
    assert alive(long_a.pid) and alive(long_b.pid)  # watch only reports; stop() acts
    sup.stop()
    assert all_gone([long_a.pid, long_b.pid])


def test_watch_returns_none_when_a_stop_is_requested(sup):
    child = sup.start("c", ["sleep", "300"])
    sup.request_stop("SIGTERM")
    assert sup.watch(poll=0.05) is None
    sup.request_stop("later reason")
    assert sup.stop_reason == "SIGTERM"  # the first reason wins
    sup.stop()
    assert not alive(child.pid)


def test_a_child_ignoring_sigterm_is_killed_after_the_grace_period(sup):
    stubborn = sup.start("stubborn", ["sh", "-c", "trap '' TERM; sleep 300 & wait; sleep 300"])
    time.sleep(0.3)  # let the trap be installed
    t0 = time.monotonic()
    sup.stop()
    elapsed = time.monotonic() - t0
    assert not alive(stubborn.pid)
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
    assert all(alive(p) for p in pids)

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


# ------------------------------------------------------------------ private state (STRATA_HOME)
def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_prepare_makes_strata_home_and_logs_0700_and_tightens_old_files(tmp_path):
    home = tmp_path / "home"
    (home / "logs").mkdir(parents=True)
    for folder in (home, home / "logs"):
        folder.chmod(0o755)
    old_db, old_log = home / "db.sqlite3", home / "logs" / "web.log"
    for old in (old_db, old_log):
        old.write_text("left by an older version")
        old.chmod(0o644)

    Launcher(Config(home=home, port=free_port(), demo=False, verbose=False, ray_address=None)).prepare()

    assert mode(home) == mode(home / "logs") == 0o700
    assert mode(old_db) == mode(old_log) == 0o600


def test_children_run_under_umask_0077_and_their_logs_are_0600(tmp_path):
    home = tmp_path / "home"
    launcher = Launcher(Config(home=home, port=free_port(), demo=False, verbose=False, ray_address=None))
    launcher.prepare()
    old_umask = os.umask(0o022)  # a permissive umask in the launcher's own process changes nothing
    try:
        rc = launcher.sup.run("touch", ["sh", "-c", "echo made; touch made.db; mkdir made.d"], cwd=home,
                              log_path=launcher._log("touch"))
    finally:
        os.umask(old_umask)
    assert rc == 0
    assert mode(home / "made.db") == 0o600 and mode(home / "made.d") == 0o700
    log = home / "logs" / "touch.log"
    assert log.read_text().strip() == "made" and mode(log) == 0o600


def test_run_captured_keeps_stdout_in_memory_and_only_stderr_in_the_log(sup, tmp_path):
    log = tmp_path / "logs" / "secretive.log"
    rc, out = sup.run_captured("secretive", ["sh", "-c", "echo the-secret; echo a-warning >&2"], log_path=log)
    assert (rc, out.strip()) == (0, "the-secret")
    assert log.read_text().strip() == "a-warning" and "the-secret" not in log.read_text()
    assert mode(log) == 0o600 and mode(log.parent) == 0o700


def _demo_secrets(output: str) -> list[str]:
    """The operator token, the admin password and the tenant keys that strata_demo printed."""
    token = re.search(r"^Admin API token\s+(st-op-\S+)$", output, re.M)
    password = re.search(r"\buser admin\s+password (\S+)$", output, re.M)
    keys = re.findall(r"^\s+(?:acme|globex)\s+(sk-st-\S+)$", output, re.M)
    assert token and password and len(keys) == 2, output
    return [token.group(1), password.group(1), *keys]


@pytest.mark.slow
def test_demo_set_up_prints_secrets_once_and_writes_them_to_no_file(tmp_path, capsys):
    """The real set-up (manage.py migrate + strata_demo under the launcher, on SQLite in a fresh
    STRATA_HOME): every file is 0600 in 0700 folders, and no file under STRATA_HOME (logs, database,
    broker, keys) holds the token, password or keys that the banner printed once."""
    home = tmp_path / "home"
    launcher = Launcher(Config(home=home, port=free_port(), demo=True, verbose=False, ray_address=None))
    for name in ("DATABASE_URL", "CELERY_BROKER_URL", "REDIS_URL", "STRATA_SECRET_KEY", "STRATA_AUDIT_KEY"):
        launcher.env.pop(name, None)  # embedded defaults, also under CI's PostgreSQL
    launcher.env["DJANGO_SETTINGS_MODULE"] = "controlplane.settings.local"
    launcher.prepare()
    launcher.migrate()
    launcher.demo()
    launcher.banner()
    printed = capsys.readouterr().out

    found = _demo_secrets(launcher.demo_output)
    assert all(secret in printed for secret in found)
    assert printed.count("Tenant API keys (shown only now: store them)") == 1  # the demo output, once

    files = [p for p in home.rglob("*") if p.is_file()]
    assert {"db.sqlite3", "broker.sqlite3", "secret_key", "migrate.log"} <= {p.name for p in files}
    assert (home / "logs" / "migrate.log").exists()
    for path in files:
        content = path.read_bytes()
        leaked = [s for s in found if s.encode() in content]
        assert not leaked, f"{path} holds a demo secret"
        assert mode(path) == 0o600, f"{path} is {oct(mode(path))}"
    for folder in [home, *(p for p in home.rglob("*") if p.is_dir())]:
        assert mode(folder) & 0o077 == 0, f"{folder} is {oct(mode(folder))}"


# ------------------------------------------------------------------ the local Ray head's address
def test_the_local_ray_head_binds_to_loopback_with_the_dashboard_off(tmp_path, monkeypatch):
    monkeypatch.delenv("STRATA_RAY_BIND", raising=False)
    launcher = Launcher(Config(home=tmp_path, port=1, demo=False, verbose=False, ray_address=None))
    argv = launcher.ray_head_argv(6380)
    assert argv[1:4] == ["start", "--head", "--block"]
    assert "--node-ip-address=127.0.0.1" in argv and "--port=6380" in argv
    assert "--include-dashboard=false" in argv and "--dashboard-host=127.0.0.1" in argv
    # Ray on Linux turns --node-ip-address 127.0.0.1 into the outward address (and listens on every
    # interface) unless its single-machine switch is off.
    assert ray_bind_env("127.0.0.1") == {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def test_strata_ray_bind_opens_the_head_to_other_nodes_but_not_the_dashboard(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_RAY_BIND", "10.0.0.7")
    launcher = Launcher(Config(home=tmp_path, port=1, demo=False, verbose=False, ray_address=None))
    argv = launcher.ray_head_argv(6380)
    assert "--node-ip-address=10.0.0.7" in argv and "--node-ip-address=127.0.0.1" not in argv
    assert "--include-dashboard=false" in argv and "--dashboard-host=127.0.0.1" in argv
    assert ray_bind_env("10.0.0.7") == {}


class _RecordingSupervisor(Supervisor):
    """start() records what it was asked to run and starts ``true`` instead (which exits at once)."""

    def __init__(self) -> None:
        super().__init__(stop_timeout=3, log=lambda _msg: None)
        self.started: list[tuple[str, list[str], dict[str, str]]] = []

    def start(self, name, argv, *, env=None, **kwargs):
        self.started.append((name, list(argv), dict(env or {})))
        return super().start(name, ["true"], env=env, **kwargs)


def test_start_ray_runs_the_head_and_its_drivers_on_the_loopback_address(tmp_path, monkeypatch):
    from workers.launcher import LaunchError

    for name in ("STRATA_RAY_BIND", "RAY_AUTH_MODE", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
        monkeypatch.delenv(name, raising=False)
    sup = _RecordingSupervisor()
    launcher = Launcher(Config(home=tmp_path, port=1, demo=False, verbose=False, ray_address=None), sup)
    try:
        with pytest.raises(LaunchError, match="Ray head exited"):
            launcher.start_ray()
    finally:
        sup.stop()
    (name, argv, env), = sup.started
    assert name == "ray-head" and "--node-ip-address=127.0.0.1" in argv
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0" and env["RAY_AUTH_MODE"] == "token"
    assert launcher.env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"  # web and Celery (drivers) too
    assert mode(tmp_path / "ray_auth_token") == 0o600


def test_the_banner_gives_manage_py_the_same_state_folder(tmp_path, capsys, monkeypatch):
    """With a custom STRATA_HOME the printed operator-token recipe carries it (a plain ``manage.py``
    would look in ``.strata``)."""
    monkeypatch.delenv("DATABASE_URL", raising=False)
    home = tmp_path / "custom home"
    Launcher(Config(home=home, port=free_port(), demo=False, verbose=False, ray_address=None)).banner()
    printed = capsys.readouterr().out
    assert f"STRATA_HOME='{home}' .venv/bin/python manage.py create_operator_token" in printed
    default = Launcher(Config(home=REPO_ROOT / ".strata", port=free_port(), demo=False, verbose=False,
                              ray_address=None))
    default.banner()
    assert "  .venv/bin/python manage.py create_operator_token" in capsys.readouterr().out
