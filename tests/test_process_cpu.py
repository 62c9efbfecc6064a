"""bench._process_cpu: a block's CPU is found on the process and the thread that spent it. Bounds are
on CPU seconds spent on purpose (two clock ticks of slack), never on wall time."""

import os
import threading
import time

import pytest

psutil = pytest.importorskip("psutil")

from bench._process_cpu import MachineCpu  # noqa: E402


def _spin(seconds: float, done: threading.Event | None = None, leave: threading.Event | None = None) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
    if done is not None:
        done.set()
        leave.wait(10)  # alive until read: a thread that ended is no longer listed (its CPU is the process's)


def test_busy_thread_is_found_on_its_process_and_by_name():
    watch = (psutil.Process().name(),)  # this process, by its own name
    with MachineCpu(labels={os.getpid(): "me"}, watch=watch) as cpu:
        done, leave = threading.Event(), threading.Event()
        t = threading.Thread(target=_spin, args=(0.2, done, leave))
        t.start()
        done.wait(10)
    leave.set()
    t.join()
    me = next(p for p in cpu.processes if p.pid == os.getpid())
    assert me.label == "me"
    assert me.seconds >= 0.2 - 0.02
    assert cpu.engine() is me
    assert cpu.busy_cores >= me.share > 0
    _, busiest_share = me.threads[0]  # the spinner (named as the kernel knows it: Python 3.11 names none)
    assert busiest_share * cpu.wall >= 0.2 - 0.02, me.threads
    assert cpu.wall > 0 and cpu.processes == sorted(cpu.processes, key=lambda p: p.seconds, reverse=True)


def test_unwatched_process_has_no_threads_and_idle_ones_are_left_out():
    with MachineCpu(min_share=0.5) as cpu:
        _spin(0.1)
    assert cpu.engine() is None
    assert all(p.share >= 0.5 and p.threads == [] for p in cpu.processes)
