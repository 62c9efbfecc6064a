"""Parallel work off the forwards' thread pool: ``on_passing_thread``.

torch's CPU kernels run on OpenMP, and OpenMP keeps a pool of worker threads for every thread that has
run a parallel region, for as long as that thread lives. A worker's forwards run on its scheduler's
loop thread; when another long-lived thread (the actor's main thread loading the weights, a Ray method
thread staging a revision) has also run parallel regions, the process holds two pools, more OpenMP
threads than cores, and libgomp's waits between regions turn from spinning to sleeping: every region
of every step then wakes its threads through the kernel. A 16-sequence decode step on 2 threads, off
the main thread: 38-42.5 ms (1.43 cores busy) after the main thread had run on 2 threads, 31-35 ms
(1.98 cores) when it had not, 24.6-24.9 ms with freed memory kept as well (``cachecore.allocator``);
the main thread's own figure is 23.9-25.4 ms.

``on_passing_thread`` runs such work (loading a revision: reading, converting and reordering its
weights, all parallel) on a thread that ends with it, on ``threads`` intra-op threads: its pool goes
with it, and the loop thread's is the only one left.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def on_passing_thread(fn: Callable[..., T], *args, threads: int, name: str = "strata-passing", **kwargs) -> T:
    """``fn(*args, **kwargs)`` on a new thread with ``threads`` intra-op threads (and the caller's
    context variables), waited for; returns its result or raises its exception. The default for threads
    started later stays the caller's count."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive int, got {threads!r}")
    ctx = contextvars.copy_context()
    outcome: dict[str, object] = {}
    previous = torch.get_num_threads()

    def run() -> None:
        torch.set_num_threads(threads)
        try:
            outcome["result"] = ctx.run(fn, *args, **kwargs)
        except BaseException as exc:  # re-raised in the caller's thread
            outcome["error"] = exc
        finally:
            # torch.set_num_threads also sets the default of threads not started yet: give it back, so a
            # helper thread started later does not run (and keep) a pool of this size
            torch.set_num_threads(previous)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["result"]  # type: ignore[return-value]
