"""bench.api_overhead: the CPU meter behind the throughput explanation (CPU per request of the web
process, by thread too, the worker and the client), and the throughput run's minimal HTTP client."""

from __future__ import annotations

import os
import time
from collections import defaultdict

from bench.api_overhead import CpuMeter


def test_cpu_meter_adds_each_process_cpu_and_the_wall_time_over_a_block():
    meter = CpuMeter(web=os.getpid(), idle=os.getppid())
    into: dict[str, float] = defaultdict(float)
    with meter.measure(into):
        end = time.thread_time() + 0.1
        while time.thread_time() < end:  # 100 ms of this thread's CPU (the process's other threads aside)
            pass
    # per-process and per-thread CPU are read from /proc in clock ticks (10 ms): a block can read
    # a tick or two short of what it spent, so the bounds leave two ticks
    assert into["web"] >= 0.08 and into["wall"] >= 0.08
    assert {"web", "idle", "wall"} <= set(into)
    assert into["thread:MainThread"] >= 0.08  # this process's CPU by thread too
    before = into["web"]
    with meter.measure(into):  # a second block adds to the same totals
        time.sleep(0.01)
    assert into["web"] >= before and into["wall"] >= 0.1


def test_the_raw_load_client_reads_sized_and_chunked_answers_and_a_close():
    import asyncio

    from bench.api_overhead import _raw_exchange

    answers = [b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello",
               b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n",
               b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"]

    async def serve(reader, writer):
        for answer in answers:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(answer)
            await writer.drain()
        writer.close()

    async def run():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        got = [await _raw_exchange(reader, writer, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n") for _ in answers]
        writer.close()
        server.close()
        return got

    assert asyncio.run(run()) == [(200, b"hello", False), (200, b"abcde", False), (429, b"{}", True)]
