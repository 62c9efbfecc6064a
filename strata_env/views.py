"""The variables themselves: where ``STRATA_HOME`` is, and one typed view per kind of process.

- :class:`StrataEnv` / :func:`load`: the control plane (web, Celery, ``manage.py``);
- :class:`WorkerEnv` / :func:`load_worker`: a cache worker (the Ray actor and vLLM's KV connector);
  ``workers.config.WorkerConfig`` is built from it and adds the checks across variables;
- :class:`LauncherEnv` / :func:`load_launcher`: ``make run``'s launcher (``workers.launcher``).

Every loader takes the mapping to read (default ``os.environ``; the launcher passes its children's)
and raises :class:`~strata_env.fields.EnvError` naming the first variable it cannot use. The few
switches read again at call time (a device, test hooks, the sampler...) are functions here too, and
the views use the same functions, so each variable still has one definition.

Paths: ``STRATA_HOME``, ``STRATA_MASTER_KEY_FILE`` and ``STRATA_AUDIT_KEY_FILE`` are absolute, a
relative value taken from the repository root, so that every process agrees whatever its working
directory (a Ray worker runs in Ray's). ``STRATA_WEIGHTS_ROOT`` is resolved against the working
directory (as the control plane always did).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from strata_env.fields import EnvError, flag, fraction, given, integer, items, networks, number, string, word
from strata_env.fields import boolean as _boolean

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_HOME = ".strata"  # relative to REPO_ROOT
DEFAULT_PORT = 8000
DEFAULT_RAY_PORT = 6380  # not 6379: that is Redis's port
DEFAULT_RAY_BIND = "127.0.0.1"

# Switches the launcher sets for one child (its web process); read there by the control plane.
SAMPLER = "STRATA_SAMPLER"  # the stats sampler thread (controlplane.timeseries)
WARM_REPLICAS = "STRATA_WARM_REPLICAS"  # start replicas at startup and on create (runtime.warm)


def _src(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    """The mapping to read: ``environ``, or this process's environment (the one place Strata's code
    looks at ``os.environ`` to read it)."""
    return os.environ if environ is None else environ


# ---------------------------------------------------------------------------------------- paths
def repo_path(raw: str) -> Path:
    """``raw`` as an absolute path; a relative one is relative to the repository (as ``STRATA_HOME``
    is), so every process agrees whatever its working directory (Ray workers run elsewhere)."""
    path = Path(raw).expanduser()
    return path if path.is_absolute() else REPO_ROOT / path


def home(environ: Mapping[str, str] | None = None) -> Path:
    """``STRATA_HOME``: the state folder (SQLite database, keys, broker files, logs, the default L3
    store), default ``.strata`` in the repository; always absolute (relative: to the repository)."""
    raw = _src(environ).get("STRATA_HOME")
    path = Path(raw or REPO_ROOT / DEFAULT_HOME).expanduser()
    return path if path.is_absolute() else REPO_ROOT / path


def weights_root(environ: Mapping[str, str] | None = None) -> Path | None:
    """``STRATA_WEIGHTS_ROOT``: checkpoints (and every file in them) must resolve inside it when set."""
    raw = string(_src(environ), "STRATA_WEIGHTS_ROOT")
    # expanduser: the worker's reader (hf_config.weights_root) always expanded "~"; the control
    # plane's resolved "~/w" to a folder named "~" in the working directory.
    return Path(raw).expanduser().resolve() if raw else None


class _MasterKeyPaths:
    """``master_key_file`` of a view with ``home`` and ``master_key_path``."""

    @property
    def master_key_file(self) -> Path:
        """Where the master key lives: ``STRATA_MASTER_KEY_FILE`` or ``$STRATA_HOME/master.key``."""
        return self.master_key_path or self.home / "master.key"  # type: ignore[attr-defined]


@dataclass(frozen=True)
class MasterKeyEnv(_MasterKeyPaths):
    """The master key's variables alone (what a worker reads again when the key appears later)."""

    home: Path
    master_key: str | None  # STRATA_MASTER_KEY: base64 of the 32-byte key-encryption key
    master_key_path: Path | None  # STRATA_MASTER_KEY_FILE: the file holding it (else $STRATA_HOME/master.key)


def master_key_env(environ: Mapping[str, str] | None = None) -> MasterKeyEnv:
    src = _src(environ)
    path = string(src, "STRATA_MASTER_KEY_FILE")
    return MasterKeyEnv(home=home(src), master_key=string(src, "STRATA_MASTER_KEY"),
                        master_key_path=repo_path(path) if path else None)


# ---------------------------------------------------------------------------------------- switches
def device(environ: Mapping[str, str] | None = None) -> str | None:
    """``STRATA_DEVICE``: the torch device the engine must use (``cpu``, ``cuda``, ``cuda:1``; ``auto``
    or unset: CUDA when present), checked where torch parses it (``cachecore.device``)."""
    return word(_src(environ), "STRATA_DEVICE")


def enabled_test_hooks(environ: Mapping[str, str] | None = None) -> bool:
    """``STRATA_TEST_HOOKS=1``: the workers' fault-injection hooks answer (the test suite only)."""
    return _src(environ).get("STRATA_TEST_HOOKS") == "1"


def vllm_eager(environ: Mapping[str, str] | None = None) -> bool:
    """``STRATA_VLLM_EAGER=1``: vLLM without CUDA graphs on a GPU too (always eager on CPU)."""
    return _src(environ).get("STRATA_VLLM_EAGER") == "1"


def sampler(environ: Mapping[str, str] | None = None) -> bool:
    """``STRATA_SAMPLER``: this process runs the stats sampler (``make run`` sets it for web only)."""
    return flag(_src(environ), SAMPLER)


def warm_replicas(environ: Mapping[str, str] | None = None) -> bool:
    """``STRATA_WARM_REPLICAS``: the web process starts every deployment's replicas when it starts, and
    creating or granting a deployment starts its replicas at once. Unset or blank: on where a Ray
    cluster is configured (``RAY_ADDRESS``), off elsewhere; otherwise a switch (1/true/yes/on)."""
    src = _src(environ)
    if not given(src, WARM_REPLICAS):
        return given(src, "RAY_ADDRESS")
    return flag(src, WARM_REPLICAS)


def routing(environ: Mapping[str, str] | None = None) -> str | None:
    """``STRATA_ROUTING``: ``round_robin`` switches the replica routing policies off."""
    return string(_src(environ), "STRATA_ROUTING")


# ---------------------------------------------------------------------------------------- control plane
def web_share(environ: Mapping[str, str] | None, max_connections: int) -> int:
    """``STRATA_WEB_MAX_CONNECTIONS_PER_SOURCE``: connections one source (an IPv4 address or an IPv6
    /64) may hold in one web process, between 1 and the cap; default a quarter of the cap (at least 1),
    so that no single client can hold every slot."""
    default = max(1, max_connections // 4)
    return integer(_src(environ), "STRATA_WEB_MAX_CONNECTIONS_PER_SOURCE", default, minimum=1,
                   maximum=max(1, max_connections))


@dataclass(frozen=True)
class StrataEnv(_MasterKeyPaths):
    """The control plane's view. ``None`` means "not set: use the embedded default"."""

    home: Path  # STRATA_HOME: state directory (SQLite DB, secret key files, broker files, audit head log)
    secret_key: str | None  # STRATA_SECRET_KEY
    audit_key: str | None  # STRATA_AUDIT_KEY: HMAC key of the audit chain (else the file below)
    # STRATA_AUDIT_KEY_FILE: a file holding it (a mounted secret: must exist, never created); unset:
    # $STRATA_HOME/audit.key, generated on first use
    audit_key_path: Path | None
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
    web_max_connections_per_source: int  # STRATA_WEB_MAX_CONNECTIONS_PER_SOURCE: one source's share (429 past it)
    web_keepalive_s: int  # STRATA_WEB_KEEPALIVE_S: idle kept-alive connections closed after this
    web_header_timeout_s: float  # STRATA_WEB_HEADER_TIMEOUT_S: request line + headers within this
    web_body_timeout_s: float  # STRATA_WEB_BODY_TIMEOUT_S: the whole request body within this (else 408)
    weights_root: Path | None  # STRATA_WEIGHTS_ROOT: weights_path must resolve inside it when set
    sampler: bool  # STRATA_SAMPLER: this process samples the cache counters (make run's web process)
    warm_replicas: bool  # STRATA_WARM_REPLICAS: replicas start with the platform and on create (default: with Ray)
    routing: str | None  # STRATA_ROUTING: round_robin turns the routing policies off
    lora_max_loras: int  # STRATA_LORA_MAX_LORAS: adapters in one vLLM batch (0: vLLM starts without LoRA)
    lora_max_rank: int  # STRATA_LORA_MAX_RANK: the largest adapter rank registered and vLLM starts with
    demo_model: str | None  # STRATA_DEMO_MODEL: the checkpoint directory strata_demo serves as demo-hf
    database_url: str | None  # DATABASE_URL: PostgreSQL instead of the embedded SQLite file
    redis_url: str | None  # REDIS_URL: shared L3 store
    celery_broker_url: str | None  # CELERY_BROKER_URL: real broker instead of the embedded one
    ray_address: str | None  # RAY_ADDRESS: join a Ray cluster instead of a local head

    @property
    def secret_key_file(self) -> Path:
        return self.home / "secret_key"

    @property
    def audit_key_file(self) -> Path:
        """Where the audit key lives: ``STRATA_AUDIT_KEY_FILE`` or ``$STRATA_HOME/audit.key``."""
        return self.audit_key_path or self.home / "audit.key"


def load(environ: Mapping[str, str] | None = None) -> StrataEnv:
    """The control plane's view of ``environ`` (default: this process's environment), read now."""
    src = _src(environ)
    keys = master_key_env(src)
    max_connections = integer(src, "STRATA_WEB_MAX_CONNECTIONS", 512)
    audit_key, audit_key_path = string(src, "STRATA_AUDIT_KEY"), string(src, "STRATA_AUDIT_KEY_FILE")
    if audit_key and audit_key_path:
        raise EnvError("set only one of STRATA_AUDIT_KEY and STRATA_AUDIT_KEY_FILE")
    return StrataEnv(
        home=keys.home,
        secret_key=string(src, "STRATA_SECRET_KEY"),
        audit_key=audit_key,
        audit_key_path=repo_path(audit_key_path) if audit_key_path else None,
        master_key=keys.master_key,
        master_key_path=keys.master_key_path,
        debug=_boolean(src, "STRATA_DEBUG", False),
        allowed_hosts=items(src, "STRATA_ALLOWED_HOSTS"),
        csrf_trusted_origins=items(src, "STRATA_CSRF_TRUSTED_ORIGINS"),
        secure_ssl_redirect=_boolean(src, "STRATA_SECURE_SSL_REDIRECT", True),
        behind_tls_proxy=_boolean(src, "STRATA_BEHIND_TLS_PROXY", False),
        hsts_seconds=integer(src, "STRATA_HSTS_SECONDS", 31_536_000),
        log_level=(src.get("STRATA_LOG_LEVEL") or "INFO").upper(),
        max_body_bytes=integer(src, "STRATA_MAX_BODY_BYTES", 32 * 1024 * 1024),
        admin_max_body_bytes=integer(src, "STRATA_ADMIN_MAX_BODY_BYTES", 1024 * 1024),
        serving_max_body_bytes=integer(src, "STRATA_SERVING_MAX_BODY_BYTES", 4 * 1024 * 1024),
        render_threads=max(1, integer(src, "STRATA_RENDER_THREADS", 2)),
        render_budget_ms=max(1, integer(src, "STRATA_RENDER_BUDGET_MS", 1000)),
        trusted_proxies=networks(src, "STRATA_TRUSTED_PROXIES"),
        web_max_connections=max_connections,
        web_max_connections_per_source=web_share(src, max_connections),
        web_keepalive_s=integer(src, "STRATA_WEB_KEEPALIVE_S", 5),
        web_header_timeout_s=number(src, "STRATA_WEB_HEADER_TIMEOUT_S", 10.0),
        web_body_timeout_s=number(src, "STRATA_WEB_BODY_TIMEOUT_S", 60.0),
        weights_root=weights_root(src),
        sampler=sampler(src),
        warm_replicas=warm_replicas(src),
        routing=routing(src),
        lora_max_loras=integer(src, "STRATA_LORA_MAX_LORAS", 4, minimum=0, maximum=64),
        lora_max_rank=integer(src, "STRATA_LORA_MAX_RANK", 64, minimum=1, maximum=512),
        demo_model=string(src, "STRATA_DEMO_MODEL"),
        database_url=string(src, "DATABASE_URL"),
        redis_url=string(src, "REDIS_URL"),
        celery_broker_url=string(src, "CELERY_BROKER_URL"),
        ray_address=string(src, "RAY_ADDRESS"),
    )


# ---------------------------------------------------------------------------------------- worker
@dataclass(frozen=True)
class WorkerEnv(_MasterKeyPaths):
    """A cache worker's view. The defaults of the tunables are class attributes
    (``WorkerEnv.l1_mb``): ``workers.config.WorkerConfig`` takes its own defaults from them."""

    home: Path  # STRATA_HOME
    master_key: str | None  # STRATA_MASTER_KEY (read where it is used: workers.config.master_key)
    master_key_path: Path | None  # STRATA_MASTER_KEY_FILE (else $STRATA_HOME/master.key)
    l3_url: str  # STRATA_L3_URL: file:///path (default $STRATA_HOME/l3), redis[+cluster]://host:port[/db], or none
    weights_root: Path | None  # STRATA_WEIGHTS_ROOT
    device: str | None  # STRATA_DEVICE
    test_hooks: bool  # STRATA_TEST_HOOKS=1
    vllm_eager: bool  # STRATA_VLLM_EAGER=1
    eviction_policy: str | None  # STRATA_EVICTION_POLICY (None: the engine's default; checked by EngineConfig)
    l1_mb: int = 256  # STRATA_L1_MB: device pages per worker (>= 1)
    l1_mb_explicit: bool = False  # STRATA_L1_MB was set: on CUDA, vLLM's KV cache is that size, not a GPU share
    gpu_memory_utilization: float = 0.9  # STRATA_GPU_MEMORY_UTILIZATION: vLLM's share of each GPU, in (0, 1]
    l2_mb: int = 1024  # STRATA_L2_MB: host-memory pool per worker (0: no L2)
    write_policy: str = "write_back"  # STRATA_WRITE_POLICY: write_back | write_through | selective
    selective_min_hits: int = 2  # STRATA_SELECTIVE_MIN_HITS (>= 1)
    load_policy: str = "cost"  # STRATA_LOAD_POLICY: cost | always_load | always_recompute
    load_deadline_ms: int = 500  # STRATA_LOAD_DEADLINE_MS (>= 1)
    torch_threads: int = 0  # STRATA_TORCH_THREADS (0: every core but one, at least one)
    prefill_chunk: int = 256  # STRATA_PREFILL_CHUNK: tokens per prefill turn (>= 1)
    token_budget: int = 512  # STRATA_TOKEN_BUDGET: tokens one scheduler step computes at most (>= 2)
    max_batch: int = 32  # STRATA_MAX_BATCH: requests running at once (>= 1)
    lean_budget: int = 8  # STRATA_LEAN_BUDGET: others' tokens in a step carrying a lean tenant's prefill
    contended_budget: int = 64  # STRATA_CONTENDED_BUDGET: tokens per step under contention (0: no bound)
    anticipate_ms: int = 40  # STRATA_ANTICIPATE_MS: wait for a lean tenant's next request (0..1000)
    l3_mb: int = 4096  # STRATA_L3_MB: L3 capacity
    l3_sweep_seconds: int = 300  # STRATA_L3_SWEEP_SECONDS: retention sweep period (>= 1)
    vllm_connector: bool = True  # STRATA_VLLM_CONNECTOR (integer; 0: vLLM keeps its device cache only)


def load_worker(environ: Mapping[str, str] | None = None) -> WorkerEnv:
    """A cache worker's view of ``environ`` (default: this process's environment), read now."""
    src = _src(environ)
    keys = master_key_env(src)
    d = WorkerEnv  # the defaults
    return WorkerEnv(
        home=keys.home,
        master_key=keys.master_key,
        master_key_path=keys.master_key_path,
        l3_url=word(src, "STRATA_L3_URL") or (keys.home / "l3").as_uri(),
        weights_root=weights_root(src),
        device=device(src),
        test_hooks=enabled_test_hooks(src),
        vllm_eager=vllm_eager(src),
        eviction_policy=word(src, "STRATA_EVICTION_POLICY"),
        l1_mb=integer(src, "STRATA_L1_MB", d.l1_mb, minimum=1),
        l1_mb_explicit=given(src, "STRATA_L1_MB"),
        gpu_memory_utilization=fraction(src, "STRATA_GPU_MEMORY_UTILIZATION", d.gpu_memory_utilization),
        l2_mb=integer(src, "STRATA_L2_MB", d.l2_mb, minimum=0),
        write_policy=word(src, "STRATA_WRITE_POLICY", d.write_policy),
        selective_min_hits=integer(src, "STRATA_SELECTIVE_MIN_HITS", d.selective_min_hits, minimum=1),
        load_policy=word(src, "STRATA_LOAD_POLICY", d.load_policy),
        load_deadline_ms=integer(src, "STRATA_LOAD_DEADLINE_MS", d.load_deadline_ms, minimum=1),
        torch_threads=integer(src, "STRATA_TORCH_THREADS", d.torch_threads, minimum=0),
        prefill_chunk=integer(src, "STRATA_PREFILL_CHUNK", d.prefill_chunk, minimum=1),
        token_budget=integer(src, "STRATA_TOKEN_BUDGET", d.token_budget, minimum=2),
        max_batch=integer(src, "STRATA_MAX_BATCH", d.max_batch, minimum=1),
        lean_budget=integer(src, "STRATA_LEAN_BUDGET", d.lean_budget, minimum=0),
        contended_budget=integer(src, "STRATA_CONTENDED_BUDGET", d.contended_budget, minimum=0),
        anticipate_ms=integer(src, "STRATA_ANTICIPATE_MS", d.anticipate_ms, minimum=0, maximum=1000),
        l3_mb=integer(src, "STRATA_L3_MB", d.l3_mb, minimum=0),
        l3_sweep_seconds=integer(src, "STRATA_L3_SWEEP_SECONDS", d.l3_sweep_seconds, minimum=1),
        vllm_connector=integer(src, "STRATA_VLLM_CONNECTOR", 1, minimum=0) != 0,
    )


# ---------------------------------------------------------------------------------------- launcher
@dataclass(frozen=True)
class LauncherEnv:
    """``make run``'s view (``workers.launcher``). What its children read is theirs: the launcher
    passes them its environment with ``STRATA_HOME``, ``STRATA_MASTER_KEY_FILE``, ``RAY_ADDRESS`` and,
    for the web process, :data:`SAMPLER` and :data:`WARM_REPLICAS` set."""

    home: Path  # STRATA_HOME
    port: int  # PORT: the web server's port on 127.0.0.1 (default 8000)
    demo: bool  # STRATA_DEMO: run manage.py strata_demo before starting (a switch: 1/true/yes/on)
    ray_bind: str  # STRATA_RAY_BIND: the address the local Ray head binds to (default 127.0.0.1)
    ray_port: int  # STRATA_RAY_PORT: the local Ray head's preferred port (default 6380)
    ray_address: str | None  # RAY_ADDRESS: join this Ray cluster instead of starting a head
    database_url: str | None  # DATABASE_URL: shown in the banner's manage.py recipe when set


def load_launcher(environ: Mapping[str, str] | None = None) -> LauncherEnv:
    """The launcher's view of ``environ`` (default: this process's environment), read now."""
    src = _src(environ)
    return LauncherEnv(
        home=home(src),
        port=integer(src, "PORT", DEFAULT_PORT),
        demo=flag(src, "STRATA_DEMO"),
        ray_bind=word(src, "STRATA_RAY_BIND", DEFAULT_RAY_BIND),
        ray_port=integer(src, "STRATA_RAY_PORT", DEFAULT_RAY_PORT),
        ray_address=string(src, "RAY_ADDRESS"),
        database_url=string(src, "DATABASE_URL"),
    )
