"""Process supervision for ``make run``: start children in their own process groups, stop them all.

A plain class (:class:`Supervisor`) so it is testable with harmless children. Stopping sends SIGTERM
to each child's process group in reverse start order, waits a grace period, then SIGKILLs the group
and any descendant that left it (tracked by pid and start time, so a reused pid is never hit).
Children also get SIGTERM from the kernel if the launcher itself dies (Linux parent-death signal).

Files: log files are created mode 0600 (whatever the umask), their folder 0700, and a supervisor
given ``umask`` starts every child under it, so what the children create is private too. A one-shot
child's stdout can be kept in memory only (:meth:`Supervisor.run_captured`): for output that holds
secrets and must never reach a log file.
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


def _set_parent_death_signal() -> None:
    """Runs in the child before exec (Linux): if the launcher dies without cleaning up (SIGKILL),
    the kernel sends the child SIGTERM so nothing is orphaned."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG


def _drain(pipe: IO[bytes], into: bytearray) -> None:
    with contextlib.suppress(OSError, ValueError), pipe:
        for chunk in iter(lambda: pipe.read1(65536), b""):
            into.extend(chunk)


@dataclass(frozen=True)
class ProcInfo:
    ppid: int
    pgid: int
    state: str  # "Z" = zombie (exited, not yet reaped)
    start: int  # start time in clock ticks since boot: tells a reused pid apart


def _proc_table() -> dict[int, ProcInfo] | None:
    """Every process from /proc, or None where /proc is not available (then only groups are used)."""
    if not os.path.isdir("/proc/self"):
        return None
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read().decode(errors="replace")
        except OSError:
            continue
        # Fields after the command name (which may contain spaces and parentheses).
        rest = stat.rpartition(")")[2].split()
        table[int(entry)] = ProcInfo(ppid=int(rest[1]), pgid=int(rest[2]), state=rest[0], start=int(rest[19]))
    return table


def descendants(pid: int) -> dict[int, int]:
    """Live descendants of ``pid`` as {pid: start time}; empty where /proc is not available."""
    table = _proc_table() or {}
    children: dict[int, list[int]] = {}
    for p, info in table.items():
        children.setdefault(info.ppid, []).append(p)
    found: dict[int, int] = {}
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found and table[child].state != "Z":
                found[child] = table[child].start
                todo.append(child)
    return found


def _alive(pid: int, start: int | None = None) -> bool:
    """Whether ``pid`` runs (not a zombie) and, given ``start``, is still the process seen then."""
    table = _proc_table()
    if table is not None:
        info = table.get(pid)
        return info is not None and info.state != "Z" and (start is None or info.start == start)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is still in process group ``pgid``."""
    table = _proc_table()
    if table is not None:
        return any(info.pgid == pgid and info.state != "Z" for info in table.values())
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path | None = None
    known: dict[int, int] = field(default_factory=dict)  # descendants seen while it ran: pid -> start
    captured: bytearray | None = None  # stdout kept in memory (start(capture=True))
    reader: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid


class Supervisor:
    """Starts child processes, watches them, and stops all of them.

    Each child runs in its own session (process group), so a terminal's Ctrl-C reaches only the
    launcher, which then stops the children in reverse start order; signals go to the whole group
    so grandchildren (Celery pool processes, Ray daemons) are included. Descendants that left the
    group are remembered and killed too. ``stop()`` is idempotent and always leaves nothing running.
    Not thread-safe: one launcher thread owns it; signal handlers only call ``request_stop``.
    """

    def __init__(self, *, stop_timeout: float = 20.0, log: Callable[[str], None] = say,
                 umask: int | None = None) -> None:
        self.stop_timeout = stop_timeout
        self.log = log
        self.umask = umask  # every child runs under it (None: the children inherit this process's)
        self.children: list[Child] = []
        self.stop_reason: str | None = None

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
    ) -> Child:
        """Start ``argv`` as child ``name``; output goes to ``log_path`` (appended, created 0600) or
        this console. With ``capture`` its stdout is kept in memory only (``Child.captured``) and just
        its stderr goes to ``log_path``."""
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
        child = Child(name, proc, log_path)
        if capture:
            child.captured = bytearray()
            child.reader = threading.Thread(target=_drain, args=(proc.stdout, child.captured),
                                            name=f"capture-{name}", daemon=True)
            child.reader.start()
        self.children.append(child)
        return child

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
                return None
            time.sleep(0.1)
        self._reap_leftovers(child)
        self.children.remove(child)
        return child.proc.returncode

    # -------------------------------------------------------------- watching
    def request_stop(self, reason: str) -> None:
        """Safe from a signal handler: the watch loop notices and stops everything."""
        if self.stop_reason is None:
            self.stop_reason = reason

    def exited(self) -> Child | None:
        """The first child that has exited, if any."""
        for child in self.children:
            if child.proc.poll() is not None:
                return child
        return None

    def watch(self, poll: float = 0.5) -> Child | None:
        """Block until a stop is requested (returns None) or a child exits (returns it)."""
        while self.stop_reason is None:
            child = self.exited()
            if child is not None:
                return child
            self._remember_descendants()
            time.sleep(poll)
        return None

    def _remember_descendants(self) -> None:
        for child in self.children:
            if child.proc.poll() is None:
                child.known.update(descendants(child.pid))

    # -------------------------------------------------------------- stopping
    def stop(self) -> None:
        """Stop every child (reverse start order): SIGTERM to its group, wait up to
        ``stop_timeout`` for all, then SIGKILL what is left."""
        children = list(reversed(self.children))
        self._stop_children(children)
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
        return group_alive(child.pid) or any(_alive(p, t) for p, t in child.known.items())

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
        table = _proc_table() or {}  # ``known`` is empty where there is no /proc
        for pid, start in child.known.items():
            info = table.get(pid)
            if info is not None and info.state != "Z" and info.start == start and info.pgid != child.pid:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
