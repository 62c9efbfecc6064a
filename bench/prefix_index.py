"""Question: how fast is the prefix index (hash chain + lookup) compared with vLLM's default scheme?

For a long random prompt (128K tokens) at block sizes 16 and 64, one timed run is what admission
does for a prompt whose every block is cached:

- ours: ``chain_hashes`` (BLAKE2b keyed with the namespace digest, over a uint32 token buffer), then
  ``BlockPool.get_cached`` per block (hash index lookup + re-check of the stored token ids).
- base: vLLM's default ``sha256(pickle.dumps((parent_hash, tuple(block_tokens), extras)))`` chained
  from a random seed hash, then a plain dict lookup per block (no token re-check).

Both start from the same Python ``list[int]`` (what a request carries after tokenization) and must
hit every block. The "chain only" rows time the hashing alone. Schemes run interleaved, round by
round (in the thread's CPU time, see below), so background load hits them alike; Mtok/s is from the
median time, and "ratio" is the median over rounds of (base time / this scheme's time) for the same
block size and part.

Per request (the second table): the whole bookkeeping of a request through ``CacheEngine``, hashing
included, on a shared-prefix workload: 64 prefixes of 1,024 random tokens; 4,000 requests, each one
of the prefixes cut at a random length in 512..1,024 tokens plus 256 fresh random tokens; block size
16; 31,250 blocks (500K tokens) of capacity. No model forward: each request is ``admit`` ->
``mark_computed(seq, len(seq.tokens))`` -> ``commit`` -> ``release``, one namespace, owner "bench";
the page tensor uses a 1-layer, 1-head, head_dim-1 layout (its bytes are never touched).

- ours: that sequence through a fresh ``CacheEngine`` per round (so every round replays the same
  cold-to-warm cache history).
- base: a minimal vLLM-style prefix cache in plain Python, measured in the same run: sha256(pickle)
  chain, dict index without token re-check, ref counts, one LRU free list, deepest blocks freed first
  (blocks holding no cached hash to the front, as ours, so both caches evict alike);
  no tenants, fair sharing, caps, locks or metrics. It is the yardstick that makes figures from runs
  on a loaded machine comparable (the ratio), not a claim about vLLM's speed.
- "chain only" rows: the same requests' hash chains alone (the hashing floor of a request).

Both caches must serve exactly the same hit tokens (checked every round), so they did the same work.
Times are the benchmark thread's CPU time (``time.thread_time``). us/req is the median over rounds of
(round time / 4,000 requests); Mtok/s is prompt tokens over that
median; "ratio" is the median over rounds of (base time / this scheme's time); "hit" is the
token-weighted share of prompt tokens served from cache.

``--profile``: instead of the tables, one round of the per-request workload through ``CacheEngine``
under cProfile (where the microseconds go), top functions by own time.

    .venv/bin/python -m bench.prefix_index [--quick] [--rounds N] [--request-rounds N] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import os
import pickle
import pstats
import random
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from cachecore.block_pool import BlockPool
from cachecore.engine import CacheEngine
from cachecore.hashing import chain_hashes
from cachecore.layout import KVLayout
from cachecore.namespace import Namespace

#: Rounds are timed in the thread's CPU time: on a shared machine, time spent preempted by other
#: processes counts against neither side (cache contention still does, alike for both).
clock = time.thread_time

PROMPT_TOKENS = 128 * 1024
VOCAB = 128_000
BLOCK_SIZES = (16, 64)

# Per-request workload (issue 8): shared prefixes, random cut, fresh tail.
REQ_PREFIXES = 64
REQ_PREFIX_TOKENS = 1024
REQ_CUT = (512, 1024)
REQ_FRESH_TOKENS = 256
REQ_COUNT = 4000
REQ_BLOCK_SIZE = 16
REQ_CAPACITY_TOKENS = 500_000


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
                t0 = clock()
                schemes[name]()
                times[name].append(clock() - t0)
        finally:
            gc.enable()
    return times


# ---------------------------------------------------------------------- per-request row
def shared_prefix_requests(rng: random.Random, *, count: int = REQ_COUNT) -> list[list[int]]:
    """The per-request workload: ``count`` prompts, each a random one of ``REQ_PREFIXES`` prefixes cut at
    a random length in ``REQ_CUT`` plus ``REQ_FRESH_TOKENS`` fresh random tokens."""
    prefixes = [[rng.randrange(VOCAB) for _ in range(REQ_PREFIX_TOKENS)] for _ in range(REQ_PREFIXES)]
    out = []
    for _ in range(count):
        cut = rng.randint(*REQ_CUT)
        out.append(rng.choice(prefixes)[:cut] + [rng.randrange(VOCAB) for _ in range(REQ_FRESH_TOKENS)])
    return out


class MiniPrefixCache:
    """Baseline: a minimal vLLM-style prefix cache (see the module docstring). Not thread-safe."""

    def __init__(self, num_blocks: int, block_size: int, seed: bytes) -> None:
        self.block_size = block_size
        self.seed = seed
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.index: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # reuse from the front

    def admit(self, tokens: list[int]) -> tuple[list[int], list[bytes], int]:
        """Hash, take the longest hit (last prompt token recomputed), allocate the rest.
        Returns (block table, hashes, hit tokens)."""
        bs = self.block_size
        hashes = vllm_sha256_chain(tokens, bs, self.seed)
        table: list[int] = []
        get = self.index.get
        for h in hashes[: (len(tokens) - 1) // bs]:
            block_id = get(h)
            if block_id is None:
                break
            table.append(block_id)
        ref, free = self.ref, self.free
        for block_id in table:
            if ref[block_id] == 0:
                del free[block_id]
            ref[block_id] += 1
        hit = len(table)
        for _ in range(-(-len(tokens) // bs) - hit):
            block_id, _ = free.popitem(last=False)
            old = self.hash_of[block_id]
            if old is not None:  # evict: the reused block leaves the index
                del self.index[old]
                self.hash_of[block_id] = None
            ref[block_id] = 1
            table.append(block_id)
        return table, hashes, hit * bs

    def commit(self, table: list[int], hashes: list[bytes], hit_tokens: int) -> None:
        """Index every full block that is not indexed yet (a duplicate keeps the existing block)."""
        index, hash_of = self.index, self.hash_of
        for i in range(hit_tokens // self.block_size, len(hashes)):
            h = hashes[i]
            if h not in index:
                index[h] = table[i]
                hash_of[table[i]] = h

    def release(self, table: list[int]) -> None:
        """Drop one reference per block; freed blocks join the LRU end deepest first, those holding
        no cached hash (a partial last block, a duplicate) the front (reused first, as ours)."""
        ref, free, hash_of = self.ref, self.free, self.hash_of
        for block_id in reversed(table):
            ref[block_id] -= 1
            if ref[block_id] == 0:
                free[block_id] = None
                if hash_of[block_id] is None:
                    free.move_to_end(block_id, last=False)


def tiny_layout(block_size: int) -> KVLayout:
    """A 1-layer, 1-head, head_dim-1 layout: 31K blocks of pages cost a few MB (never written)."""
    return KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_size=block_size)


def make_request_schemes(
    requests: list[list[int]], block_size: int, num_blocks: int
) -> tuple[dict[str, Callable[[], int]], Callable[[], None]]:
    """Timed callables over ``requests`` (each returns the hit tokens, or blocks hashed for chain rows)
    and a ``reset`` that gives the cache schemes a fresh, empty cache (called before every round)."""
    layout = tiny_layout(block_size)
    ns = Namespace.build(
        scope_salt=os.urandom(32),
        model_id="bench",
        weight_digest="w",
        tokenizer_digest="t",
        layout=layout.canonical(),
        rope={"theta": 10000.0},
    )
    seed = os.urandom(32)
    state: dict[str, object] = {}

    def reset() -> None:
        state.clear()  # drop the old engine first: two 31K-block pools need not coexist
        gc.collect()
        state["engine"] = CacheEngine(layout, num_blocks, "cpu")
        state["base"] = MiniPrefixCache(num_blocks, block_size, seed)

    def ours() -> int:
        engine = state["engine"]
        admit, mark_computed, commit, release = engine.admit, engine.mark_computed, engine.commit, engine.release
        hit = 0
        for tokens in requests:
            seq = admit(ns, tokens, owner="bench")
            mark_computed(seq, len(seq.tokens))
            commit(seq)
            release(seq)
            hit += seq.num_cached_tokens
        return hit

    def base() -> int:
        cache = state["base"]
        admit, commit, release = cache.admit, cache.commit, cache.release
        hit = 0
        for tokens in requests:
            table, hashes, hit_tokens = admit(tokens)
            commit(table, hashes, hit_tokens)
            release(table)
            hit += hit_tokens
        return hit

    def base_chain() -> int:
        return sum(len(vllm_sha256_chain(tokens, block_size, seed)) for tokens in requests)

    def ours_chain() -> int:
        return sum(len(chain_hashes(ns, tokens, block_size)) for tokens in requests)

    return {"base": base, "ours": ours, "base_chain": base_chain, "ours_chain": ours_chain}, reset


def run_request_rounds(
    schemes: dict[str, Callable[[], int]], reset: Callable[[], None], rounds: int
) -> tuple[dict[str, list[float]], dict[str, int]]:
    """One untimed warm-up round, then ``rounds`` timed ones; every scheme once per round in rotating
    order, a fresh cache before each round, GC off while timing. Returns (times, result of round 0)."""
    names = list(schemes)
    times: dict[str, list[float]] = {name: [] for name in names}
    reset()
    outcome = {name: schemes[name]() for name in names}
    for r in range(rounds):
        reset()
        gc.disable()
        try:
            for name in names[r % len(names) :] + names[: r % len(names)]:
                t0 = clock()
                got = schemes[name]()
                times[name].append(clock() - t0)
                assert got == outcome[name], f"{name}: round {r} differs from the warm-up ({got} != {outcome[name]})"
        finally:
            gc.enable()
    return times, outcome


def per_request_table(rounds: int, rng: random.Random) -> dict[str, float]:
    requests = shared_prefix_requests(rng)
    bs = REQ_BLOCK_SIZE
    num_blocks = REQ_CAPACITY_TOKENS // bs
    prompt_tokens = sum(len(t) for t in requests)
    schemes, reset = make_request_schemes(requests, bs, num_blocks)
    times, outcome = run_request_rounds(schemes, reset, rounds)
    assert outcome["ours"] == outcome["base"], f"the caches served different hits: {outcome}"
    assert outcome["ours_chain"] == outcome["base_chain"], f"the chains hashed different blocks: {outcome}"
    n = len(requests)
    print()
    print(
        f"per request: admit + mark_computed + commit + release, {n} requests ({prompt_tokens} prompt tokens), "
        f"{REQ_PREFIXES} prefixes of {REQ_PREFIX_TOKENS} cut at {REQ_CUT[0]}..{REQ_CUT[1]} + {REQ_FRESH_TOKENS} "
        f"fresh, {num_blocks} blocks, median of {rounds} rounds"
    )
    header = f"{'scheme':<40} {'block':>5} {'us/req':>8} {'Mtok/s':>8} {'ratio':>6} {'hit':>6}"
    print(header)
    print("-" * len(header))
    labels = {
        "base": "base  minimal vLLM-style prefix cache",
        "ours": "ours  CacheEngine admit/commit/release",
        "base_chain": "base  chain only",
        "ours_chain": "ours  chain only",
    }
    us = {name: statistics.median(ts) / n * 1e6 for name, ts in times.items()}
    ratio = {
        name: statistics.median(b / t for b, t in zip(times[ref], ts, strict=True))
        for name, ts in times.items()
        for ref in ["base_chain" if name.endswith("_chain") else "base"]
    }
    for name in ("base", "ours", "base_chain", "ours_chain"):
        hit = f"{outcome[name] / prompt_tokens:>6.1%}" if not name.endswith("_chain") else f"{'-':>6}"
        mtok = prompt_tokens / (us[name] * n / 1e6) / 1e6
        print(f"{labels[name]:<40} {bs:>5} {us[name]:>8.1f} {mtok:>8.2f} {ratio[name]:>5.2f}x {hit}")
    # The goal measured against its floor: what the baseline spends beside its hashing is the least
    # per-block Python work a prefix cache does (one dict lookup or insert, a ref count and a free-list
    # move per block; no tenants, shares, caps, listeners or locks). Ours at 0.5x the baseline must fit
    # its own hashing (of the blocks it misses) and all of its bookkeeping into this budget.
    goal_us = 0.5 * us["base"]
    floor_us = us["base"] - us["base_chain"]
    print(
        f"goal 0.5x: ours <= {goal_us:.1f} us/req. The baseline's work beside its hashing (base - base chain) is "
        f"{floor_us:.1f} us/req, so the goal leaves ours {goal_us / floor_us:.2f}x of that bare per-block floor "
        f"for all of its bookkeeping, before any hashing; ours spends {us['ours'] / floor_us:.2f}x it, hashing "
        f"included."
    )
    return {
        "per_request_us": us["ours"],
        "goal_per_request_us": goal_us,
        "base_bookkeeping_us": floor_us,
        "base_per_request_us": us["base"],
        "per_request_speedup": ratio["ours"],
        "per_request_chain_us": us["ours_chain"],
        "per_request_hit": outcome["ours"] / prompt_tokens,
    }


def profile_requests(rng: random.Random, top: int = 25) -> None:
    """One warm-up and one profiled round of the per-request workload through ``CacheEngine``."""
    requests = shared_prefix_requests(rng)
    schemes, reset = make_request_schemes(requests, REQ_BLOCK_SIZE, REQ_CAPACITY_TOKENS // REQ_BLOCK_SIZE)
    reset()
    schemes["ours"]()
    reset()
    profiler = cProfile.Profile()
    profiler.enable()
    schemes["ours"]()
    profiler.disable()
    print(f"per request, {len(requests)} requests through CacheEngine under cProfile (own time first):")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="101 rounds instead of 1001 (seconds)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (median taken)")
    parser.add_argument(
        "--request-rounds", type=int, default=None, help="timed rounds of the per-request table (default 9, quick 3)"
    )
    parser.add_argument("--profile", action="store_true", help="profile one per-request round instead")
    args = parser.parse_args(argv)
    if args.profile:
        profile_requests(random.Random(0))
        return
    rounds = args.rounds or (101 if args.quick else 1001)
    request_rounds = args.request_rounds or (3 if args.quick else 9)
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
    result.update(per_request_table(request_rounds, rng))
    print("RESULT " + " ".join(f"{k}={v:.2f}" for k, v in result.items()))


if __name__ == "__main__":
    main()
