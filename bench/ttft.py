"""Time to first token of a 2,048-token prompt on the `small` model, by cached fraction.

    .venv/bin/python -m bench.ttft [--quick] [--preset small] [--tokens 2048] [--reps 5]

Cases: caching disabled (the baseline: no hashing, no lookup, no commit), then 0%, 50%, 90% and
all-but-the-last token cached. Each repetition uses a fresh random prompt; for a partial hit the
cache is first warmed with a prompt that shares exactly the cached prefix and differs after it.
Ratios are against the uncached (0%) TTFT measured in the same run; the 0% row is also compared with
caching disabled (the overhead of the cache on a miss).
"""

from __future__ import annotations

import argparse
import random
import secrets
import statistics
import time

import torch

from cachecore.engine import CacheEngine
from cachecore.model.loader import RevisionSpec, load_model
from cachecore.runner import CompletionRunner, Prefilled, SamplingParams, TokenOut


def ttft(gen: CompletionRunner, ns, tokens: list[int], *, use_cache: bool = True) -> tuple[float, int]:
    start = time.perf_counter()
    cached = None
    for ev in gen.stream(ns, tokens, owner="bench", params=SamplingParams(max_tokens=1), use_cache=use_cache):
        if isinstance(ev, Prefilled):
            cached = ev.cached_tokens
        if isinstance(ev, TokenOut):
            if cached is None:
                raise RuntimeError("the first token came without a Prefilled event: its cached tokens went unseen")
            return time.perf_counter() - start, cached
    raise RuntimeError("no token produced")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="TTFT by cached fraction")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (under a minute)")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=None)
    args = ap.parse_args(argv)
    reps = args.reps or (2 if args.quick else 5)

    loaded = load_model("bench-llama", args.preset, RevisionSpec(label="r1", seed=7))
    n, bs = args.tokens, loaded.block_size
    engine = CacheEngine(loaded.layout, num_blocks=4 * (n // bs + 2) * 4, device=loaded.model.device)
    gen = CompletionRunner(loaded.model, engine, loaded.tokenizer, model_name="bench-llama", revision="r1")
    ns = loaded.namespace(secrets.token_bytes(32))
    rng = random.Random(0)
    vocab = loaded.config.vocab_size

    def prompt() -> list[int]:
        return [rng.randrange(256) for _ in range(n)]

    ttft(gen, ns, prompt(), use_cache=False)  # warm-up: allocator, kernels
    cases = [("disabled", None), ("0%", 0.0), ("50%", 0.5), ("90%", 0.9), ("all-but-last", 1.0)]
    results: dict[str, list[float]] = {name: [] for name, _ in cases}
    cached_tokens: dict[str, int] = {}
    for _ in range(reps):
        for name, frac in cases:
            target = prompt()
            keep = 0
            if frac is None:
                t, c = ttft(gen, ns, target, use_cache=False)
            else:
                keep = (n - 1) // bs * bs if frac == 1.0 else int(n * frac) // bs * bs
                if keep:
                    warm = target[:keep] + [(x + 1) % vocab for x in target[keep:]]
                    ttft(gen, ns, warm)  # populates exactly `keep` tokens of shared prefix
                t, c = ttft(gen, ns, target)
            if c != keep:  # the engine served what the case names, or its row measures another case
                raise SystemExit(f"{name}: the request found {c} cached tokens, not the {keep} its case warmed: "
                                 "nothing measured")
            results[name].append(t)
            cached_tokens[name] = c
    engine.check_integrity()

    base = statistics.median(results["0%"])
    disabled = statistics.median(results["disabled"])
    print(f"TTFT, {n}-token prompt, preset {args.preset}, device {engine.pages.device}, "
          f"threads {torch.get_num_threads()}, {reps} reps (median)")
    print(f"{'case':<14} {'cached tok':>10} {'TTFT ms':>9} {'vs 0%':>7}")
    for name, _ in cases:
        med = statistics.median(results[name])
        print(f"{name:<14} {cached_tokens[name]:>10} {med * 1000:>9.1f} {med / base:>7.3f}")
    r90 = statistics.median(results["90%"]) / base
    rall = statistics.median(results["all-but-last"]) / base
    overhead = base / disabled - 1
    print(f"0% vs disabled: {overhead * 100:+.2f}% (goal <= +3%); 90% cached: {r90:.3f}x of uncached "
          "(goal <= 0.15x)")
    print(f"RESULT ttft_uncached_ms={base * 1000:.1f} ttft_disabled_ms={disabled * 1000:.1f} "
          f"ttft_50_ms={statistics.median(results['50%']) * 1000:.1f} "
          f"ttft_90_ms={statistics.median(results['90%']) * 1000:.1f} "
          f"ttft_all_ms={statistics.median(results['all-but-last']) * 1000:.1f} ratio_90={r90:.3f} "
          f"ratio_all={rall:.3f} miss_overhead_pct={overhead * 100:.2f}")


if __name__ == "__main__":
    main()
