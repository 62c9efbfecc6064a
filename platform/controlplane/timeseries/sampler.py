"""The sampler thread: ``sample_take()`` at every interval boundary, in the process that starts it.

``make run`` starts it in the web (uvicorn) process: ``apps.TimeseriesConfig.ready`` calls
:func:`start` when ``STRATA_SAMPLER=1``, which the launcher sets for that process only. The web
process already joins Ray for the dashboard, so sampling costs no extra driver; a daemon thread dies
with the process. A failed sample is logged and the next interval tried again; the thread's
database connection is closed after each sample (Django does that only for request threads).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from django.db import connection

from controlplane.timeseries.config import sampler_config

logger = logging.getLogger("controlplane.timeseries")

_lock = threading.Lock()
_thread: Sampler | None = None


class Sampler(threading.Thread):
    def __init__(self, *, interval_seconds: float, take: Callable[[], object] | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(name="strata-sampler", daemon=True)
        self.interval = float(interval_seconds)
        self._take = take
        self._clock = clock
        self.stopped = threading.Event()
        self.taken = 0  # samples attempted (tests wait on it)

    def delay(self) -> float:
        """Seconds until the next interval boundary (a little after it, so the floored time is it)."""
        return self.interval - self._clock() % self.interval + 0.05

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                if self._take is None:
                    from controlplane.timeseries.services import sample_take

                    sample_take()
                else:
                    self._take()
            except Exception:  # a sampler that dies silently would leave the charts empty
                logger.exception("stats sample failed; trying again at the next interval")
            finally:
                connection.close()
                self.taken += 1
            self.stopped.wait(self.delay())

    def stop(self) -> None:
        self.stopped.set()


def start() -> Sampler:
    """Start this process's sampler (once; later calls return the running one)."""
    global _thread
    with _lock:
        if _thread is None or not _thread.is_alive():
            _thread = Sampler(interval_seconds=sampler_config().interval_seconds)
            _thread.start()
            logger.info("stats sampler started (every %s s)", _thread.interval)
        return _thread
