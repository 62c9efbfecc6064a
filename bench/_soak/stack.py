"""The soak's stack: ``make run``'s real launcher (``python -m workers.launcher``) on a dedicated
PostgreSQL database, the soak's own ``redis-server`` and a private ``STRATA_HOME``.

What each service is for, and why it is the soak's own:

- PostgreSQL on 127.0.0.1:5432 (trust auth, as CI has it): database ``strata_soak`` (``--db``), created
  at the start and dropped at the end, so ``pg_terminate_backend`` only ever hits this stack's sessions;
- ``redis-server`` on a free port, started by the soak: ``REDIS_URL`` (shared rate-limit counters) and
  ``STRATA_L3_URL`` (L3) point at it, so stopping it or pausing it never touches the machine's Redis;
- the Celery broker is the machine's Redis on 6379 with its own db number (``--broker-db``): jobs must
  outlive the soak's Redis faults;
- the web server on a free port, the Ray head on another (never 6379).

The launcher's children are found by their command lines (``roles``): ``web``, ``celery``, ``ray-head``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import psycopg
import redis

REPO_ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
PG_ADMIN_DSN = "host=127.0.0.1 port=5432 user=postgres dbname=postgres"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class OwnRedis:
    """A ``redis-server`` on a free port of 127.0.0.1, without persistence, that the soak may stop,
    restart and pause."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def url(self, db: int = 0) -> str:
        return f"redis://{HOST}:{self.port}/{db}"

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis(host=HOST, port=self.port, db=db, socket_timeout=5)

    def start(self, timeout: float = 20.0) -> None:
        argv = ["redis-server", "--port", str(self.port), "--bind", HOST, "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), "--maxclients", "1000"]
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self.alive():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not start (see {self.workdir / 'redis.log'})")
            time.sleep(0.1)

    def alive(self) -> bool:
        with contextlib.suppress(redis.RedisError, OSError):
            return bool(self.client().ping())
        return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def pause(self, seconds: float) -> None:
        """``CLIENT PAUSE`` every client (writes and reads) for ``seconds``."""
        self.client().execute_command("CLIENT", "PAUSE", str(int(seconds * 1000)), "ALL")


class SoakDatabase:
    """The stack's own PostgreSQL database: created empty, dropped at the end."""

    def __init__(self, name: str) -> None:
        self.name = name

    @property
    def url(self) -> str:
        return f"postgres://postgres@{HOST}:5432/{self.name}"

    def _admin(self) -> psycopg.Connection:
        return psycopg.connect(PG_ADMIN_DSN, autocommit=True, connect_timeout=10)

    def create(self) -> None:
        with self._admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{self.name}"')

    def drop(self) -> None:
        with self._admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')

    def terminate(self) -> int:
        """``pg_terminate_backend`` on every session of this database (the stack's); how many."""
        with self._admin() as conn:
            rows = conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                "WHERE datname = %s AND pid <> pg_backend_pid()", (self.name,)).fetchall()
        return sum(1 for (ok,) in rows if ok)


@dataclass
class StackConfig:
    db: str = "strata_soak"
    broker_db: int = 12
    l1_mb: int = 16
    l2_mb: int = 16
    l3_mb: int = 1
    extra_env: dict[str, str] | None = None


class Stack:
    """``python -m workers.launcher`` with the soak's environment; ``start`` returns once ``/healthz``
    answers, ``stop`` ends the launcher (and so every child), the Redis server and the database."""

    def __init__(self, cfg: StackConfig) -> None:
        self.cfg = cfg
        self.home = Path(tempfile.mkdtemp(prefix="strata-soak-"))
        self.redis = OwnRedis(self.home)
        self.db = SoakDatabase(cfg.db)
        self.web_port = free_port()
        self.ray_port = free_port()
        self.url = f"http://{HOST}:{self.web_port}"
        self.launcher: subprocess.Popen | None = None
        self.env: dict[str, str] = {}

    # ------------------------------------------------------------------ lifecycle
    def _environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("STRATA_", "RAY_"))}
        env.update({
            "STRATA_HOME": str(self.home), "PORT": str(self.web_port), "STRATA_RAY_PORT": str(self.ray_port),
            "DATABASE_URL": self.db.url, "REDIS_URL": self.redis.url(0), "STRATA_L3_URL": self.redis.url(1),
            "CELERY_BROKER_URL": f"redis://{HOST}:6379/{self.cfg.broker_db}",
            "STRATA_L1_MB": str(self.cfg.l1_mb), "STRATA_L2_MB": str(self.cfg.l2_mb),
            "STRATA_L3_MB": str(self.cfg.l3_mb), "STRATA_DEVICE": "cpu", "PYTHONUNBUFFERED": "1",
        })
        env.update(self.cfg.extra_env or {})
        return env

    def start(self, timeout: float = 300.0) -> None:
        self.redis.start()
        self.db.create()
        self.env = self._environment()
        log = open(self.home / "launcher.log", "ab")  # noqa: SIM115 - handed to the child
        self.launcher = subprocess.Popen([sys.executable, "-m", "workers.launcher"], cwd=REPO_ROOT, env=self.env,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.launcher.poll() is not None:
                raise RuntimeError(f"the launcher exited ({self.launcher.returncode}):\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the stack did not answer /healthz within {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.5)

    def healthy(self) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200
        return False

    def alive(self) -> bool:
        return self.launcher is not None and self.launcher.poll() is None

    def manage(self, *args: str, env: dict[str, str] | None = None) -> str:
        """``manage.py`` with the stack's environment; its stdout."""
        done = subprocess.run([sys.executable, str(REPO_ROOT / "manage.py"), *args], cwd=REPO_ROOT,
                              env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"manage.py {args[0]} failed: {done.stderr.strip()[-2000:]}")
        return done.stdout

    def stop(self, *, keep_home: bool = False) -> None:
        if self.launcher is not None and self.launcher.poll() is None:
            self.launcher.send_signal(signal.SIGTERM)
            try:
                self.launcher.wait(timeout=90)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.launcher.pid, signal.SIGKILL)
                self.launcher.wait()
        self.redis.stop()
        with contextlib.suppress(psycopg.Error):
            self.db.drop()
        with contextlib.suppress(redis.RedisError, OSError):
            redis.Redis(host=HOST, port=6379, db=self.cfg.broker_db, socket_timeout=5).flushdb()
        if not keep_home:
            shutil.rmtree(self.home, ignore_errors=True)

    def log_tail(self, name: str = "launcher.log", lines: int = 30) -> str:
        path = self.home / name if name == "launcher.log" else self.home / "logs" / name
        if not path.exists():
            return ""
        return "\n".join(path.read_bytes()[-16384:].decode(errors="replace").splitlines()[-lines:])

    def l3_backend(self):
        """The stack's L3 store as its workers open it (``cachecore.tiers.backends``): what it holds."""
        from cachecore.tiers.backends import open_backend

        return open_backend(self.env["STRATA_L3_URL"])

    # ------------------------------------------------------------------ processes
    def roles(self) -> dict[str, psutil.Process]:
        """The launcher's live children by role: ``web``, ``celery``, ``ray-head``."""
        found: dict[str, psutil.Process] = {}
        if not self.alive():
            return found
        for proc in psutil.Process(self.launcher.pid).children(recursive=False):
            with contextlib.suppress(psutil.Error):
                cmd = " ".join(proc.cmdline())
                if "workers.webserver" in cmd:
                    found["web"] = proc
                elif "celery" in cmd and " worker" in cmd:
                    found["celery"] = proc
                elif "ray" in cmd and "--head" in cmd:
                    found["ray-head"] = proc
        return found

    def wait_role(self, role: str, *, not_pid: int | None = None, timeout: float = 60.0) -> psutil.Process | None:
        """The live ``role`` process other than ``not_pid`` (a restarted one), or None by ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.alive():
            proc = self.roles().get(role)
            if proc is not None and proc.pid != not_pid:
                return proc
            time.sleep(0.5)
        return None
