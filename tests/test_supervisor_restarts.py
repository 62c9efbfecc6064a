"""The supervisor restarts a child that dies, with harmless children (sleep, sh) instead of Ray/Celery/uvicorn.

Pins: the backoff doubles up to its cap and starts again after a stable run; more deaths than allowed
within the window is a crash loop. A child killed with SIGKILL is started again (a new process), the
restart logged with the signal and the tail of its log, the status file saying so; a second quick death
waits twice as long; a crash loop ends ``watch`` with one message naming the child, its exit and its log;
a dependent is stopped while the child it depends on restarts and started again after it, once that one is
ready; ``stop`` after restarts leaves nothing running, old processes or new.
"""

from __future__ import annotations

import json
import signal
import sys
import threading

import pytest

from tests.test_launcher import all_gone, wait_for
from workers import process_status
from workers.proc_table import alive
from workers.restarts import RestartHistory, RestartPolicy
from workers.supervisor import Supervisor

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and setsid")

FAST = RestartPolicy(base_s=0.2, cap_s=1.0, max_restarts=3, window_s=60, stable_s=30)


def test_backoff_doubles_to_its_cap_and_starts_again_after_a_stable_run():
    history = RestartHistory(RestartPolicy(base_s=1, cap_s=4, max_restarts=100, window_s=10, stable_s=60))
    assert [history.died(now=t, uptime=1) for t in range(5)] == [1, 2, 4, 4, 4]
    assert history.died(now=100, uptime=61) == 1  # ran a minute: a new series
    assert history.died(now=101, uptime=1) == 2


def test_more_deaths_than_allowed_within_the_window_is_a_crash_loop_and_fewer_is_not():
    policy = RestartPolicy(base_s=1, cap_s=8, max_restarts=2, window_s=10, stable_s=60)
    spread = RestartHistory(policy)
    assert all(spread.died(now=t, uptime=1) is not None for t in (0, 11, 22, 33))  # one per window
    looping = RestartHistory(policy)
    assert looping.died(now=0, uptime=1) is not None and looping.died(now=1, uptime=1) is not None
    assert looping.died(now=2, uptime=1) is None  # a third death within 10 s


@pytest.mark.parametrize("bad", [dict(base_s=0), dict(base_s=2, cap_s=1), dict(window_s=0), dict(max_restarts=-1)])
def test_a_policy_that_makes_no_sense_is_refused(bad):
    with pytest.raises(ValueError):
        RestartPolicy(**bad)


class Watched:
    """A supervisor whose ``watch`` runs on a thread, its log kept."""

    def __init__(self, tmp_path, **kwargs) -> None:
        self.lines: list[str] = []
        self.status = tmp_path / "processes.json"
        self.sup = Supervisor(stop_timeout=3, log=self.lines.append, status_path=self.status, **kwargs)
        self.result: list = []
        self.thread: threading.Thread | None = None

    def watch(self) -> None:
        self.thread = threading.Thread(target=lambda: self.result.append(self.sup.watch(poll=0.05)), daemon=True)
        self.thread.start()

    def logged(self, text: str) -> bool:
        return any(text in line for line in list(self.lines))

    def child_status(self, name: str) -> dict:
        return next(c for c in json.loads(self.status.read_text())["children"] if c["name"] == name)

    def close(self) -> None:
        self.sup.request_stop("test over")
        if self.thread is not None:
            self.thread.join(timeout=10)
        self.sup.stop()


@pytest.fixture
def watched(tmp_path):
    w = Watched(tmp_path)
    yield w
    w.close()


def test_a_killed_child_is_restarted_with_backoff_and_the_restart_is_logged_and_in_the_status(watched, tmp_path):
    log = tmp_path / "logs" / "worker.log"
    child = watched.sup.start("worker", ["sh", "-c", "echo worker says hello; exec sleep 300"], log_path=log,
                              restart=FAST)
    calm = watched.sup.start("calm", ["sleep", "300"], restart=FAST)
    first = child.pid
    assert wait_for(lambda: "hello" in log.read_text())
    watched.watch()

    child.proc.send_signal(signal.SIGKILL)  # as the kernel's OOM killer would

    assert wait_for(lambda: child.restarts == 1 and child.state == "running" and alive(child.pid))
    assert child.pid != first and not alive(first)
    assert watched.logged(f"worker (pid {first}) killed by SIGKILL")
    assert watched.logged("restarting it in 0.2 s (restart 1)") and watched.logged("worker says hello")
    # the status file is rewritten just after the child shows as running: wait for that write
    assert wait_for(lambda: watched.child_status("worker")["restarts"] == 1)
    status = watched.child_status("worker")
    assert status["restarts"] == 1 and status["state"] == "running" and status["pid"] == child.pid
    assert status["last_exit"]["signal"] == "SIGKILL" and status["last_exit"]["code"] == -signal.SIGKILL
    assert status["last_restart"] is not None
    assert calm.restarts == 0 and alive(calm.pid)  # the others were left alone

    second = child.pid
    child.proc.send_signal(signal.SIGKILL)  # again, soon after: the backoff doubles
    assert wait_for(lambda: child.restarts == 2 and child.state == "running")
    assert watched.logged("restarting it in 0.4 s (restart 2)")
    assert not alive(second)
    assert watched.result == []  # watch goes on: no crash loop


def test_a_crash_loop_ends_watch_with_one_message_naming_the_child_and_its_log(watched, tmp_path):
    log = tmp_path / "logs" / "web.log"
    other = watched.sup.start("other", ["sleep", "300"], restart=FAST)
    looping = watched.sup.start("web", ["sh", "-c", "echo cannot bind the port >&2; exit 3"], log_path=log,
                                restart=FAST)

    assert watched.sup.watch(poll=0.05) is looping

    assert looping.restarts == FAST.max_restarts and looping.state == "crash_loop"
    failure = watched.sup.failure
    assert failure.startswith("web is crash-looping (4 exits within 60 s, the last exit code 3)")
    assert "cannot bind the port" in failure and "stopping the platform" in failure
    assert watched.child_status("web")["state"] == "crash_loop"
    assert alive(other.pid)  # watch reports; stop() acts
    watched.sup.stop()
    assert all_gone([other.pid]) and json.loads(watched.status.read_text())["stopping"] == failure


def test_dependents_stop_with_the_child_they_need_and_start_again_after_it_is_ready(tmp_path):
    ready = threading.Event()
    w = Watched(tmp_path)
    try:
        head = w.sup.start("ray-head", ["sleep", "300"], restart=FAST, ready=ready.is_set)
        web = w.sup.start("web", ["sleep", "300"], restart=FAST, after="ray-head")
        loner = w.sup.start("loner", ["sleep", "300"], restart=FAST)
        old_head, old_web = head.pid, web.pid
        w.watch()

        head.proc.send_signal(signal.SIGKILL)

        assert wait_for(lambda: not alive(old_web))  # stopped at once, not left on a dead head
        assert wait_for(lambda: head.restarts == 1)
        assert web.state == "waiting" and web.restarts == 0  # the new head is not ready yet
        assert w.child_status("web")["state"] == "waiting"
        ready.set()
        assert wait_for(lambda: web.restarts == 1 and web.state == "running" and alive(web.pid))
        assert web.pid != old_web and loner.restarts == 0
        order = [line for line in w.lines if line.startswith("restarted")]
        assert order[0].startswith("restarted ray-head") and order[1].startswith("restarted web (pid")
        assert w.logged("stopping web until ray-head is back")
        assert web.history.recent() == 0  # a planned stop is not one of its deaths
    finally:
        w.close()
    assert all_gone([old_head, old_web, head.pid, web.pid, loner.pid])


def test_stop_after_restarts_leaves_nothing_running_and_says_so_in_the_status(watched, tmp_path):
    pidfile = tmp_path / "grandchildren"
    tree = watched.sup.start("tree", ["sh", "-c", f"sleep 300 & echo $! >> {pidfile}; wait"], restart=FAST)
    seen = [tree.pid]
    watched.watch()
    for restart in (1, 2):
        assert wait_for(lambda n=restart: pidfile.exists() and len(pidfile.read_text().split()) == n)
        tree.proc.send_signal(signal.SIGKILL)  # its sleep is left behind in the group: killed too
        assert wait_for(lambda n=restart: tree.restarts == n and tree.state == "running")
        seen.append(tree.pid)
    assert wait_for(lambda: len(pidfile.read_text().split()) == 3)
    grandchildren = [int(p) for p in pidfile.read_text().split()]
    assert not any(alive(p) for p in grandchildren[:2]) and alive(grandchildren[2])

    watched.close()

    assert all_gone(seen + grandchildren) and watched.sup.children == []
    body = process_status.read(watched.status)
    assert body["children"][0]["state"] == "stopped" and body["children"][0]["restarts"] == 2
    assert body["stopping"] == "test over" and body["running"] is True  # this process wrote it
