"""The accounting of finished requests off their response path: one daemon thread of the web process
takes them in order (``submit``) and runs ``accounting.account`` (the ledger's increment, the
diagnostics history). A response never waits for it; a request that asked for its diagnosis is
accounted in its own call instead (``views``), since its answer carries the result.

The thread keeps one database connection for its life (it serves no request, so Django never closes
it), checked every few seconds and reopened when the database dropped it. ``drain`` waits until
everything submitted so far is accounted: the ledger's readers in this process (admin API, console)
call it, so what they show includes every request answered before.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

logger = logging.getLogger("controlplane.serving")

MAX_PENDING = 100_000  # beyond this, submissions wait (the database fell far behind)
CHECK_EVERY_S = 5.0  # how often the kept connection is checked (a query of its own)


class Accountant(threading.Thread):
    def __init__(self) -> None:
        super().__init__(name="strata-accountant", daemon=True)
        self._queue: queue.Queue = queue.Queue(maxsize=MAX_PENDING)

    def submit(self, prep, finished: dict) -> None:
        self._queue.put((prep, finished))

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until everything submitted before this call is accounted; False after ``timeout``."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def run(self) -> None:
        from django.db import connection

        from controlplane.serving.accounting import account

        checked = 0.0
        while True:
            item = self._queue.get()
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                if connection.connection is not None and time.monotonic() - checked > CHECK_EVERY_S:
                    checked = time.monotonic()
                    if not connection.is_usable():  # the database dropped it: reconnect on next use
                        connection.close()
                account(*item)
            except Exception:  # account() logs its own failures; this is the last line
                logger.exception("accounting failed")


_lock = threading.Lock()
_thread: Accountant | None = None


def accountant() -> Accountant:
    global _thread
    with _lock:
        if _thread is None or not _thread.is_alive():
            _thread = Accountant()
            _thread.start()
        return _thread


def submit(prep, finished: dict) -> None:
    accountant().submit(prep, finished)


def drain(timeout: float = 10.0) -> bool:
    """Everything this process submitted is accounted (no-op when nothing ever was)."""
    return _thread.drain(timeout) if _thread is not None and _thread.is_alive() else True
