"""The render pool (``serving.render_pool``): one tenant never holds every thread, and a tenant that
piles up jobs is refused rather than queued without bound."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from controlplane.common.errors import RateLimited
from controlplane.serving.render_pool import MAX_WAITING, RenderPool


def _blocked(release: threading.Event, started: list, name: str):
    def job():
        started.append(name)
        assert release.wait(30)
        return name
    return job


def test_a_tenant_with_many_slow_jobs_leaves_a_thread_for_another_tenant():
    async def scenario():
        executor = ThreadPoolExecutor(2)
        pool = RenderPool(executor, threads=2)
        release, started = threading.Event(), []
        flood = [asyncio.create_task(pool.run("a", _blocked(release, started, f"a{i}"))) for i in range(4)]
        await asyncio.sleep(0)
        # tenant b's job runs while all four of a's are still there (one running, three waiting)
        assert await asyncio.wait_for(pool.run("b", lambda: "b"), 30) == "b"
        assert set(started) <= {"a0"} and pool.busy("a") == 4  # a1..a3 wait without a thread
        release.set()
        assert await asyncio.gather(*flood) == ["a0", "a1", "a2", "a3"]
        assert pool.busy("a") == 0 and pool.busy("b") == 0
        executor.shutdown()

    asyncio.run(scenario())


def test_without_a_per_tenant_share_the_flood_would_take_every_thread():
    """Paired with the above: a pool whose tenants may use both threads runs two of a's jobs at once,
    so b's job would have to wait for them."""
    async def scenario():
        executor = ThreadPoolExecutor(2)
        pool = RenderPool(executor, threads=2)
        pool.per_tenant = 2
        release, started = threading.Event(), []
        flood = [asyncio.create_task(pool.run("a", _blocked(release, started, f"a{i}"))) for i in range(2)]
        for _ in range(100):
            await asyncio.sleep(0.01)
            if len(started) == 2:
                break
        assert sorted(started) == ["a0", "a1"]
        release.set()
        await asyncio.gather(*flood)
        executor.shutdown()

    asyncio.run(scenario())


def test_a_tenant_past_its_waiting_jobs_gets_429_and_a_cancelled_wait_frees_its_place():
    async def scenario():
        executor = ThreadPoolExecutor(2)
        pool = RenderPool(executor, threads=2)
        release, started = threading.Event(), []
        jobs = [asyncio.create_task(pool.run("a", _blocked(release, started, f"a{i}")))
                for i in range(pool.per_tenant + MAX_WAITING)]
        await asyncio.sleep(0)
        with pytest.raises(RateLimited) as info:
            await pool.run("a", lambda: "one too many")
        assert info.value.code == "render_busy"
        jobs[-1].cancel()  # a waiting client went away: its place is free again
        await asyncio.sleep(0)
        late = asyncio.create_task(pool.run("a", lambda: "late"))
        release.set()
        await asyncio.gather(*jobs[:-1])
        assert await late == "late" and pool.busy("a") == 0
        executor.shutdown()

    asyncio.run(scenario())
