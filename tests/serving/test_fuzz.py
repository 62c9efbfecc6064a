"""Generated request bodies against the live serving API: whatever arrives, never a 5xx other than a
clean 503, and every error is the JSON error shape."""

from __future__ import annotations

import httpx
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20), st.lists(st.integers(-5, 300), max_size=5),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
MODEL = st.one_of(st.just("tiny-serve"), st.just("tiny-serve"), JUNK)
FIELDS = {
    "prompt": st.one_of(st.text(min_size=1, max_size=40), st.lists(st.integers(0, 259), min_size=1, max_size=20),
                        JUNK),
    "messages": st.one_of(
        st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "bot"]),
                                        "content": st.one_of(st.text(max_size=30), JUNK)}), max_size=3),
        JUNK),
    "max_tokens": st.one_of(st.integers(-2, 3), JUNK),
    "temperature": st.one_of(st.floats(0, 2), JUNK),
    "seed": JUNK,
    "logprobs": JUNK,
    "stream": st.one_of(st.booleans(), JUNK),
    "cache_salt": JUNK,
    "n": JUNK,
    "unexpected": JUNK,
}
BODIES = st.fixed_dictionaries({"model": MODEL}, optional=FIELDS)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=BODIES, chat=st.booleans())
# explicit valid bodies: the success path is exercised on every run, whatever hypothesis draws
@example(body={"model": "tiny-serve", "prompt": "fuzz", "max_tokens": 2}, chat=False)
@example(body={"model": "tiny-serve", "messages": [{"role": "user", "content": "fuzz"}], "max_tokens": 2,
               "stream": True}, chat=True)
def test_generated_bodies_never_cause_a_server_error(platform, body, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    resp = httpx.post(f"{platform.url}{path}", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {platform.keys['acme']}"})
    assert resp.status_code < 500, (body, resp.status_code, resp.text[:300])
    if resp.status_code >= 400:
        error = resp.json()["error"]
        assert error["message"] and error["type"] and error["code"]
    elif body.get("stream") is True:
        assert resp.text.rstrip().endswith("data: [DONE]")
    else:
        assert resp.json()["usage"]["completion_tokens"] >= 1

