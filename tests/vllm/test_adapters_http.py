"""Tenant LoRA adapters on a vLLM deployment, over HTTP with the official ``openai`` client against the
live server and the suite's local Ray: two adapters built in the test (PEFT's files, no peft), each
adapter's greedy output equal to transformers' ``generate`` on its merged weights, the same prompt on
the base model, adapter A and adapter B never sharing KV in any tier (device cache, then L3 after a
replica restart) while each hits its own, a private adapter a 404 like a missing model for another
tenant, and a deleted adapter's L3 objects gone from the L3 directory."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

import httpx
import openai
import pytest
import torch

from tests.adapters.lora_files import build_adapter, merged
from tests.controlplane.helpers import post
from tests.jobs.conftest import wait_for
from tests.vllm.test_vllm_platform import _grant, _kill

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow
NAME = "vllm-lora"
PROMPT = [5 + (i * 7) % 290 for i in range(70)]  # two full blocks of vLLM's CPU build (32)
DOC = [5 + (i * 13) % 290 for i in range(700)]  # two L3 chunks of 256 tokens and change
NAMED = [9 + (i * 11) % 280 for i in range(66)]  # a named cache's prefix: two full blocks


def _complete(client, model, prompt, max_tokens=8):
    out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return out.choices[0].text, out.usage.prompt_tokens_details.cached_tokens


def _reference(hf, tok, prompt, max_new_tokens=8) -> str:
    with torch.no_grad():
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=None)[0, len(prompt):]
    return tok.decode(ids, skip_special_tokens=True)


def _l3_files(name: str, scope: str = "") -> list[Path]:
    from cachecore.tiers.remote.names import enc

    root = Path(urlparse(os.environ["STRATA_L3_URL"]).path)
    return [p for p in root.glob(f"*/{enc(name)}/*/**/*") if p.is_file()
            and p.relative_to(root).parts[2].endswith(enc("~" + scope) if scope else "")]


def test_adapters_serve_their_own_weights_and_never_share_kv(platform, admin_client, actor, vllm_checkpoint,
                                                            tmp_path_factory, celery_worker_factory):
    import ray

    from controlplane.adapters.models import Adapter
    from controlplane.registry.services import model_create
    from workers import actor as worker_actor

    path, hf, tok = vllm_checkpoint
    root = tmp_path_factory.mktemp("lora-adapters")
    tensors_a = build_adapter(root / "a", hf, seed=21)
    tensors_b = build_adapter(root / "b", hf, seed=22, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    d = model_create(actor=actor, name=NAME, preset="", engine="vllm", revision={"label": "r1", "path": str(path)})
    _grant(platform, actor, d, "acme", "globex")
    for name, where, tenant in (("tuned-a", "a", None), ("tuned-b", "b", "acme")):
        resp = post(admin_client, f"/api/admin/models/{NAME}/adapters",
                    {"name": name, "path": str(root / where), **({"tenant": tenant} if tenant else {})})
        assert resp.status_code == 201, resp.content
    acme, globex = platform.client("acme"), platform.client("globex")
    try:
        listed = {m.id: m for m in acme.models.list().data}
        assert {NAME, "tuned-a", "tuned-b"} <= set(listed) and listed["tuned-b"].model_extra["parent"] == NAME
        assert "tuned-b" not in {m.id for m in globex.models.list().data}

        # each adapter computes its own merged weights, greedy, as transformers does
        base_text, base_cached = _complete(acme, NAME, PROMPT)
        a_text, a_cached = _complete(acme, "tuned-a", PROMPT)
        b_text, b_cached = _complete(acme, "tuned-b", PROMPT)
        assert base_text == _reference(hf, tok, PROMPT)
        assert a_text == _reference(merged(hf, tensors_a), tok, PROMPT)
        assert b_text == _reference(merged(hf, tensors_b), tok, PROMPT)
        assert len({base_text, a_text, b_text}) == 3
        # the same prompt: nothing shared across base, A and B; full hits within each
        assert (base_cached, a_cached, b_cached) == (0, 0, 0)
        assert _complete(acme, "tuned-a", PROMPT) == (a_text, 64)
        assert _complete(acme, "tuned-b", PROMPT) == (b_text, 64)
        assert _complete(acme, NAME, PROMPT) == (base_text, 64)
        # another tenant on the public adapter: its own scope (a miss), the same output
        assert _complete(globex, "tuned-a", PROMPT) == (a_text, 0)
        # another tenant's private adapter: the very 404 of a missing model
        with pytest.raises(openai.NotFoundError) as private:
            _complete(globex, "tuned-b", PROMPT)
        with pytest.raises(openai.NotFoundError) as missing:
            _complete(globex, "tuned-c", PROMPT)
        assert private.value.body["code"] == missing.value.body["code"] == "model_not_found"
        assert private.value.body["message"].replace("tuned-b", "X") == missing.value.body["message"].replace(
            "tuned-c", "X")

        # chats name the adapter too: its answer says so, and its prefix is its own
        messages = [{"role": "system", "content": "You answer briefly. " * 8}, {"role": "user", "content": "Hi!"}]
        chats = [acme.chat.completions.create(model=m, messages=messages, max_tokens=4, temperature=0)
                 for m in ("tuned-a", "tuned-a", NAME)]
        assert [c.model for c in chats] == ["tuned-a", "tuned-a", NAME]
        cached = [c.usage.prompt_tokens_details.cached_tokens for c in chats]
        assert cached[0] == cached[2] == 0 and cached[1] >= 32

        # a named cache prewarmed on B is B's: used with B it hits, with A it does not exist, and the base
        # model sending its very prefix finds nothing of it
        made = httpx.post(f"{platform.url}/v1/caches", timeout=300, json={"model": "tuned-b", "prompt": NAMED},
                          headers={"Authorization": f"Bearer {platform.keys['acme']}"})
        assert made.status_code == 201, made.text
        assert made.json()["model"] == "tuned-b"
        on_b = acme.completions.create(model="tuned-b", prompt=[7, 8, 9], max_tokens=4, temperature=0,
                                       extra_body={"cache_id": made.json()["id"]})
        assert on_b.usage.prompt_tokens_details.cached_tokens == 64
        with pytest.raises(openai.NotFoundError) as other:
            acme.completions.create(model="tuned-a", prompt=[7, 8, 9], max_tokens=4,
                                    extra_body={"cache_id": made.json()["id"]})
        assert other.value.body["code"] == "cache_not_found"
        assert _complete(acme, NAME, NAMED + [7, 8, 9], max_tokens=4)[1] == 0

        # through L3: the device cache and L2 are gone with a replica restart
        cold = {m: _complete(acme, m, DOC) for m in (NAME, "tuned-a")}
        assert [c for _, c in cold.values()] == [0, 0]
        ray.get(worker_actor.find(NAME, 0).drain_writes.remote(), timeout=120)
        assert _l3_files(NAME, Adapter.objects.get(name="tuned-a").scope)
        _kill(NAME)
        assert _complete(acme, "tuned-b", DOC)[1] == 0  # neither A's L3 objects nor the base model's
        for m in (NAME, "tuned-a"):
            assert _complete(acme, m, DOC) == (cold[m][0], 512)  # its own, from L3

        # deleting A: a job removes its KV from every tier, L3 files included; the base model's stay
        scope = Adapter.objects.get(name="tuned-a").scope
        celery_worker_factory()
        resp = admin_client.delete(f"/api/admin/models/{NAME}/adapters/tuned-a?reason=retired")
        assert resp.status_code == 202, resp.content
        job_id = resp.json()["job"]["id"]
        job = wait_for(lambda: (j := admin_client.get(f"/api/admin/flush-jobs/{job_id}").json())["status"]
                       in ("succeeded", "partial", "failed") and j, timeout=300)
        assert job["status"] == "succeeded" and job["verified"] is True, job
        assert not _l3_files(NAME, scope)
        assert _l3_files(NAME)  # the base model's and B's
        with pytest.raises(openai.NotFoundError):
            _complete(acme, "tuned-a", PROMPT)
    finally:
        _kill(NAME)
