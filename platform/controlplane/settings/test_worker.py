"""Settings of the Celery worker and web processes that the integration tests start as real subprocesses.

Same as ``test`` (the test process passes ``DATABASE_URL`` pointing at its test database, and the
broker/Ray addresses), plus the two job test hooks: a pause between workers so a test can kill the
Celery worker mid-job, and a short staleness window so the restarted worker resumes the job soon.
Only tests use this module; the variables are read here because they exist only for tests.
"""

import os

from .test import *  # noqa: F403

STRATA_JOB_STEP_DELAY = float(os.environ.get("STRATA_TEST_JOB_STEP_DELAY", "0"))
STRATA_JOB_STALE_SECONDS = float(os.environ.get("STRATA_TEST_JOB_STALE_SECONDS", "3"))
STRATA_ROLLOUT_DRAIN_SECONDS = float(os.environ.get("STRATA_TEST_ROLLOUT_DRAIN_SECONDS", "10"))
# Several test web processes that must share their lockouts (one Redis) name one namespace.
STRATA_THROTTLE_NAMESPACE = os.environ.get("STRATA_TEST_THROTTLE_NAMESPACE", STRATA_THROTTLE_NAMESPACE)  # noqa: F405
# Weight hashes: web subprocesses take stale ones over, within a short window; a file pauses them.
STRATA_DIGEST_RESUME = True
STRATA_DIGEST_STALE_SECONDS = float(os.environ.get("STRATA_TEST_DIGEST_STALE_SECONDS", "2"))
STRATA_DIGEST_PAUSE_FILE = os.environ.get("STRATA_TEST_DIGEST_PAUSE_FILE") or None
STRATA_DIGEST_INLINE_BYTES = int(os.environ.get("STRATA_TEST_DIGEST_INLINE_BYTES", str(64 << 20)))
