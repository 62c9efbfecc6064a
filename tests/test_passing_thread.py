"""``on_passing_thread``: work that runs parallel regions off the forwards' thread, on a thread that ends
with it (so the loop thread's OpenMP pool stays the process's only one); the worker loads revisions so."""

from __future__ import annotations

import contextvars
import threading

import pytest
import torch

from cachecore.passing_thread import on_passing_thread
from workers import revisions
from workers.config import WorkerConfig

VAR = contextvars.ContextVar("VAR", default="unset")


def test_runs_on_a_thread_of_its_own_with_the_threads_asked_and_the_callers_context():
    token = VAR.set("caller's")
    try:
        def probe(x, *, y):
            return x + y, threading.current_thread(), torch.get_num_threads(), VAR.get()

        asked = torch.get_num_threads() + 1  # not the caller's count
        (total, thread, threads, var) = on_passing_thread(probe, 1, y=2, threads=asked, name="probe")
    finally:
        VAR.reset(token)
    assert total == 3 and threads == asked and var == "caller's"
    assert thread is not threading.current_thread() and thread.name == "probe"
    assert not thread.is_alive()  # it ended: its thread pool with it
    later = {}
    helper = threading.Thread(target=lambda: later.update(threads=torch.get_num_threads()))
    helper.start()
    helper.join()
    assert later["threads"] == torch.get_num_threads()  # a thread started later gets the caller's default


def test_its_exception_is_raised_in_the_caller():
    def fail():
        raise KeyError("no such revision")

    with pytest.raises(KeyError, match="no such revision"):
        on_passing_thread(fail, threads=1)
    with pytest.raises(ValueError):
        on_passing_thread(print, threads=0)


def test_a_revision_loads_on_a_passing_thread_with_the_workers_compute_threads(monkeypatch):
    seen = {}

    def load_model(*args, **kwargs):
        seen.update(thread=threading.current_thread().name, threads=torch.get_num_threads())
        return "loaded"

    monkeypatch.setattr(revisions, "load_model", load_model)
    cfg = WorkerConfig(torch_threads=2)
    assert revisions.load_revision("d", "tiny", {"label": "r1", "seed": 1}, config=cfg, device="cpu",
                                   block_size=16, dtype=None) == "loaded"
    assert seen == {"thread": "strata-load-revision", "threads": 2}


def test_the_allocator_keeps_freed_memory_on_glibc_and_sets_it_once():
    import platform

    from cachecore.allocator import keep_freed_memory

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    assert keep_freed_memory() is True
    assert keep_freed_memory.cache_info().currsize == 1  # once per process
    x = torch.empty(16 << 20, dtype=torch.uint8).fill_(1)  # a step-sized temporary still allocates
    assert int(x[-1]) == 1
