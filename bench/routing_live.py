"""Live routing: 2 or 3 real replicas of one deployment on this machine, Strata's expected-TTFT
routing against round robin, on measured TTFT and the token-weighted hit ratio.

    .venv/bin/python -m bench.routing_live [--quick] [--replicas 2] [--preset tiny] [--trace FILE]

A throwaway platform (``bench._platform``: its own database, local Ray, uvicorn) serves one
deployment scaled to ``--replicas`` (``model_set_replicas``, started and waited for). The trace
(``--trace`` in the Mooncake format, or ``bench.traces.generate_trace``: multi-turn chats over shared
system prompts plus one-off requests) is expanded at ``--scale`` (tokens per hash block = 512 /
scale), prompts cut to the model's context, and replayed over HTTP (streamed completions, prompts as
token ids) with its arrival times compressed into ``--span`` seconds, once per policy:

- ``round_robin``: the policies module's ``RoundRobin``;
- ``strata``: ``ExpectedTTFT`` over the router's prefix index (KV events polled from every replica)
  and the replicas' measured rates and queues, with stickiness and the load guard.

Both run through the same gateway router (only the policy differs), each after every replica's cache
was flushed, so each starts cold. TTFT is measured at the client: request sent to first token chunk.
The hit ratio is the served ``cached_tokens`` over prompt tokens (the usage of the last chunk). The
benchmark checks that its router decided every request with the policy under test and that the
replicas' own lookup counters saw them all (the last column: lookups per replica; a request
re-admitted after a transient refusal counts again).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from bench.traces import expand_trace, generate_trace, read_trace

POLICIES = ("round_robin", "strata")


@dataclass
class Outcome:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    ok: bool


def _p(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


async def _one(client: httpx.AsyncClient, url: str, headers: dict, model: str, tokens: list[int],
               max_tokens: int) -> Outcome:
    body = {"model": model, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, usage = None, None
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return Outcome(time.perf_counter() - t0, len(tokens), 0, False)
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    cached = int(((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return Outcome(ttft if ttft is not None else time.perf_counter() - t0, len(tokens), cached,
                   ttft is not None and usage is not None)


async def replay(url: str, headers: Sequence[dict], model: str, requests, span_s: float,
                 max_tokens: int) -> list[Outcome]:
    """Send every request at its (compressed) arrival time, concurrently; one tenant per session."""
    first, last = requests[0].timestamp, requests[-1].timestamp
    factor = span_s / max(1e-9, (last - first) / 1000.0)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=300) as client:
        async def at(req, i):
            delay = (req.timestamp - first) / 1000.0 * factor - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            return await _one(client, url, headers[i % len(headers)], model, req.tokens,
                              min(max_tokens, max(1, req.output_length)))

        return await asyncio.gather(*(at(r, i) for i, r in enumerate(requests)))


def _tenant_of(requests) -> list[int]:
    """A tenant per request: the first hash id's (a chat and its turns share it; so do chats over one
    system prompt, which may share their cache inside one tenant)."""
    firsts: dict[int, int] = {}
    return [firsts.setdefault(r.hash_ids[0] if r.hash_ids else -1, len(firsts)) for r in requests]


def _row(name: str, outcomes: list[Outcome], split: dict[int, int]) -> dict:
    ttfts = [o.ttft_s for o in outcomes if o.ok]
    prompt = sum(o.prompt_tokens for o in outcomes)
    return {"policy": name, "requests": len(outcomes), "failed": sum(not o.ok for o in outcomes),
            "mean_ms": statistics.fmean(ttfts) * 1e3 if ttfts else 0.0, "p50_ms": _p(ttfts, 0.5) * 1e3,
            "p99_ms": _p(ttfts, 0.99) * 1e3, "hit": sum(o.cached_tokens for o in outcomes) / prompt if prompt else 0.0,
            "split": split}


def _requests_per_replica(model: str) -> dict[int, int]:
    from controlplane.runtime.stats import cluster_stats

    return {w["replica"]: int(w["totals"]["requests"]) for w in cluster_stats(refresh=True)["workers"]
            if w["model"] == model and w["status"] == "ok"}


def run(args) -> list[dict]:
    from bench._platform import throwaway_platform

    raw = read_trace(args.trace) if args.trace else generate_trace(
        sessions=args.sessions, system_prompts=4, turns=(2, 4), one_offs=args.sessions // 2,
        system_blocks=(2, 4), user_tokens=(64, 512), output_tokens=(16, 64), duration_ms=120_000, seed=args.seed)
    with throwaway_platform(preset=args.preset, tenants=max(1, args.tenants), quiet=args.quiet) as p:
        from controlplane.common.actor import Actor
        from controlplane.registry.services import model_set_replicas
        from controlplane.runtime import gateway

        deployment = model_set_replicas(actor=Actor.system("bench"), deployment=p.deployment, replicas=args.replicas)
        spec = gateway.spec_for(deployment)
        gateway.get_worker(spec)  # every replica started and loaded
        info = gateway.call(spec, "info", replica=0)
        requests = expand_trace(raw, scale=args.scale, max_input_tokens=int(info["max_seq_len"]) - args.max_tokens - 1,
                                max_output_tokens=args.max_tokens, vocab=int(info["vocab_size"]) - 4)
        requests = [r for r in requests if r.tokens]
        tenants = _tenant_of(requests)
        headers = [p.headers(t % len(p.keys)) for t in tenants]
        router = gateway.router(spec)
        rows = []
        for name in POLICIES:
            for i in gateway.replica_set(spec).indices():
                gateway.call(spec, "flush", {"scope": "all"}, replica=i)
            time.sleep(1.0)  # the flush's KV events reach the router's index
            router.use(name)
            before, decided = _requests_per_replica(p.model), router.decisions["policy"]
            outcomes = asyncio.run(replay(p.url, [{**h} for h in headers], p.model, requests, args.span,
                                          args.max_tokens))
            after = _requests_per_replica(p.model)
            split = {i: after.get(i, 0) - before.get(i, 0) for i in sorted(after)}
            served = sum(split.values())
            # The instrumentation saw this phase: every request routed by the policy, counted by a replica.
            assert router.decisions["policy"] - decided >= len(requests) - sum(not o.ok for o in outcomes), (
                "the router did not decide the requests with the policy under test")
            assert served >= len(requests), f"the replicas counted {served} lookups for {len(requests)} requests"
            rows.append(_row(name, outcomes, split))
        return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Strata routing vs round robin on real replicas")
    ap.add_argument("--quick", action="store_true", help="a short trace (under a minute on 2 cores)")
    ap.add_argument("--replicas", type=int, default=2, choices=(2, 3))
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--trace", default=None, help="a Mooncake-format trace (default: the generator)")
    ap.add_argument("--scale", type=int, default=16, help="512 / scale tokens per hash block")
    ap.add_argument("--sessions", type=int, default=None)
    ap.add_argument("--span", type=float, default=None, help="seconds the trace's arrivals are compressed into")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--tenants", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    args.sessions = args.sessions or (8 if args.quick else 24)
    args.span = args.span or (8.0 if args.quick else 30.0)
    rows = run(args)
    print(f"\nlive routing: {args.replicas} replicas of preset {args.preset}, {rows[0]['requests']} requests "
          f"over {args.span:.0f} s (scale {args.scale})")
    print(f"{'policy':<12} {'requests':>8} {'failed':>6} {'mean ms':>9} {'p50 ms':>8} {'p99 ms':>8} {'hit':>6}  "
          "lookups per replica")
    for r in rows:
        split = "/".join(str(r["split"][i]) for i in sorted(r["split"]))
        print(f"{r['policy']:<12} {r['requests']:>8} {r['failed']:>6} {r['mean_ms']:>9.1f} {r['p50_ms']:>8.1f} "
              f"{r['p99_ms']:>8.1f} {r['hit']:>6.3f}  {split}")
    rr, st = rows
    print(f"RESULT replicas={args.replicas} rr_mean_ttft_ms={rr['mean_ms']:.1f} "
          f"strata_mean_ttft_ms={st['mean_ms']:.1f} rr_p99_ttft_ms={rr['p99_ms']:.1f} "
          f"strata_p99_ttft_ms={st['p99_ms']:.1f} rr_hit={rr['hit']:.3f} strata_hit={st['hit']:.3f} "
          f"failed={rr['failed'] + st['failed']}")


if __name__ == "__main__":
    main()
