"""Can one tenant tell, by timing, that another tenant sent a prompt? (the audit of Gu et al.)

    .venv/bin/python -m bench.timing_audit [--quick] [--preset small] [--tokens 384] [--pairs 100]

The statistical audit of "Auditing Prompt Caching in Language Model APIs" (Gu et al., 2025,
arXiv 2502.07776), run against a throwaway platform (``bench._platform``: SQLite, local Ray, uvicorn,
the ``small`` model by default) through the public HTTP API with streaming:

- cross-tenant: a victim tenant sends a fresh random prompt (warming the cache if the cache were
  shared); the attacker tenant then times that same prompt (the "hit" set) and another fresh random
  prompt nobody sent (the "miss" set), in random order. A one-sided two-sample Kolmogorov-Smirnov test
  (``scipy.stats.ks_2samp(hit, miss, alternative="greater")``: the alternative is "the hit set's CDF
  lies above the miss set's", i.e. victim-warmed prompts come back faster) must find NO difference:
  p > 0.01.
- within-tenant (the control that proves the test can see a hit): the attacker itself warms a prompt,
  then times it and a fresh one, in random order. The same test must find the difference: p < 0.01.

The timed quantity is TTFT: from sending ``POST /v1/completions`` (``stream: true``, ``max_tokens``
1, temperature 0) to the first server-sent event that carries the token, measured by the client on a
keep-alive connection. Every prompt is used once (fresh random byte tokens), so no timed request ever
reuses anything but what its pair's warm-up put there. Each pair has exactly one untimed warm-up
request before its two timed ones, in both settings, so the load before a "hit" and a "miss" sample is
the same. Cross- and within-tenant pairs are interleaved in random order, so drifts of this noisy
machine fall on both alike. The cached-token counts the API reports are shown as a cross-check;
the test itself uses only time, as an outside attacker would.

Sizes: 100 hit + 100 miss samples per setting, 384-token prompts on ``small`` (a miss prefills for
about 0.3 s on 2 cores, a hit recomputes one block: roughly 8x faster, so a shared cache could not
hide). A pair costs three full prefills across tenants and two within, 500 in all: about three
minutes. ``--quick``: 20 pairs of 256-token prompts (the within-tenant control still separates
completely; the cross-tenant test has less power, which the output says).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import httpx
from scipy.stats import ks_2samp

ALPHA = 0.01


def ttft(client: httpx.Client, headers: dict, body: dict) -> tuple[float, int]:
    """Seconds until the first token event of a streamed completion, and the reported cached tokens."""
    t0 = time.perf_counter()
    first = None
    cached = -1
    with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            if first is None and event.get("choices") and event["choices"][0]["finish_reason"] is None:
                first = time.perf_counter() - t0
            if event.get("usage"):
                cached = event["usage"]["prompt_tokens_details"]["cached_tokens"]
    if first is None:
        raise RuntimeError("the stream carried no token")
    return first, cached


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Prompt-cache timing audit across and within tenants (Gu et al.)")
    ap.add_argument("--quick", action="store_true", help="fewer, shorter prompts (under a minute)")
    ap.add_argument("--preset", default="small", choices=["tiny", "small"])
    ap.add_argument("--tokens", type=int, default=None, help="prompt length in tokens (384; quick 256)")
    ap.add_argument("--pairs", type=int, default=None, help="hit/miss sample pairs per setting (100; quick 20)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    n_tokens = args.tokens or (256 if args.quick else 384)
    pairs = args.pairs or (20 if args.quick else 100)
    rng = random.Random(args.seed)
    t_start = time.perf_counter()

    from bench._platform import throwaway_platform

    with throwaway_platform(preset=args.preset, tenants=2, model="audit-model") as p:
        victim, attacker = p.headers(0), p.headers(1)

        def body() -> dict:
            return {"model": p.model, "prompt": [rng.randrange(256) for _ in range(n_tokens)], "max_tokens": 1,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}

        # One trial = one untimed warm-up request, then the two timed requests in random order.
        trials = [kind for kind in ("cross", "within") for _ in range(pairs)]
        rng.shuffle(trials)
        samples: dict[str, dict[str, list[float]]] = {k: {"hit": [], "miss": []} for k in ("cross", "within")}
        cached: dict[str, dict[str, list[int]]] = {k: {"hit": [], "miss": []} for k in ("cross", "within")}
        with httpx.Client(base_url=p.url, timeout=300) as client:
            for _ in range(3):  # warm the paths (model, allocator, connections); not recorded
                warm = body()
                ttft(client, attacker, warm)
                ttft(client, attacker, warm)
                ttft(client, victim, body())
            t_loop = time.perf_counter()
            for i, kind in enumerate(trials):
                target, fresh = body(), body()
                ttft(client, victim if kind == "cross" else attacker, target)  # the warm-up
                order = ["hit", "miss"]
                rng.shuffle(order)
                for which in order:
                    t, c = ttft(client, attacker, target if which == "hit" else fresh)
                    samples[kind][which].append(t)
                    cached[kind][which].append(c)
                if (i + 1) % 50 == 0:
                    print(f"  {i + 1}/{len(trials)} trials, {time.perf_counter() - t_loop:.0f} s", flush=True)
            t_loop = time.perf_counter() - t_loop
    # The cached-token cross-check must have seen every timed answer's usage (-1: none came).
    blind = sum(c < 0 for kind in cached.values() for values in kind.values() for c in values)
    if blind:
        raise SystemExit(f"{blind} timed answers carried no usage: the cached-token cross-check saw nothing of them")

    # ------------------------------------------------------------------ report
    def test(kind: str) -> tuple[float, float]:
        res = ks_2samp(samples[kind]["hit"], samples[kind]["miss"], alternative="greater")
        return float(res.statistic), float(res.pvalue)

    def med_ms(kind: str, which: str) -> float:
        return statistics.median(samples[kind]["hit" if which == "hit" else "miss"]) * 1000

    d_cross, p_cross = test("cross")
    d_within, p_within = test("within")
    cross_ok = p_cross > ALPHA
    within_ok = p_within < ALPHA
    leaked = sum(1 for c in cached["cross"]["hit"] if c > 0)

    print()
    print(f"Prompt-cache timing audit (Gu et al. 2025): preset {args.preset}, {n_tokens}-token fresh random prompts, "
          f"TTFT over HTTP streaming, {pairs} hit + {pairs} miss samples per setting"
          + (" [quick: fewer samples and shorter prompts than the full run]" if args.quick else ""))
    print(f"one-sided two-sample KS test, H1: hit-set TTFT stochastically smaller; alpha = {ALPHA}")
    header = (f"{'setting':<44} {'n hit':>5} {'n miss':>6} {'hit ms':>8} {'miss ms':>8} {'KS D':>6} "
              f"{'p-value':>9} {'cached (hit)':>12}  verdict")
    print(header)
    rows = [
        ("cross-tenant: victim warms, attacker times", "cross", cross_ok,
         "no difference (PASS)" if cross_ok else "DIFFERENCE: timing leak (FAIL)"),
        ("within-tenant: attacker warms its own", "within", within_ok,
         "hit detected (PASS)" if within_ok else "no difference: test blind (FAIL)"),
    ]
    for label, kind, _, verdict in rows:
        d, pv = (d_cross, p_cross) if kind == "cross" else (d_within, p_within)
        mean_cached = statistics.mean(cached[kind]["hit"])
        print(f"{label:<44} {len(samples[kind]['hit']):>5} {len(samples[kind]['miss']):>6} "
              f"{med_ms(kind, 'hit'):8.1f} {med_ms(kind, 'miss'):8.1f} {d:6.3f} {pv:9.2e} {mean_cached:12.0f}  "
              f"{verdict}")
    print(f"cross-tenant hit-set answers reporting cached tokens > 0: {leaked} of {len(cached['cross']['hit'])}")
    print(f"within-tenant speed-up of a hit (median miss / median hit): "
          f"{med_ms('within', 'miss') / med_ms('within', 'hit'):.1f}x; "
          f"{len(trials)} trials in {t_loop:.0f} s, total {time.perf_counter() - t_start:.0f} s")
    print(f"RESULT cross_tenant_p={p_cross:.3g} within_tenant_p={p_within:.3g} "
          f"cross_median_hit_ms={med_ms('cross', 'hit'):.1f} cross_median_miss_ms={med_ms('cross', 'miss'):.1f} "
          f"within_median_hit_ms={med_ms('within', 'hit'):.1f} within_median_miss_ms={med_ms('within', 'miss'):.1f} "
          f"cross_ks_d={d_cross:.3f} within_ks_d={d_within:.3f} samples_per_set={pairs} prompt_tokens={n_tokens} "
          f"cross_pass={int(cross_ok)} within_pass={int(within_ok)} cross_cached_leaks={leaked}")


if __name__ == "__main__":
    main()
