"""The accounting of finished requests off their response path: one daemon thread of the web process
takes them in order (``submit``) and runs ``accounting.account`` (the ledger's increment, the
diagnostics history). A response never waits for it; a request that asked for its diagnosis is
accounted in its own call instead (``views``), since its answer carries the result.

Requests that wait together (under load; the thread gathers what arrives within ``GATHER_S`` of a
batch's first request) are accounted in one transaction, each in a savepoint of its own (one failing
request loses only its own history), so the database commits once per batch rather than once per
request, and their ledger increments are added up first: one update per tenant and model for the
batch (``ledger.services.ledger_record_many``), not one per request (building that update is most
of a request's accounting CPU, ``bench.api_overhead``). The thread keeps one database connection
for its life (it serves no request, so Django never closes it), checked every few seconds and reopened when the database
dropped it. ``drain`` waits until everything submitted so far is accounted: the ledger's readers in
this process (admin API, console) call it, so what they show includes every request answered before.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

logger = logging.getLogger("controlplane.serving")

MAX_PENDING = 100_000  # beyond this, submissions wait (the database fell far behind)
CHECK_EVERY_S = 5.0  # how often the kept connection is checked (a query of its own)
MAX_BATCH = 32  # requests waiting together are accounted in one transaction (one commit)
GATHER_S = 0.05  # how long a batch's first request waits for others (never past a drain)


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

    def _batch(self) -> list:
        """The next item, and those arriving behind it within ``GATHER_S`` (at most ``MAX_BATCH``; a
        ``drain`` ends the wait at once)."""
        batch = [self._queue.get()]
        deadline = time.monotonic() + GATHER_S
        while len(batch) < MAX_BATCH and not isinstance(batch[-1], threading.Event):
            try:
                batch.append(self._queue.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
        return batch

    def run(self) -> None:
        from django.db import connection, transaction

        from controlplane.serving.accounting import account

        checked = 0.0
        while True:
            batch = self._batch()
            work = [item for item in batch if not isinstance(item, threading.Event)]
            try:
                if connection.connection is not None and time.monotonic() - checked > CHECK_EVERY_S:
                    checked = time.monotonic()
                    if not connection.is_usable():  # the database dropped it: reconnect on next use
                        connection.close()
                if len(work) == 1:
                    account(*work[0])
                elif work:  # one commit for the batch; each request in a savepoint of its own
                    from controlplane.ledger.services import ledger_record_many

                    with transaction.atomic():
                        ledger: list[dict] = []
                        for item in work:
                            try:
                                with transaction.atomic():
                                    account(*item, ledger=ledger)
                            except Exception:  # its savepoint is rolled back; the batch goes on
                                logger.exception("accounting failed")
                        try:
                            with transaction.atomic():
                                ledger_record_many(ledger)
                        except Exception:
                            logger.exception("ledger record failed")
            except Exception:  # account() logs its own failures; this is the last line
                logger.exception("accounting failed")
            for item in batch:  # in order: everything submitted before each is accounted now
                if isinstance(item, threading.Event):
                    item.set()


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
