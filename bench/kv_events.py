"""KV events: what publishing them costs the cache's hot path, and what indexing them costs a router.

    .venv/bin/python -m bench.kv_events [--quick] [--requests 2000] [--replicas 16]

**Engine side.** The same request trace (prompts of 1-16 blocks drawn from a few hundred shared
prefixes with fresh tails, several tenants, L1 small enough to evict all the time, L2 under it with
write-back) runs through ``admit -> commit -> release`` of two engines, one without an event log
(the baseline) and one publishing every tier's events; rounds alternate and the best round of each
counts. No model runs: this is the bookkeeping path alone, where events are the largest share. Time
is this process's CPU time (``time.process_time``, one torch thread), so other processes on a shared
machine do not count.
Reported: microseconds per request, batches and hashes published per request, the overhead.

**Router side.** The log's batches (as JSON dicts, as a router polls them) are applied to a
``PrefixIndex`` for ``--replicas`` replicas, and the trace's requests are matched against it:
batches per second applied, and microseconds per ``match`` over every replica.

Goal: the events add under 10% to the bookkeeping path (which itself is a small part of a request).
"""

from __future__ import annotations

import argparse
import random
import secrets
import time

import torch

from cachecore.config import EngineConfig
from cachecore.engine import CacheEngine
from cachecore.events import EventBatch, EventLog
from cachecore.hashing import chain_hashes
from cachecore.layout import KVLayout
from cachecore.namespace import Namespace
from cachecore.routing.index import PrefixIndex

BS = 16
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=BS, dtype="float32")


def _trace(n: int, seed: int = 0) -> list[tuple[int, list[int]]]:
    """(tenant, tokens) per request: a shared prefix of the tenant's, then a fresh tail."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(256) for _ in range(BS * rng.randint(1, 8))] for _ in range(300)]
    out = []
    for _ in range(n):
        p = rng.randrange(len(prefixes))
        tail = [rng.randrange(256) for _ in range(BS * rng.randint(0, 8) + rng.randrange(BS))]
        out.append((p % 4, prefixes[p] + tail))
    return out


def _engine(log: EventLog | None) -> CacheEngine:
    return CacheEngine(LAYOUT, num_blocks=256, config=EngineConfig(l2_blocks=1024), events=log)


def run_engine(trace, nss, log: EventLog | None) -> float:
    """Seconds for the trace's requests through admit -> commit -> release."""
    engine = _engine(log)
    t0 = time.process_time()
    for tenant, tokens in trace:
        seq = engine.admit(nss[tenant], tokens, owner=f"t{tenant}")
        engine.finish_loads(seq)
        engine.mark_computed(seq, len(tokens))
        engine.commit(seq)
        engine.release(seq)
    seconds = time.process_time() - t0
    engine.check_integrity()
    return seconds


def run_index(batches: list[dict], replicas: int, requests: list[list[bytes]]) -> tuple[float, float]:
    """(batches applied per second, microseconds per match over every replica)."""
    index = PrefixIndex()
    t0 = time.process_time()
    for r in range(replicas):
        rid = f"dep:{r}:bench"
        for d in batches:
            assert index.apply(EventBatch.from_dict({**d, "replica_id": rid}))
    applied = replicas * len(batches) / (time.process_time() - t0)
    t0 = time.process_time()
    hits = 0
    for hashes in requests:
        hits += len(index.match(hashes, BS))
    per_match = (time.process_time() - t0) / len(requests) * 1e6
    assert hits > 0, "the index matched nothing: the events did not reach it"
    return applied, per_match


def main() -> None:
    ap = argparse.ArgumentParser(description="KV events: hot-path overhead and router index cost")
    ap.add_argument("--quick", action="store_true", help="fewer requests and rounds (seconds)")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--replicas", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)  # idle OpenMP threads spin, and CPU time would count their spinning
    n = args.requests or (300 if args.quick else 2000)
    replicas = args.replicas or (4 if args.quick else 16)
    rounds = args.rounds or (2 if args.quick else 5)
    trace = _trace(n)
    nss = [Namespace.build(scope_salt=secrets.token_bytes(32), model_id="bench", weight_digest="w",
                           tokenizer_digest="t", layout=LAYOUT.canonical(), rope={"theta": 10000.0})
           for _ in range(4)]
    base, with_events, log = [], [], None
    for r in range(rounds):  # alternate which runs first, so neither gets the warmer machine
        log = EventLog("dep:0:bench")  # the worker's default ring size
        if r % 2:
            with_events.append(run_engine(trace, nss, log))
            base.append(run_engine(trace, nss, None))
        else:
            base.append(run_engine(trace, nss, None))
            with_events.append(run_engine(trace, nss, log))
    b, e = min(base), min(with_events)
    overhead = (e - b) / b * 100
    counts = log.counts
    assert counts["batches"] > 0 and log.seq == counts["batches"], "the engine published no events"
    full = EventLog("dep:0:bench", capacity=1 << 20)  # untimed: every batch, for the router side
    run_engine(trace, nss, full)
    batches = [bt.to_dict() for bt in full.since(0, limit=1 << 20)[0]]
    requests = [chain_hashes(nss[t], tokens, BS) for t, tokens in trace[: min(n, 500)]]
    applied, per_match = run_index(batches, replicas, requests)

    print(f"engine bookkeeping path, {n} requests, best of {rounds} rounds")
    print(f"{'engine':<22}{'us/request':>12}{'batches/req':>13}{'hashes/req':>12}")
    print(f"{'no events (baseline)':<22}{b / n * 1e6:>12.1f}{0:>13.2f}{0:>12.2f}")
    print(f"{'events':<22}{e / n * 1e6:>12.1f}{counts['batches'] / n:>13.2f}{counts['hashes'] / n:>12.2f}")
    print(f"overhead: {overhead:+.1f}%")
    print()
    print(f"router index, {replicas} replicas, {len(batches)} batches each")
    print(f"{'applied batches/s':<22}{applied:>12.0f}")
    print(f"{'match us (all reps)':<22}{per_match:>12.1f}")
    print(f"RESULT overhead_pct={overhead:.1f} us_per_request_base={b / n * 1e6:.1f} "
          f"us_per_request_events={e / n * 1e6:.1f} batches_per_request={counts['batches'] / n:.2f} "
          f"index_batches_per_s={applied:.0f} match_us={per_match:.1f} replicas={replicas} "
          f"goal_met={overhead < 10}")


if __name__ == "__main__":
    main()
