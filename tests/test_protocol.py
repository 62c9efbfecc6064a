"""The worker protocol: one typed request both engines read, refusing unknown or ill-typed fields."""

from __future__ import annotations

import pytest

from workers.protocol import WorkerRequest, finished_event, fold_completion, prefilled_event, token_event

SALT = bytes(range(32))


def test_round_trip_through_plain_data():
    req = WorkerRequest(tenant="7", scope_salt=SALT, prompt=[1, 2, 3], max_tokens=4, cache_salt="u1", logprobs=2)
    again = WorkerRequest.from_dict(req.to_dict())
    assert again == req
    assert WorkerRequest.from_dict(req) is req


def test_unknown_fields_and_bad_values_are_refused():
    base = WorkerRequest(tenant="7", scope_salt=SALT, prompt=[1]).to_dict()
    with pytest.raises(ValueError, match="unknown worker request field"):
        WorkerRequest.from_dict({**base, "scope": "everything"})
    with pytest.raises(ValueError, match="max_tokens"):
        WorkerRequest.from_dict({**base, "max_tokens": 0})
    with pytest.raises(ValueError, match="scope_salt"):
        WorkerRequest.from_dict({**base, "scope_salt": "acme"})
    with pytest.raises(ValueError, match="cache_salt"):
        WorkerRequest.from_dict({**base, "cache_salt": 5})
    with pytest.raises(ValueError, match="bad worker request"):
        WorkerRequest.from_dict({"tenant": "7"})
    # what the router adds on the way is tolerated
    assert WorkerRequest.from_dict({**base, "_route_hashes": []}).tenant == "7"


def test_events_fold_into_a_completion():
    events = [prefilled_event(prompt_tokens=3, cached_tokens=0, revision="r1"),
              token_event(5, "a", -0.5, {"a": -0.5}), token_event(6, "b"),
              finished_event(finish_reason="length", revision="r1", prompt_tokens=3, completion_tokens=2,
                             cached_tokens=0)]
    out = fold_completion(events)
    assert out["token_ids"] == [5, 6] and out["text"] == "ab" and out["logprobs"] == [-0.5]
    assert out["usage"]["total_tokens"] == 5 and out["finish_reason"] == "length"
