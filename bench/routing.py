"""Routing across replicas: does routing by expected TTFT beat round robin, least loaded and SGLang's rule?

    .venv/bin/python -m bench.routing [--quick] [--trace FILE] [--replicas 4,16,64] [--load 0.75]

A discrete-event simulation (``bench._routing_sim``) of N replicas serving a trace, once per policy
on the same requests: round robin, least loaded, the SGLang router's cache-aware rule (its default
thresholds) and Strata's ``ExpectedTTFT``; every policy routes with the same knowledge (each
replica's reported state and the request's exact hit on every replica). Replicas prefill one request
at a time with the router's own cost model (``cachecore.routing.cost``) at true rates, and cache
512-token blocks in L1 + L2 with LRU and fair-share eviction per tenant.

For each N (default 4, 16, 64; ``--quick``: 2 and 4 on a shorter trace) and each cache size (the
replicas' caches together hold 10%, 50% and 100% of the trace's working set, its distinct full
blocks; a quarter of each replica's share is L1, the rest L2) a table: mean and p99 TTFT,
token-weighted hit ratio (prompt tokens loaded from cache / prompt tokens) and load imbalance (max /
mean of the replicas' busy prefill seconds), with the trace's infinite-cache hit bound.

The trace (``--trace FILE``: Mooncake FAST'25 JSONL, ``timestamp`` in ms drives arrivals) defaults to
``bench.traces.generate_trace`` scaled to N (``default_trace``: ``16 N`` sessions, at least 400, over
``max(4, N)`` shared system prompts, a quarter as many one-off requests). The arrival rate is set so
that the trace's prompt tokens, prefilled without any cache, would keep ``--load`` (default 75%) of the
aggregate prefill capacity busy (``bench._routing_trace``): every policy can keep up, and caching is
what separates them.

Goal: Strata's mean and p99 TTFT lower than every other policy's at every N and size, and at 100% its
hit ratio at least 90% of the bound. The RESULT line gives the worst case over all configurations of
Strata's mean and p99 over the best other policy's (below 1 is better), the lowest Strata hit / bound
at 100%, and whether the goal was met.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass

from bench import traces
from bench._routing_sim import SimResult, simulate
from bench._routing_trace import SimTrace, prepare
from cachecore.routing.cost import CostModel, Rates
from cachecore.routing.policies import ExpectedTTFT, LeastLoaded, Policy, RoundRobin, SGLangRule

FRACS = (0.1, 0.5, 1.0)
STRATA = ExpectedTTFT.name


@dataclass(frozen=True)
class Config:
    replicas: int
    frac: float
    l1_blocks: int
    l2_blocks: int
    trace: SimTrace
    results: list[SimResult]

    def result(self, name: str) -> SimResult:
        return next(r for r in self.results if r.policy == name)


def policies(cost: CostModel, *, sticky_bonus_s: float, load_guard: float) -> list[Policy]:
    """A fresh instance of every compared policy (each run starts with no routing state)."""
    return [
        RoundRobin(),
        LeastLoaded(),
        SGLangRule(),
        ExpectedTTFT(cost, sticky_bonus_s=sticky_bonus_s, load_guard=load_guard),
    ]


def default_trace(replicas: int, *, quick: bool, seed: int = 0) -> list[traces.TraceRequest]:
    """``bench.traces.generate_trace`` scaled to ``replicas``: ``16 N`` sessions (at least 400, so that a
    p99 is taken over more than a thousand requests; ``--quick``: ``6 N``, at least 60) over ``max(4,
    N)`` shared system prompts, and a quarter as many one-off requests."""
    sessions = max(60, 6 * replicas) if quick else max(400, 16 * replicas)
    return traces.generate_trace(sessions=sessions, system_prompts=max(4, replicas), one_offs=sessions // 4, seed=seed)


def run(
    replica_counts: Sequence[int], *, rates: Rates, load: float, quick: bool, trace_file: str | None = None,
    fracs: Sequence[float] = FRACS, sticky_bonus_s: float = 0.05, load_guard: float = 2.0, seed: int = 0,
) -> list[Config]:
    """Every (N, cache size) configuration, every policy simulated on the same requests."""
    cost = CostModel()
    from_file = traces.read_trace(trace_file) if trace_file else None
    out = []
    for n in replica_counts:
        raw = from_file if from_file is not None else default_trace(n, quick=quick, seed=seed)
        trace = prepare(raw, replicas=n, prefill_tokens_per_s=rates.prefill_tokens_per_s, load=load)
        for frac in fracs:
            per_replica = max(2, round(frac * trace.unique_blocks / n))
            l1 = max(1, per_replica // 4)
            l2 = per_replica - l1
            results = [
                simulate(trace.requests, p, replicas=n, rates=rates, l1_blocks=l1, l2_blocks=l2, cost=cost)
                for p in policies(cost, sticky_bonus_s=sticky_bonus_s, load_guard=load_guard)
            ]
            out.append(Config(n, frac, l1, l2, trace, results))
    return out


def summary(configs: Sequence[Config]) -> dict[str, float | bool]:
    """Worst-case Strata / best-other ratios of mean and p99 TTFT, lowest hit / bound at 100%, goal."""
    mean_ratio = p99_ratio = 0.0
    hit_vs_bound = float("inf")
    beats_all = True
    for c in configs:
        strata = c.result(STRATA)
        others = [r for r in c.results if r.policy != STRATA]
        best_mean = min(r.mean_ttft for r in others)
        best_p99 = min(r.p99_ttft for r in others)
        mean_ratio = max(mean_ratio, strata.mean_ttft / best_mean)
        p99_ratio = max(p99_ratio, strata.p99_ttft / best_p99)
        beats_all &= strata.mean_ttft < best_mean and strata.p99_ttft < best_p99
        if c.frac == 1.0:
            hit_vs_bound = min(hit_vs_bound, strata.hit_ratio / c.trace.infinite_hit)
    has_full = hit_vs_bound != float("inf")
    return {
        "strata_vs_best_mean_ttft": mean_ratio,
        "strata_vs_best_p99": p99_ratio,
        "hit_vs_bound_100": hit_vs_bound if has_full else float("nan"),
        "goal_met": beats_all and has_full and hit_vs_bound >= 0.9,
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
              f"(L1 {c.l1_blocks} + L2 {c.l2_blocks})")
        header = (f"  {'policy':<14} {'mean TTFT s':>12} {'p99 TTFT s':>11} {'hit ratio':>10} {'vs bound':>9} "
                  f"{'imbalance':>10}")
        print(header)
        print("  " + "-" * (len(header) - 2))
        for r in c.results:
            print(f"  {r.policy:<14} {r.mean_ttft:>12.3f} {r.p99_ttft:>11.3f} {r.hit_ratio:>10.1%} "
                  f"{r.hit_ratio / t.infinite_hit:>9.1%} {r.imbalance:>10.2f}")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="simulated routing across N replicas: four policies compared")
    ap.add_argument("--quick", action="store_true", help="N = 2, 4 on a shorter generated trace")
    ap.add_argument("--trace", help="a Mooncake FAST'25 JSONL trace (default: bench.traces.generate_trace scaled to N)")
    ap.add_argument("--replicas", help="comma-separated replica counts (default 4,16,64; quick 2,4)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the generated trace")
    ap.add_argument("--load", type=float, default=0.75, help="offered load without cache, of prefill capacity")
    ap.add_argument("--prefill-rate", type=float, default=10_000.0, help="prefill tokens/s per replica")
    ap.add_argument("--l2-rate", type=float, default=100_000.0, help="tokens/s of KV loaded from L2")
    ap.add_argument("--decode-step", type=float, default=0.03, help="seconds per decode step")
    ap.add_argument("--sticky-bonus", type=float, default=0.05, help="ExpectedTTFT stickiness bound, seconds")
    ap.add_argument("--load-guard", type=float, default=2.0, help="ExpectedTTFT load guard, seconds of queue")
    args = ap.parse_args(argv)
    try:
        default = [2, 4] if args.quick else [4, 16, 64]
        counts = [int(x) for x in args.replicas.split(",")] if args.replicas else default
        if not counts or min(counts) < 1 or args.load <= 0:
            raise ValueError("replica counts must be >= 1 and --load > 0")
        rates = Rates(prefill_tokens_per_s=args.prefill_rate,
                      load_tokens_per_s={"l1": float("inf"), "l2": args.l2_rate}, decode_step_s=args.decode_step)
        started = time.perf_counter()
        configs = run(counts, rates=rates, load=args.load, quick=args.quick, trace_file=args.trace,
                      sticky_bonus_s=args.sticky_bonus, load_guard=args.load_guard, seed=args.seed)
    except (traces.TraceFormatError, ValueError, OSError) as exc:
        ap.exit(2, f"bench.routing: {exc}\n")
    source = args.trace or f"generated (bench.traces, scaled to N, seed {args.seed})"
    print(f"bench.routing: simulated replicas, prefill {rates.prefill_tokens_per_s:,.0f} tok/s, L2 load "
          f"{args.l2_rate:,.0f} tok/s, decode step {rates.decode_step_s * 1000:.0f} ms; one prefill at a time per "
          f"replica (FCFS), decode beside it; trace {source}; "
          f"ExpectedTTFT sticky_bonus={args.sticky_bonus}s load_guard={args.load_guard}s; SGLang rule at its "
          f"defaults (abs 32, rel 1.0001, cache 0.5)")
    print_tables(configs)
    s = summary(configs)
    print(f"\nsimulated in {time.perf_counter() - started:.1f} s")
    print("RESULT " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in s.items()))


if __name__ == "__main__":
    main()
