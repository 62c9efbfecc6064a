"""The one place that reads the process environment.

Every setting the platform takes from the environment is a field of :class:`StrataEnv`, read once by
:func:`load`. Strata's own variables carry the ``STRATA_`` prefix; the conventional names
``DATABASE_URL``, ``REDIS_URL``, ``CELERY_BROKER_URL`` and ``RAY_ADDRESS`` are read as they are so
that standard tooling (docker-compose, PaaS) works unchanged. Other modules read ``settings`` (or
call :func:`load`), never ``os.environ``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off", ""}


class EnvError(ValueError):
    """An environment variable is set to a value that cannot be used."""


def _bool(src: Mapping[str, str], name: str, default: bool) -> bool:
    raw = src.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise EnvError(f"{name} must be a boolean (1/0, true/false), got {raw!r}")


def _int(src: Mapping[str, str], name: str, default: int) -> int:
    raw = src.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise EnvError(f"{name} must be an integer, got {raw!r}") from None


def _float(src: Mapping[str, str], name: str, default: float) -> float:
    raw = src.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise EnvError(f"{name} must be a number, got {raw!r}") from None


def _list(src: Mapping[str, str], name: str, default: tuple[str, ...] = ()) -> tuple[str, ...]:
    raw = src.get(name)
    if raw is None:
        return default
    return tuple(item.strip() for item in raw.split(",") if item.strip())


def _networks(src: Mapping[str, str], name: str) -> tuple[str, ...]:
    """Comma-separated IP addresses or CIDR networks, each checked (a typo must not silently trust
    nobody, or everybody); returned normalised (``10.0.0.1`` -> ``10.0.0.1/32``)."""
    networks = []
    for item in _list(src, name):
        try:
            networks.append(str(ipaddress.ip_network(item, strict=False)))
        except ValueError:
            raise EnvError(f"{name} must list IP addresses or CIDR networks, got {item!r}") from None
    return tuple(networks)


def _str(src: Mapping[str, str], name: str) -> str | None:
    raw = src.get(name)
    return raw if raw else None


@dataclass(frozen=True)
class StrataEnv:
    """Typed view of the environment. ``None`` means "not set: use the embedded default"."""

    home: Path  # STRATA_HOME: state directory (SQLite DB, secret key files, broker files, audit head log)
    secret_key: str | None  # STRATA_SECRET_KEY
    audit_key: str | None  # STRATA_AUDIT_KEY: HMAC key of the audit chain (else $STRATA_HOME/audit.key)
    master_key: str | None  # STRATA_MASTER_KEY: base64 of the 32-byte key-encryption key of L3 data keys
    master_key_path: Path | None  # STRATA_MASTER_KEY_FILE: file holding it (else $STRATA_HOME/master.key)
    debug: bool  # STRATA_DEBUG (local settings only)
    allowed_hosts: tuple[str, ...]  # STRATA_ALLOWED_HOSTS, comma separated
    csrf_trusted_origins: tuple[str, ...]  # STRATA_CSRF_TRUSTED_ORIGINS, comma separated
    secure_ssl_redirect: bool  # STRATA_SECURE_SSL_REDIRECT (production)
    behind_tls_proxy: bool  # STRATA_BEHIND_TLS_PROXY: trust X-Forwarded-Proto (production)
    hsts_seconds: int  # STRATA_HSTS_SECONDS (production)
    log_level: str  # STRATA_LOG_LEVEL
    max_body_bytes: int  # STRATA_MAX_BODY_BYTES: largest body on /v1/kv/store, the UI and Django's admin
    admin_max_body_bytes: int  # STRATA_ADMIN_MAX_BODY_BYTES: largest request body on /api/admin/
    serving_max_body_bytes: int  # STRATA_SERVING_MAX_BODY_BYTES: largest body on /v1/ but /v1/kv/store
    render_threads: int  # STRATA_RENDER_THREADS: threads that parse, render and tokenize /v1/ bodies
    render_budget_ms: int  # STRATA_RENDER_BUDGET_MS: time budget of one chat template render
    trusted_proxies: tuple[str, ...]  # STRATA_TRUSTED_PROXIES: proxies whose X-Forwarded-For is believed
    web_max_connections: int  # STRATA_WEB_MAX_CONNECTIONS: the web server's connection/task cap (503 past it)
    web_keepalive_s: int  # STRATA_WEB_KEEPALIVE_S: idle kept-alive connections closed after this
    web_header_timeout_s: float  # STRATA_WEB_HEADER_TIMEOUT_S: request line + headers within this
    web_body_timeout_s: float  # STRATA_WEB_BODY_TIMEOUT_S: the whole request body within this (else 408)
    weights_root: Path | None  # STRATA_WEIGHTS_ROOT: weights_path must resolve inside it when set
    database_url: str | None  # DATABASE_URL: PostgreSQL instead of the embedded SQLite file
    redis_url: str | None  # REDIS_URL: shared L3 store
    celery_broker_url: str | None  # CELERY_BROKER_URL: real broker instead of the embedded one
    ray_address: str | None  # RAY_ADDRESS: join a Ray cluster instead of a local head

    @property
    def secret_key_file(self) -> Path:
        return self.home / "secret_key"

    @property
    def audit_key_file(self) -> Path:
        return self.home / "audit.key"

    @property
    def master_key_file(self) -> Path:
        """Where the master key lives: ``STRATA_MASTER_KEY_FILE`` or ``$STRATA_HOME/master.key``."""
        return self.master_key_path or self.home / "master.key"


def _repo_path(raw: str) -> Path:
    """``raw`` as an absolute path; a relative one is relative to the repository (as ``STRATA_HOME``
    is), so every process agrees whatever its working directory (Ray workers run elsewhere)."""
    path = Path(raw).expanduser()
    return path if path.is_absolute() else REPO_ROOT / path


def load(environ: Mapping[str, str] | None = None) -> StrataEnv:
    """Read the environment now (``environ``: another process's, e.g. a launcher's children's).
    Raises :class:`EnvError` for malformed values."""
    src = os.environ if environ is None else environ
    home = Path(src.get("STRATA_HOME") or REPO_ROOT / ".strata").expanduser()
    if not home.is_absolute():
        home = REPO_ROOT / home
    weights_root = _str(src, "STRATA_WEIGHTS_ROOT")
    master_key_path = _str(src, "STRATA_MASTER_KEY_FILE")
    return StrataEnv(
        home=home,
        secret_key=_str(src, "STRATA_SECRET_KEY"),
        audit_key=_str(src, "STRATA_AUDIT_KEY"),
        master_key=_str(src, "STRATA_MASTER_KEY"),
        master_key_path=_repo_path(master_key_path) if master_key_path else None,
        debug=_bool(src, "STRATA_DEBUG", False),
        allowed_hosts=_list(src, "STRATA_ALLOWED_HOSTS"),
        csrf_trusted_origins=_list(src, "STRATA_CSRF_TRUSTED_ORIGINS"),
        secure_ssl_redirect=_bool(src, "STRATA_SECURE_SSL_REDIRECT", True),
        behind_tls_proxy=_bool(src, "STRATA_BEHIND_TLS_PROXY", False),
        hsts_seconds=_int(src, "STRATA_HSTS_SECONDS", 31_536_000),
        log_level=(src.get("STRATA_LOG_LEVEL") or "INFO").upper(),
        max_body_bytes=_int(src, "STRATA_MAX_BODY_BYTES", 32 * 1024 * 1024),
        admin_max_body_bytes=_int(src, "STRATA_ADMIN_MAX_BODY_BYTES", 1024 * 1024),
        serving_max_body_bytes=_int(src, "STRATA_SERVING_MAX_BODY_BYTES", 4 * 1024 * 1024),
        render_threads=max(1, _int(src, "STRATA_RENDER_THREADS", 2)),
        render_budget_ms=max(1, _int(src, "STRATA_RENDER_BUDGET_MS", 1000)),
        trusted_proxies=_networks(src, "STRATA_TRUSTED_PROXIES"),
        web_max_connections=_int(src, "STRATA_WEB_MAX_CONNECTIONS", 512),
        web_keepalive_s=_int(src, "STRATA_WEB_KEEPALIVE_S", 5),
        web_header_timeout_s=_float(src, "STRATA_WEB_HEADER_TIMEOUT_S", 10.0),
        web_body_timeout_s=_float(src, "STRATA_WEB_BODY_TIMEOUT_S", 60.0),
        weights_root=Path(weights_root).resolve() if weights_root else None,
        database_url=_str(src, "DATABASE_URL"),
        redis_url=_str(src, "REDIS_URL"),
        celery_broker_url=_str(src, "CELERY_BROKER_URL"),
        ray_address=_str(src, "RAY_ADDRESS"),
    )


def private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) mode 0700; an existing one of ours is tightened to 0700.

    ``STRATA_HOME`` holds the database, broker files, keys and logs: nobody else may read it. A
    shared sticky folder (``/tmp``) is never changed."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) & 0o077 and not info.st_mode & stat.S_ISVTX:
        path.chmod(0o700)
    return path


def private_file(path: Path, *companions: str) -> Path:
    """Create ``path`` empty with mode 0600 if it is missing, and tighten it (and the companion
    files ``path`` + suffix that exist, e.g. SQLite's ``-wal``/``-shm``) to 0600 when they are ours.

    SQLite gives its ``-wal``, ``-shm`` and journal files the mode of the database file, so a
    database created here first stays private whatever the process umask."""
    private_dir(path.parent)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    for candidate in (path, *(path.with_name(path.name + suffix) for suffix in companions)):
        with contextlib.suppress(FileNotFoundError, PermissionError):
            info = candidate.stat()
            if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) & 0o077:
                candidate.chmod(0o600)
    return path


def secret_key_from_file(path: Path) -> str:
    """Return the key stored at ``path``, generating it (mode 0600, in a 0700 folder) on first use.

    The file appears atomically with its content (written aside, then hard-linked into place), so
    two processes starting at once agree on one key and never read a half-written file.
    """
    if path.exists():
        return path.read_text().strip()
    private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_urlsafe(50) + "\n")
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path.read_text().strip()
