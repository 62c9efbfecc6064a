"""The tier hierarchy: what L2 (host memory) under L1 buys, and whether load-vs-recompute decides well.

    .venv/bin/python -m bench.tiers [--quick] [--trace FILE] [--scale 16] [--preset small] [--tokens 2048]

Three questions, one run:

1. **TTFT by tier** (``--preset``, default ``small``): a ``--tokens``-token prompt served from L1, from
   L2 (after other traffic evicted it from L1), and recomputed (caching off). Goal: from L2 at most
   0.2x of recompute.
2. **Working-set replay** (``tiny`` model): a trace in the Mooncake FAST'25 format (``--trace FILE``;
   by default one written by ``bench.traces.generate_trace``: shared system prompts, multi-turn
   sessions, one-off requests) expanded to token ids at ``1/--scale`` of its lengths and replayed one
   request at a time through the real model. L1 holds one eighth of the trace's working set (plus
   room for the running request); L2 holds the whole working set. Token-weighted effective hit
   ratio (prefill tokens actually skipped / prompt tokens) with L1 only and with L1+L2, against the
   infinite-cache bound and Belady's offline optimum at the same total capacity, computed from the
   same trace (``bench.traces.BlockTrace``). Goal: L1+L2 >= 90% of the infinite-cache bound.
3. **Load vs recompute** on the same replay (L1+L2): mean TTFT with the cost policy against the two
   fixed baselines ``always_load`` and ``always_recompute``. Goal: never worse than either.
4. **L3** (the encrypted remote tier): TTFT of the same prompt served from L3 on the filesystem and on
   Redis (a redis-server this benchmark starts on a free port) by a fresh engine sharing the store (a
   restart), against recompute (goal at most 0.3x); L3 throughput, the Redis backend against raw
   redis-py SET/GET of the same frame sizes (goal at least 80%) and the filesystem backend against
   AES-256-GCM alone on the same frames (goal at least 60%); and the replay with L1+L2+L3, L3 holding
   the working set and L1+L2 one eighth of it (goal at least 95% of the infinite-cache bound).

Each replay asserts that its engine saw every request (its query-token counter equals the trace's
prompt tokens), so a figure never comes from a path the server no longer takes.
"""

from __future__ import annotations

import argparse
import random
import secrets
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench import _l3, traces
from cachecore.config import EngineConfig
from cachecore.engine import CacheEngine
from cachecore.model.loader import RevisionSpec, load_model
from cachecore.runner import Generator, SamplingParams, TokenOut
from cachecore.tiers.remote import DEFAULT_CHUNK_BLOCKS

BS = 16


def _ttft(gen: Generator, ns, tokens: list[int], *, owner: str = "bench", use_cache: bool = True) -> tuple[float, int]:
    start = time.perf_counter()
    cached = 0
    for ev in gen.stream(ns, tokens, owner=owner, params=SamplingParams(max_tokens=1), use_cache=use_cache):
        if isinstance(ev, TokenOut):
            return time.perf_counter() - start, cached
        cached = getattr(ev, "cached_tokens", cached)
    raise RuntimeError("no token produced")


def ttft_by_tier(preset: str, n_tokens: int, reps: int) -> dict:
    loaded = load_model("bench-tiers", preset, RevisionSpec(label="r1", seed=7))
    blocks = n_tokens // BS + 2
    # L1 fits one prompt (plus the filler's room); L2 holds several.
    engine = CacheEngine(loaded.layout, num_blocks=blocks + 2, device=loaded.model.device,
                         config=EngineConfig(l2_blocks=4 * blocks, load_policy="always_load"))
    gen = Generator(loaded.model, engine, loaded.tokenizer, model_name="bench-tiers", revision="r1")
    ns = loaded.namespace(secrets.token_bytes(32))
    rng = random.Random(0)

    def prompt() -> list[int]:
        return [rng.randrange(256) for _ in range(n_tokens)]

    _ttft(gen, ns, prompt(), use_cache=False)  # warm-up
    rows: dict[str, list[float]] = {"recompute": [], "l1": [], "l2": []}
    cached: dict[str, int] = {}
    for _ in range(reps):
        target = prompt()
        t, c = _ttft(gen, ns, target, use_cache=False)
        rows["recompute"].append(t)
        cached["recompute"] = c
        _ttft(gen, ns, target)  # computes and caches it in L1
        t, c = _ttft(gen, ns, target)
        rows["l1"].append(t)
        cached["l1"] = c
        _ttft(gen, ns, prompt())  # other traffic: evicts the target from L1 (written back to L2)
        t, c = _ttft(gen, ns, target)
        rows["l2"].append(t)
        cached["l2"] = c
    engine.check_integrity()
    if engine.metrics.tier("l2").promotions == 0:
        raise SystemExit("the L2 row never loaded from L2: nothing measured")
    return {"rows": {k: statistics.median(v) for k, v in rows.items()}, "cached": cached,
            "device": str(engine.pages.device), "preset": preset, "tokens": n_tokens, "reps": reps}


def ttft_from_l3(preset: str, n_tokens: int, reps: int, url: str) -> tuple[float, int]:
    """Median TTFT of a prompt served from L3 by a fresh engine (empty L1, no L2) sharing the store
    with the engine that computed it: what a restart or another worker sees."""
    loaded = load_model("bench-tiers", preset, RevisionSpec(label="r1", seed=7))
    ring = _l3.keyring()
    blocks = n_tokens // BS + 2
    ns = loaded.namespace(secrets.token_bytes(32))
    rng = random.Random(1)
    times, cached = [], 0

    def gen_on(store) -> Generator:
        engine = CacheEngine(loaded.layout, num_blocks=blocks + 2, device=loaded.model.device,
                             config=EngineConfig(load_policy="always_load", load_deadline_s=30.0), l3=store)
        return Generator(loaded.model, engine, loaded.tokenizer, model_name="bench-tiers", revision="r1")

    for _ in range(reps + 1):
        target = [rng.randrange(256) for _ in range(n_tokens)]
        writer = gen_on(_l3.store(url, loaded.layout, ring))
        _ttft(writer, ns, target)
        writer.engine.drain_writes()
        reader = gen_on(_l3.store(url, loaded.layout, ring))
        t, c = _ttft(reader, ns, target)
        times.append(t)
        cached = c
        if reader.engine.metrics.tier("l3").promotions == 0:
            raise SystemExit(f"the L3 row ({url.split(':')[0]}) never loaded from L3: nothing measured")
    return statistics.median(times[1:]), cached  # the first round warms the backend


def replay(prompts: list[list[int]], loaded, *, l1_blocks: int, l2_blocks: int, load_policy: str = "cost",
           l3_url: str | None = None, chunk_blocks: int = 16) -> dict:
    l3 = _l3.store(l3_url, loaded.layout, _l3.keyring(), chunk_blocks=chunk_blocks) if l3_url else None
    engine = CacheEngine(loaded.layout, num_blocks=l1_blocks, device="cpu",
                         config=EngineConfig(l2_blocks=l2_blocks, load_policy=load_policy), l3=l3)
    gen = Generator(loaded.model, engine, loaded.tokenizer, model_name="replay", revision="r1")
    ns = loaded.namespace(b"\x01" * 32)
    ttfts = []
    skipped = 0
    for tokens in prompts:
        t, c = _ttft(gen, ns, tokens)
        ttfts.append(t)
        skipped += c
        if l3 is not None:
            engine.drain_writes()  # requests arrive seconds apart in the trace: their writes have landed
    engine.check_integrity()
    total = sum(len(p) for p in prompts)
    usage = engine.metrics.usage("bench", "replay")
    if usage.query_tokens != total or usage.requests != len(prompts):
        raise SystemExit("the replay's engine did not see every request: nothing measured")
    l2 = engine.metrics.tier("l2")
    if l3 is not None:
        shutil.rmtree(l3_url.removeprefix("file://"), ignore_errors=True)
    return {"ratio": skipped / total, "mean_ttft": statistics.fmean(ttfts), "p50_ttft": statistics.median(ttfts),
            "promotions": l2.promotions, "demotions": l2.demotions, "decisions": dict(engine.cost.decisions),
            "skipped": skipped}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="what the tier hierarchy buys")
    ap.add_argument("--quick", action="store_true", help="tiny model and a short trace (under a minute)")
    ap.add_argument("--trace", default=None, help="Mooncake FAST'25 trace file (default: a generated one)")
    ap.add_argument("--scale", type=int, default=16, help="scale lengths down by this factor (divides 512)")
    ap.add_argument("--preset", default=None, help="model of the TTFT table (default small; tiny with --quick)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=None)
    args = ap.parse_args(argv)
    preset = args.preset or ("tiny" if args.quick else "small")
    reps = args.reps or (2 if args.quick else 3)
    torch.manual_seed(0)

    t = ttft_by_tier(preset, min(args.tokens, 1000) if preset == "tiny" else args.tokens, reps)
    rec = t["rows"]["recompute"]
    print(f"TTFT of a {t['tokens']}-token prompt, preset {t['preset']}, device {t['device']}, "
          f"median of {t['reps']}")
    print(f"{'served from':<12} {'cached tok':>10} {'TTFT ms':>9} {'vs recompute':>13}")
    for name in ("recompute", "l1", "l2"):
        print(f"{name:<12} {t['cached'][name]:>10} {t['rows'][name] * 1e3:>9.1f} {t['rows'][name] / rec:>13.3f}")
    l2_ratio = t["rows"]["l2"] / rec

    if args.trace:
        reqs = traces.read_trace(args.trace)
        source = args.trace
    else:
        reqs = traces.generate_trace(sessions=12 if args.quick else 32, one_offs=6 if args.quick else 16, seed=0)
        source = "generated (bench.traces.generate_trace)"
    expanded = traces.expand_trace(reqs, scale=args.scale, max_input_tokens=1008, max_output_tokens=16)
    prompts = [r.tokens for r in expanded]
    bt = traces.BlockTrace.from_prompts(prompts, block_size=BS)
    working = bt.unique_blocks
    longest = max(-(-len(p) // BS) for p in prompts) + 1
    l1_cache = max(1, working // 8)
    l1_blocks = l1_cache + longest  # room for the running request on top of the cache's share
    infinite = bt.infinite().ratio
    belady_l1 = bt.belady(l1_cache).ratio
    belady_l12 = bt.belady(l1_cache + working).ratio
    loaded = load_model("replay", "tiny", RevisionSpec(label="r1", seed=3))
    replay(prompts[: len(prompts) // 4], loaded, l1_blocks=l1_blocks, l2_blocks=working)  # warm-up (discarded)
    rounds = 1 if args.quick else 2

    def best_of(**kw) -> dict:
        # The hit ratio is deterministic; TTFT is noisy on a shared machine: keep the round with the
        # lower mean, and run the configurations interleaved (below) so load drifts hit them alike.
        runs = [replay(prompts, loaded, l1_blocks=l1_blocks, **kw) for _ in range(rounds)]
        return min(runs, key=lambda r: r["mean_ttft"])

    only_l1 = best_of(l2_blocks=0)
    both = {p: best_of(l2_blocks=working, load_policy=p) for p in ("cost", "always_load", "always_recompute")}
    cost = both["cost"]
    capacity = both["always_load"]  # the capacity question: every L2 hit used
    print()
    print(f"replay of {len(prompts)} requests ({bt.query_tokens} prompt tokens, working set {working} blocks) "
          f"from {source}, scale 1/{args.scale}, tiny model; L1 {l1_cache}+{longest} blocks, L2 {working}")
    print(f"{'configuration':<28} {'eff. hit':>9} {'vs infinite':>12} {'vs Belady':>10} {'mean TTFT ms':>13} "
          f"{'promoted':>9}")
    print(f"{'infinite cache (bound)':<28} {infinite:>9.3f} {1.0:>12.3f} {'':>10} {'':>13} {'':>9}")
    print(f"{'Belady @ L1':<28} {belady_l1:>9.3f} {belady_l1 / infinite:>12.3f} {'':>10} {'':>13} {'':>9}")
    print(f"{'Belady @ L1+L2':<28} {belady_l12:>9.3f} {belady_l12 / infinite:>12.3f} {'':>10} {'':>13} {'':>9}")
    print(f"{'L1 only':<28} {only_l1['ratio']:>9.3f} {only_l1['ratio'] / infinite:>12.3f} "
          f"{only_l1['ratio'] / belady_l1:>10.3f} {only_l1['mean_ttft'] * 1e3:>13.2f} {0:>9}")
    for name, r in both.items():
        print(f"{'L1+L2, ' + name:<28} {r['ratio']:>9.3f} {r['ratio'] / infinite:>12.3f} "
              f"{r['ratio'] / belady_l12:>10.3f} {r['mean_ttft'] * 1e3:>13.2f} {r['promotions']:>9}")
    best_fixed = min(both["always_load"]["mean_ttft"], both["always_recompute"]["mean_ttft"])
    cost_vs_best = cost["mean_ttft"] / best_fixed
    print(f"cost policy decisions {cost['decisions']}; mean TTFT {cost_vs_best:.3f}x of the better fixed policy "
          f"(goal <= 1.0); L2 TTFT {l2_ratio:.3f}x of recompute (goal <= 0.2); L1+L2 (every L2 hit loaded) "
          f"{capacity['ratio'] / infinite:.3f} of the infinite bound (goal >= 0.9)")
    # ---------------------------------------------------------------- 4. L3
    l3_rows: dict[str, tuple[float, int]] = {}
    with _l3.redis_server() as redis_url:
        fs_root = Path(tempfile.mkdtemp(prefix="strata-bench-l3-"))
        l3_rows["l3 filesystem"] = ttft_from_l3(t["preset"], t["tokens"], reps, fs_root.as_uri())
        shutil.rmtree(fs_root, ignore_errors=True)
        if redis_url is not None:
            l3_rows["l3 redis"] = ttft_from_l3(t["preset"], t["tokens"], reps, redis_url)
        tput = _l3.throughput(loaded.layout if preset == "tiny" else load_model(
            "bench-tiers", preset, RevisionSpec(label="r1", seed=7)).layout, redis_url,
            chunks=8 if args.quick else 24, rounds=3)
    print()
    print(f"TTFT served from L3 by a fresh engine sharing the store (a restart), {t['tokens']} tokens, "
          f"preset {t['preset']}")
    print(f"{'served from':<14} {'cached tok':>10} {'TTFT ms':>9} {'vs recompute':>13}")
    for name, (secs, cached) in l3_rows.items():
        print(f"{name:<14} {cached:>10} {secs * 1e3:>9.1f} {secs / rec:>13.3f}")
    print()
    print("L3 throughput (GB/s of KV, median of 3 rounds)")
    for name, gbps in tput.items():
        print(f"{name:<26} {gbps:>8.3f}")
    redis_ratio = (min(tput["redis put (encrypted)"] / tput["redis-py SET raw"],
                       tput["redis get (decrypted)"] / tput["redis-py GET raw"]) if redis_url else 0.0)
    # The filesystem goal is about reads from the page cache (writes pay an fsync per object, by design).
    fs_ratio = tput["fs get (decrypted)"] / tput["AES-256-GCM open alone"]
    l3_dir = Path(tempfile.mkdtemp(prefix="strata-bench-replay-"))
    small = max(1, working // 16)
    # The L3 chunk scales with the trace: 256 tokens at full scale are 256/scale tokens here.
    chunk_blocks = max(1, DEFAULT_CHUNK_BLOCKS * BS // args.scale // BS)
    tiered = replay(prompts, loaded, l1_blocks=small + longest, l2_blocks=small, load_policy="always_load",
                    l3_url=l3_dir.as_uri(), chunk_blocks=chunk_blocks)
    print()
    print(f"replay with L1 {small}+{longest} + L2 {small} blocks (one eighth of the working set) + L3 (the "
          f"working set, chunks of {chunk_blocks} block(s) = 256 tokens scaled 1/{args.scale}): effective hit "
          f"{tiered['ratio']:.3f} = "
          f"{tiered['ratio'] / infinite:.3f} of the infinite bound (goal >= 0.95)")
    worst_l3 = max((v[0] / rec for v in l3_rows.values()), default=0.0)
    print(f"RESULT ttft_recompute_ms={rec * 1e3:.1f} ttft_l1_ms={t['rows']['l1'] * 1e3:.1f} "
          f"ttft_l2_ms={t['rows']['l2'] * 1e3:.1f} l2_vs_recompute={l2_ratio:.3f} "
          f"hit_l1_only={only_l1['ratio']:.3f} hit_l1_l2={capacity['ratio']:.3f} hit_l1_l2_cost={cost['ratio']:.3f} "
          f"infinite={infinite:.3f} belady_l1={belady_l1:.3f} belady_l1_l2={belady_l12:.3f} "
          f"l1_l2_vs_infinite={capacity['ratio'] / infinite:.3f} "
          f"mean_ttft_cost_ms={cost['mean_ttft'] * 1e3:.2f} "
          f"mean_ttft_always_load_ms={both['always_load']['mean_ttft'] * 1e3:.2f} "
          f"mean_ttft_always_recompute_ms={both['always_recompute']['mean_ttft'] * 1e3:.2f} "
          f"cost_vs_best_fixed={cost_vs_best:.3f} goal_l2={int(l2_ratio <= 0.2)} "
          f"goal_hit={int(capacity['ratio'] / infinite >= 0.9)} goal_policy={int(cost_vs_best <= 1.0)} "
          f"ttft_l3_fs_ms={l3_rows['l3 filesystem'][0] * 1e3:.1f} "
          f"ttft_l3_redis_ms={l3_rows.get('l3 redis', (0.0, 0))[0] * 1e3:.1f} l3_vs_recompute={worst_l3:.3f} "
          f"redis_vs_raw={redis_ratio:.3f} fs_vs_aes={fs_ratio:.3f} hit_l1_l2_l3={tiered['ratio']:.3f} "
          f"l1_l2_l3_vs_infinite={tiered['ratio'] / infinite:.3f} goal_l3_ttft={int(worst_l3 <= 0.3)} "
          f"goal_redis={int(redis_ratio >= 0.8)} goal_fs={int(fs_ratio >= 0.6)} "
          f"goal_l3_hit={int(tiered['ratio'] / infinite >= 0.95)}")


if __name__ == "__main__":
    main()
