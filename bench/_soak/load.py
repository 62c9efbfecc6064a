"""The tenants' traffic during the soak, bounded in count and time, sent only to the stack on
127.0.0.1 (asyncio + httpx), and what each request saw (:class:`Sample`).

Profiles (``bench._soak.fleet.TenantSpec.profile``):

- ``steady``: streamed completions over a few shared document prefixes, every few seconds a greedy
  (``temperature`` 0) whole completion with a unique prompt whose text is kept for the cold re-run,
  and every few requests a stream abandoned after its first chunk;
- ``chat``: multi-turn chat completions (the history grows, then a new conversation starts), streamed;
- ``burst``: quiet, then a burst of concurrent requests above its ``max_concurrent_requests``;
- ``quota``: requests faster than its ``requests_per_minute`` allows (429s with ``Retry-After`` expected);
- ``kv``: KV API lookups of the token lists it stored;
- ``ops``: light completions (its data keys are rotated and shredded by the operators).

A stream's retryable end is an SSE ``error`` event whose type is ``rate_limit_error`` or
``service_unavailable_error`` (``controlplane.common.errors``: the worker's code mapped to 429/503).
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

RETRYABLE_EVENT_TYPES = frozenset({"rate_limit_error", "service_unavailable_error"})
DOCS = [(f"Document {i}: " + f"Strata shares the attention KV of prefix {i} across requests. " * 6) for i in range(3)]


@dataclass
class Sample:
    tenant: str
    profile: str
    kind: str  # stream, chat, complete, greedy, abandon, kv_lookup, kv_store
    model: str
    start: float
    end: float
    status: int | None  # HTTP status; None: no connection or a broken transfer
    retry_after: bool = False
    error: str = ""  # an error code, a stream error event's code, or an exception's class
    stream_error: bool = False  # the stream ended with an error event
    stream_retryable: bool = False
    ttft: float | None = None
    cached_tokens: int | None = None


@dataclass
class Greedy:
    tenant: str
    model: str
    prompt: str
    text: str
    at: float


class Traffic:
    """Sends one tenant's requests and records a :class:`Sample` per request."""

    def __init__(self, url: str, keys: dict[str, str], models: list[str], clock: Callable[[], float],
                 *, max_tokens: int = 8) -> None:
        self.client = httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120, connect=10),
                                         limits=httpx.Limits(max_connections=64))
        self.keys, self.models, self.clock, self.max_tokens = keys, models, clock, max_tokens
        self.samples: list[Sample] = []
        self.greedy: list[Greedy] = []
        self.stored_kv: dict[str, list[int]] = {}  # tenant -> a token list it stored through the KV API

    async def close(self) -> None:
        await self.client.aclose()

    def _headers(self, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}

    def _record(self, sample: Sample) -> Sample:
        sample.end = self.clock()
        self.samples.append(sample)
        return sample

    # ------------------------------------------------------------------ one request
    async def post(self, tenant: str, profile: str, kind: str, path: str, body: dict) -> tuple[Sample, dict | None]:
        """A whole (not streamed) request; its sample and JSON body (None on an error)."""
        s = Sample(tenant, profile, kind, body.get("model", ""), self.clock(), 0.0, None)
        try:
            resp = await self.client.post(path, json=body, headers=self._headers(tenant))
        except httpx.HTTPError as exc:
            s.error = type(exc).__name__
            return self._record(s), None
        s.status, s.retry_after = resp.status_code, "retry-after" in resp.headers
        data = _json(resp)
        if resp.status_code != 200:
            s.error = ((data or {}).get("error") or {}).get("code", "") if isinstance(data, dict) else ""
            return self._record(s), None
        usage = (data or {}).get("usage") or {}
        s.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return self._record(s), data

    async def stream(self, tenant: str, profile: str, kind: str, path: str, body: dict, *,
                     abandon: bool = False) -> Sample:
        """A streamed request; ``abandon``: close it after its first chunk (a client that went away)."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        s = Sample(tenant, profile, kind, body["model"], self.clock(), 0.0, None)
        try:
            async with self.client.stream("POST", path, json=body, headers=self._headers(tenant)) as resp:
                s.status, s.retry_after = resp.status_code, "retry-after" in resp.headers
                if resp.status_code != 200:
                    await resp.aread()
                    s.error = ((_json(resp) or {}).get("error") or {}).get("code", "")
                    return self._record(s)
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        s.stream_error, s.error = True, event["error"].get("code", "")
                        s.stream_retryable = event["error"].get("type") in RETRYABLE_EVENT_TYPES
                        break
                    if event.get("choices") and s.ttft is None:
                        s.ttft = self.clock() - s.start
                        if abandon:
                            break
                    usage = event.get("usage") or {}
                    if usage:
                        s.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        except httpx.HTTPError as exc:
            s.status, s.error = None, type(exc).__name__  # a connection refused or a transfer cut off
        return self._record(s)

    # ------------------------------------------------------------------ profiles
    async def run(self, tenant: str, profile: str, until: float, *, seed: int, pace: float) -> None:
        """``tenant``'s loop until ``until`` (the clock's seconds); ``pace``: seconds between requests."""
        rng = random.Random(seed)
        turn = 0
        history: list[dict] = []
        while self.clock() < until:
            turn += 1
            model = self.models[turn % len(self.models)]
            if profile == "steady":
                await self._steady(tenant, model, rng, turn)
            elif profile == "chat":
                history = await self._chat(tenant, model, history, rng)
            elif profile == "burst":
                if turn % 4 == 0:
                    await asyncio.gather(*(self.stream(tenant, profile, "stream", "/v1/completions",
                                                       self._completion(model, rng.choice(DOCS) + f" burst {i}"))
                                           for i in range(6)))
            elif profile == "quota":
                body = self._completion(model, f"quota {turn}")
                await self.post(tenant, profile, "complete", "/v1/completions", body)
                await asyncio.sleep(pace / 4)
                continue
            elif profile == "kv":
                await self._kv(tenant, self.models[-1])
            else:
                await self.post(tenant, profile, "complete", "/v1/completions",
                                self._completion(model, rng.choice(DOCS) + f" ops {turn}"))
            await asyncio.sleep(pace * (0.5 + rng.random()))

    def _completion(self, model: str, prompt: str, **extra) -> dict:
        return {"model": model, "prompt": prompt, "max_tokens": self.max_tokens, **extra}

    async def _steady(self, tenant: str, model: str, rng: random.Random, turn: int) -> None:
        doc = rng.choice(DOCS)
        if turn % 5 == 0:
            prompt = f"{doc} Greedy question {turn}-{rng.randrange(10**9)}?"
            s, data = await self.post(tenant, "steady", "greedy", "/v1/completions",
                                      self._completion(model, prompt, temperature=0))
            if data is not None:
                self.greedy.append(Greedy(tenant, model, prompt, data["choices"][0]["text"], s.start))
        elif turn % 7 == 0:
            await self.stream(tenant, "steady", "abandon", "/v1/completions",
                              self._completion(model, doc + f" abandoned {turn}", max_tokens=48), abandon=True)
        else:
            await self.stream(tenant, "steady", "stream", "/v1/completions",
                              self._completion(model, doc + f" Question {rng.randrange(50)}?"))

    async def _chat(self, tenant: str, model: str, history: list[dict], rng: random.Random) -> list[dict]:
        if len(history) >= 6 or not history:
            history = [{"role": "system", "content": DOCS[0]}]
        history = [*history, {"role": "user", "content": f"Tell me about item {rng.randrange(100)}."}]
        await self.stream(tenant, "chat", "chat", "/v1/chat/completions",
                          {"model": model, "messages": history, "max_tokens": self.max_tokens})
        return [*history, {"role": "assistant", "content": "noted."}]

    async def _kv(self, tenant: str, model: str) -> None:
        tokens = self.stored_kv.get(f"{tenant}:{model}")
        if tokens is None:
            return
        await self.post(tenant, "kv", "kv_lookup", "/v1/kv/lookup", {"model": model, "tokens": tokens})

    async def kv_store(self, tenant: str, model: str, tokens: list[int]) -> int:
        """Upload KV (random finite values of the layout's shape) for ``tokens``' full blocks; stored blocks."""
        import numpy as np

        resp = await self.client.get("/v1/kv/layout", params={"model": model}, headers=self._headers(tenant))
        layout = resp.json()
        n_blocks = len(tokens) // layout["block_size"]
        kv = np.random.default_rng(len(tokens)).standard_normal((n_blocks, *layout["page_shape"]))
        body = {"model": model, "tokens": tokens,
                "kv": base64.b64encode(kv.astype(layout.get("dtype", "float32")).tobytes()).decode()}
        _, data = await self.post(tenant, "kv", "kv_store", "/v1/kv/store", body)
        self.stored_kv[f"{tenant}:{model}"] = tokens
        return int((data or {}).get("stored_blocks", 0))

    async def kv_hits(self, tenant: str, model: str, tokens: list[int]) -> int | None:
        _, data = await self.post(tenant, "kv", "kv_lookup", "/v1/kv/lookup", {"model": model, "tokens": tokens})
        return None if data is None else int(data.get("hit_tokens", 0))


def _json(resp: httpx.Response):
    try:
        return resp.json()
    except ValueError:
        return None


def monotonic_clock(t0: float | None = None) -> Callable[[], float]:
    """Seconds since ``t0`` (now by default): every sample, fault and job shares this clock."""
    start = time.monotonic() if t0 is None else t0
    return lambda: time.monotonic() - start
