"""The stored-response sweep's thread: ``services.responses_sweep()`` every ``STRATA_L3_SWEEP_SECONDS``,
in the process that runs the stats sampler (``STRATA_SAMPLER=1``), like ``caches.sweeper``. Elsewhere
``manage.py responses_sweep`` runs one sweep. Reads never serve an expired response either way."""

from __future__ import annotations

import logging
import threading

from controlplane.caches.sweeper import period_seconds
from controlplane.timeseries.sampler import Sampler

logger = logging.getLogger("controlplane.conversations")

_lock = threading.Lock()
_thread: Sampler | None = None


def _sweep() -> None:
    from controlplane.conversations.services import responses_sweep

    responses_sweep()


def start() -> Sampler:
    """Start this process's sweep thread (once; later calls return the running one)."""
    global _thread
    with _lock:
        if _thread is None or not _thread.is_alive():
            _thread = Sampler(interval_seconds=period_seconds(), take=_sweep)
            _thread.name = "strata-response-sweep"
            _thread.start()
            logger.info("stored-response sweep started (every %s s)", _thread.interval)
        return _thread
