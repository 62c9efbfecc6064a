"""Routing across replicas: does routing by expected TTFT beat round robin, least loaded and SGLang's rule?

    .venv/bin/python -m bench.routing [--quick] [--shape sessions|fast25 | --trace FILE] [--replicas 4,16,64]

A discrete-event simulation (``bench._routing_sim``) of N replicas serving a trace, once per policy
on the same requests: round robin, least loaded, the SGLang router's cache-aware rule (its default
thresholds) and Strata's ``ExpectedTTFT``; every policy routes with the same knowledge (each
replica's reported state, the request's exact hit on every replica, and its block keys). Replicas
prefill one request at a time with the router's own cost model (``cachecore.routing.cost``) at true
rates, and cache 512-token blocks in L1 + L2 with LRU and fair-share eviction per tenant.

For each N (default 4, 16, 64; ``--quick``: 2 and 4 on a shorter trace) and each cache size (the
replicas' caches together hold 10%, 50% and 100% of the trace's working set, its distinct full
blocks; a quarter of each replica's share is L1, the rest L2) a table: mean and p99 TTFT,
token-weighted hit ratio (prompt tokens loaded from cache / prompt tokens) against the trace's
infinite-cache bound and against one LRU cache of the replicas' total capacity (``BlockTrace.lru``:
what routing every prefix to a single replica, never caching it twice, would get from LRU caches of
that size; it falls short of the bound when the caches are too small to keep a prefix until its
reuse), and load imbalance (max / mean of the replicas' busy prefill seconds).

The trace: ``--shape sessions`` (default) is ``bench.traces.generate_trace`` scaled to N
(``default_trace``: ``16 N`` sessions, at least 400, over ``max(4, N)`` shared system prompts, a
quarter as many one-off requests); ``--shape fast25`` is ``bench.traces.generate_fast25_trace``, the
public FAST'25 conversation trace's shape (12,031 requests, ``--requests`` to change, 1,500 with
``--quick``; almost every session a single request, median prompt ~6.9K tokens, max 126K);
``--trace FILE`` reads a Mooncake FAST'25 JSONL (``timestamp`` in ms drives arrivals). The arrival rate
is set so that the trace's prompt tokens, prefilled without any cache, would keep ``--load`` (default
75%) of the aggregate prefill capacity busy (``bench._routing_trace``): every policy can keep up, and
caching is what separates them.

Goal: Strata's mean and p99 TTFT lower than every other policy's at every N and size, and its hit
ratio at least 90% of the infinite-cache bound at every N and size; where one LRU cache of the
replicas' total capacity cannot reach the bound itself, at least 90% of that cache's hit (the
"vs 1 LRU" column shows how far routing is from it). The RESULT line gives the worst case over all
configurations of Strata's mean and p99 over the best other policy's (below 1 is better), the lowest
Strata hit / bound and hit / one LRU, and whether the goal was met.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass

from bench import traces
from bench._routing_sim import SimResult, simulate
from bench._routing_trace import SimTrace, prepare
from bench.traces import BlockTrace
from cachecore.routing.cost import CostModel, Rates
from cachecore.routing.policies import ExpectedTTFT, LeastLoaded, Policy, RoundRobin, SGLangRule

FRACS = (0.1, 0.5, 1.0)
STRATA = ExpectedTTFT.name
QUICK_FAST25_REQUESTS = 1_500


@dataclass(frozen=True)
class Config:
    replicas: int
    frac: float
    l1_blocks: int
    l2_blocks: int
    trace: SimTrace
    results: list[SimResult]
    lru_hit: float  # one LRU cache of the replicas' total capacity (module docstring)

    def result(self, name: str) -> SimResult:
        return next(r for r in self.results if r.policy == name)


def policies(cost: CostModel, **strata: float | None) -> list[Policy]:
    """A fresh instance of every compared policy (each run starts with no routing state); ``strata``:
    ``ExpectedTTFT``'s parameters (its defaults when left out)."""
    return [RoundRobin(), LeastLoaded(), SGLangRule(), ExpectedTTFT(cost, **strata)]


def default_trace(replicas: int, *, quick: bool, seed: int = 0) -> list[traces.TraceRequest]:
    """``bench.traces.generate_trace`` scaled to ``replicas``: ``16 N`` sessions (at least 400, so that a
    p99 is taken over more than a thousand requests; ``--quick``: ``6 N``, at least 60) over ``max(4,
    N)`` shared system prompts, and a quarter as many one-off requests."""
    sessions = max(60, 6 * replicas) if quick else max(400, 16 * replicas)
    return traces.generate_trace(sessions=sessions, system_prompts=max(4, replicas), one_offs=sessions // 4, seed=seed)


def fixed_trace(shape: str, *, trace_file: str | None, requests: int | None, quick: bool,
                seed: int) -> list[traces.TraceRequest] | None:
    """The trace every N replays (``--trace`` or ``--shape fast25``), or None: ``default_trace`` per N."""
    if trace_file:
        return traces.read_trace(trace_file)
    if shape == "fast25":
        count = requests or (QUICK_FAST25_REQUESTS if quick else traces.FAST25_REQUESTS)
        return traces.generate_fast25_trace(requests=count, seed=seed)
    if shape != "sessions":
        raise ValueError(f"unknown shape {shape!r}; shapes are {traces.SHAPES}")
    return None


def run(
    replica_counts: Sequence[int], *, rates: Rates, load: float, quick: bool, trace_file: str | None = None,
    shape: str = "sessions", requests: int | None = None, fracs: Sequence[float] = FRACS, seed: int = 0,
    **strata: float | None,
) -> list[Config]:
    """Every (N, cache size) configuration, every policy simulated on the same requests; ``strata``:
    ``ExpectedTTFT``'s parameters."""
    cost = CostModel()
    fixed = fixed_trace(shape, trace_file=trace_file, requests=requests, quick=quick, seed=seed)
    out = []
    for n in replica_counts:
        raw = fixed if fixed is not None else default_trace(n, quick=quick, seed=seed)
        trace = prepare(raw, replicas=n, prefill_tokens_per_s=rates.prefill_tokens_per_s, load=load)
        blocks = BlockTrace([list(r.keys) for r in trace.requests], [r.usable for r in trace.requests],
                            sum(r.prompt_tokens for r in trace.requests), traces.HASH_BLOCK_TOKENS)
        for frac in fracs:
            per_replica = max(2, round(frac * trace.unique_blocks / n))
            l1 = max(1, per_replica // 4)
            l2 = per_replica - l1
            results = [
                simulate(trace.requests, p, replicas=n, rates=rates, l1_blocks=l1, l2_blocks=l2, cost=cost)
                for p in policies(cost, **strata)
            ]
            out.append(Config(n, frac, l1, l2, trace, results, blocks.lru(per_replica * n).ratio))
    return out


def summary(configs: Sequence[Config]) -> dict[str, float | bool]:
    """Worst-case Strata / best-other ratios of mean and p99 TTFT, lowest Strata hit / bound and hit /
    one LRU over every configuration, and the goal (module docstring)."""
    mean_ratio = p99_ratio = 0.0
    vs_bound = vs_lru = float("inf")
    beats_all = True
    for c in configs:
        strata = c.result(STRATA)
        others = [r for r in c.results if r.policy != STRATA]
        best_mean = min(r.mean_ttft for r in others)
        best_p99 = min(r.p99_ttft for r in others)
        mean_ratio = max(mean_ratio, strata.mean_ttft / best_mean)
        p99_ratio = max(p99_ratio, strata.p99_ttft / best_p99)
        beats_all &= strata.mean_ttft < best_mean and strata.p99_ttft < best_p99
        vs_bound = min(vs_bound, strata.hit_ratio / c.trace.infinite_hit)
        vs_lru = min(vs_lru, strata.hit_ratio / c.lru_hit if c.lru_hit else float("inf"))
    return {
        "strata_vs_best_mean_ttft": mean_ratio,
        "strata_vs_best_p99": p99_ratio,
        "hit_vs_bound_min": vs_bound,
        "hit_vs_lru_min": vs_lru,
        "goal_met": bool(configs) and beats_all and vs_lru >= 0.9,
    }


def print_tables(configs: Sequence[Config]) -> None:
    shown = None
    for c in configs:
        t = c.trace
        if shown is not t:
            shown = t
            print(f"\nN={c.replicas}: {len(t.requests)} requests, {t.sessions} sessions, working set "
                  f"{t.unique_blocks} blocks of {traces.HASH_BLOCK_TOKENS} tokens, infinite-cache hit bound "
                  f"{t.infinite_hit:.1%}; arrivals x{t.time_scale:.3g} over {t.span_s:.0f} s -> offered load "
                  f"{t.offered_load:.0%} of prefill capacity (no cache)")
        print(f"  cache {c.frac:.0%} of the working set: {c.l1_blocks + c.l2_blocks} blocks per replica "
              f"(L1 {c.l1_blocks} + L2 {c.l2_blocks}); one LRU cache of their total capacity hits "
              f"{c.lru_hit:.1%} ({c.lru_hit / t.infinite_hit:.1%} of the bound)")
        header = (f"  {'policy':<14} {'mean TTFT s':>12} {'p99 TTFT s':>11} {'hit ratio':>10} {'vs bound':>9} "
                  f"{'vs 1 LRU':>9} {'imbalance':>10}")
        print(header)
        print("  " + "-" * (len(header) - 2))
        for r in c.results:
            print(f"  {r.policy:<14} {r.mean_ttft:>12.3f} {r.p99_ttft:>11.3f} {r.hit_ratio:>10.1%} "
                  f"{r.hit_ratio / t.infinite_hit:>9.1%} {r.hit_ratio / c.lru_hit if c.lru_hit else 0:>9.1%} "
                  f"{r.imbalance:>10.2f}")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="simulated routing across N replicas: four policies compared")
    ap.add_argument("--quick", action="store_true", help="N = 2, 4 on a shorter trace")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--trace", help="a Mooncake FAST'25 JSONL trace (default: a generated one, --shape)")
    src.add_argument("--shape", choices=traces.SHAPES, default="sessions",
                     help="generated trace: sessions (generate_trace scaled to N) or fast25 (the public "
                          "conversation trace's shape, generate_fast25_trace)")
    ap.add_argument("--requests", type=int, help=f"requests of a fast25 trace (default {traces.FAST25_REQUESTS:,}; "
                                                 f"quick {QUICK_FAST25_REQUESTS:,})")
    ap.add_argument("--replicas", help="comma-separated replica counts (default 4,16,64; quick 2,4)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the generated trace")
    ap.add_argument("--load", type=float, default=0.75, help="offered load without cache, of prefill capacity")
    ap.add_argument("--prefill-rate", type=float, default=10_000.0, help="prefill tokens/s per replica")
    ap.add_argument("--l2-rate", type=float, default=100_000.0, help="tokens/s of KV loaded from L2")
    ap.add_argument("--decode-step", type=float, default=0.03, help="seconds per decode step")
    ap.add_argument("--work-weight", type=float, help="ExpectedTTFT: a fixed weight w (default: from the queues)")
    ap.add_argument("--min-work-weight", type=float, default=1.0, help="ExpectedTTFT: floor of the queue-set w")
    ap.add_argument("--sticky-bonus", type=float, default=0.05, help="ExpectedTTFT stickiness bound, seconds")
    ap.add_argument("--load-guard", type=float, help="ExpectedTTFT load guard, seconds of queue (default: none)")
    ap.add_argument("--prefill-guard", type=float, default=1.0,
                    help="ExpectedTTFT prefill guard: queue above the least, in the request's own prefill times "
                         "(negative: none)")
    ap.add_argument("--tenant-weight", type=float, default=1.0, help="ExpectedTTFT tenant mixing weight (0: off)")
    ap.add_argument("--eviction-weight", type=float, default=1.0,
                    help="ExpectedTTFT large-write eviction weight (0: off)")
    ap.add_argument("--long-prefill", type=float, default=1.2,
                    help="ExpectedTTFT: own prefill seconds past which the prefill guard also allows the hit's saving "
                         "(negative: never)")
    args = ap.parse_args(argv)
    prefill_guard = args.prefill_guard if args.prefill_guard >= 0 else None
    long_prefill = args.long_prefill if args.long_prefill >= 0 else None
    strata = {"work_weight": args.work_weight, "min_work_weight": args.min_work_weight,
              "sticky_bonus_s": args.sticky_bonus, "load_guard": args.load_guard, "prefill_guard": prefill_guard,
              "tenant_weight": args.tenant_weight, "eviction_weight": args.eviction_weight,
              "long_prefill_s": long_prefill}
    try:
        default = [2, 4] if args.quick else [4, 16, 64]
        counts = [int(x) for x in args.replicas.split(",")] if args.replicas else default
        if not counts or min(counts) < 1 or args.load <= 0:
            raise ValueError("replica counts must be >= 1 and --load > 0")
        if args.requests is not None and (args.shape != "fast25" or args.trace or args.requests < 1):
            raise ValueError("--requests needs --shape fast25 and a count >= 1")
        rates = Rates(prefill_tokens_per_s=args.prefill_rate,
                      load_tokens_per_s={"l1": float("inf"), "l2": args.l2_rate}, decode_step_s=args.decode_step)
        started = time.perf_counter()
        configs = run(counts, rates=rates, load=args.load, quick=args.quick, trace_file=args.trace,
                      shape=args.shape, requests=args.requests, seed=args.seed, **strata)
    except (traces.TraceFormatError, ValueError, OSError) as exc:
        ap.exit(2, f"bench.routing: {exc}\n")
    if args.trace:
        source = args.trace
    elif args.shape == "fast25":
        source = f"generated fast25 shape ({len(configs[0].trace.requests):,} requests, seed {args.seed})"
    else:
        source = f"generated sessions shape (bench.traces, scaled to N, seed {args.seed})"
    weight = args.work_weight if args.work_weight is not None else f"max({args.min_work_weight}, mean waiting)"
    print(f"bench.routing: simulated replicas, prefill {rates.prefill_tokens_per_s:,.0f} tok/s, L2 load "
          f"{args.l2_rate:,.0f} tok/s, decode step {rates.decode_step_s * 1000:.0f} ms; one prefill at a time per "
          f"replica (FCFS), decode beside it; trace {source}; "
          f"ExpectedTTFT w={weight} sticky_bonus={args.sticky_bonus}s load_guard={args.load_guard} "
          f"prefill_guard={prefill_guard} long_prefill={long_prefill} tenant_weight={args.tenant_weight} "
          f"eviction_weight={args.eviction_weight}; SGLang rule "
          f"at its defaults (abs 32, rel 1.0001, cache 0.5)")
    print_tables(configs)
    s = summary(configs)
    print(f"\nsimulated in {time.perf_counter() - started:.1f} s")
    print("RESULT " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in s.items()))


if __name__ == "__main__":
    main()
