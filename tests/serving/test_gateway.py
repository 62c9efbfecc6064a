"""The runtime gateway: which worker failures are the client's (4xx, the actor handle kept) and which
mean the worker is unreachable (503 + Retry-After, the handle dropped); cancelling a request on its
worker when the caller goes away; never starting a Ray cluster of its own."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from ray import exceptions as rex

from cachecore.errors import InvalidPrompt, OutOfBlocks
from controlplane.common.errors import ApplicationError, Unavailable
from controlplane.runtime import gateway

REPO = Path(__file__).resolve().parents[2]
FAKE = gateway.WorkerSpec(deployment="fake-deployment", preset="tiny", revision={"label": "r1", "seed": 1})


def _task_error(cause: Exception) -> Exception:
    """What awaiting a Ray ref raises when the actor method raised ``cause``."""
    return rex.RayTaskError("collect", "Traceback (most recent call last): ...", cause).as_instanceof_cause()


class _Method:
    def __init__(self, result) -> None:
        self.result = result  # a callable returning an awaitable (a coroutine, like an ObjectRef)
        self.calls: list[tuple] = []

    def remote(self, *args, **kwargs):
        self.calls.append(args)
        return self.result()


class _Stream:
    """Like Ray's ObjectRefGenerator: an async iterator of awaitable refs; then hangs (worker busy)."""

    def __init__(self, events: list[dict]) -> None:
        self.events = events

    def __aiter__(self):
        return self._refs()

    async def _refs(self):
        for ev in self.events:
            yield _value(ev)
        await asyncio.sleep(3600)


async def _value(v):
    return v


class _Handle:
    def __init__(self, *, collect=None, stream_events=(), kv_lookup=None) -> None:
        self.collect = _Method(collect or (lambda: asyncio.sleep(3600)))
        self.kv_lookup = _Method(kv_lookup or (lambda: _value(0)))
        self.cancel = _Method(lambda: None)  # a fire-and-forget ObjectRef nobody awaits
        self.stream = _Method(lambda: _Stream(list(stream_events)))


def _raising(exc):
    async def fail():
        raise exc

    return fail


@pytest.fixture
def fake_handle():
    def install(handle: _Handle) -> _Handle:
        gateway.replica_set(FAKE).install(0, handle)
        return handle

    yield install
    gateway.forget(FAKE.deployment)


# ------------------------------------------------------------------------- worker-side errors
@pytest.mark.parametrize("cause,status,code,retry", [
    (InvalidPrompt("token ids must be in 0..4294967295"), 400, "invalid_prompt", None),
    (ValueError("bad value"), 422, "invalid_request", None),
    (TypeError("not a list"), 422, "invalid_request", None),
    (OverflowError("too big"), 422, "invalid_request", None),
    (OutOfBlocks("all blocks are held"), 503, "out_of_blocks", "1"),  # alive, momentarily full
    (RuntimeError("probability tensor contains nan"), 503, "worker_failed", "2"),
])
def test_errors_raised_inside_the_actor_keep_the_handle(fake_handle, cause, status, code, retry):
    handle = fake_handle(_Handle(kv_lookup=_raising(_task_error(cause))))
    with pytest.raises(ApplicationError) as info:
        asyncio.run(gateway.acall(FAKE, "kv_lookup", {"tokens": [1]}))
    err = info.value
    assert not isinstance(err, Unavailable)
    assert (err.status, err.code, err.headers.get("Retry-After")) == (status, code, retry)
    assert "Traceback" not in err.message
    assert gateway.replica_set(FAKE).cached(0) is handle  # a refused request never drops a live actor


@pytest.mark.parametrize("exc", [
    rex.ActorDiedError(),
    rex.ActorUnavailableError("the actor is restarting", None),
    rex.GetTimeoutError("timed out"),
    ConnectionError("connection to the GCS lost"),
    TimeoutError(),
])
def test_unreachable_workers_are_503_and_drop_the_handle(fake_handle, exc):
    fake_handle(_Handle(kv_lookup=_raising(exc)))
    with pytest.raises(Unavailable) as info:
        asyncio.run(gateway.acall(FAKE, "kv_lookup", {"tokens": [1]}))
    assert info.value.status == 503 and int(info.value.headers["Retry-After"]) >= 1
    assert gateway.replica_set(FAKE).cached(0) is None


def test_stream_refused_before_the_first_event_is_the_api_error_and_keeps_the_handle(fake_handle):
    handle = _Handle()
    handle.stream = _Method(lambda: _raising_stream(_task_error(ValueError("temperature overflow"))))
    fake_handle(handle)

    async def first():
        return await gateway.astream(FAKE, {"request_id": "r-1"}).__anext__()

    with pytest.raises(ApplicationError) as info:
        asyncio.run(first())
    assert info.value.status == 422 and gateway.replica_set(FAKE).cached(0) is handle


class _raising_stream:
    def __init__(self, exc) -> None:
        self.exc = exc

    def __aiter__(self):
        return self

    async def __anext__(self):
        raise self.exc


# ------------------------------------------------------------------------- cancellation
def test_request_id_is_read_from_the_request_dict():
    assert gateway.request_id_of(({"request_id": "abc", "prompt": [1]},)) == "abc"
    assert gateway.request_id_of(({"prompt": [1]},)) is None
    assert gateway.request_id_of(()) is None and gateway.request_id_of(("x",)) is None


def test_cancelled_collect_cancels_the_request_on_its_worker(fake_handle):
    handle = fake_handle(_Handle())

    async def scenario():
        task = asyncio.create_task(gateway.acall(FAKE, "collect", {"request_id": "req-7"}, timeout=60))
        await asyncio.sleep(0.05)
        assert handle.cancel.calls == []  # nothing is cancelled while the caller waits
        task.cancel()  # what Django does to the view when the client disconnects
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert handle.cancel.calls == [("req-7",)]
    assert gateway.replica_set(FAKE).cached(0) is handle


def test_timed_out_collect_is_cancelled_too(fake_handle):
    handle = fake_handle(_Handle())
    with pytest.raises(Unavailable):
        asyncio.run(gateway.acall(FAKE, "collect", {"request_id": "req-8"}, timeout=0.05))
    assert handle.cancel.calls == [("req-8",)]


def test_completed_collect_and_other_methods_cancel_nothing(fake_handle):
    handle = fake_handle(_Handle(collect=lambda: _value([{"type": "finished"}])))
    assert asyncio.run(gateway.acall(FAKE, "collect", {"request_id": "req-9"})) == [{"type": "finished"}]
    assert asyncio.run(gateway.acall(FAKE, "kv_lookup", {"tokens": [1]})) == 0
    assert handle.cancel.calls == []


def test_stream_closed_early_cancels_the_request_on_its_worker(fake_handle):
    handle = fake_handle(_Handle(stream_events=[{"type": "prefilled"}, {"type": "token"}, {"type": "token"}]))

    async def scenario():
        events = gateway.astream(FAKE, {"request_id": "req-s"})
        assert (await events.__anext__())["type"] == "prefilled"
        assert handle.cancel.calls == []
        await events.aclose()  # the response stopped iterating: the client went away

    asyncio.run(scenario())
    assert handle.cancel.calls == [("req-s",)]


def test_stream_task_cancelled_while_waiting_cancels_the_request(fake_handle):
    handle = fake_handle(_Handle(stream_events=[{"type": "prefilled"}]))

    async def scenario():
        async def consume():
            async for _ in gateway.astream(FAKE, {"request_id": "req-w"}):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)  # the stream now waits on the worker for the next event
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert handle.cancel.calls == [("req-w",)]


def test_stream_closed_after_its_last_event_cancels_nothing(fake_handle):
    handle = fake_handle(_Handle(stream_events=[{"type": "token"}, {"type": "error", "code": "out_of_blocks"}]))

    async def scenario():
        events = gateway.astream(FAKE, {"request_id": "req-e"})
        assert [(await events.__anext__())["type"] for _ in range(2)] == ["token", "error"]
        await events.aclose()  # the view stops at an error event: the worker already ended the request

    asyncio.run(scenario())
    assert handle.cancel.calls == []


def test_finished_stream_cancels_nothing(fake_handle):
    handle = _Handle()
    handle.stream = _Method(lambda: _finite([{"type": "token"}, {"type": "finished"}]))
    fake_handle(handle)

    async def drain():
        return [ev async for ev in gateway.astream(FAKE, {"request_id": "req-f"})]

    assert [e["type"] for e in asyncio.run(drain())] == ["token", "finished"]
    assert handle.cancel.calls == []


async def _finite(events):
    for ev in events:
        yield _value(ev)


# ------------------------------------------------------------------------- never start Ray
def test_no_ray_address_is_unavailable_and_never_starts_ray():
    """In a fresh process (this one may already have Ray): no RAY_ADDRESS, no Ray initialised -> every
    kind of call is a 503 with Retry-After, and Ray is still not initialised afterwards."""
    script = """
import asyncio, django
django.setup()
import ray
from controlplane.common.errors import Unavailable
from controlplane.runtime import gateway
spec = gateway.WorkerSpec(deployment="nowhere", preset="tiny", revision={"label": "r1", "seed": 1})
for call in (lambda: gateway.call(spec, "ping"), lambda: asyncio.run(gateway.acall(spec, "ping")),
             lambda: gateway.get_worker(spec, create=False)):
    try:
        call()
        print("NO-ERROR")
    except Unavailable as exc:
        print("UNAVAILABLE", exc.status, exc.headers["Retry-After"], exc.message)
print("RAY-INITIALIZED", ray.is_initialized())
"""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "STRATA_RAY_ADDRESS")}
    env.update(DJANGO_SETTINGS_MODULE="controlplane.settings.test",
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "platform")]))
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert [line.split()[:3] for line in lines[:3]] == [["UNAVAILABLE", "503", "5"]] * 3, out.stdout
    assert "cache workers unavailable" in lines[0]
    assert lines[-1] == "RAY-INITIALIZED False"
    assert time.monotonic() - t0 < 60  # no local cluster was started (that takes far longer on 2 cores)


def test_an_already_initialised_ray_is_joined(ray_cluster, monkeypatch, settings):
    settings.STRATA_RAY_ADDRESS = None

    def no_init(*args, **kwargs):
        raise AssertionError("ray.init must not be called when Ray is initialised")

    monkeypatch.setattr("ray.init", no_init)
    assert gateway._ray().is_initialized()


def test_threads_joining_ray_at_once_initialise_it_once(monkeypatch, settings):
    """The first requests after a start join Ray from several threads together: one ray.init, no
    AssertionError ("Perhaps you called ray.init twice by accident?") answered as a 503."""
    import threading as th

    settings.STRATA_RAY_ADDRESS = "127.0.0.1:1"
    state = {"up": False, "inits": 0}
    entered = th.Barrier(4)

    def is_initialized():
        return state["up"]

    def init(*args, **kwargs):
        state["inits"] += 1
        if state["inits"] > 1:
            raise AssertionError("Perhaps you called ray.init twice by accident?")
        time.sleep(0.2)  # connecting takes a while: the other threads arrive meanwhile
        state["up"] = True

    monkeypatch.setattr("ray.is_initialized", is_initialized)
    monkeypatch.setattr("ray.init", init)
    errors: list[BaseException] = []

    def join():
        entered.wait()
        try:
            gateway._ray()
        except BaseException as exc:  # noqa: BLE001  (recorded for the assertion)
            errors.append(exc)

    threads = [th.Thread(target=join) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and state["inits"] == 1


# ------------------------------------------------------------------------- over HTTP, real worker
def _kv(platform, path, tokens):
    return httpx.post(f"{platform.url}{path}", json={"model": platform.model, "tokens": tokens}, timeout=60,
                      headers={"Authorization": f"Bearer {platform.keys['acme']}"})


def test_kv_token_id_2_32_is_4xx_and_the_worker_keeps_serving(platform):
    assert _kv(platform, "/v1/kv/lookup", [1, 2, 3]).status_code == 200
    handle = gateway.replica_set(gateway.spec_for(platform.deployment)).cached(0)
    bad = _kv(platform, "/v1/kv/lookup", [4294967296])
    assert 400 <= bad.status_code < 500, (bad.status_code, bad.text[:300])
    assert bad.headers["content-type"].startswith("application/json")
    error = bad.json()["error"]
    assert error["message"] and error["type"] and error["code"] and "Traceback" not in bad.text
    # the bad request did not drop the actor
    assert gateway.replica_set(gateway.spec_for(platform.deployment)).cached(0) is handle
    t0 = time.monotonic()
    assert _kv(platform, "/v1/kv/lookup", [1, 2, 3]).status_code == 200
    assert time.monotonic() - t0 < 10


def test_real_actor_refusals_are_4xx_and_keep_the_handle(platform):
    """Past the HTTP validation (the gateway is the safety net behind it): requests the actor itself
    refuses (malformed request dicts: a CacheError or a KeyError inside the actor) are 4xx with the
    error shape, and the cached handle stays; the next normal request is served."""
    spec = gateway.spec_for(platform.deployment)
    gateway.call(spec, "ping")
    handle = gateway.replica_set(spec).cached(0)
    for req in ({"scope_salt": b"short", "tokens": [1, 2]}, {"scope_salt": b"s" * 32}, {"tokens": [2**32]}):
        with pytest.raises(ApplicationError) as info:
            asyncio.run(gateway.acall(spec, "kv_lookup", req))
        assert 400 <= info.value.status < 500, (info.value.status, info.value.code, info.value.message)
        assert info.value.response()["Content-Type"] == "application/json"
        assert gateway.replica_set(spec).cached(0) is handle
    assert _kv(platform, "/v1/kv/lookup", [1, 2, 3]).status_code == 200
