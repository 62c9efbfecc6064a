"""``make run``: the whole platform in the foreground on one machine (``python -m workers.launcher``).

Steps: create ``$STRATA_HOME`` (default ``.strata``); ``manage.py migrate``; with ``STRATA_DEMO=1`` or
``--demo`` run ``manage.py strata_demo``; start a local Ray head unless ``RAY_ADDRESS`` names a
cluster; start a Celery worker and uvicorn (``controlplane.asgi:application``) on
``127.0.0.1:$PORT`` (default 8000); print the URL and how to log in; wait. Ctrl-C, SIGTERM or the
death of any child stops every process it started (SIGTERM to each child's process group, a grace
period, then SIGKILL to the group and to any descendant that left it) and the launcher exits.

The Ray head runs as ``ray start --head --block`` under the supervisor: on SIGTERM it tears down its
own daemons (GCS, raylet, workers, detached actors). ``ray stop`` is deliberately not used: it kills
every Ray process of the machine, including clusters this launcher did not start.

Children's output goes to ``$STRATA_HOME/logs/<name>.log`` (``--verbose``: to this console instead);
the last lines of a child's log are printed when it dies unexpectedly.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

REPO_ROOT = Path(__file__).resolve().parents[1]
PLATFORM_DIR = REPO_ROOT / "platform"
DEFAULT_RAY_PORT = 6380  # not 6379: that is Redis's port
HOST = "127.0.0.1"


def say(message: str) -> None:
    print(f"[strata] {message}", flush=True)


# ---------------------------------------------------------------------------------------- processes
def _set_parent_death_signal() -> None:
    """Runs in the child before exec (Linux): if the launcher dies without cleaning up (SIGKILL),
    the kernel sends the child SIGTERM so nothing is orphaned."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG


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

    def __init__(self, *, stop_timeout: float = 20.0, log: Callable[[str], None] = say) -> None:
        self.stop_timeout = stop_timeout
        self.log = log
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
    ) -> Child:
        """Start ``argv`` as child ``name``; output goes to ``log_path`` (appended) or this console."""
        out: IO | None = None
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            out = open(log_path, "ab")  # noqa: SIM115 - the child holds it; closed below
        try:
            proc = subprocess.Popen(
                list(argv),
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                start_new_session=True,
                preexec_fn=_set_parent_death_signal if sys.platform.startswith("linux") else None,
            )
        finally:
            if out is not None:
                out.close()
        child = Child(name, proc, log_path)
        self.children.append(child)
        return child

    def run(self, name: str, argv: Sequence[str], *, timeout: float | None = None, **kwargs) -> int | None:
        """Run a one-shot child to completion; returns its exit code, or None if a stop was requested
        (or ``timeout`` passed) first, in which case the child has been stopped."""
        child = self.start(name, argv, **kwargs)
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


# ---------------------------------------------------------------------------------------- launcher
def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout):
        return True
    return False


def free_port(preferred: int | None = None) -> int:
    """``preferred`` if nothing listens on it, otherwise a port the kernel says is free."""
    if preferred and not port_open(HOST, preferred):
        return preferred
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def ray_temp_dir() -> str:
    """A short, private directory for Ray's sessions (its socket paths must fit in 107 bytes)."""
    path = Path(tempfile.gettempdir()) / f"strata-ray-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    if path.stat().st_uid != os.getuid():
        raise LaunchError(f"{path} belongs to another user; remove it or set TMPDIR")
    return str(path)


def tail(path: Path | None, lines: int = 20) -> str:
    if path is None or not path.exists():
        return ""
    text = path.read_bytes()[-16384:].decode(errors="replace").splitlines()
    return "\n".join("    " + line for line in text[-lines:])


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """The HTTP status of GET ``url`` (any status), or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - our own http:// URL
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError):
        return None


@dataclass
class Config:
    home: Path
    port: int
    demo: bool
    verbose: bool
    ray_address: str | None
    python: str = sys.executable

    @classmethod
    def from_env(cls, argv: Sequence[str] | None = None) -> Config:
        parser = argparse.ArgumentParser(prog="python -m workers.launcher", description="Run Strata locally.")
        parser.add_argument("--demo", action="store_true",
                            help="create demo tenants, keys and a model (STRATA_DEMO=1)")
        parser.add_argument("--port", type=int, help="HTTP port (PORT, default 8000)")
        parser.add_argument("--verbose", action="store_true",
                            help="children log to this console, not to files")
        args = parser.parse_args(argv)
        home = Path(os.environ.get("STRATA_HOME") or ".strata").expanduser()
        if not home.is_absolute():
            home = (REPO_ROOT / home).resolve()
        try:
            port = args.port or int(os.environ.get("PORT") or 8000)
        except ValueError:
            parser.error(f"PORT must be an integer, got {os.environ.get('PORT')!r}")
        demo = args.demo or (os.environ.get("STRATA_DEMO", "").strip().lower() in {"1", "true", "yes", "on"})
        return cls(home=home, port=port, demo=demo, verbose=args.verbose,
                   ray_address=os.environ.get("RAY_ADDRESS") or None)


class Launcher:
    """The ``make run`` sequence on top of a :class:`Supervisor`."""

    def __init__(self, cfg: Config, sup: Supervisor | None = None) -> None:
        self.cfg = cfg
        self.sup = sup or Supervisor()
        self.logs = cfg.home / "logs"
        self.env = self._child_env()
        self.ray_port: int | None = None
        self.demo_output = ""

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        paths = [str(REPO_ROOT), str(PLATFORM_DIR)]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env["STRATA_HOME"] = str(self.cfg.home)
        env.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings.local")
        env["PYTHONUNBUFFERED"] = "1"
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        return env

    def _log(self, name: str) -> Path | None:
        return None if self.cfg.verbose else self.logs / f"{name}.log"

    def _bin(self, name: str) -> str:
        local = Path(self.cfg.python).parent / name
        return str(local) if local.exists() else name

    def _manage(self, *args: str) -> list[str]:
        return [self.cfg.python, str(REPO_ROOT / "manage.py"), *args]

    def _one_shot(self, name: str, argv: list[str], what: str, timeout: float) -> None:
        rc = self.sup.run(name, argv, env=self.env, cwd=REPO_ROOT, log_path=self._log(name), timeout=timeout)
        if rc is None and self.sup.stop_reason:
            raise Interrupted(self.sup.stop_reason)
        if rc != 0:
            detail = tail(self._log(name))
            reason = "timed out" if rc is None else f"exit {rc}"
            raise LaunchError(f"{what} failed ({reason})" + (f"; last lines of {self._log(name)}:\n{detail}"
                                                             if detail else ""))

    # -------------------------------------------------------------- steps
    def prepare(self) -> None:
        self.cfg.home.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        if port_open(HOST, self.cfg.port):
            raise LaunchError(f"port {self.cfg.port} is already in use; set PORT to a free port")
        say(f"state in {self.cfg.home} (logs in {self.logs})")

    def migrate(self) -> None:
        say("applying database migrations")
        self._one_shot("migrate", self._manage("migrate", "--noinput"), "manage.py migrate", timeout=600)

    def demo(self) -> None:
        say("creating demo tenants, keys and model (strata_demo)")
        argv = self._manage("strata_demo", "--base-url", f"http://{HOST}:{self.cfg.port}")
        self._one_shot("demo", argv, "manage.py strata_demo", timeout=300)
        path = self._log("demo")
        self.demo_output = path.read_text() if path and path.exists() else ""

    def start_ray(self) -> None:
        if self.cfg.ray_address:
            say(f"joining the Ray cluster at {self.cfg.ray_address} (RAY_ADDRESS)")
            return
        port = free_port(int(os.environ.get("STRATA_RAY_PORT") or DEFAULT_RAY_PORT))
        if port != DEFAULT_RAY_PORT:
            say(f"port {DEFAULT_RAY_PORT} is busy; the Ray head uses {port}")
        temp_dir = ray_temp_dir()
        argv = [
            self._bin("ray"), "start", "--head", "--block",
            f"--port={port}", f"--num-cpus={os.cpu_count() or 1}",
            "--include-dashboard=false", "--disable-usage-stats",
            # Ray's fixed defaults collide with other local clusters (tests, a second launcher).
            f"--dashboard-port={free_port(8265)}", f"--dashboard-agent-listen-port={free_port(52365)}",
            f"--temp-dir={temp_dir}",
        ]
        self._ray_auth()
        env = {**self.env, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}  # one node: nothing to drain
        say(f"starting a local Ray head on {HOST}:{port}")
        child = self.sup.start("ray-head", argv, env=env, cwd=REPO_ROOT, log_path=self._log("ray-head"))
        deadline = time.monotonic() + 120
        while not port_open(HOST, port):
            if child.proc.poll() is not None:
                raise LaunchError(f"the Ray head exited (code {child.proc.returncode}):\n"
                                  f"{tail(child.log_path)}")
            if self.sup.stop_reason:
                raise Interrupted(self.sup.stop_reason)
            if time.monotonic() > deadline:
                raise LaunchError(f"the Ray head did not open port {port} within 120 s")
            time.sleep(0.25)
        self.ray_port = port
        self.env["RAY_ADDRESS"] = f"{HOST}:{port}"

    def _ray_auth(self) -> None:
        """Ray's GCS listens on every interface, so the local head requires a token (Ray's own token
        auth) kept in ``$STRATA_HOME/ray_auth_token`` (0600); children get it through the
        environment. An explicit ``RAY_AUTH_MODE`` in the environment is respected."""
        if "RAY_AUTH_MODE" in os.environ:
            return
        path = self.cfg.home / "ray_auth_token"
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(secrets.token_hex(32))
        self.env["RAY_AUTH_MODE"] = "token"
        self.env["RAY_AUTH_TOKEN_PATH"] = str(path)
        self.env.pop("RAY_AUTH_TOKEN", None)

    def start_celery(self) -> None:
        say("starting the Celery worker")
        argv = [self._bin("celery"), "-A", "controlplane.celery_app", "worker", "-l", "info",
                "--concurrency", "1", "--pool", "threads", "--hostname", f"strata-{os.getpid()}@%h"]
        self.sup.start("celery", argv, env=self.env, cwd=REPO_ROOT, log_path=self._log("celery"))

    def start_web(self) -> None:
        say(f"starting the web server on http://{HOST}:{self.cfg.port}")
        argv = [self._bin("uvicorn"), "controlplane.asgi:application", "--host", HOST,
                "--port", str(self.cfg.port), "--lifespan", "off", "--timeout-graceful-shutdown", "5"]
        child = self.sup.start("web", argv, env=self.env, cwd=REPO_ROOT, log_path=self._log("web"))
        url = f"http://{HOST}:{self.cfg.port}/healthz"
        deadline = time.monotonic() + 120
        while True:
            status = http_status(url)
            if status is not None:
                if status != 200:
                    say(f"warning: {url} answered {status}")
                return
            if child.proc.poll() is not None:
                raise LaunchError(f"the web server exited (code {child.proc.returncode}):\n"
                                  f"{tail(child.log_path)}")
            if self.sup.stop_reason:
                raise Interrupted(self.sup.stop_reason)
            if time.monotonic() > deadline:
                raise LaunchError(f"the web server did not answer {url} within 120 s")
            time.sleep(0.25)

    def banner(self) -> None:
        base = f"http://{HOST}:{self.cfg.port}"
        lines = [
            "",
            f"Strata is up at {base}",
            f"  operator UI:                {base}/ui/  (log in as a staff user; Django admin: {base}/admin/)",
            f"  admin API:                  {base}/api/admin/  (Authorization: Bearer <operator token>)",
            f"  serving API (OpenAI):       {base}/v1          (Authorization: Bearer <tenant key>)",
            f"  health:                     {base}/healthz  {base}/readyz",
        ]
        if self.ray_port:
            lines.append(f"  Ray head:                   {HOST}:{self.ray_port} (RAY_ADDRESS for clients)")
        if not self.cfg.demo:
            lines += [
                "",
                "Log in: create an operator token and an admin user with",
                "  .venv/bin/python manage.py create_operator_token --username you --role admin",
                "  .venv/bin/python manage.py createsuperuser",
                "or start with STRATA_DEMO=1 make run for demo tenants, keys and a model.",
            ]
        print("\n".join(lines), flush=True)
        if self.demo_output:
            print("\n" + self.demo_output.rstrip(), flush=True)
        print(f"\nLogs: {self.logs}/   Stop: Ctrl-C\n", flush=True)

    def run(self) -> int:
        """The whole sequence. Returns the process exit code; never leaves a child running."""
        try:
            self.prepare()
            self.migrate()
            if self.cfg.demo:
                self.demo()
            self.start_ray()
            self.start_celery()
            self.start_web()
            self.banner()
            dead = self.sup.watch()
            if dead is not None:
                say(f"{dead.name} exited unexpectedly (code {dead.proc.returncode}); stopping everything")
                if dead.log_path:
                    print(tail(dead.log_path), flush=True)
                return 1
            say(f"{self.sup.stop_reason}: stopping")
            return 0
        except Interrupted as exc:
            say(f"{exc}: stopping")
            return 130
        except LaunchError as exc:
            say(f"error: {exc}")
            return 1
        finally:
            self.sup.stop()
            if self.ray_port and port_open(HOST, self.ray_port):
                say(f"warning: something still listens on the Ray port {self.ray_port}")
            say("stopped")


class LaunchError(RuntimeError):
    """A step of the launch failed; the message says which and why."""


class Interrupted(RuntimeError):
    """A stop was requested (signal) while a step was still running."""


def stop_on_signals(sup: Supervisor) -> None:
    """Ctrl-C, SIGTERM and SIGHUP ask ``sup`` to stop (the watch loop does the work)."""

    def on_signal(signum: int, _frame) -> None:
        sup.request_stop(signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)


def main(argv: Sequence[str] | None = None) -> int:
    launcher = Launcher(Config.from_env(argv))
    stop_on_signals(launcher.sup)
    return launcher.run()


if __name__ == "__main__":
    sys.exit(main())
