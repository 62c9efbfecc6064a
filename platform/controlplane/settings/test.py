"""pytest settings (``[tool.pytest.ini_options] DJANGO_SETTINGS_MODULE``).

SQLite by default, PostgreSQL when ``DATABASE_URL`` is set. The SQLite test database is a file (not
``:memory:``) so that a worker subprocess can open it; both vendors get a per-process test database
name, and the embedded broker a per-process file, so that concurrent pytest runs in one checkout
(or a ``make run`` next to them) never drop each other's database or consume each other's tasks.
"""

import os
import secrets

from .base import *  # noqa: F403
from .base import DATABASES, ENV, STRATA_HOME

SECRET_KEY = secrets.token_urlsafe(50)  # per process: nothing signed outlives a test run
DEBUG = False
ALLOWED_HOSTS = ["testserver", "localhost", "127.0.0.1"]
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
STRATA_AUDIT_ALLOW_FLUSH = True

_TEST_HOME = STRATA_HOME / "test"
_TEST_HOME.mkdir(parents=True, exist_ok=True)
# One audit key for every test process and its worker subprocesses (they write to one database);
# one head log per test database, so concurrent test runs never read each other's heads.
STRATA_AUDIT_KEY_FILE = _TEST_HOME / "audit.key"
STRATA_AUDIT_HEAD_LOG = str(_TEST_HOME / "audit-head-{db}.log")
# Login/token throttle counters of this process only (test runs may share one Redis cache); the
# control-plane tests give each test a namespace of its own.
STRATA_THROTTLE_NAMESPACE = f"test-{os.getpid()}"
CELERY_BROKER_URL = ENV.celery_broker_url or f"sqla+sqlite:///{_TEST_HOME / f'broker-{os.getpid()}.sqlite3'}"

# The suite starts replicas on their first request (no warm start without RAY_ADDRESS), a vLLM engine
# taking up to minutes on a loaded 2-core machine: those requests wait for it, as they always did. The
# bounded wait's own tests set a short bound.
STRATA_START_WAIT_SECONDS = 900.0
# The test process's in-process web server never takes over the hashes of the tests' rows; the web
# subprocesses of tests/controlplane/test_models_digest.py (settings.test_worker) do.
STRATA_DIGEST_RESUME = False
# Admin reads answer from the last stats sample of each replica (``runtime.samples``): in tests every
# read polls again and waits for the answers, so a figure asserted right after a request is current.
# tests/controlplane/test_stats_no_stall.py runs with the production bounds.
STRATA_STATS_FRESH_SECONDS = 0.0
STRATA_STATS_READ_WAIT_SECONDS = 30.0

_db = DATABASES["default"]
if _db["ENGINE"].endswith("sqlite3"):
    _db["TEST"] = {"NAME": str(_TEST_HOME / f"db-{os.getpid()}.sqlite3")}
else:
    _db["TEST"] = {"NAME": f"test_{_db['NAME']}_{os.getpid()}"}

# A queue of this test process's own (its Celery worker subprocess is told the name), so concurrent
# test runs on one shared broker never take each other's jobs.
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("STRATA_TEST_CELERY_QUEUE") or f"strata-test-{os.getpid()}"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": "WARNING"},
}
