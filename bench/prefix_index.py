"""Question: how fast is the prefix index (hash chain + lookup) compared with vLLM's default scheme?

For a long random prompt (128K tokens) at block sizes 16 and 64, one timed run is what admission
does for a prompt whose every block is cached:

- ours: ``chain_hashes`` (BLAKE2b keyed with the namespace digest, over a uint32 token buffer), then
  ``BlockPool.get_cached`` per block (hash index lookup + re-check of the stored token ids).
- base: vLLM's default ``sha256(pickle.dumps((parent_hash, tuple(block_tokens), extras)))`` chained
  from a random seed hash, then a plain dict lookup per block (no token re-check).

Both start from the same Python ``list[int]`` (what a request carries after tokenization) and must
hit every block. The "chain only" rows time the hashing alone. Schemes run interleaved, round by
round, so background load hits them alike; Mtok/s is from the median time, and "ratio" is the
median over rounds of (base time / this scheme's time) for the same block size and part.

    .venv/bin/python -m bench.prefix_index [--quick]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import pickle
import random
import statistics
import time
from collections.abc import Callable, Sequence

from cachecore.block_pool import BlockPool
from cachecore.hashing import chain_hashes
from cachecore.namespace import Namespace

PROMPT_TOKENS = 128 * 1024
VOCAB = 128_000
BLOCK_SIZES = (16, 64)


def vllm_sha256_chain(tokens: Sequence[int], block_size: int, seed: bytes) -> list[bytes]:
    """vLLM's default prefix hash: sha256 over the pickled (parent, block tokens, extras) tuple."""
    out = []
    parent = seed
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tuple(tokens[start : start + block_size])
        parent = hashlib.sha256(pickle.dumps((parent, block, None), protocol=pickle.HIGHEST_PROTOCOL)).digest()
        out.append(parent)
    return out


def make_schemes(tokens: list[int], block_size: int) -> dict[str, Callable[[], int]]:
    """Build both indexes for ``tokens``; return timed callables, each returning its block count."""
    ns = Namespace.build(
        scope_salt=os.urandom(32),
        model_id="bench",
        weight_digest="w",
        tokenizer_digest="t",
        layout={"block_size": block_size},
        rope={"theta": 10000.0},
    )
    n_blocks = len(tokens) // block_size
    pool = BlockPool(n_blocks, block_size)
    table = pool.allocate(n_blocks, "bench")
    for i, (block, h) in enumerate(zip(table, chain_hashes(ns, tokens, block_size), strict=True)):
        pool.cache(block, h, tuple(tokens[i * block_size : (i + 1) * block_size]), "bench")
    pool.free(table)
    pool.check_integrity()
    seed = os.urandom(32)
    base_index = {h: i for i, h in enumerate(vllm_sha256_chain(tokens, block_size, seed))}

    def ours() -> int:
        get = pool.get_cached
        found = []
        keep = found.append
        # zip(*[iter(tokens)] * bs) yields each block's tokens as a tuple, built in C.
        groups = zip(*[iter(tokens)] * block_size, strict=False)
        for h, block_tokens in zip(chain_hashes(ns, tokens, block_size), groups, strict=False):
            block = get(h, block_tokens)
            if block is None:
                break
            keep(block)
        return len(found)

    def base() -> int:
        get = base_index.get
        found = []
        keep = found.append
        for h in vllm_sha256_chain(tokens, block_size, seed):
            block_id = get(h)
            if block_id is None:
                break
            keep(block_id)
        return len(found)

    return {
        "base": base,
        "ours": ours,
        "base_chain": lambda: len(vllm_sha256_chain(tokens, block_size, seed)),
        "ours_chain": lambda: len(chain_hashes(ns, tokens, block_size)),
    }


def run_rounds(schemes: dict[str, Callable[[], int]], rounds: int, expect: int) -> dict[str, list[float]]:
    """Time every scheme once per round, in rotating order; GC off while timing."""
    names = list(schemes)
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in names:
        assert schemes[name]() == expect, f"{name}: expected {expect} blocks"  # warm-up + correctness
    for r in range(rounds):
        gc.collect()
        gc.disable()
        try:
            for name in names[r % len(names) :] + names[: r % len(names)]:
                t0 = time.perf_counter()
                schemes[name]()
                times[name].append(time.perf_counter() - t0)
        finally:
            gc.enable()
    return times


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="101 rounds instead of 1001 (seconds)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (median taken)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (101 if args.quick else 1001)
    rng = random.Random(0)

    print(f"prefix index: {PROMPT_TOKENS} random tokens, every block cached, median of {rounds} rounds")
    header = f"{'scheme':<40} {'block':>5} {'Mtok/s':>8} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    labels = {
        "base": "base  sha256(pickle) chain + dict",
        "ours": "ours  blake2b-keyed chain + get_cached",
        "base_chain": "base  chain only",
        "ours_chain": "ours  chain only",
    }
    result: dict[str, float] = {}
    for bs in BLOCK_SIZES:
        tokens = [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)]
        times = run_rounds(make_schemes(tokens, bs), rounds, PROMPT_TOKENS // bs)
        mtok = {name: PROMPT_TOKENS / statistics.median(ts) / 1e6 for name, ts in times.items()}
        ratio = {
            name: statistics.median(b / t for b, t in zip(times[ref], ts, strict=True))
            for name, ts in times.items()
            for ref in ["base_chain" if name.endswith("_chain") else "base"]
        }
        for name in ("base", "ours", "base_chain", "ours_chain"):
            print(f"{labels[name]:<40} {bs:>5} {mtok[name]:>8.2f} {ratio[name]:>5.2f}x")
        result[f"ours_bs{bs}_mtok_s"] = mtok["ours"]
        result[f"base_bs{bs}_mtok_s"] = mtok["base"]
        result[f"speedup_bs{bs}"] = ratio["ours"]
        result[f"chain_speedup_bs{bs}"] = ratio["ours_chain"]
    print("RESULT " + " ".join(f"{k}={v:.2f}" for k, v in result.items()))


if __name__ == "__main__":
    main()
