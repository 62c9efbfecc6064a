"""The engine's compute threads: every core but one by default, the operator's number when set; a step of
prompt chunks alone on every core (``cachecore.scheduler.threads``)."""

from __future__ import annotations

import secrets
import threading

import pytest
import torch

from cachecore.crypto import Keyring
from cachecore.engine import CacheEngine
from cachecore.layout import KVLayout
from cachecore.model.loader import RevisionSpec, load_model
from cachecore.runner import CompletionRunner, SamplingParams
from cachecore.scheduler import Scheduler
from cachecore.scheduler.threads import StepThreads
from cachecore.tiers.backends import open_backend
from cachecore.tiers.remote import RemoteStore
from workers.config import WorkerConfig


@pytest.mark.parametrize(("cores", "want"), [(1, 1), (2, 1), (4, 3), (16, 15)])
def test_default_leaves_one_core_to_the_loop_and_the_web_tier(cores, want):
    assert WorkerConfig().compute_threads(cores) == want


def test_strata_torch_threads_is_taken_as_given():
    cfg = WorkerConfig.from_env({"STRATA_TORCH_THREADS": "2"})
    assert cfg.compute_threads(2) == 2
    assert cfg.compute_threads(64) == 2
    assert WorkerConfig.from_env({}).compute_threads(8) == 7


# ---------------------------------------------------------------------- per-step threads (cachecore.scheduler.threads)
def test_step_threads_default_every_core_for_prompt_chunks_one_less_with_a_decode():
    plan = WorkerConfig().step_threads("cpu", cores=4)
    assert (plan.steady, plan.burst) == (3, 4)
    assert WorkerConfig().step_threads("cpu", cores=1).burst == 1
    assert WorkerConfig(torch_threads=2).step_threads("cpu", cores=8).burst == 2  # the operator's number, always
    gpu = WorkerConfig().step_threads("cuda:0", cores=4)  # the kernels run on the GPU: no bursts of host threads
    assert (gpu.steady, gpu.burst) == (3, 3)


def test_a_step_is_a_burst_only_when_every_item_is_a_prompt_chunk():
    plan = StepThreads(1, 2)
    assert plan.threads_for([(0, 256), (32, 64)]) == 2
    assert plan.threads_for([(0, 256), (40, 41)]) == 1  # one decode in the step
    assert plan.threads_for([(63, 64)]) == 1  # a one-token item (a fully cached prompt's last token)
    with pytest.raises(ValueError):
        StepThreads(2, 1)
    with pytest.raises(ValueError):
        StepThreads(0, 1)


def test_enter_sets_the_calling_threads_torch_threads_only_when_they_change(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    plan = StepThreads(1, 2)
    for spans in ([(0, 64)], [(0, 64)], [(64, 65)], [(65, 66)], [(0, 32)]):
        plan.enter(spans)
    assert calls == [2, 1, 2]


def test_a_step_that_could_burst_is_held_on_steady_threads_while_background_work_holds_a_core():
    calls, asked = [], []

    def writing() -> bool:
        asked.append(True)
        return True

    plan = StepThreads(1, 2, set_threads=calls.append)
    assert plan.enter_step(False, writing) == 1 and not plan.last_held and not asked  # a decode step: not asked
    assert plan.enter_step(True, writing) == 1 and plan.last_held and len(asked) == 1
    assert plan.enter_step(True, lambda: False) == 2 and not plan.last_held
    assert plan.enter_step(True) == 2 and not plan.last_held  # nothing to ask
    gpu = StepThreads(2, 2, set_threads=calls.append)  # no burst possible: never asked, never held
    assert gpu.enter_step(True, writing) == 2 and not gpu.last_held and len(asked) == 1
    assert calls == [1, 2, 2]


def _serve(threads, *, l3_writing: bool = False):
    """An 80-token prompt and 6 decodes through a real loop on the tiny model: (tokens, [(the step's
    largest item, the threads its forward ran on)], the loop's counters). ``l3_writing``: the engine
    reports L3 chunks being written throughout."""
    loaded = load_model("threads-llama", "tiny", RevisionSpec(label="r1", seed=9), device="cpu")
    prompt = torch.randint(0, 256, (80,), generator=torch.Generator().manual_seed(3)).tolist()
    engine = CacheEngine(loaded.layout, num_blocks=32, device="cpu")
    if l3_writing:
        engine.l3_writing = lambda: True
    sched = Scheduler(engine, threads=threads)
    gen = CompletionRunner(loaded.model, engine, loaded.tokenizer, model_name="threads-llama", revision="r1",
                           scheduler=sched, prefill_chunk=32)
    seen, forward = [], gen.forward_items

    def recording(items):  # on the loop thread, inside the step: the threads its forward runs on
        seen.append((max(end - start for _, start, end in items), torch.get_num_threads()))
        return forward(items)

    gen.forward_items = recording
    out = gen.complete(loaded.namespace(secrets.token_bytes(32)), prompt, owner="t",
                       params=SamplingParams(max_tokens=6, stop_at_eos=False))
    return out.token_ids, seen, sched.counters


def test_the_loop_runs_prompt_steps_on_burst_threads_and_decodes_on_steady_with_the_same_tokens():
    before = torch.get_num_threads()
    plain, _, unplanned = _serve(None)
    tokens, seen, counters = _serve(StepThreads(1, 2))
    assert torch.get_num_threads() == before  # the caller's threads are not the loop's
    assert tokens == plain and unplanned["burst_steps"] == 0
    assert [t for n, t in seen if n > 1] == [2, 2, 2] and counters["burst_steps"] == 3  # 80 tokens, 32-token chunks
    assert {t for n, t in seen if n == 1} == {1}  # every decode step
    assert counters["burst_held"] == 0


def test_prompt_steps_stay_on_steady_threads_while_the_engine_writes_l3_chunks():
    plain, _, _ = _serve(None)
    tokens, seen, counters = _serve(StepThreads(1, 2), l3_writing=True)
    assert tokens == plain
    assert {t for _, t in seen} == {1}  # the writer holds a core: a forward split over both would wait for it
    assert counters["burst_steps"] == 0 and counters["burst_held"] == 3


def test_the_engine_reports_l3_writing_while_its_chunk_writer_has_a_job(tmp_path):
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16)
    assert not CacheEngine(layout, num_blocks=8).l3_writing()  # no L3: nothing is ever written
    l3 = RemoteStore(open_backend(f"file://{tmp_path / 'l3'}"), Keyring(), layout,
                     chunk_blocks=4)
    engine = CacheEngine(layout, num_blocks=8, l3=l3)
    assert not engine.l3_writing()
    gate = threading.Event()
    engine.chunk_writer._writer.submit(lambda: gate.wait(10))  # a chunk set being sealed and fsynced
    assert engine.l3_writing()
    gate.set()
    engine.drain_writes()
    assert not engine.l3_writing()
