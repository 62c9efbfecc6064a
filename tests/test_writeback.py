"""``cachecore.writeback.Writer``: jobs run in order on one thread; ``busy`` while one is queued or
running (the vLLM worker keeps its forwards off the second core meanwhile, ``workers.kv_connector``)."""

from __future__ import annotations

import threading
import time

from cachecore.writeback import Writer


def test_busy_while_a_job_is_queued_or_running_and_not_after_it_failed_or_finished():
    writer = Writer("test-writer")
    assert not writer.busy()
    started, release = threading.Event(), threading.Event()
    order: list[str] = []

    def slow() -> None:
        started.set()
        release.wait(10)
        order.append("slow")

    def failing() -> None:
        order.append("failing")
        raise RuntimeError("a failed write")

    writer.submit(slow)
    writer.submit(failing)
    assert started.wait(10)
    assert writer.busy() and writer.backlog() == 1
    release.set()
    writer.drain()
    assert order == ["slow", "failing"] and writer.errors == 1
    deadline = time.monotonic() + 10  # drain's own job is marked done just after it woke us
    while writer.busy() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert not writer.busy()
