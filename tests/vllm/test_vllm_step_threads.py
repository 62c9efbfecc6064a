"""Strata's per-step threads in vLLM's worker (``workers.kv_connector``): a step of prompt chunks alone
runs on every core, a step with a decode or a one-token item on ``compute_threads``, the rule of
Strata's own scheduler (``cachecore.scheduler.threads``). The engine tests of this directory run
vLLM with it (on 2 cores: 2 threads for prompt steps, 1 for the others) and check its outputs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from cachecore.scheduler.threads import StepThreads  # noqa: E402
from workers.kv_connector import StrataConnector, StrataMetadata  # noqa: E402


def _scheduler_side() -> StrataConnector:
    """The scheduler side's state without vLLM's config (``build_connector_meta`` reads only this)."""
    connector = object.__new__(StrataConnector)
    connector._reqs, connector._forgets = {}, []
    connector.block_size, connector.chunk_blocks = 16, 16
    return connector


def _step(counts: dict[str, int]):
    return SimpleNamespace(num_scheduled_tokens=counts, scheduled_new_reqs=[], finished_req_ids=set(),
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                                                 num_computed_tokens=[], resumed_req_ids=set()))


@pytest.mark.parametrize(("counts", "prompt_only"), [
    ({"a": 256, "b": 33}, True),  # prompt chunks only
    ({"a": 256, "b": 1}, False),  # one decode in the step
    ({"a": 1}, False),  # a fully cached prompt's last token, or a decode
    ({}, False),  # nothing scheduled (vLLM still runs the connector)
])
def test_a_step_is_prompt_only_when_every_request_in_it_computes_more_than_one_token(counts, prompt_only):
    meta = _scheduler_side().build_connector_meta(_step(counts))
    assert isinstance(meta, StrataMetadata) and meta.prompt_only is prompt_only


def _worker_side(calls: list[int], writing: list[bool]) -> StrataConnector:
    connector = object.__new__(StrataConnector)
    connector._threads = StepThreads(1, 2, set_threads=calls.append)
    connector.service = SimpleNamespace(writing=lambda: writing[0])
    return connector


def test_the_worker_sets_its_threads_from_each_step_s_metadata_only_when_they_change():
    calls: list[int] = []
    connector = _worker_side(calls, [False])
    for prompt_only in (True, True, False, False, True):
        connector.handle_preemptions(StrataMetadata(prompt_only=prompt_only))
    assert calls == [2, 1, 2]
    connector._threads = None  # not on a CPU: vLLM's host threads are left alone
    connector.handle_preemptions(StrataMetadata(prompt_only=False))
    assert calls == [2, 1, 2]


def test_a_prompt_step_stays_on_steady_threads_while_l3_chunks_are_being_written():
    calls: list[int] = []
    writing = [True]
    connector = _worker_side(calls, writing)
    connector.handle_preemptions(StrataMetadata(prompt_only=True))
    assert calls == [1]  # the write holds a core: a forward split over both would wait for it
    writing[0] = False
    connector.handle_preemptions(StrataMetadata(prompt_only=True))
    assert calls == [1, 2]
