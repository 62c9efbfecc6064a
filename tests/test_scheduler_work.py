"""Work beside the forwards (``Scheduler.submit_work``, ``cachecore.scheduler.work``): a tenant's KV uploads
are charged to it in the fair queue and run between steps, never during a forward. Steps and calls are
counted, never timed."""

from __future__ import annotations

import secrets
import threading
import time

import pytest
import torch

from cachecore.engine import CacheEngine
from cachecore.scheduler import Scheduler
from cachecore.scheduler.anticipate import Anticipation
from cachecore.scheduler.work import Work, WorkQueue
from tests.test_scheduler_fairness import Recording, _flooded, _req, ns_layout
from tests.test_scheduler_property import FakeRunner
from tests.worker_calls import complete
from workers.cache_worker import CacheWorker


@pytest.fixture(scope="module")
def layout():
    return ns_layout()


def _sched(layout, **kw) -> tuple[Scheduler, CacheEngine]:
    engine = CacheEngine(layout, num_blocks=2000, device="cpu")
    return Scheduler(engine, start_thread=False, **kw), engine


class Log(Recording):
    """Recording runner that also writes the tenants of each forward into a shared log, beside the jobs'
    entries."""

    def __init__(self, log: list, sched: Scheduler) -> None:
        super().__init__()
        self.log, self.sched = log, sched

    def forward_items(self, items):
        owner = {id(r.seq): r.owner for r in self.sched.running}
        self.log.append({owner[id(seq)] for seq, _, _ in items})
        return super().forward_items(items)


def _job(log: list[str], name: str):
    def run() -> str:
        log.append(name)
        return name
    return run


# ---------------------------------------------------------------- the queue's policy
def test_a_job_waits_while_another_tenant_below_it_has_requests_and_runs_when_it_is_level():
    queue = WorkQueue()
    queue.submit(Work("a", 256, lambda: None))
    queue.owners(step=0)
    vt = {"a": 5000.0, "b": 4000.0}
    assert queue.take(vtime=vt.get, requesting={"b": 4000.0}, step=1, age_steps=64, budget=128, spent=0) is None
    assert queue.take(vtime=vt.get, requesting={"a": 5000.0}, step=1, age_steps=64, budget=128, spent=0) is not None


def test_an_overdue_job_runs_even_behind_a_tenant_below_it():
    queue = WorkQueue()
    queue.submit(Work("a", 256, lambda: None))
    queue.owners(step=0)
    vt = {"a": 5000.0, "b": 4000.0}
    assert queue.take(vtime=vt.get, requesting={"b": 4000.0}, step=63, age_steps=64, budget=128, spent=0) is None
    assert queue.take(vtime=vt.get, requesting={"b": 4000.0}, step=64, age_steps=64, budget=128, spent=0) is not None


def test_bad_job_sizes_are_refused():
    for tokens in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError):
            WorkQueue().submit(Work("a", tokens, lambda: None))


# ---------------------------------------------------------------- in the scheduler
def test_a_victims_waiting_prefill_runs_before_the_flooders_queued_uploads(layout):
    """Tenant a floods (30 decoding, more queued) and has uploads queued; tenant b's request arrives: b's
    prompt and its decode are computed first, a's uploads only once b has nothing left, each charged to a."""
    sched, engine = _sched(layout, token_budget=512, max_batch=40, lean_budget=16)
    ns = layout_ns(layout)
    log: list = []
    runner = Log(log, sched)
    flood = _flooded(sched, runner, ns, running=30, waiting=10)
    uploads = [sched.submit_work("a", 256, _job(log, f"upload{i}")) for i in range(2)]
    victim = sched.submit(_req(runner, ns, "b", [200 + i % 50 for i in range(40)], 2, chunk=64))
    log.clear()
    vtime_a = sched.fair.vtime("a")
    # the victim's step first
    _step_until(sched, lambda: all(u.done() for u in uploads))
    first_upload = log.index("upload0")
    assert any(isinstance(e, set) and "b" in e for e in log[:first_upload])  # b's prompt was computed before
    assert not any(isinstance(e, set) and "b" in e for e in log[first_upload:])  # and its decode too
    assert victim.done.is_set()
    assert [u.result() for u in uploads] == ["upload0", "upload1"]
    assert sched.counters["work_jobs"] == 2 and sched.counters["work_tokens"] == 512
    assert sched.fair.vtime("a") >= vtime_a + 512  # charged as computed tokens (plus its decodes meanwhile)
    for r in flood:
        sched.cancel(r, wait=False)
    _step_until(sched, lambda: victim.done.is_set() and all(r.done.is_set() for r in flood))
    engine.check_integrity()


def test_a_tenant_alone_runs_its_jobs_at_once_within_one_steps_budget(layout):
    sched, _ = _sched(layout, token_budget=512, max_batch=16)
    log: list[str] = []
    jobs = [sched.submit_work("a", 200, _job(log, f"j{i}")) for i in range(3)]
    assert sched.step()  # no requests at all: jobs run (two fit one step's 512 tokens, the third waits)
    assert log == ["j0", "j1"] and not jobs[2].done()
    assert sched.step() and log == ["j0", "j1", "j2"]
    assert not sched.step()  # nothing left


def test_a_failing_job_gives_its_exception_to_its_caller_and_the_loop_goes_on(layout):
    sched, _ = _sched(layout)

    def boom() -> None:
        raise ValueError("bad upload")

    bad, good = sched.submit_work("a", 16, boom), sched.submit_work("a", 16, lambda: 7)
    sched.step()
    with pytest.raises(ValueError, match="bad upload"):
        bad.result(timeout=0)
    assert good.result(timeout=0) == 7


def layout_ns(layout):
    from cachecore.model.loader import RevisionSpec, load_model

    return load_model("fair-llama", "tiny", RevisionSpec(label="r1", seed=3), device="cpu").namespace(
        secrets.token_bytes(32))


def _step_until(sched: Scheduler, done, limit: int = 400) -> None:
    for _ in range(limit):
        if done():
            return
        sched.step()
    raise AssertionError("not done within the step bound")


# ---------------------------------------------------------------- the worker's uploads (real tiny model)
@pytest.fixture(scope="module")
def worker():
    return CacheWorker(deployment="work-llama", preset="tiny", revision={"label": "r1", "seed": 5}, l1_mb=2)


def test_an_upload_sent_during_a_forward_runs_after_it_and_reads_back_exactly(worker, monkeypatch):
    """An upload arrives while a completion's forward is running: its page writes wait for the forward
    (counted: no store call while a forward is in flight), and its blocks are then retrieved bit for bit."""
    salt = secrets.token_bytes(32)
    layout = worker.kv_layout()
    tokens = torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(9)).tolist()
    kv = torch.randn(4, *layout["page_shape"], generator=torch.Generator().manual_seed(9))
    gen, engine = worker.revisions.active.runner, worker.engine
    real_forward, real_store = gen.forward_items, engine.store
    state = {"forwards": 0, "in_forward": 0, "stores": 0, "overlaps": 0}
    result: dict = {}
    uploaded = threading.Event()

    def upload() -> None:
        try:
            result["stored"] = worker.kv_store({"tenant": "up", "scope_salt": salt, "tenant_salt": salt,
                                                "tokens": tokens}, kv)
        finally:
            uploaded.set()
    uploader = threading.Thread(target=upload, daemon=True)

    def store(*args, **kwargs):
        state["stores"] += 1
        state["overlaps"] += int(state["in_forward"] > 0)
        return real_store(*args, **kwargs)

    def forward(items):
        state["in_forward"] += 1
        try:
            state["forwards"] += 1
            if state["forwards"] == 1:  # the upload arrives mid-forward: queued by the scheduler, or run now
                uploader.start()
                for _ in range(20_000):
                    if uploaded.is_set() or worker.scheduler.work.pending():
                        break
                    time.sleep(0.001)
            return real_forward(items)
        finally:
            state["in_forward"] -= 1

    monkeypatch.setattr(gen, "forward_items", forward)
    monkeypatch.setattr(engine, "store", store)
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(10)).tolist()
    out = complete(worker, {"tenant": "chat", "scope_salt": salt, "prompt": prompt,
                           "max_tokens": 2, "temperature": 0})
    assert out["usage"]["completion_tokens"] == 2
    assert uploaded.wait(60) and result.get("stored") == 4
    assert state["forwards"] >= 1 and state["stores"] >= 1
    assert state["overlaps"] == 0  # the page writes never ran while a forward was in flight
    assert worker.scheduler.counters["work_tokens"] >= 64  # charged as 4 blocks of 16 tokens
    got, mask, origin = worker.kv_retrieve({"tenant": "up", "scope_salt": salt, "tenant_salt": salt,
                                            "tokens": tokens})
    assert origin == "upload" and bool(mask.all()) and torch.equal(got, kv)
    worker.check_integrity()


def test_an_invalid_upload_still_raises_invalid_kv_through_the_scheduler(worker):
    from cachecore.errors import InvalidKV

    salt = secrets.token_bytes(32)
    layout = worker.kv_layout()
    kv = torch.randn(1, *layout["page_shape"])
    kv[0, 0, 0, 0, 0, 0] = float("nan")
    with pytest.raises(InvalidKV, match="NaN"):
        worker.kv_store({"tenant": "up", "scope_salt": salt, "tenant_salt": salt, "tokens": list(range(16))}, kv)


# ---------------------------------------------------------------- anticipation (``anticipate.py``)
def test_anticipation_expects_back_only_an_idle_tenant_below_every_other():
    hold = Anticipation(0.04)
    hold.finished("b", busy=False, vtime=10.0, others={"a": 500.0})
    assert hold.take() == ("b", 0.04) and hold.take() is None  # once per finished request
    hold.finished("a", busy=False, vtime=500.0, others={"b": 10.0})  # the flooder, above its share
    assert hold.take() is None
    hold.finished("b", busy=True, vtime=10.0, others={"a": 500.0})  # it still has work: nothing to wait for
    assert hold.take() is None
    hold.finished("b", busy=False, vtime=10.0, others={})  # nobody else has work: the loop idles anyway
    assert hold.take() is None
    assert Anticipation(0).finished("b", busy=False, vtime=0.0, others={"a": 9.0}) is None
    for bad in (-0.1, 2, True, "1"):
        with pytest.raises(ValueError):
            Anticipation(bad)


class Gate(FakeRunner):
    """FakeRunner whose forwards after ``first`` finished, and before ``second`` is submitted, wait for that
    submission (bounded): so a step begun before the follow-up arrives is one the follow-up must wait for."""

    def __init__(self) -> None:
        super().__init__()
        self.first = None
        self.second_sent = threading.Event()

    def forward_items(self, items):
        if self.first is not None and self.first.done.is_set():
            self.second_sent.wait(30)
        time.sleep(0.2)  # a step as long as a real one: a hold lasts at most the last step's time
        return super().forward_items(items)

    def stops(self, token, req):
        return False  # the flood keeps decoding until cancelled


def test_the_loop_holds_the_next_step_for_a_sequential_victims_follow_up(layout):
    """A floods with 4 decoding requests; B (below its share) sends one request, then its follow-up as soon
    as the first finished. The loop waits for the follow-up instead of starting A's next step, so the
    follow-up is computed in the very next step (without the hold it lands in A's step and waits for it)."""
    engine = CacheEngine(layout, num_blocks=2000, device="cpu")
    sched = Scheduler(engine, token_budget=128, max_batch=16, anticipate_ms=1000)
    ns = layout_ns(layout)
    runner = Gate()
    flood = [sched.submit(_req(runner, ns, "a", [(i + 3) % 11] * 40, 1500)) for i in range(4)]
    for _ in range(20_000):  # the flood is running before B arrives
        if all(r.prefilled for r in flood):
            break
        time.sleep(0.001)
    first = _req(runner, ns, "b", [7, 1] * 8, 1)
    runner.first = first
    sched.submit(first)
    assert first.done.wait(30) and first.prefilled
    second = sched.submit(_req(runner, ns, "b", [7, 2] * 8, 1))
    runner.second_sent.set()
    assert second.done.wait(30) and second.prefilled
    assert all(not r.done.is_set() for r in flood)  # A had work all along
    assert second.arrival_step == first.started_step + 1  # no step of A's ran between B's two requests
    assert sched.counters["holds"] >= 1 and sched.counters["held_arrivals"] >= 1
    for r in flood:
        sched.cancel(r, wait=False)
    assert all(r.done.wait(30) for r in flood)
    engine.check_integrity()


def test_anticipation_settings_are_validated(layout, monkeypatch):
    from workers.config import WorkerConfig, WorkerConfigError

    engine = CacheEngine(layout, num_blocks=64, device="cpu")
    for bad in (-1, 1001, 2.5, True):
        with pytest.raises(ValueError, match="anticipate_ms"):
            Scheduler(engine, start_thread=False, anticipate_ms=bad)
    monkeypatch.setenv("STRATA_ANTICIPATE_MS", "1001")
    with pytest.raises(WorkerConfigError, match="STRATA_ANTICIPATE_MS"):
        WorkerConfig.from_env()
    monkeypatch.setenv("STRATA_ANTICIPATE_MS", "0")
    assert WorkerConfig.from_env().anticipate_ms == 0
