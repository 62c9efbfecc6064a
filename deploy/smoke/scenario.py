"""The tenant's and the operator's side of ``deploy/smoke-compose``, one phase per call, against a
running compose deployment over HTTP: the admin API with an operator token, the serving API through
the official ``openai`` client. It runs in the image itself (``python deploy/smoke/scenario.py``),
so the machine running the smoke test needs nothing but podman.

Phases (``--phase``), each printing one ``ok`` line per check with its figures, or raising:

- ``setup``: tenant ``smoke`` (default cache policy: persist in L3), an API key, deployment
  ``smoke-vllm`` on engine ``vllm`` from the checkpoint path, two replicas (one per Ray worker node),
  the grant; then waits until a completion is served. Writes the API key to ``--state``.
- ``serve``: a completion, a streamed chat, and the completion again: the second is served from the
  cache (``cached_tokens`` > 0) with the same greedy text.
- ``flush``: a tenant flush job, succeeded and verified (the script checks L3 is empty after it).
- ``rewrite``: the same prompt finds nothing cached (the flush reached every replica), and writes
  the prefix again (L1, L2 and L3).
- ``l3``: after every container was restarted (empty L1 and L2), the same prompt is served with
  ``cached_tokens_by_tier.l3`` > 0: read back from Redis, decrypted with the tenant's data key,
  which the restarted processes unwrapped with the master key from the mounted secret.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx
from openai import OpenAI

TENANT, MODEL = "smoke", "smoke-vllm"
# 1,059 tokens with the test checkpoints' small byte-level tokenizer (context 2,048): four whole L3
# chunks (256 tokens each), 33 of vLLM's CPU blocks (32 tokens).
DOCUMENT = " ".join(
    f"Section {i}: a cache keeps the attention keys and values of prompts that many requests share; "
    f"tenants never read, probe or evict each other's entries (clause {i * 7 % 13})."
    for i in range(11))
GREEDY = {"temperature": 0.0, "seed": 7}


def say(step: str, started: float, **figures) -> None:
    shown = " ".join(f"{k}={v}" for k, v in figures.items())
    print(f"  ok  {step:<44} {time.monotonic() - started:7.2f} s  {shown}", flush=True)


class Admin:
    """The admin API with an operator token; every call must succeed (raises with the body)."""

    def __init__(self, url: str, token: str) -> None:
        self.http = httpx.Client(base_url=f"{url}/api/admin/", timeout=120,
                                 headers={"Authorization": f"Bearer {token}"})

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        response = self.http.request(method, path, json=body)
        if response.status_code >= 300:
            raise RuntimeError(f"{method} {path}: {response.status_code} {response.text}")
        return response.json() if response.content else {}


def client(url: str, key: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key=key, timeout=300, max_retries=0)


def complete(openai: OpenAI, prompt: str = DOCUMENT, max_tokens: int = 8):
    return openai.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, **GREEDY)


def details(usage) -> dict:
    """``prompt_tokens_details`` as a dict (Strata adds ``cache_write_tokens`` and the per-tier split)."""
    raw = usage.prompt_tokens_details
    return raw.model_dump() if hasattr(raw, "model_dump") else dict(raw or {})


def setup(admin: Admin, url: str, checkpoint: str, state: Path, timeout: float) -> None:
    t = time.monotonic()
    admin.call("POST", "tenants", {"slug": TENANT, "name": "Smoke test"})
    key = admin.call("POST", f"tenants/{TENANT}/keys")["key"]
    say("tenant and API key", t, tenant=TENANT)

    t = time.monotonic()
    model = admin.call("POST", "models", {"name": MODEL, "engine": "vllm", "replicas": 2,
                                          "revision": {"label": "r1", "path": checkpoint}})
    admin.call("POST", f"tenants/{TENANT}/grants", {"model": MODEL})
    assert model["engine"] == "vllm" and model["replicas"] == 2, model
    say("vLLM checkpoint deployment, 2 replicas", t, engine=model["engine"], path=checkpoint)

    t = time.monotonic()
    openai, deadline, last = client(url, key), time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            complete(openai, "warm up", max_tokens=1)
            break
        except Exception as exc:  # replicas starting: 503 with Retry-After, then served
            last = exc
            time.sleep(5)
    else:
        raise RuntimeError(f"no completion within {timeout:.0f} s: {last}")
    while True:  # the other replica too (its engine starts in parallel), as the admin API reports it
        workers = [w for w in admin.call("GET", "stats")["workers"] if w["model"] == MODEL]
        if len(workers) == 2 and all(w["status"] == "ok" for w in workers):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"both replicas not up within {timeout:.0f} s: {workers}")
        time.sleep(3)
    say("both replicas serving (vLLM engines started)", t, replicas=[w["name"] for w in workers])
    state.write_text(json.dumps({"key": key}))


def serve(url: str, key: str) -> None:
    openai = client(url, key)
    t = time.monotonic()
    first = complete(openai)
    got = details(first.usage)
    assert first.usage.prompt_tokens >= 512, first.usage
    say("completion", t, prompt_tokens=first.usage.prompt_tokens, cached_tokens=got.get("cached_tokens"),
        text=repr(first.choices[0].text))

    t = time.monotonic()
    chunks, text, usage = 0, "", None
    stream = openai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": DOCUMENT[:400]}], max_tokens=8, stream=True,
        stream_options={"include_usage": True}, **GREEDY)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            chunks += 1
            text += chunk.choices[0].delta.content
        usage = chunk.usage or usage
    assert chunks >= 1 and usage is not None and usage.completion_tokens >= 1, (chunks, usage)
    say("streamed chat", t, chunks=chunks, completion_tokens=usage.completion_tokens)

    t = time.monotonic()
    second = complete(openai)
    got = details(second.usage)
    assert got["cached_tokens"] > 0, got
    assert second.choices[0].text == first.choices[0].text  # greedy: the cache changes no token
    say("cached second request", t, cached_tokens=got["cached_tokens"], by_tier=got.get("cached_tokens_by_tier"))


def flush(admin: Admin, timeout: float) -> None:
    t = time.monotonic()
    job = admin.call("POST", "flush-jobs", {"scope": "tenant", "tenant": TENANT, "reason": "smoke test"})
    deadline = time.monotonic() + timeout
    while (job := admin.call("GET", f"flush-jobs/{job['id']}"))["status"] not in ("succeeded", "partial", "failed"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"flush job not done within {timeout:.0f} s: {job}")
        time.sleep(1)
    assert job["status"] == "succeeded" and job.get("verified"), job
    say("flush job", t, job=job["id"], status=job["status"], verified=bool(job.get("verified")))


def rewrite(url: str, key: str) -> None:
    t = time.monotonic()
    after = complete(client(url, key))
    got = details(after.usage)
    assert got["cached_tokens"] == 0, got  # the flush reached the replica that holds the prefix
    say("after the flush: nothing cached, prefix written again", t, cached_tokens=got["cached_tokens"],
        cache_write_tokens=got.get("cache_write_tokens"))


def l3(url: str, key: str, timeout: float) -> None:
    t = time.monotonic()
    openai, deadline, last = client(url, key), time.monotonic() + timeout, None
    while True:
        try:
            response = complete(openai)
            break
        except Exception as exc:  # the replicas start again after the restart
            last = exc
            if time.monotonic() > deadline:
                raise RuntimeError(f"no completion within {timeout:.0f} s of the restart: {last}") from exc
            time.sleep(5)
    got = details(response.usage)
    by_tier = got.get("cached_tokens_by_tier") or {}
    assert by_tier.get("l3", 0) > 0, got  # L1 and L2 started empty: these came from Redis
    say("after the restart: L3 hit", t, cached_tokens=got["cached_tokens"], by_tier=by_tier)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", required=True, choices=["setup", "serve", "flush", "rewrite", "l3"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--token", help="operator token (setup, flush)")
    parser.add_argument("--checkpoint", help="the checkpoint's path in the containers (setup)")
    parser.add_argument("--state", type=Path, required=True, help="JSON file holding the tenant's API key")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    if args.phase == "setup":
        setup(Admin(args.url, args.token), args.url, args.checkpoint, args.state, args.timeout)
        return
    key = json.loads(args.state.read_text())["key"]
    if args.phase == "serve":
        serve(args.url, key)
    elif args.phase == "flush":
        flush(Admin(args.url, args.token), args.timeout)
    elif args.phase == "rewrite":
        rewrite(args.url, key)
    else:
        l3(args.url, key, args.timeout)


if __name__ == "__main__":
    main()
