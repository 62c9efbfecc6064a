"""``make run``'s launcher process restarts its children: a fake launcher (the real ``Launcher.run``,
signal handling and status file; sleeps instead of Ray, Celery and uvicorn, started as the real steps
start theirs: with the launcher's restart policy, web and Celery after the Ray head).

Pins: the Celery worker killed with SIGKILL (as an OOM kill would) is restarted, the platform stays up
and ``$STRATA_HOME/processes.json`` says so; a SIGTERM afterwards still stops every process, the
restarted one included; a web server that keeps dying stops the launcher with one crash-loop message.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.test_launcher import all_gone, wait_for
from workers.launcher import REPO_ROOT, free_port
from workers.proc_table import alive

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and setsid")

FAKE = textwrap.dedent("""
    import sys
    from pathlib import Path
    from workers.launcher import Config, Launcher, stop_on_signals
    from workers.restarts import RestartPolicy

    home, port, web = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]

    class Fake(Launcher):
        restart_policy = RestartPolicy(base_s=0.2, cap_s=1, max_restarts=2, window_s=60)

        def migrate(self):
            self._one_shot("migrate", ["true"], "migrate", timeout=30)

        def start_ray(self):
            self.ray_port = 1  # "this launcher runs the head": web and Celery start after it
            self.sup.start("ray-head", ["sleep", "300"], log_path=self._log("ray-head"),
                           restart=self.restart_policy, ready=lambda: True)

        def start_celery(self):
            self.sup.start("celery", ["sh", "-c", "echo celery ready; exec sleep 300"],
                           log_path=self._log("celery"), restart=self.restart_policy, after=self._after_ray())

        def start_web(self):
            cmd = "echo address already in use >&2; sleep 0.2; exit 1" if web == "loops" else "sleep 300"
            self.sup.start("web", ["sh", "-c", cmd], log_path=self._log("web"), restart=self.restart_policy,
                           after=self._after_ray())

    launcher = Fake(Config(home=home, port=port, demo=False, verbose=False, ray_address=None))
    stop_on_signals(launcher.sup)
    sys.exit(launcher.run())
""")


def start(tmp_path: Path, web: str = "stays") -> tuple[subprocess.Popen, Path]:
    home = tmp_path / "home"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", FAKE, str(home), str(free_port()), web], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, home / "processes.json"


def children(status: Path) -> dict[str, dict]:
    try:
        return {c["name"]: c for c in json.loads(status.read_text())["children"]}
    except (OSError, ValueError):
        return {}


def test_a_celery_worker_killed_like_an_oom_kill_is_restarted_and_sigterm_still_stops_everything(tmp_path):
    proc, status = start(tmp_path)
    try:
        assert wait_for(lambda: {"ray-head", "celery", "web"} <= children(status).keys()
                        and all(c["state"] == "running" for c in children(status).values()), 30)
        first = children(status)
        os.kill(first["celery"]["pid"], signal.SIGKILL)

        assert wait_for(lambda: children(status)["celery"]["restarts"] == 1
                        and children(status)["celery"]["state"] == "running", 30)
        now = children(status)
        assert now["celery"]["last_exit"]["signal"] == "SIGKILL" and now["celery"]["pid"] != first["celery"]["pid"]
        assert now["web"]["pid"] == first["web"]["pid"] and now["web"]["restarts"] == 0  # the others stay up
        assert proc.poll() is None  # the platform is still there
        pids = [c["pid"] for c in first.values()] + [now["celery"]["pid"]]
        assert alive(now["celery"]["pid"])
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)

    assert proc.returncode == 0, out
    assert all_gone(pids), out
    assert "celery (pid" in out and "killed by SIGKILL" in out and "restarting it in 0.2 s (restart 1)" in out
    assert "celery ready" in out  # the tail of its log
    assert "restarted celery" in out and "stopping web" in out and "[strata] stopped" in out
    assert all(c["state"] == "stopped" for c in children(status).values())


def test_a_web_server_in_a_crash_loop_stops_the_platform_with_one_message(tmp_path):
    proc, status = start(tmp_path, web="loops")
    out, _ = proc.communicate(timeout=60)

    assert proc.returncode == 1, out
    failure = [line for line in out.splitlines() if "crash-looping" in line]
    assert len(failure) == 1, out
    assert failure[0].startswith("[strata] error: web is crash-looping (3 exits within 60 s, the last exit code 1)")
    assert "address already in use" in out and "[strata] stopped" in out
    final = children(status)
    assert final["web"]["state"] == "crash_loop" and final["celery"]["state"] == "stopped"
