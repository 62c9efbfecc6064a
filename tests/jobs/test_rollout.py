"""Weight-revision rollout ("model updated: reset the cache") through the admin API and Celery."""

from __future__ import annotations

import json
import threading

import httpx

from tests.controlplane.helpers import post
from tests.jobs.conftest import wait_for

PROMPT = "The weights of this model were just updated; nothing cached before may be reused. " * 3


def _reference(model: str, label: str, seed: int, prompt: str, max_tokens: int) -> str:
    """From-scratch greedy output of one revision, computed in this process on a fresh cache."""
    from cachecore.engine import CacheEngine
    from cachecore.model.loader import RevisionSpec, load_model
    from cachecore.runner import CompletionRunner, SamplingParams

    loaded = load_model(model, "tiny", RevisionSpec(label=label, seed=seed), device="cpu")
    engine = CacheEngine(loaded.layout, num_blocks=256, device="cpu")
    gen = CompletionRunner(loaded.model, engine, loaded.tokenizer, model_name=model, revision=label)
    ns = loaded.namespace(b"\x00" * 32)
    return gen.complete(ns, loaded.tokenizer.encode(prompt), owner="ref", params=SamplingParams(max_tokens=max_tokens),
                        use_cache=False).text


def _setup(platform, actor, name, seeds):
    from controlplane.registry.services import model_create, revision_create
    from controlplane.tenants.access import grant_create

    d = model_create(actor=actor, name=name, preset="tiny", revision={"label": "r1", "seed": seeds[0]})
    revision_create(actor=actor, deployment=d, label="r2", seed=seeds[1])
    grant_create(actor=actor, tenant=platform.tenants["acme"], deployment=d)
    return d


def _complete(platform, model, prompt=PROMPT, max_tokens=8):
    out = platform.client("acme").completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return out.choices[0].text, out.usage.prompt_tokens_details.cached_tokens


def _rollout(admin_client, model, revision="r2"):
    resp = post(admin_client, f"/api/admin/models/{model}/rollout", {"revision": revision, "reason": "new weights"})
    assert resp.status_code == 202, resp.content
    job_id = resp.json()["job"]["id"]
    return wait_for(lambda: (j := admin_client.get(f"/api/admin/flush-jobs/{job_id}").json())["status"]
                    in ("succeeded", "partial", "failed") and j, timeout=180)


def test_rollout_serves_new_weights_with_no_stale_reuse(platform, admin_client, actor, celery_worker_factory):
    name = "tiny-roll-a"
    _setup(platform, actor, name, (31, 32))
    old_text, _ = _complete(platform, name)
    assert _complete(platform, name) == (old_text, (len(PROMPT) + 1 - 1) // 16 * 16)
    assert old_text == _reference(name, "r1", 31, PROMPT, 8)
    celery_worker_factory()
    job = _rollout(admin_client, name)
    assert job["status"] == "succeeded" and job["verified"] is True, job
    steps = [s["step"] for s in job["steps"]]
    assert steps.index("switched") < steps.index("verified")
    switched = [r for r in job["results"] if r["worker"].endswith(":switch")]
    assert switched and all(r["status"] == "ok" for r in switched)
    # the bytes it freed are reported (the cached prefix of r1 was in L1), per tier
    assert sum(r["bytes"] for r in switched) > 0
    assert all(set(r["tiers"]) == {"l1", "l2", "l3"} for r in switched)
    new_text, cached = _complete(platform, name)
    assert cached == 0  # the old namespace is gone and the new one starts cold
    assert new_text == _reference(name, "r2", 32, PROMPT, 8)
    assert new_text != old_text
    assert _complete(platform, name) == (new_text, (len(PROMPT) + 1 - 1) // 16 * 16)  # the new one caches
    models = {m["name"]: m for m in admin_client.get("/api/admin/models").json()}
    assert models[name]["active_revision"] == "r2"
    actions = [e["action"] for e in admin_client.get("/api/admin/audit?limit=500").json()["items"]]
    assert {"rollout.request", "model.activate", "rollout.complete"} <= set(actions)
    assert admin_client.get("/api/admin/audit/verify").json()["ok"] is True
    again = post(admin_client, f"/api/admin/models/{name}/rollout", {"revision": "r2"})
    assert again.status_code == 409  # already active


def test_streams_during_rollout_finish_on_old_revision_or_get_retryable_error(platform, admin_client, actor,
                                                                                 celery_worker_factory):
    name, tokens = "tiny-roll-b", 700
    _setup(platform, actor, name, (41, 42))
    prompt = "stream across a rollout "
    old = _reference(name, "r1", 41, prompt, tokens)
    new = _reference(name, "r2", 42, prompt, tokens)
    assert old != new
    _complete(platform, name, prompt, 1)  # start the worker
    celery_worker_factory()
    results: list[dict] = []
    started = threading.Barrier(5)

    def stream():
        text, error, first = "", None, True
        with httpx.stream("POST", f"{platform.url}/v1/completions", timeout=120,
                          headers={"Authorization": f"Bearer {platform.keys['acme']}"},
                          json={"model": name, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                                "stream": True}) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]
                    break
                text += event["choices"][0]["text"]
                if first:
                    first = False
                    started.wait(timeout=60)
        results.append({"text": text, "error": error})

    threads = [threading.Thread(target=stream) for _ in range(4)]
    for t in threads:
        t.start()
    started.wait(timeout=60)  # every stream has its first token: all run on r1
    job = _rollout(admin_client, name)
    for t in threads:
        t.join(timeout=120)
    assert job["status"] == "succeeded", job
    assert len(results) == 4
    for r in results:
        if r["error"] is None:
            assert r["text"] == old  # finished entirely on the old revision
        else:
            assert r["error"]["code"] == "revision_changed"
            assert old.startswith(r["text"])  # what arrived before the abort is old-revision output only
    assert _complete(platform, name, prompt, tokens)[0] == new


def test_pages_freed_by_rollout_are_never_read(platform, admin_client, actor, celery_worker_factory):
    from controlplane.registry.models import ModelDeployment
    from controlplane.runtime import gateway

    name = "tiny-roll-c"
    _setup(platform, actor, name, (51, 52))
    prompts = [f"{i} " + PROMPT for i in range(4)]
    for p in prompts:
        _complete(platform, name, p)
    celery_worker_factory()
    job = _rollout(admin_client, name)
    assert job["status"] == "succeeded"
    assert sum(r.get("blocks_freed", 0) for r in job["results"]) > 0
    spec = gateway.spec_for(ModelDeployment.objects.select_related("active_revision").get(name=name))
    assert gateway.call(spec, "poison_free_blocks") > 0  # every page the rollout freed is now NaN
    for p in prompts:
        text, cached = _complete(platform, name, p)
        assert cached == 0
        assert text == _reference(name, "r2", 52, p, 8)  # a NaN page read would change the output
    assert gateway.call(spec, "check_integrity") is True
