"""The L3 fault matrix on a vLLM deployment (``workers.kv_connector`` over a real redis-server): Redis
stopped (F1) or paused (F2) while vLLM serves is a bounded miss — the request is served, with the
same output — and L3 resumes after; objects moved to another tenant (F5) are never served to it."""

from __future__ import annotations

import base64
import os
import secrets
import shutil
import time

import pytest
import torch

from tests.l3_workers import L3Site
from tests.test_l3 import RedisServer
from tests.worker_calls import complete
from workers.config import WorkerConfig

pytest.importorskip("vllm")


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def redis_l3(tmp_path_factory):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH")
    server = RedisServer(str(tmp_path_factory.mktemp("vllm-redis")))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    s = L3Site(tmp_path_factory.mktemp("vllm-f"))
    s.master = base64.b64decode(os.environ["STRATA_MASTER_KEY"])
    return s


@pytest.fixture(scope="module")
def redis_worker(redis_l3, vllm_checkpoint):
    from workers.vllm_worker import VllmWorker

    cfg = WorkerConfig(l1_mb=16, l2_mb=0, l3_url=redis_l3.url, load_policy="always_load")  # only L3 can hit
    worker = VllmWorker(deployment="vllm-redis", preset="", config=cfg,
                        revision={"label": "r1", "checkpoint_path": str(vllm_checkpoint[0])})
    yield worker
    worker.close()


def _run(worker, site, tenant, salt, prompt, **kw):
    out = complete(worker, {**site.request(tenant, prompt, scope_salt=salt, **kw), "max_tokens": 6})
    assert "error" not in out, out
    worker.drain_writes()
    return out


def _reset(worker):
    assert worker.loop.run(worker._reset(worker._active), timeout=60)


def _up(server):
    if server.proc is None or server.proc.poll() is not None:
        server.start()


def test_f1_redis_stopped_while_serving_is_a_bounded_miss_and_l3_resumes(redis_worker, redis_l3, site):
    _up(redis_l3)
    salt, prompt = secrets.token_bytes(32), _prompt(600, 1)
    cold = _run(redis_worker, site, "f1", salt, prompt)
    _reset(redis_worker)
    assert _run(redis_worker, site, "f1", salt, prompt)["usage"]["cached_tokens"] == 512  # from Redis
    redis_l3.stop()
    _reset(redis_worker)
    t0 = time.monotonic()
    down = _run(redis_worker, site, "f1", salt, prompt)
    assert time.monotonic() - t0 < 30  # served (a miss), not stuck on the dead backend
    assert down["usage"]["cached_tokens"] == 0 and down["token_ids"] == cold["token_ids"]
    assert redis_worker.stats()["tiers"]["l3"]["unavailable"] + redis_worker.stats()["tiers"]["l3"]["failures"] >= 1
    with pytest.raises(Exception, match="BackendUnavailable|unreachable|Connection"):
        redis_worker.flush({"scope": "tenant", "tenant": "f1"})  # a flush job must know it did not happen
    redis_l3.start()  # back, empty
    time.sleep(1.2)  # past the store's retry-after
    _reset(redis_worker)
    _run(redis_worker, site, "f1", salt, prompt)  # written again
    _reset(redis_worker)
    back = _run(redis_worker, site, "f1", salt, prompt)
    assert back["usage"]["cached_tokens"] == 512 and back["token_ids"] == cold["token_ids"]


def test_f2_paused_redis_is_a_miss_within_the_socket_timeout(redis_worker, redis_l3, site):
    _up(redis_l3)
    salt, prompt = secrets.token_bytes(32), _prompt(600, 2)
    cold = _run(redis_worker, site, "f2", salt, prompt)
    _reset(redis_worker)
    redis_l3.client().client_pause(3000)
    t0 = time.monotonic()
    paused = _run(redis_worker, site, "f2", salt, prompt)
    assert time.monotonic() - t0 < 3.0  # did not wait out the pause
    assert paused["usage"]["cached_tokens"] == 0 and paused["token_ids"] == cold["token_ids"]
    time.sleep(3.5)
    _reset(redis_worker)
    assert _run(redis_worker, site, "f2", salt, prompt)["usage"]["cached_tokens"] == 512


def test_f5_objects_moved_to_another_tenant_are_never_served_to_it(site, vllm_checkpoint):
    from workers.vllm_worker import VllmWorker

    cfg = WorkerConfig(l1_mb=16, l2_mb=0, l3_url=site.l3.as_uri(), load_policy="always_load")
    worker = VllmWorker(deployment="vllm-f5", preset="", config=cfg,
                        revision={"label": "r1", "checkpoint_path": str(vllm_checkpoint[0])})
    try:
        salt_a, salt_b = secrets.token_bytes(32), secrets.token_bytes(32)
        prompt = _prompt(600, 5)
        cold = _run(worker, site, "victim", salt_a, prompt)
        _run(worker, site, "thief", salt_b, _prompt(300, 6))  # the thief has a directory of its own
        src, dst = site.l3 / "victim", site.l3 / "thief"
        moved = 0
        for f in site.files("victim"):
            target = dst / f.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, target)
            moved += 1
        assert moved >= 2
        _reset(worker)
        stolen = _run(worker, site, "thief", salt_b, prompt)
        assert stolen["usage"]["cached_tokens"] == 0 and stolen["token_ids"] == cold["token_ids"]
        # retention: an object older than the request's retention is not served
        _reset(worker)
        time.sleep(1.1)
        assert _run(worker, site, "victim", salt_a, prompt, retention=1)["usage"]["cached_tokens"] == 0
    finally:
        worker.close()


def test_a_slow_tier_fetch_never_stalls_another_tenant_and_a_late_one_is_recomputed(redis_worker, redis_l3, site):
    """Defence: the fetch runs on the tier service's loader thread and vLLM's scheduler is told "not
    yet" (``get_num_new_matched_tokens`` -> None). Without it, vLLM's engine loop waits out the fetch
    and Y's request, which needs nothing from the tiers, finishes after X's first token."""
    import threading

    _up(redis_l3)
    salt_x, salt_y = secrets.token_bytes(32), secrets.token_bytes(32)
    px, py = _prompt(600, 7), _prompt(100, 8)
    cold = _run(redis_worker, site, "sx", salt_x, px)
    _reset(redis_worker)
    _run(redis_worker, site, "sy", salt_y, py)  # Y's prompt now sits in vLLM's own cache
    redis_worker._tiers("slow_loads", seconds=2.0)
    marks: dict[str, float] = {}
    out: dict = {}

    def run_x():
        events = []
        for ev in redis_worker.stream({**site.request("sx", px, scope_salt=salt_x), "max_tokens": 6}):
            if ev["type"] == "prefilled":
                marks["x_first"] = time.monotonic()
            events.append(ev)
        out["x"] = events

    try:
        thread = threading.Thread(target=run_x)
        thread.start()
        time.sleep(0.3)  # X is waiting for its fetch now
        y = _run(redis_worker, site, "sy", salt_y, py)
        marks["y_done"] = time.monotonic()
        thread.join(60)
    finally:
        redis_worker._tiers("slow_loads", seconds=0.0)
    assert y["usage"]["cached_tokens"] == 96
    assert marks["y_done"] < marks["x_first"]  # Y was served while X's fetch ran
    finished = out["x"][-1]
    assert finished["type"] == "finished" and finished["usage"]["cached_tokens"] == 0  # late: recomputed
    assert [e["id"] for e in out["x"] if e["type"] == "token"] == cold["token_ids"]
