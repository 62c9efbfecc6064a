"""The C allocator of a process that runs forwards off its main thread: ``keep_freed_memory``.

A step's temporaries (activations, attention buffers, logits: up to tens of MB) are freed at the end
of every step and allocated again in the next. On the main thread glibc serves them from the main
heap and keeps what was freed. The scheduler's loop thread, where every forward runs, gets a heap of
its own, and glibc gives the top of such a heap back to the kernel as soon as it is freed (and serves
allocations above its dynamic threshold with ``mmap``): the next step touches fresh pages, each a
page fault the kernel zero-fills, and on several intra-op threads the faults queue on the process's
memory map. A 16-sequence decode step of a dim-512, 12-layer model over 512-token contexts, on a
thread of its own: 4,700 minor faults per step on 1 thread (48.5 ms, against none and 41.2 ms on the
main thread), 6,000 on 2 threads; with freed memory kept, 34 and 2. Together with one OpenMP pool per
process (``passing_thread``) that step on 2 threads went from 38-42 ms to 24.6-24.9 ms, the main
thread's own figure.

``keep_freed_memory`` raises glibc's trim threshold (freed memory above it goes back to the kernel)
and fixes its mmap threshold (allocations below it come from the heaps), for every heap of the
process: it holds on to what a step used at its peak. Elsewhere than glibc, nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD = 512 << 20  # freed memory a heap keeps before giving the rest back
MMAP_THRESHOLD = 32 << 20  # glibc's largest: half of a thread heap's 64 MB


@functools.cache
def keep_freed_memory() -> bool:
    """Set the thresholds once per process; True when glibc took them."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
