"""Process supervision for ``make run``: start children in their own process groups, stop them all.

A plain class (:class:`Supervisor`) so it is testable with harmless children. Stopping sends SIGTERM
to each child's process group in reverse start order, waits a grace period, then SIGKILLs the group
and any descendant that left it (tracked by pid and start time, so a reused pid is never hit).
Children also get SIGTERM from the kernel if the launcher itself dies (Linux parent-death signal).

Files: log files are created mode 0600 (whatever the umask), their folder 0700, and a supervisor
given ``umask`` starts every child under it, so what the children create is private too. A one-shot
child's stdout can be kept in memory only (:meth:`Supervisor.run_captured`): for output that holds
secrets and must never reach a log file.

Restarts: a child started with a :class:`~workers.restarts.RestartPolicy` that dies is started again
by :meth:`Supervisor.watch` after the policy's backoff, each restart logged with the exit code or
signal and the tail of the child's log; a crash loop (more restarts within the policy's window than
it allows) ends ``watch`` with :attr:`Supervisor.failure` saying so. A child started ``after`` another
(the web server and the Celery worker after the Ray head) is stopped when that one dies and started
again, in start order, once it is back and answers its ``ready`` probe. With ``status_path`` the
supervisor keeps a status file there (``workers.process_status``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from workers import process_status
from workers.proc_table import alive, descendants, group_alive, proc_table
from workers.restarts import RestartHistory, RestartPolicy


def say(message: str) -> None:
    print(f"[strata] {message}", flush=True)


def private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) mode 0700; an existing one of ours is tightened to 0700 (never a
    shared sticky folder such as ``/tmp``)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) & 0o077 and not info.st_mode & stat.S_ISVTX:
        path.chmod(0o700)
    return path


def private_files(folder: Path) -> None:
    """Tighten every regular file of ours directly in ``folder`` to 0600 (left by older versions)."""
    if not folder.is_dir():
        return
    for entry in folder.iterdir():
        with contextlib.suppress(OSError):
            info = entry.lstat()
            if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) & 0o077:
                entry.chmod(0o600)


def open_private_log(path: Path) -> IO[bytes]:
    """``path`` opened for appending, created mode 0600 in a 0700 folder (independent of the umask)."""
    private_dir(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o600)
    return os.fdopen(fd, "ab")


def tail(path: Path | None, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file, indented ("" when there is none)."""
    if path is None or not path.exists():
        return ""
    text = path.read_bytes()[-16384:].decode(errors="replace").splitlines()
    return "\n".join("    " + line for line in text[-lines:])


def _set_parent_death_signal() -> None:
    """Runs in the child before exec (Linux): if the launcher dies without cleaning up (SIGKILL),
    the kernel sends the child SIGTERM so nothing is orphaned."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG


def _drain(pipe: IO[bytes], into: bytearray) -> None:
    with contextlib.suppress(OSError, ValueError), pipe:
        for chunk in iter(lambda: pipe.read1(65536), b""):
            into.extend(chunk)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path | None = None
    known: dict[int, int] = field(default_factory=dict)  # descendants seen while it ran: pid -> start
    captured: bytearray | None = None  # stdout kept in memory (start(capture=True))
    reader: threading.Thread | None = None
    # Restarts (start(restart=...)): how to start it again, and what happened so far.
    launch: dict | None = None  # argv, env, cwd of the start
    history: RestartHistory | None = None
    after: str | None = None  # stopped while that child restarts, started again once it is ready
    ready: Callable[[], bool] | None = None  # "up and serving" probe, asked before its dependents start
    state: str = "running"  # running | restarting (backoff) | waiting (for ``after``) | stopped | crash_loop
    started: float = field(default_factory=time.monotonic)
    started_wall: float = field(default_factory=time.time)
    restarts: int = 0
    due: float | None = None  # monotonic time of the next start (state restarting)
    last_exit: dict | None = None
    last_restart: float | None = None  # wall time

    @property
    def pid(self) -> int:
        return self.proc.pid

    def status(self, now: float) -> dict:
        """This child as the status file shows it (``workers.process_status``)."""
        return {"name": self.name, "state": self.state, "pid": self.pid if self.state == "running" else None,
                "restarts": self.restarts, "started": process_status.utc(self.started_wall),
                "last_exit": self.last_exit, "last_restart": process_status.utc(self.last_restart),
                "next_start_in_s": round(max(0.0, self.due - now), 1) if self.due is not None else None}


class Supervisor:
    """Starts child processes, watches them, and stops all of them.

    Each child runs in its own session (process group), so a terminal's Ctrl-C reaches only the
    launcher, which then stops the children in reverse start order; signals go to the whole group
    so grandchildren (Celery pool processes, Ray daemons) are included. Descendants that left the
    group are remembered and killed too. ``stop()`` is idempotent and always leaves nothing running.
    Not thread-safe: one launcher thread owns it; signal handlers only call ``request_stop``.
    """

    def __init__(self, *, stop_timeout: float = 20.0, log: Callable[[str], None] = say,
                 umask: int | None = None, status_path: Path | None = None, ready_timeout: float = 120.0) -> None:
        self.stop_timeout = stop_timeout
        self.log = log
        self.umask = umask  # every child runs under it (None: the children inherit this process's)
        self.status_path = status_path  # the status file (None: none is written)
        self.ready_timeout = ready_timeout  # a restarted child's ``ready`` probe, before its dependents
        self.children: list[Child] = []
        self.stop_reason: str | None = None
        self.failure: str | None = None  # why watch() gave up: a crash loop, said in one message

    # -------------------------------------------------------------- starting
    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: Path | str | None = None,
        log_path: Path | None = None,
        capture: bool = False,
        restart: RestartPolicy | None = None,
        after: str | None = None,
        ready: Callable[[], bool] | None = None,
    ) -> Child:
        """Start ``argv`` as child ``name``; output goes to ``log_path`` (appended, created 0600) or
        this console. With ``capture`` its stdout is kept in memory only (``Child.captured``) and just
        its stderr goes to ``log_path``. With ``restart`` :meth:`watch` starts it again when it dies;
        ``after`` names the child it depends on (stopped and started again around that one's
        restart); ``ready`` tells whether it serves (asked before its dependents are started again)."""
        if restart is not None and capture:
            raise ValueError("a captured child is one-shot; it cannot be restarted")
        child = Child(name, self._spawn(argv, env, cwd, log_path, capture), log_path)
        if capture:
            child.captured = bytearray()
            child.reader = threading.Thread(target=_drain, args=(child.proc.stdout, child.captured),
                                            name=f"capture-{name}", daemon=True)
            child.reader.start()
        if restart is not None:
            child.launch = {"argv": list(argv), "env": env, "cwd": cwd}
            child.history = RestartHistory(restart)
            child.after, child.ready = after, ready
        self.children.append(child)
        self._write_status()
        return child

    def _spawn(self, argv: Sequence[str], env: dict[str, str] | None, cwd: Path | str | None,
               log_path: Path | None, capture: bool = False) -> subprocess.Popen:
        out: IO | None = open_private_log(log_path) if log_path is not None else None
        try:
            proc = subprocess.Popen(
                list(argv),
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if capture else out,
                stderr=out if capture else (subprocess.STDOUT if out else None),
                start_new_session=True,
                preexec_fn=_set_parent_death_signal if sys.platform.startswith("linux") else None,
                umask=-1 if self.umask is None else self.umask,
            )
        finally:
            if out is not None:
                out.close()
        return proc

    def run(self, name: str, argv: Sequence[str], *, timeout: float | None = None, **kwargs) -> int | None:
        """Run a one-shot child to completion; returns its exit code, or None if a stop was requested
        (or ``timeout`` passed) first, in which case the child has been stopped."""
        return self._finish(self.start(name, argv, **kwargs), timeout)

    def run_captured(self, name: str, argv: Sequence[str], *, timeout: float | None = None,
                     **kwargs) -> tuple[int | None, str]:
        """:meth:`run` with the child's stdout kept in memory, never written to a file: returns
        ``(exit code or None, stdout)``. Its stderr goes to ``log_path`` (or this console)."""
        child = self.start(name, argv, capture=True, **kwargs)
        rc = self._finish(child, timeout)
        if child.reader is not None:
            child.reader.join(timeout=5)
        return rc, bytes(child.captured or b"").decode(errors="replace")

    def _finish(self, child: Child, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while child.proc.poll() is None:
            if self.stop_reason or (deadline is not None and time.monotonic() > deadline):
                self._stop_children([child])
                self.children.remove(child)
                self._write_status()
                return None
            time.sleep(0.1)
        self._reap_leftovers(child)
        self.children.remove(child)
        self._write_status()
        return child.proc.returncode

    # -------------------------------------------------------------- watching
    def request_stop(self, reason: str) -> None:
        """Safe from a signal handler: the watch loop notices and stops everything."""
        if self.stop_reason is None:
            self.stop_reason = reason

    def exited(self) -> Child | None:
        """The first running child that has exited, if any."""
        for child in self.children:
            if child.state == "running" and child.proc.poll() is not None:
                return child
        return None

    def watch(self, poll: float = 0.5) -> Child | None:
        """Block until a stop is requested (returns None), a child without a restart policy exits
        (returns it), or a child is in a crash loop (returns it; ``failure`` says so). Children with
        a policy that die are started again after their backoff, meanwhile."""
        while self.stop_reason is None:
            child = self.exited()
            if child is not None:
                if child.history is None:
                    return child
                if not self._died(child):
                    return child
                continue
            now = time.monotonic()
            for child in list(self.children):
                if child.state == "restarting" and child.due is not None and now >= child.due:
                    self._restart(child)
                    break  # the stop flag and other exits are looked at again first
            self._remember_descendants()
            time.sleep(poll)
        return None

    # -------------------------------------------------------------- restarting
    def _dependents(self, child: Child) -> list[Child]:
        return [c for c in self.children if c.after == child.name and c.history is not None]

    def _died(self, child: Child) -> bool:
        """``child`` (with a policy) died: leftovers killed, restart scheduled, its dependents stopped
        until it is back. False (and ``failure`` set) for a crash loop."""
        rc = child.proc.returncode
        self._reap_leftovers(child)
        now = time.monotonic()
        child.last_exit = process_status.exit_info(rc, time.time())
        delay = child.history.died(now, now - child.started)
        how = process_status.describe_exit(rc)
        if delay is None:
            child.state, child.due = "crash_loop", None
            policy = child.history.policy
            self.failure = (f"{child.name} is crash-looping ({child.history.recent()} exits within "
                            f"{policy.window_s:.0f} s, the last {how}); stopping the platform"
                            + self._tail_of(child))
            self._write_status()
            return False
        child.state, child.due = "restarting", now + delay
        self.log(f"{child.name} (pid {child.pid}) {how} after {now - child.started:.0f} s; "
                 f"restarting it in {delay:g} s (restart {child.restarts + 1})" + self._tail_of(child))
        for dep in self._dependents(child):
            if dep.state in ("running", "restarting"):
                self.log(f"stopping {dep.name} until {child.name} is back")
                if dep.proc.poll() is None:
                    self._stop_children([dep])
                else:
                    self._reap_leftovers(dep)
                dep.state, dep.due = "waiting", None
        self._write_status()
        return True

    def _restart(self, child: Child) -> None:
        """Start ``child`` again; once it is ready, the dependents that wait for it (in start order)."""
        self._relaunch(child)
        waiting = [d for d in self._dependents(child) if d.state == "waiting"]
        if not waiting:
            return
        if child.ready is not None and not self._wait_ready(child):
            return  # it died, or a stop came: watch() deals with that
        for dep in waiting:
            self._relaunch(dep, after=child)

    def _relaunch(self, child: Child, after: Child | None = None) -> None:
        """Start ``child``'s process again; the restart is logged before the child shows as running, so
        whoever sees it running (the status file, a test) finds the line too."""
        spec = child.launch or {}
        child.proc = self._spawn(spec["argv"], spec.get("env"), spec.get("cwd"), child.log_path)
        child.known = {}
        child.started, child.started_wall = time.monotonic(), time.time()
        child.last_restart = child.started_wall
        child.restarts += 1
        self.log(f"restarted {child.name} (pid {child.pid}, restart {child.restarts})"
                 + (f" after {after.name}" if after is not None else ""))
        child.state, child.due = "running", None
        self._write_status()

    def _wait_ready(self, child: Child) -> bool:
        deadline = time.monotonic() + self.ready_timeout
        while self.stop_reason is None and child.proc.poll() is None:
            with contextlib.suppress(Exception):  # a probe that fails means "not yet"
                if child.ready():
                    return True
            if time.monotonic() > deadline:
                self.log(f"{child.name} was not ready within {self.ready_timeout:.0f} s of its restart; "
                         "stopping it (it counts as a failed start)")
                self._signal(child, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.proc.wait(timeout=5)
                return False
            time.sleep(0.2)
        return False

    @staticmethod
    def _tail_of(child: Child) -> str:
        text = tail(child.log_path)
        return f"; last lines of {child.log_path}:\n{text}" if text else ""

    def _write_status(self, stopping: str | None = None) -> None:
        if self.status_path is None:
            return
        now = time.monotonic()
        try:
            process_status.write(self.status_path, [c.status(now) for c in self.children],
                                 stopping=stopping or self.stop_reason or self.failure)
        except OSError as exc:  # the status file is for operators; never a reason to stop
            self.log(f"warning: could not write {self.status_path}: {exc}")

    def _remember_descendants(self) -> None:
        for child in self.children:
            if child.proc.poll() is None:
                child.known.update(descendants(child.pid))

    # -------------------------------------------------------------- stopping
    def stop(self) -> None:
        """Stop every child (reverse start order): SIGTERM to its group, wait up to
        ``stop_timeout`` for all, then SIGKILL what is left."""
        children = list(reversed(self.children))
        if children:
            self._write_status(stopping=self.stop_reason or self.failure or "stopping")
        self._stop_children(children)
        for child in children:
            if child.state != "crash_loop":
                child.state, child.due = "stopped", None
        if children:
            self._write_status(stopping=self.stop_reason or self.failure or "stopped")
        self.children.clear()

    def _stop_children(self, children: list[Child]) -> None:
        self._remember_descendants()
        for child in children:
            if child.proc.poll() is None:
                self.log(f"stopping {child.name} (pid {child.pid})")
            self._signal(child, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        for child in children:
            while self._running(child) and time.monotonic() < deadline:
                time.sleep(0.1)
            if self._running(child):
                self.log(f"{child.name} did not stop within {self.stop_timeout:.0f}s; killing it")
        for child in children:
            self._reap_leftovers(child)

    def _reap_leftovers(self, child: Child) -> None:
        """SIGKILL whatever of ``child`` is left (its group and remembered descendants), then reap."""
        if self._running(child):
            self._signal(child, signal.SIGKILL)
            deadline = time.monotonic() + 5
            while self._running(child) and time.monotonic() < deadline:
                time.sleep(0.05)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(timeout=5)

    def _running(self, child: Child) -> bool:
        if child.proc.poll() is None:
            return True
        return group_alive(child.pid) or any(alive(p, t) for p, t in child.known.items())

    @staticmethod
    def _signal(child: Child, sig: int) -> None:
        """``sig`` to the child's process group (once to each member) and to every remembered
        descendant that has left the group."""
        try:
            os.killpg(child.pid, sig)  # start_new_session: the child's pid is its group id
        except ProcessLookupError:
            if child.proc.poll() is None:  # the child left its own group (setsid)
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(sig)
        except PermissionError:
            pass
        table = proc_table() or {}  # ``known`` is empty where there is no /proc
        for pid, start in child.known.items():
            info = table.get(pid)
            if info is not None and info.state != "Z" and info.start == start and info.pgid != child.pid:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
