"""``make run``: the whole platform in the foreground on one machine (``python -m workers.launcher``).

Steps: create ``$STRATA_HOME`` (default ``.strata`` in the repository; the launcher's view of the
environment is ``strata_env.load_launcher``, its children's their own); make sure the L3 master key exists
(``$STRATA_HOME/master.key``, 32 random bytes, mode 0600, created on first run, unless
``STRATA_MASTER_KEY``/``STRATA_MASTER_KEY_FILE`` name one) and point every child at it; ``manage.py
migrate``; with ``STRATA_DEMO=1`` or ``--demo`` run ``manage.py strata_demo``; start a local Ray
head unless ``RAY_ADDRESS`` names a cluster; start a Celery worker and the web server
(``workers.webserver``: uvicorn serving ``controlplane.asgi:application`` with a connection cap, header
and body timeouts and no trust in proxy headers; the app also samples the cache counters every 30 s for the
dashboard's charts: ``STRATA_SAMPLER=1``) on ``127.0.0.1:$PORT`` (default 8000); print the URL and how to
log in; wait. Ctrl-C or SIGTERM stops every process it started (SIGTERM to each child's process
group, a grace period, then SIGKILL to the group and to any descendant that left it) and the
launcher exits.

Supervision: the Ray head, the Celery worker and the web server are restarted when they die
(``Launcher.restart_policy``: backoff 1, 2, 4 ... 30 s; each restart logged with the exit code or
signal and the last lines of the child's log). When the Ray head dies, the web server and the Celery
worker are stopped with it and started again once the new head listens (their Ray connection, their
cached actor handles and the replicas themselves died with the old head; a fresh process joins the
new one). A crash loop (more than 5 deaths of one child within 5 minutes) stops the platform with
one message. ``$STRATA_HOME/processes.json`` (``workers.process_status``) says what each child is
doing; ``/readyz`` (operator details) and the console's dashboard show it.

The Ray head runs as ``ray start --head --block`` under the supervisor: on SIGTERM it tears down its
own daemons (GCS, raylet, workers, detached actors). ``ray stop`` is deliberately not used: it kills
every Ray process of the machine, including clusters this launcher did not start.

Children's output goes to ``$STRATA_HOME/logs/<name>.log`` (``--verbose``: to this console instead);
the last lines of a child's log are printed when it dies.

Private state: the launcher and every child run under umask 0077, ``$STRATA_HOME`` and ``logs/`` are
0700 and the files in them 0600 (files left by older versions are tightened on start). The local Ray
head's temp root (sessions, sockets, logs) is inside ``$TMPDIR/strata-<uid>``, a 0700 folder checked
on start (``workers.private_tmp``: repaired when ours, refused when not), because Ray makes its own
folders 0777. The demo's
stdout holds secrets (operator token, admin password, tenant keys): it is kept in memory and printed
to this terminal once, never written to a log (its stderr still goes to ``logs/demo.log``).

The local Ray head binds to ``127.0.0.1`` (``--node-ip-address``; dashboard off, and on 127.0.0.1
if turned on). ``STRATA_RAY_BIND=<this node's address>`` makes it reachable for other nodes, which
join with ``ray start --address=<address>:<port>`` and the token in ``$STRATA_HOME/ray_auth_token``
(the banner prints the command, with the ``strata_worker`` resource that keeps cache workers off
this head; docs/cluster.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shlex
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import strata_env
from workers import private_tmp, process_status
from workers.actor import WORKER_RESOURCE  # the custom resource worker nodes advertise
from workers.config import apply_ray_env
from workers.restarts import RestartPolicy
from workers.supervisor import Supervisor, private_dir, private_files, say, tail

REPO_ROOT = Path(__file__).resolve().parents[1]
PLATFORM_DIR = REPO_ROOT / "platform"
DEFAULT_RAY_PORT = strata_env.DEFAULT_RAY_PORT  # STRATA_RAY_PORT's default (not 6379: Redis's port)
HOST = "127.0.0.1"
PRIVATE_UMASK = 0o077  # files the launcher and its children create: owner only


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
    """Ray's temp root for the local head, inside ``$TMPDIR/strata-<uid>`` (0700, checked and repaired
    or refused on every start: ``workers.private_tmp``), short enough for Ray's socket paths."""
    try:
        root = private_tmp.private_root()
    except private_tmp.UnsafeFolderError as exc:
        raise LaunchError(str(exc)) from None
    if root.repaired:
        say(f"{root.path} was open to other users: now 0700")
    return str(private_tmp.ray_temp_dir(root.path))


def ray_bind() -> str:
    """The address the local Ray head binds to: ``STRATA_RAY_BIND`` (for a multi-node cluster: this
    node's address that the other nodes reach), default 127.0.0.1 (this machine only)."""
    return strata_env.load_launcher().ray_bind


def ray_bind_env(bind: str) -> dict[str, str]:
    """Environment for a Ray head bound to ``bind``. On Linux Ray replaces ``--node-ip-address
    127.0.0.1`` by the machine's outward address and its GCS and raylet then listen on every
    interface; with Ray's single-machine switch (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, Ray's
    ``ENABLE_RAY_CLUSTER``) the loopback address is kept and they listen on 127.0.0.1 only."""
    if bind in {"127.0.0.1", "localhost", "::1"}:
        return {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    return {}


def join_command(host: str, port: int, auth_file: str = "/path/to/ray_auth_token", slots: int = 8) -> str:
    """The command another machine runs to join this head as a cache-worker node (``slots`` replicas
    at most; ``auth_file``: its copy of ``$STRATA_HOME/ray_auth_token``)."""
    resources = json.dumps({WORKER_RESOURCE: slots})
    return (f"RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={auth_file} "
            f"ray start --address={host}:{port} --resources='{resources}' --block")


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """The HTTP status of GET ``url`` (any status), or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - our own http:// URL
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError):
        return None


def web_argv(python: str, port: int, environ: dict[str, str]) -> list[str]:
    """The web server's command line (``workers.webserver``: uvicorn with no proxy-header handling, a
    connection cap and each source's share of it, keep-alive, header and body timeouts; values from
    ``STRATA_WEB_*`` in ``environ``, spelled out so ``ps`` and the log show what the server runs with)."""
    try:
        web = strata_env.load(environ)  # the control plane's view: the web process reads the same
    except strata_env.EnvError as exc:
        raise LaunchError(str(exc)) from None
    return [python, "-m", "workers.webserver", "--host", HOST, "--port", str(port), "--lifespan", "off",
            "--timeout-graceful-shutdown", "5", "--limit-concurrency", str(web.web_max_connections),
            "--max-connections-per-source", str(web.web_max_connections_per_source),
            "--timeout-keep-alive", str(web.web_keepalive_s), "--timeout-header", f"{web.web_header_timeout_s:g}",
            "--timeout-body", f"{web.web_body_timeout_s:g}"]


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
        try:
            env = strata_env.load_launcher()
        except strata_env.EnvError as exc:
            parser.error(str(exc))
        return cls(home=env.home, port=args.port or env.port, demo=args.demo or env.demo, verbose=args.verbose,
                   ray_address=env.ray_address)


class Launcher:
    """The ``make run`` sequence on top of a :class:`Supervisor`."""

    restart_policy = RestartPolicy()  # for the Ray head, the Celery worker and the web server

    def __init__(self, cfg: Config, sup: Supervisor | None = None) -> None:
        self.cfg = cfg
        self.sup = sup or Supervisor(umask=PRIVATE_UMASK)
        if self.sup.status_path is None:
            self.sup.status_path = process_status.path_in(cfg.home)
        self.logs = cfg.home / "logs"
        self.env = self._child_env()
        self.ray_port: int | None = None
        self.ray_host = HOST
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
        apply_ray_env(env)  # replicas at the normal priority (workers.config.RAY_PROCESS_ENV)
        return env

    def _log(self, name: str) -> Path | None:
        return None if self.cfg.verbose else self.logs / f"{name}.log"

    def _bin(self, name: str) -> str:
        local = Path(self.cfg.python).parent / name
        return str(local) if local.exists() else name

    def _manage(self, *args: str) -> list[str]:
        return [self.cfg.python, str(REPO_ROOT / "manage.py"), *args]

    def _one_shot(self, name: str, argv: list[str], what: str, timeout: float, *, capture: bool = False) -> str:
        """Run a set-up step to completion; returns its stdout when ``capture`` (kept in memory only:
        never in a log file), else ``""``."""
        kwargs = {"env": self.env, "cwd": REPO_ROOT, "log_path": self._log(name), "timeout": timeout}
        output = ""
        if capture:
            rc, output = self.sup.run_captured(name, argv, **kwargs)
        else:
            rc = self.sup.run(name, argv, **kwargs)
        if rc is None and self.sup.stop_reason:
            raise Interrupted(self.sup.stop_reason)
        if rc != 0:
            detail = tail(self._log(name))
            reason = "timed out" if rc is None else f"exit {rc}"
            raise LaunchError(f"{what} failed ({reason})" + (f"; last lines of {self._log(name)}:\n{detail}"
                                                             if detail else ""))
        return output

    # -------------------------------------------------------------- steps
    def prepare(self) -> None:
        """``$STRATA_HOME`` and ``logs/`` mode 0700, what is already in them 0600; the port is free."""
        for folder in (self.cfg.home, self.logs):
            private_dir(folder)
            private_files(folder)
        if port_open(HOST, self.cfg.port):
            raise LaunchError(f"port {self.cfg.port} is already in use; set PORT to a free port")
        say(f"state in {self.cfg.home} (logs in {self.logs})")

    def master_key(self) -> None:
        """The L3 master key (``controlplane.common.masterkey``): created on first run as
        ``$STRATA_HOME/master.key`` (0600) when neither ``STRATA_MASTER_KEY`` nor
        ``STRATA_MASTER_KEY_FILE`` is set, checked now (a malformed key or a file others may read
        stops the launch with the reason), and ``STRATA_MASTER_KEY_FILE`` passed to every child
        (web, Celery, the Ray head and so the cache workers), so all of them use the same key."""
        from controlplane.common.masterkey import ensure_master_key

        try:
            self.env.update(ensure_master_key(strata_env.load(self.env)))
        except strata_env.EnvError as exc:  # a MasterKeyError too
            raise LaunchError(str(exc)) from None
        where = self.env.get("STRATA_MASTER_KEY_FILE") or "STRATA_MASTER_KEY"
        say(f"L3 master key: {where}")

    def migrate(self) -> None:
        say("applying database migrations")
        self._one_shot("migrate", self._manage("migrate", "--noinput"), "manage.py migrate", timeout=600)

    def demo(self) -> None:
        say("creating demo tenants, keys and model (strata_demo)")
        argv = self._manage("strata_demo", "--base-url", f"http://{HOST}:{self.cfg.port}")
        # Its stdout holds the secrets: in memory, printed once by banner(), never in logs/demo.log.
        self.demo_output = self._one_shot("demo", argv, "manage.py strata_demo", timeout=300, capture=True)

    def ray_head_argv(self, port: int) -> list[str]:
        """``ray start --head`` for the local head: bound to 127.0.0.1 (or ``STRATA_RAY_BIND``), no
        dashboard (its host pinned to 127.0.0.1 all the same), private temp dir."""
        bind = ray_bind()
        return [
            self._bin("ray"), "start", "--head", "--block",
            f"--node-ip-address={bind}", f"--port={port}", f"--num-cpus={os.cpu_count() or 1}",
            "--include-dashboard=false", f"--dashboard-host={HOST}", "--disable-usage-stats",
            # Ray's fixed defaults collide with other local clusters (tests, a second launcher).
            f"--dashboard-port={free_port(8265)}", f"--dashboard-agent-listen-port={free_port(52365)}",
            f"--temp-dir={ray_temp_dir()}",
        ]

    def start_ray(self) -> None:
        if self.cfg.ray_address:
            say(f"joining the Ray cluster at {self.cfg.ray_address} (RAY_ADDRESS)")
            return
        try:
            preferred = strata_env.load_launcher().ray_port
        except strata_env.EnvError as exc:
            raise LaunchError(str(exc)) from None
        port = free_port(preferred)
        if port != preferred:
            say(f"port {preferred} is busy; the Ray head uses {port}")
        argv = self.ray_head_argv(port)
        self._ray_auth()
        host = ray_bind()
        self.env.update(ray_bind_env(host))  # the head and every driver (web, Celery) agree on the address
        # Whatever Ray in a child writes by default goes inside the private root too (ray_head_argv checked it).
        self.env["RAY_TMPDIR"] = str(private_tmp.root_path())
        env = {**self.env, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}  # one node: nothing to drain
        say(f"starting a local Ray head on {host}:{port}")
        child = self.sup.start("ray-head", argv, env=env, cwd=REPO_ROOT, log_path=self._log("ray-head"),
                               restart=self.restart_policy, ready=lambda: port_open(host, port))
        deadline = time.monotonic() + 120
        while not port_open(host, port):
            if child.proc.poll() is not None:
                raise LaunchError(f"the Ray head exited (code {child.proc.returncode}):\n"
                                  f"{tail(child.log_path)}")
            if self.sup.stop_reason:
                raise Interrupted(self.sup.stop_reason)
            if time.monotonic() > deadline:
                raise LaunchError(f"the Ray head did not open port {port} within 120 s")
            time.sleep(0.25)
        self.ray_port = port
        self.ray_host = host
        self.env["RAY_ADDRESS"] = f"{host}:{port}"

    def _ray_auth(self) -> None:
        """Defence in depth beside the loopback bind (the only defence with ``STRATA_RAY_BIND``): the
        local head requires a token (Ray's own token auth) kept in ``$STRATA_HOME/ray_auth_token``
        (0600); children get it through the environment. An explicit ``RAY_AUTH_MODE`` in the
        environment is respected."""
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
        self.sup.start("celery", argv, env=self.env, cwd=REPO_ROOT, log_path=self._log("celery"),
                       restart=self.restart_policy, after=self._after_ray())

    def _after_ray(self) -> str | None:
        """``"ray-head"`` when this launcher runs the Ray head: its drivers start again after it."""
        return "ray-head" if self.ray_port else None

    def start_web(self) -> None:
        say(f"starting the web server on http://{HOST}:{self.cfg.port}")
        argv = web_argv(self.cfg.python, self.cfg.port, self.env)
        # The web process also runs the stats sampler (controlplane.timeseries; STRATA_SAMPLER=0 turns it off).
        # ... and starts a deployment's replicas when it is created or granted (controlplane.runtime.warm).
        env = {strata_env.SAMPLER: "1", strata_env.WARM_REPLICAS: "1", **self.env}
        url = f"http://{HOST}:{self.cfg.port}/healthz"
        child = self.sup.start("web", argv, env=env, cwd=REPO_ROOT, log_path=self._log("web"),
                               restart=self.restart_policy, after=self._after_ray(),
                               ready=lambda: http_status(url) is not None)
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

    def _manage_env(self) -> str:
        """What ``manage.py`` needs in front of it to use this platform's state (nothing by default)."""
        parts = []
        if self.cfg.home.resolve() != strata_env.home({}).resolve():
            parts.append(f"STRATA_HOME={shlex.quote(str(self.cfg.home))}")
        if strata_env.load_launcher().database_url:
            parts.append('DATABASE_URL="$DATABASE_URL"')
        return " ".join(parts) + " " if parts else ""

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
            lines.append(f"  Ray head:                   {self.ray_host}:{self.ray_port} (RAY_ADDRESS for clients)")
            if self.ray_host not in {"127.0.0.1", "localhost", "::1"}:
                lines.append(f"  add a worker node:          {join_command(self.ray_host, self.ray_port)}")
        if not self.cfg.demo:
            manage = f"{self._manage_env()}.venv/bin/python manage.py"
            lines += [
                "",
                "Log in: create an operator token and an admin user with",
                f"  {manage} create_operator_token --username you --role admin",
                f"  {manage} createsuperuser",
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
            self.master_key()
            self.migrate()
            if self.cfg.demo:
                self.demo()
            self.start_ray()
            self.start_celery()
            self.start_web()
            self.banner()
            dead = self.sup.watch()
            if dead is not None:
                if self.sup.failure:
                    say(f"error: {self.sup.failure}")
                else:
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
            if self.ray_port and port_open(self.ray_host, self.ray_port):
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
    os.umask(PRIVATE_UMASK)  # first: everything this process creates is private (children get it too)
    launcher = Launcher(Config.from_env(argv))
    stop_on_signals(launcher.sup)
    return launcher.run()


if __name__ == "__main__":
    sys.exit(main())
