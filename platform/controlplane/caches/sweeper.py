"""The named-cache sweep's thread: ``services.caches_sweep()`` every ``STRATA_L3_SWEEP_SECONDS`` (the
period of the workers' L3 retention sweep, read from the same variable), so a cache's prompt leaves the
database on the schedule its bytes leave L3.

It runs in the process that runs the stats sampler (``STRATA_SAMPLER=1``: ``make run`` sets it for its
web process only; ``apps.CachesConfig.ready`` calls :func:`start`), so management commands, Celery and
tests never sweep on their own. A deployment that runs its web processes otherwise sets
``STRATA_SAMPLER=1`` on one of them, or runs ``manage.py caches_sweep`` on a schedule of its own.
A failed sweep is logged and the next period tried again (``timeseries.sampler.Sampler``).
"""

from __future__ import annotations

import logging
import threading

import strata_env
from controlplane.timeseries.sampler import Sampler

logger = logging.getLogger("controlplane.caches")

_lock = threading.Lock()
_thread: Sampler | None = None


def period_seconds() -> int:
    """``STRATA_L3_SWEEP_SECONDS``, as the workers read it (``strata_env.WorkerEnv``)."""
    return strata_env.load_worker().l3_sweep_seconds


def _sweep() -> None:
    from controlplane.caches.services import caches_sweep

    caches_sweep()


def start() -> Sampler:
    """Start this process's sweep thread (once; later calls return the running one)."""
    global _thread
    with _lock:
        if _thread is None or not _thread.is_alive():
            _thread = Sampler(interval_seconds=period_seconds(), take=_sweep)
            _thread.name = "strata-cache-sweep"
            _thread.start()
            logger.info("named-cache sweep started (every %s s)", _thread.interval)
        return _thread
