"""Settings shared by every environment. Environment values come only from ``controlplane.env``.

Database: the embedded SQLite file ``$STRATA_HOME/db.sqlite3`` unless ``DATABASE_URL`` is set
(parsed by dj-database-url, e.g. ``postgres://user@host:5432/strata``).
Broker: ``CELERY_BROKER_URL`` when set, otherwise kombu's SQLAlchemy transport on
``$STRATA_HOME/broker.sqlite3`` (needs no server).
Private state: ``$STRATA_HOME`` is created (or tightened to) mode 0700, and the embedded SQLite
database and broker files are created 0600 before SQLite opens them (SQLite gives their ``-wal`` and
``-shm`` files the same mode), whatever the process umask.
"""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

import dj_database_url

from controlplane import env as envmod

ENV = envmod.load()
BASE_DIR = envmod.REPO_ROOT
STRATA_HOME: Path = ENV.home

# Subpackages owned by other parts of the platform; installed when they exist so that this
# settings module never has to change when they land.
OPTIONAL_APPS = ["controlplane.jobs", "controlplane.serving", "controlplane.runtime", "controlplane.ui",
                 "controlplane.timeseries", "controlplane.adapters", "controlplane.caches", "controlplane.ledger",
                 "controlplane.backups", "controlplane.conversations"]


def _exists(module: str) -> bool:
    try:
        return find_spec(module) is not None
    except ModuleNotFoundError:
        return False


SQLITE_OPTIONS = {
    # IMMEDIATE takes the write lock when a transaction starts: concurrent writers (web, Celery, CLI)
    # queue for up to `timeout` seconds instead of failing on lock upgrade; the audit chain relies on it.
    "transaction_mode": "IMMEDIATE",
    "timeout": 20,
    # secure_delete: deleted or overwritten content is zeroed in the file, so a shredded data key's
    # wrapped bytes do not linger in free space (the shred also checkpoints the WAL away).
    "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; PRAGMA secure_delete=ON;",
}


SQLITE_COMPANIONS = ("-wal", "-shm", "-journal")


def database_config(env: envmod.StrataEnv) -> dict:
    """``DATABASES['default']`` for ``env``: ``DATABASE_URL`` (PostgreSQL, or any URL dj-database-url
    parses) or the SQLite file ``$STRATA_HOME/db.sqlite3``. Every SQLite database gets
    :data:`SQLITE_OPTIONS`, also when named by URL (a worker pointed at a test database)."""
    if env.database_url:
        # Under ASGI every request's sync code runs in a fresh thread, so per-thread persistent
        # connections are never reused: PostgreSQL gets a connection pool instead.
        config = dj_database_url.parse(env.database_url, conn_max_age=0)
        if config["ENGINE"].endswith("postgresql"):
            config.setdefault("OPTIONS", {})["pool"] = {"min_size": 1, "max_size": 20, "timeout": 10}
            # With a pool, Django passes psycopg_pool's ``check``: a pooled connection is tested (an
            # empty query) when it is handed out, and a dead one (the server restarted,
            # ``pg_terminate_backend``) is replaced instead of failing the request that drew it.
            config["CONN_HEALTH_CHECKS"] = True
    else:
        database = envmod.private_file(env.home / "db.sqlite3", *SQLITE_COMPANIONS)  # 0600 in a 0700 home
        config = {"ENGINE": "django.db.backends.sqlite3", "NAME": str(database)}
    if config["ENGINE"].endswith("sqlite3"):
        config["OPTIONS"] = {**SQLITE_OPTIONS, **config.get("OPTIONS", {})}
        config["CONN_MAX_AGE"] = 0
    return config


def secret_key(env: envmod.StrataEnv) -> str:
    """``STRATA_SECRET_KEY`` or the key file under ``STRATA_HOME`` (generated on first use)."""
    return env.secret_key or envmod.secret_key_from_file(env.secret_key_file)


DEBUG = False
ALLOWED_HOSTS: list[str] = list(ENV.allowed_hosts)
CSRF_TRUSTED_ORIGINS: list[str] = list(ENV.csrf_trusted_origins)

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "ninja",  # only for the admin API docs page's templates and static files (served here, no CDN)
    "controlplane.audit",
    "controlplane.tenants",
    "controlplane.registry",
    "controlplane.hashing",
    "controlplane.operators",
    *[app for app in OPTIONAL_APPS if _exists(app)],
]

MIDDLEWARE = [
    "controlplane.common.middleware.ApiErrorMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # Static files (operator UI CSS/JS, Django admin) straight from the app finders, in every
    # environment: compose and other deployments need no separate web server or collectstatic.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "controlplane.urls"
WSGI_APPLICATION = "controlplane.wsgi.application"
ASGI_APPLICATION = "controlplane.asgi.application"

_FRONTEND = BASE_DIR / "frontend"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [_FRONTEND / "templates"] if (_FRONTEND / "templates").is_dir() else [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {"default": database_config(ENV)}
# Threads that run the serving API's database work and keep their connections between requests
# (controlplane.serving.db_threads); a PostgreSQL connection goes back to its pool after each job.
STRATA_SERVING_DB_THREADS = 8
envmod.private_dir(STRATA_HOME)
if not ENV.celery_broker_url:  # the embedded broker's SQLite file (CELERY_BROKER_URL below): 0600 too
    envmod.private_file(STRATA_HOME / "broker.sqlite3", *SQLITE_COMPANIONS)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = STRATA_HOME / "static"
STATICFILES_DIRS = [_FRONTEND / "static"] if (_FRONTEND / "static").is_dir() else []
# Front-end packages from the npm registry through frontend/package-lock.json (`npm ci --prefix
# frontend`, run by `make setup`): served from node_modules, never copied into the repo or from a CDN.
# Without them the console's charts fall back to their tables (charts.js says so on the page).
_UPLOT = _FRONTEND / "node_modules" / "uplot" / "dist"
if _UPLOT.is_dir():
    STATICFILES_DIRS.append(("vendor/uplot", _UPLOT))
STRATA_SERVE_STATIC = False  # urls.py serves /static/ itself when True (no separate web server)
WHITENOISE_USE_FINDERS = True
STATIC_ROOT.mkdir(parents=True, exist_ok=True)  # collectstatic's target; WhiteNoise warns when it is missing

# Request bodies: the JSON error middleware answers 413 above these before anything reads the body.
STRATA_MAX_BODY_BYTES = ENV.max_body_bytes
STRATA_ADMIN_MAX_BODY_BYTES = ENV.admin_max_body_bytes
# /v1/ bodies but KV uploads (completions, chat, KV lookup/retrieve): a few MiB hold any prompt that
# fits a context; /v1/kv/store keeps STRATA_MAX_BODY_BYTES as its ceiling (serving.bounds derives the
# tighter limit of the tenant's models from their KV layout and context length).
STRATA_SERVING_MAX_BODY_BYTES = ENV.serving_max_body_bytes
# Parsing, chat template rendering and tokenization run off the event loop in this many threads
# (serving.render_pool), each tenant on at most all but one of them; one render's time budget.
STRATA_RENDER_THREADS = ENV.render_threads
STRATA_RENDER_BUDGET_MS = ENV.render_budget_ms
# Anthropic cache_control TTLs (5m, 1h) are multiplied by this (caches.breakpoints); tests scale them down.
STRATA_CACHE_CONTROL_TTL_SCALE = 1.0
DATA_UPLOAD_MAX_MEMORY_SIZE = max(ENV.max_body_bytes, ENV.admin_max_body_bytes)
STRATA_JSON_ERROR_PREFIXES = ("/api/", "/v1/")
# Peers whose X-Forwarded-For names the client (common.sources); empty: the TCP peer is the source.
STRATA_TRUSTED_PROXIES = ENV.trusted_proxies
# Operator tokens expire this many days after creation unless made with another expiry.
STRATA_OPERATOR_TOKEN_DAYS = 90

STRATA_WEIGHTS_ROOT = ENV.weights_root
# LoRA adapters (controlplane.adapters): the largest rank registered, and what every vLLM replica's
# engine is started with (workers.vllm_revision: enable_lora, max_loras adapters in one batch,
# max_lora_rank); STRATA_LORA_MAX_LORAS = 0 starts vLLM without LoRA (and refuses registrations).
STRATA_LORA_MAX_RANK = ENV.lora_max_rank
STRATA_LORA_MAX_LORAS = ENV.lora_max_loras
STRATA_REDIS_URL = ENV.redis_url
# Caches. "default" holds what may be lost (audit aggregation tallies, Django's own). Limit state
# has stores of its own that traffic cannot evict: "limits" (per-tenant rate windows: only
# authenticated tenants write it) and "lockouts" (bad-credential counts and locks per source and
# per (account, source): anonymous traffic writes it). With REDIS_URL all three are Redis, shared by
# every web process (run Redis with its default maxmemory-policy noeviction); the embedded default
# keeps them in this process, the two limit stores in common.limit_store.ExpiringOnlyCache, which
# never drops a live entry.
STRATA_LIMIT_STORE_ENTRIES = 100_000


def _cache(location: str, *, limit_state: bool) -> dict:
    if ENV.redis_url:
        return {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": ENV.redis_url,
                "KEY_PREFIX": "strata"}
    if limit_state:
        return {"BACKEND": "controlplane.common.limit_store.ExpiringOnlyCache", "LOCATION": location,
                "TIMEOUT": None, "OPTIONS": {"MAX_ENTRIES": STRATA_LIMIT_STORE_ENTRIES}}
    return {"BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": location}


CACHES = {
    "default": _cache("strata", limit_state=False),
    "limits": _cache("strata-limits", limit_state=True),
    "lockouts": _cache("strata-lockouts", limit_state=True),
}
STRATA_RAY_ADDRESS = ENV.ray_address
# How long a request waits for a replica that is starting before it gets 503 model_starting with
# Retry-After (runtime.dispatch): replicas start with the platform (runtime.warm), so a request rarely
# meets one, and a proxy's timeout (often 60 s) must never be what ends the wait.
STRATA_START_WAIT_SECONDS = 30.0
# Weight digests (controlplane.hashing): weights up to this many bytes are hashed on the POST that adds
# the revision (SHA-256 runs at about 1 GiB/s); bigger ones in the background, the revision held until
# then. A background hash whose heartbeat is this old (its process died) is taken over.
STRATA_DIGEST_INLINE_BYTES = 64 << 20
STRATA_DIGEST_STALE_SECONDS = 30.0
STRATA_DIGEST_RESUME = True  # web processes take stale hashes over from their start
STRATA_DIGEST_PAUSE_FILE = None  # test hook: a hash waits while this file exists
# Test settings set this so TransactionTestCase's flush may empty the append-only audit table.
STRATA_AUDIT_ALLOW_FLUSH = False
# The audit chain's HMAC key never lives in the database: STRATA_AUDIT_KEY, or this file: the one
# STRATA_AUDIT_KEY_FILE names (a mounted secret, must exist: never generated), else
# $STRATA_HOME/audit.key (0600, generated on first use). Every process writing to one database must
# use the same key.
STRATA_AUDIT_KEY = ENV.audit_key
STRATA_AUDIT_KEY_FILE = ENV.audit_key_file
STRATA_AUDIT_KEY_GENERATE = ENV.audit_key_path is None
# Append-only record of the chain head outside the database (one line per append); "{db}" in the
# path is replaced by a tag of the database's name (tests: one file per test database).
STRATA_AUDIT_HEAD_LOG = str(STRATA_HOME / "audit-head.log")
# L3 data keys are stored wrapped by the master key (controlplane.common.masterkey reads it from the
# environment in every process, workers included; this is where the file is, for display).
STRATA_MASTER_KEY_FILE = ENV.master_key_file
# How long a web process reuses a tenant's data-key set (wrapped keys) before reading it again; a
# rotation or shred in the same process drops it at once, and a shred job waits this long before
# telling the workers to drop the key, so no process still hands it out.
STRATA_DATA_KEY_CACHE_SECONDS = 2.0

CELERY_BROKER_URL = ENV.celery_broker_url or f"sqla+sqlite:///{STRATA_HOME / 'broker.sqlite3'}"
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"},
                   "bare": {"format": "%(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"},
                 "access": {"class": "logging.StreamHandler", "formatter": "bare",
                            "stream": "ext://sys.stdout"}},
    "root": {"handlers": ["console"], "level": ENV.log_level},
    "loggers": {"django.db.backends": {"level": "WARNING"},
                # common.access_log: one JSON object a line, one line per request (the web log)
                "strata.access": {"handlers": ["access"], "level": "INFO", "propagate": False}},
}
