"""Command-line engine demo: ``python -m cachecore.demo [--preset small] [--max-tokens 16]``.

Serves a few prompts that share prefixes (a multi-turn chat, two questions over one long document,
two tenants sending the same text) through the real model and the paged prefix cache, and prints for
each request its prompt tokens, cached tokens and time to first token, then the cache's metrics.
"""

from __future__ import annotations

import argparse
import secrets
import time

from cachecore.engine import CacheEngine
from cachecore.model.loader import RevisionSpec, load_model
from cachecore.runner import CompletionRunner, Prefilled, SamplingParams, TokenOut

DOCUMENT = (
    "Strata keeps the attention KV of prompts that many requests share, so that a later request with "
    "the same exact prefix skips that part of prefill. Each tenant's cache lives in a namespace derived "
    "from a secret salt chosen by the server, the model's weight revision, the tokenizer and the KV "
    "layout; no tenant can reach, probe or evict another's cache. "
) * 6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    loaded = load_model("demo-llama", args.preset, RevisionSpec(label="r1", seed=1), device=args.device)
    engine = CacheEngine(loaded.layout, num_blocks=2048, device=loaded.model.device)
    gen = CompletionRunner(loaded.model, engine, loaded.tokenizer, model_name="demo-llama", revision="r1")
    print(f"model demo-llama ({args.preset}) on {engine.pages.device}, revision r1 digest "
          f"{loaded.weight_digest[:12]}, {engine.pool.num_blocks} blocks of {engine.block_size} tokens, "
          f"loaded in {time.perf_counter() - t0:.2f}s\n")

    tenants = {"acme": secrets.token_bytes(32), "globex": secrets.token_bytes(32)}
    params = SamplingParams(max_tokens=args.max_tokens)
    print(f"{'request':<38} {'tenant':<7} {'prompt':>6} {'cached':>6} {'TTFT ms':>8}  output")
    print("-" * 100)

    def serve(label: str, tenant: str, tokens: list[int]) -> list[int]:
        ns = loaded.namespace(tenants[tenant])
        start = time.perf_counter()
        ttft, out, cached = None, [], 0
        for ev in gen.stream(ns, tokens, owner=tenant, params=params):
            if isinstance(ev, Prefilled):
                cached = ev.cached_tokens
            elif isinstance(ev, TokenOut):
                ttft = ttft or time.perf_counter() - start
                out.append(ev.token_id)
        text = loaded.tokenizer.decode(out).replace("\n", " ")
        print(f"{label:<38} {tenant:<7} {len(tokens):>6} {cached:>6} {ttft * 1000:>8.1f}  {text[:24]!r}")
        return out

    chat = [{"role": "system", "content": "You are a concise assistant. " * 8},
            {"role": "user", "content": "What does a prefix cache keep?"}]
    answer = serve("chat turn 1", "acme", loaded.chat.render(chat))
    chat += [{"role": "assistant", "content": loaded.tokenizer.decode(answer)},
             {"role": "user", "content": "And what does it skip?"}]
    answer = serve("chat turn 2 (reuses turn 1 + answer)", "acme", loaded.chat.render(chat))
    chat += [{"role": "assistant", "content": loaded.tokenizer.decode(answer)},
             {"role": "user", "content": "Thanks."}]
    serve("chat turn 3", "acme", loaded.chat.render(chat))

    doc = loaded.tokenizer.encode(DOCUMENT)
    serve("document + question A", "acme", doc + loaded.tokenizer.encode(" Q: who owns a cache?", add_bos=False))
    serve("document + question B", "acme", doc + loaded.tokenizer.encode(" Q: what is a salt?", add_bos=False))
    serve("same document, other tenant", "globex", doc + loaded.tokenizer.encode(" Q: who?", add_bos=False))
    serve("same document, other tenant again", "globex",
          doc + loaded.tokenizer.encode(" Q: why?", add_bos=False))

    snap = engine.snapshot()
    engine.check_integrity()
    print("\ncache metrics (token-weighted)")
    print(f"{'tenant':<8} {'requests':>8} {'query tok':>10} {'hit tok':>8} {'effective':>9} {'ratio':>6} "
          f"{'saved prefill s':>15}")
    for row in snap["usage"]:
        print(f"{row['tenant']:<8} {row['requests']:>8} {row['query_tokens']:>10} {row['lookup_hit_tokens']:>8} "
              f"{row['effective_hit_tokens']:>9} {row['effective_hit_ratio']:>6.2f} "
              f"{row['saved_prefill_seconds']:>15.3f}")
    t = snap["totals"]
    print(f"{'total':<8} {t['requests']:>8} {t['query_tokens']:>10} {t['lookup_hit_tokens']:>8} "
          f"{t['effective_hit_tokens']:>9} {t['effective_hit_ratio']:>6.2f} {t['saved_prefill_seconds']:>15.3f}")
    p = snap["pool"]
    print(f"\npages: {p['protected']} protected, {p['evictable']} evictable (cached), {p['free']} free of "
          f"{p['total']}; evictions {snap['evictions']}, duplicate stores {snap['duplicate_stores']}")


if __name__ == "__main__":
    main()
