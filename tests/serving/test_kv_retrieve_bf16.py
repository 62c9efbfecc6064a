"""``/v1/kv/retrieve`` for a bfloat16 layout (numpy has no bfloat16): the real view over a real
bf16 CacheWorker on CPU answers 200 with the raw bytes, which decode back to the stored KV."""

from __future__ import annotations

import asyncio
import base64
import json
import secrets

import pytest
import torch

from workers.cache_worker import CacheWorker


@pytest.fixture(scope="module")
def bf16_worker():
    return CacheWorker(deployment="bf16-llama", preset="tiny", revision={"label": "r1", "seed": 3}, l1_mb=1,
                       dtype="bfloat16")


def test_kv_retrieve_of_a_bf16_layout_returns_its_raw_bytes(bf16_worker, monkeypatch):
    from django.test import RequestFactory

    from controlplane.serving import context, views

    layout = bf16_worker.kv_layout()
    assert layout["dtype"] == "bfloat16"
    salt = secrets.token_bytes(32)
    tokens = list(range(10, 10 + 2 * layout["block_size"] + 3))
    req = {"tenant": "t1", "scope_salt": salt, "tenant_salt": salt, "tokens": tokens}
    kv = torch.randn(2, *layout["page_shape"]).to(torch.bfloat16)
    assert bf16_worker.kv_store(req, kv) == 2

    async def prepare_kv(request, schema):
        return None, None, req

    async def acall(spec, method, *args, **kwargs):
        return getattr(bf16_worker, method)(*args)

    monkeypatch.setattr(context, "prepare_kv", prepare_kv)
    monkeypatch.setattr(views.gateway, "acall", acall)
    request = RequestFactory().post("/v1/kv/retrieve", data=json.dumps({"model": "m", "tokens": tokens}),
                                    content_type="application/json")
    resp = asyncio.run(views.kv_retrieve(request))
    assert resp.status_code == 200, resp.content
    body = json.loads(resp.content)
    assert body["dtype"] == "bfloat16" and body["hit_tokens"] == 2 * layout["block_size"]
    raw = base64.b64decode(body["kv"])
    assert len(raw) == 2 * layout["bytes_per_block"]
    back = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).view(*body["shape"])
    assert torch.equal(back, kv)
