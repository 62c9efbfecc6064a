"""Returned logprobs are rounded to ``LOGPROB_DECIMALS`` places (the last bits of a float32 logprob
change with the batch a request shares, which would tell a tenant that others are active): whole
completions, chat completions and streamed chunks, chosen tokens and top alternatives alike."""

from __future__ import annotations

import secrets

import pytest

from workers.cache_worker import CacheWorker


@pytest.fixture(scope="module")
def token_events():
    worker = CacheWorker(deployment="lp-llama", preset="tiny", revision={"label": "r1", "seed": 4}, l1_mb=1)
    salt = secrets.token_bytes(32)
    events = worker.collect({"tenant": "t", "scope_salt": salt, "prompt": list(range(30, 70)), "max_tokens": 6,
                             "temperature": 0, "logprobs": 3})
    tokens = [e for e in events if e["type"] == "token"]
    assert len(tokens) == 6 and all(t["top_logprobs"] for t in tokens)
    return tokens


def _returned(body) -> list[float]:
    """Every logprob value in a response body (any nesting)."""
    if isinstance(body, dict):
        own = [body["logprob"]] if isinstance(body.get("logprob"), float) else []
        return own + [x for k, v in body.items() if k != "logprob" for x in _returned(v)]
    if isinstance(body, list):
        return [x for v in body for x in _returned(v)]
    return []


def test_the_worker_gives_full_precision_and_the_api_returns_it_rounded(token_events):
    from controlplane.serving import responses

    raw = [t["logprob"] for t in token_events] + [v for t in token_events for v in t["top_logprobs"].values()]
    assert any(round(v, responses.LOGPROB_DECIMALS) != v for v in raw)  # there are bits to hide
    finished = {"finish_reason": "length", "usage": {"prompt_tokens": 40, "completion_tokens": 6,
                                                     "total_tokens": 46, "cached_tokens": 0}}
    text = responses.completion("m", token_events, finished, with_logprobs=True)["choices"][0]["logprobs"]
    assert text["token_logprobs"] == [round(t["logprob"], 4) for t in token_events]
    assert text["top_logprobs"] == [{k: round(v, 4) for k, v in t["top_logprobs"].items()} for t in token_events]

    chat = responses.chat_completion("m", token_events, finished, with_logprobs=True)["choices"][0]["logprobs"]
    values = _returned(chat)
    assert len(values) == len(raw) and values == [round(v, 4) for v in values]
    assert [c["logprob"] for c in chat["content"]] == [round(t["logprob"], 4) for t in token_events]

    for kind in ("text", "chat"):
        chunk = responses.chunk(kind, "id", "m", 0, token=token_events[0], with_logprobs=True)
        got = chunk["choices"][0]["logprobs"]
        first = got["token_logprobs"][0] if kind == "text" else got["content"][0]["logprob"]
        assert first == round(token_events[0]["logprob"], 4)


def test_rounding_is_to_four_decimals_and_keeps_none():
    from controlplane.serving.responses import LOGPROB_DECIMALS, round_logprob

    assert LOGPROB_DECIMALS == 4
    assert round_logprob(-1.234567) == -1.2346 and round_logprob(-0.00001) == 0.0 and round_logprob(None) is None
