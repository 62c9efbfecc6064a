"""Every error of the serving API: OpenAI-style JSON, the right status, never a 500 or a trace."""

from __future__ import annotations

import httpx
import pytest


def _post(platform, path="/v1/completions", *, key="acme", json=None, content=None, headers=None):
    h = {"Authorization": f"Bearer {platform.keys[key]}"} if key else {}
    if content is not None:
        h["Content-Type"] = "application/json"
    h.update(headers or {})
    return httpx.post(f"{platform.url}{path}", json=json, content=content, headers=h, timeout=60)


def _err(resp, status, code=None):
    assert resp.status_code == status, (resp.status_code, resp.text[:300])
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()["error"]
    assert set(body) >= {"message", "type", "code"} and body["message"]
    assert "Traceback" not in resp.text and 'File "' not in resp.text
    if code:
        assert body["code"] == code, body
    return body


def _ok(platform, **over):
    return {"model": platform.model, "prompt": "hello", "max_tokens": 2, **over}


def test_missing_bad_and_revoked_keys_are_401(platform, actor):
    from controlplane.tenants.services import api_key_create, api_key_revoke

    _err(_post(platform, key=None, json=_ok(platform)), 401, "missing_api_key")
    _err(httpx.post(f"{platform.url}/v1/completions", json=_ok(platform),
                    headers={"Authorization": "Bearer sk-nope-123"}), 401, "invalid_api_key")
    key, raw = api_key_create(actor=actor, tenant=platform.tenants["acme"])
    ok = httpx.post(f"{platform.url}/v1/completions", json=_ok(platform), headers={"Authorization": f"Bearer {raw}"},
                    timeout=60)
    assert ok.status_code == 200  # paired: the same key works before it is revoked
    api_key_revoke(actor=actor, api_key=key)
    _err(httpx.post(f"{platform.url}/v1/completions", json=_ok(platform),
                    headers={"Authorization": f"Bearer {raw}"}), 401, "invalid_api_key")


def test_suspended_tenant_is_403(platform, actor):
    from controlplane.tenants.services import tenant_update

    tenant_update(actor=actor, tenant=platform.tenants["globex"], status="suspended")
    _err(_post(platform, key="globex", json=_ok(platform)), 403, "tenant_suspended")


def test_unknown_and_ungranted_models_are_the_same_404(platform, actor):
    from controlplane.registry.services import model_create

    model_create(actor=actor, name="secret-model", preset="tiny", revision={"label": "r1", "seed": 2})
    unknown = _err(_post(platform, json=_ok(platform, model="no-such-model")), 404, "model_not_found")
    ungranted = _err(_post(platform, json=_ok(platform, model="secret-model")), 404, "model_not_found")
    assert unknown["message"].replace("no-such-model", "X") == ungranted["message"].replace("secret-model", "X")


@pytest.mark.parametrize("content,code", [
    (b"{not json", "invalid_json"),
    (b"\xff\xfe\x00garbage", "invalid_utf8"),
    (b"[1, 2, 3]", "invalid_json"),
    (b"", "invalid_json"),
    (b"[" * 100_000, "invalid_json"),  # nesting deep enough to exhaust the parser's recursion
    (b'{"model": "m", "prompt": [' + b"1" * 5000 + b"]}", "invalid_json"),  # integer literal too long
])
def test_malformed_bodies_are_400(platform, content, code):
    _err(_post(platform, content=content), 400, code)


@pytest.mark.parametrize("over", [
    {"max_tokens": "ten"},
    {"max_tokens": -1},
    {"max_tokens": 0},
    {"max_tokens": 10**9},
    {"temperature": "hot"},
    {"temperature": -1},
    {"temperature": 1e-300},  # overflows the sampler's logits / temperature: NaN probabilities
    {"temperature": 5e-324},
    {"temperature": 0.001},
    {"temperature": 2.5},
    {"temperature": 1e308},
    {"prompt": ""},
    {"prompt": []},
    {"prompt": [1, -5]},
    {"prompt": [1, "a"]},
    {"prompt": {"text": "x"}},
    {"max_token": 5},  # a typo must not silently fall back to a default
    {"n": 3},
    {"seed": "x"},
    {"seed": 2**64},
    {"stream": "yes"},
])
def test_wrong_types_and_values_are_422(platform, over):
    _err(_post(platform, json=_ok(platform, **over)), 422)


def test_temperature_is_0_or_within_the_samplers_safe_range(platform):
    """Paired with the 422 cases above: the bounds themselves work, streamed and whole, and a non-finite
    temperature (Python's json reads NaN/Infinity) is refused too."""
    for temperature in (0, 0.01, 2):
        resp = _post(platform, json=_ok(platform, temperature=temperature, seed=1))
        assert resp.status_code == 200, (temperature, resp.text[:300])
        assert resp.json()["usage"]["completion_tokens"] == 2
    streamed = _post(platform, json=_ok(platform, temperature=0.01, stream=True))
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    assert '"error"' not in streamed.text
    for literal in (b"NaN", b"Infinity"):
        body = b'{"model": "%s", "prompt": "x", "temperature": %s}' % (platform.model.encode(), literal)
        _err(_post(platform, content=body), 422)
    _err(_post(platform, "/v1/chat/completions", json={"model": platform.model, "temperature": 1e-300,
                                                       "messages": [{"role": "user", "content": "x"}]}), 422)


def test_lone_surrogate_in_prompt_or_message_is_400(platform):
    body = b'{"model": "%s", "prompt": "abc\\ud800def"}' % platform.model.encode()
    _err(_post(platform, content=body), 400, "invalid_prompt")
    chat = b'{"model": "%s", "messages": [{"role": "user", "content": "\\udfff"}]}' % platform.model.encode()
    _err(_post(platform, "/v1/chat/completions", content=chat), 400, "invalid_prompt")


def test_missing_model_field_is_422(platform):
    _err(_post(platform, json={"prompt": "x"}), 422)


@pytest.mark.parametrize("messages", [[], [{"role": "wizard", "content": "x"}], [{"role": "user"}], "hello"])
def test_bad_chat_messages_are_422(platform, messages):
    _err(_post(platform, "/v1/chat/completions", json={"model": platform.model, "messages": messages}), 422)


def test_token_outside_vocabulary_and_context_overflow_are_400(platform):
    _err(_post(platform, json=_ok(platform, prompt=[1, 2, 99999])), 400, "invalid_prompt")
    _err(_post(platform, json=_ok(platform, prompt="x" * 1100)), 400, "context_length_exceeded")


def test_oversized_body_is_413(platform, settings):
    big = b'{"model": "m", "prompt": "' + b"x" * (settings.STRATA_MAX_BODY_BYTES + 10) + b'"}'
    _err(_post(platform, content=big), 413)


def test_prompt_token_quota_is_413_and_smaller_prompt_passes(platform, actor):
    from controlplane.tenants.services import tenant_update

    tenant_update(actor=actor, tenant=platform.tenants["acme"], quotas={"max_prompt_tokens": 50})
    _err(_post(platform, json=_ok(platform, prompt="y" * 80)), 413, "prompt_too_long")
    assert _post(platform, json=_ok(platform, prompt="y" * 20)).status_code == 200


def test_request_rate_limit_is_429_with_retry_after(platform, actor):
    from controlplane.tenants.services import tenant_update

    tenant_update(actor=actor, tenant=platform.tenants["initech"], quotas={"requests_per_minute": 2})
    assert _post(platform, key="initech", json=_ok(platform)).status_code == 200
    assert _post(platform, key="initech", json=_ok(platform)).status_code == 200
    resp = _post(platform, key="initech", json=_ok(platform))
    _err(resp, 429, "rate_limit_requests")
    assert 1 <= int(resp.headers["Retry-After"]) <= 60
    assert _post(platform, key="acme", json=_ok(platform)).status_code == 200  # other tenants unaffected


def test_token_rate_limit_is_429(platform, actor):
    from controlplane.tenants.services import tenant_update

    tenant_update(actor=actor, tenant=platform.tenants["globex"], quotas={"tokens_per_minute": 30})
    assert _post(platform, key="globex", json=_ok(platform, prompt="a" * 10, max_tokens=2)).status_code == 200
    resp = _post(platform, key="globex", json=_ok(platform, prompt="a" * 20, max_tokens=2))
    _err(resp, 429, "rate_limit_tokens")
    assert "Retry-After" in resp.headers


def test_wrong_method_and_unknown_path_are_json(platform):
    resp = httpx.get(f"{platform.url}/v1/completions", headers={"Authorization": f"Bearer {platform.keys['acme']}"})
    _err(resp, 405)
    _err(httpx.get(f"{platform.url}/v1/nothing-here"), 404)


def test_unreachable_worker_is_503_with_retry_after(platform, actor, tmp_path):
    """A revision whose weights file vanished: the worker cannot start, the API says 503, not 500."""
    from cachecore.model.config import preset
    from cachecore.model.weights import save_safetensors, seeded_weights
    from controlplane.registry.services import model_create
    from controlplane.tenants.access import grant_create

    path = tmp_path / "w.safetensors"
    save_safetensors(seeded_weights(preset("tiny"), model_name="x", revision_label="r", seed=1), path)
    deployment = model_create(actor=actor, name="fragile-model", preset="tiny",
                              revision={"label": "r1", "weights_path": str(path)})
    grant_create(actor=actor, tenant=platform.tenants["acme"], deployment=deployment)
    path.write_bytes(b"not a safetensors file")
    resp = _post(platform, json=_ok(platform, model="fragile-model"))
    _err(resp, 503)
    assert int(resp.headers["Retry-After"]) >= 1


def test_kv_api_store_lookup_retrieve_roundtrip_and_isolation(platform):
    import base64

    import numpy as np

    layout = httpx.get(f"{platform.url}/v1/kv/layout", params={"model": platform.model},
                       headers={"Authorization": f"Bearer {platform.keys['acme']}"}).json()
    bs = layout["block_size"]
    tokens = list(range(10, 10 + 2 * bs + 3))
    kv = np.random.default_rng(0).standard_normal((2, *layout["page_shape"])).astype(np.float32)
    body = {"model": platform.model, "tokens": tokens, "kv": base64.b64encode(kv.tobytes()).decode()}
    stored = _post(platform, "/v1/kv/store", json=body)
    assert stored.status_code == 200 and stored.json()["stored_blocks"] == 2
    again = _post(platform, "/v1/kv/store", json=body)
    assert again.json()["stored_blocks"] == 0  # duplicates recognised, not stored twice
    look = {"model": platform.model, "tokens": tokens}
    assert _post(platform, "/v1/kv/lookup", json=look).json()["hit_tokens"] == 2 * bs
    assert _post(platform, "/v1/kv/lookup", key="globex", json=look).json()["hit_tokens"] == 0
    got = _post(platform, "/v1/kv/retrieve", json=look).json()
    assert got["hit_tokens"] == 2 * bs
    back = np.frombuffer(base64.b64decode(got["kv"]), dtype=np.float32).reshape(kv.shape)
    assert np.array_equal(back, kv)
    _err(_post(platform, "/v1/kv/store", json={**body, "kv": "!!notbase64"}), 422, "invalid_kv")
    _err(_post(platform, "/v1/kv/store", json={**body, "kv": base64.b64encode(b"123").decode()}), 422, "invalid_kv")


def test_serving_responses_carry_nosniff_and_skip_browser_middleware(platform):
    ok = _post(platform, json=_ok(platform))
    assert ok.status_code == 200 and ok.headers["x-content-type-options"] == "nosniff"
    assert "set-cookie" not in ok.headers and "x-frame-options" not in ok.headers  # no session/CSRF/clickjacking
    err = _post(platform, key=None, json=_ok(platform))
    assert err.headers["x-content-type-options"] == "nosniff"


def test_chunked_oversized_body_without_content_length_is_413(platform, settings):
    def chunks():
        yield b'{"model": "m", "prompt": "'
        for _ in range(settings.STRATA_MAX_BODY_BYTES // 65536 + 2):
            yield b"x" * 65536
        yield b'"}'

    resp = httpx.post(f"{platform.url}/v1/completions", content=chunks(), timeout=60,
                      headers={"Authorization": f"Bearer {platform.keys['acme']}", "Content-Type": "application/json"})
    _err(resp, 413)
