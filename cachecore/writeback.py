"""Write policies: when a block's KV goes down from L1 to L2.

- ``write_back`` (default): when L1 drops a block to make room (eviction or its owner's cap), its
  bytes are written to L2 at that moment (they are still in the page).
- ``write_through``: right after a request commits blocks, they are copied to L2 by a background
  thread (:class:`Writer`), off the request's critical path; the blocks stay held until copied.
- ``selective``: like write-back, but only blocks reused at least ``min_hits`` times.

Flushed blocks are never written down (a flush must stay flushed).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class WritePolicy:
    name: str
    min_hits: int = 1

    def on_evict(self, *, reason: str, hits: int) -> bool:
        """Write a block that L1 drops for ``reason`` after ``hits`` reuses?"""
        if reason not in ("evicted", "capped"):
            return False
        if self.name == "write_back":
            return True
        if self.name == "selective":
            return hits >= self.min_hits
        return False  # write_through: already written at commit

    @property
    def on_commit(self) -> bool:
        return self.name == "write_through"


class Writer:
    """One daemon thread running submitted jobs in order (the write-through copies). ``drain`` waits
    until everything submitted so far has run (tests, shutdown)."""

    def __init__(self, name: str = "strata-l2-writer") -> None:
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.errors = 0

    def submit(self, job: Callable[[], None]) -> None:
        self._queue.put(job)

    def backlog(self) -> int:
        """Jobs submitted and not started yet (approximate)."""
        return self._queue.qsize()

    def busy(self) -> bool:
        """Whether a job is queued or running (approximate: read without a lock)."""
        return self._queue.unfinished_tasks > 0

    def drain(self, timeout: float = 30.0) -> None:
        done = threading.Event()
        self._queue.put(done.set)
        done.wait(timeout)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # a failed copy is a block not written to L2, never a crash
                self.errors += 1
            finally:
                self._queue.task_done()
