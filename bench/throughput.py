"""Throughput and TTFT of the scheduler (continuous batching) against the serialised generator.

    .venv/bin/python -m bench.throughput [--quick] [--preset small] [--device cpu]

Workload in the style of SGLang's generated-shared-prefix benchmark, scaled to the ``small`` model
on a CPU: ``--groups`` groups of requests share a system prompt (``--system`` tokens), each request
adds its own question (``--question`` tokens) and generates ``--output`` tokens (no early stop);
requests are interleaved across groups. Three parts, each on a fresh engine per run:

1. **Concurrency** 1, 4, 16, 64 (``--quick``: 1, 4, 16) streams, each stream sending its requests one
   after another: output tokens/s, TTFT p50/p99 (stream call -> first token) and the token-weighted
   hit ratio (cached / prompt tokens), for the **serial** baseline (the generator as it was before the
   scheduler, kept here: one forward at a time behind a lock, prefill in 256-token chunks) and the
   **batched** scheduler (with the scheduler's default token budget per step, 512, as workers deploy
   it; ``--token-budget`` to change), in the same run. Goal: >= 4x serial throughput at 16 streams, lower p99
   TTFT at every concurrency.
2. **Two tenants**: a steady tenant sends its requests (long private prompts) one at a time with a
   pause between, alone and then while another tenant bursts the shared-prefix workload at 16
   streams. Goal: the steady tenant's p99 TTFT under the burst <= 1.5x alone.
3. **Ordering**: the shared-prefix workload submitted at once (16 streams, a 4x larger token budget
   so that a step can start many requests), cache-aware ordering with aging against
   first-come-first-served: hit ratio (goal: higher) and the longest queue wait.
"""

from __future__ import annotations

import argparse
import random
import secrets
import threading
import time
from dataclasses import dataclass

import torch

from cachecore.engine import CacheEngine
from cachecore.model.loader import RevisionSpec, load_model
from cachecore.runner import CompletionRunner, Prefilled, SamplingParams, TokenOut
from cachecore.scheduler import Scheduler
from cachecore.scheduler.settings import SchedulerSettings

SERIAL_CHUNK = 256  # the old generator's default prefill chunk
THINK = 0.2  # seconds between the steady tenant's requests
ORDER_BUDGET_X = 4  # part 3 runs with a larger token budget: room to start many requests per step


class SerialGenerator:
    """The pre-scheduler generator, kept as the baseline: each stream runs its own forwards, one
    forward at a time on the device (a lock), prefill in chunks of 256 tokens, greedy decode."""

    def __init__(self, model, engine: CacheEngine) -> None:
        self.model, self.engine = model, engine
        self.lock = threading.Lock()

    def _forward(self, seq, start: int, end: int) -> torch.Tensor:
        dev = self.engine.pages.device
        chunk = torch.tensor(seq.tokens[start:end], dtype=torch.long, device=dev)
        table = torch.tensor(seq.block_table, dtype=torch.long, device=dev)
        with self.lock:
            logits = self.model.forward(chunk, start, table, self.engine.pages)[-1]
        self.engine.mark_computed(seq, end)
        return logits

    def stream(self, ns, tokens: list[int], *, owner: str, params: SamplingParams, **_):
        seq = self.engine.admit(ns, tokens, owner=owner, model="bench", revision="r1",
                                max_new_tokens=params.max_tokens)
        try:
            t0 = time.perf_counter()
            self.engine.finish_loads(seq)
            start, logits = seq.num_cached_tokens, None
            while start < len(tokens):
                stop = min(len(tokens), start + SERIAL_CHUNK)
                logits = self._forward(seq, start, stop)
                start = stop
            self.engine.commit(seq)
            yield Prefilled(len(tokens), seq.num_cached_tokens, time.perf_counter() - t0)
            for i in range(params.max_tokens):
                token = int(torch.argmax(logits))
                yield TokenOut(token, "")
                if i + 1 == params.max_tokens:
                    break
                self.engine.append_token(seq, token)
                logits = self._forward(seq, len(seq.tokens) - 1, len(seq.tokens))
        finally:
            self.engine.release(seq)


@dataclass
class Run:
    wall: float
    out_tokens: int
    ttfts: list[float]
    prompt_tokens: int
    cached_tokens: int
    sched: dict | None = None

    @property
    def tps(self) -> float:
        return self.out_tokens / self.wall

    @property
    def hit(self) -> float:
        return self.cached_tokens / max(1, self.prompt_tokens)

    def p(self, q: float) -> float:
        xs = sorted(self.ttfts)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def _one(gen, ns, prompt, owner, params, out: list) -> None:
    t0 = time.perf_counter()
    ttft, n, cached = None, 0, None
    for ev in gen.stream(ns, prompt, owner=owner, params=params):
        if isinstance(ev, Prefilled):
            cached = ev.cached_tokens
        elif isinstance(ev, TokenOut):
            n += 1
            if ttft is None:
                ttft = time.perf_counter() - t0
    out.append((ttft, n, len(prompt), cached))


def drive(gen, ns, jobs: list[tuple[list[int], str]], streams: int, params: SamplingParams,
          started: threading.Event | None = None, think: float = 0.0) -> Run:
    """Run ``jobs`` (prompt, owner) on ``streams`` threads, each taking the next job when done
    (after ``think`` seconds)."""
    out: list = []
    lock = threading.Lock()
    queue = list(jobs)

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                prompt, owner = queue.pop(0)
            _one(gen, ns, prompt, owner, params, out)
            time.sleep(think)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(streams)]
    for t in threads:
        t.start()
    if started is not None:
        started.set()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    # Every request must have been seen whole (a stream thread that died leaves no record): its
    # Prefilled event (the hit ratio), its first token (TTFT) and all its tokens (throughput).
    blind = [o for o in out if o[0] is None or o[3] is None or o[1] != params.max_tokens]
    if len(out) != len(jobs) or blind:
        raise SystemExit(f"{len(jobs) - len(out)} of {len(jobs)} requests left no record and {len(blind)} no first "
                         f"token, Prefilled event or all {params.max_tokens} tokens: nothing measured")
    return Run(wall, sum(o[1] for o in out), [o[0] for o in out if o[0] is not None],
               sum(o[2] for o in out), sum(o[3] for o in out))


def workload(rng: random.Random, groups: int, per_group: int, system: int, question: int) -> list[list[int]]:
    prompts = [[rng.randrange(32, 127) for _ in range(system)] for _ in range(groups)]
    reqs = [[p + [rng.randrange(32, 127) for _ in range(question)] for _ in range(per_group)] for p in prompts]
    return [reqs[g][i] for i in range(per_group) for g in range(groups)]  # interleaved across groups


def main(argv: list[str] | None = None) -> dict[str, str]:
    ap = argparse.ArgumentParser(description="scheduler throughput vs the serialised generator")
    ap.add_argument("--quick", action="store_true", help="fewer streams and shorter requests (under a minute)")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default=None)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--system", type=int, default=None, help="shared system prompt tokens")
    ap.add_argument("--question", type=int, default=32)
    ap.add_argument("--output", type=int, default=None, help="generated tokens per request")
    ap.add_argument("--token-budget", type=int, default=SchedulerSettings().token_budget,
                    help="the batched scheduler's tokens per step (default: the scheduler's, as workers deploy it, "
                         "STRATA_TOKEN_BUDGET)")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--levels", default=None, help="comma-separated stream counts (default 1,4,16,64; quick 1,4,16)")
    args = ap.parse_args(argv)
    levels = (1, 4, 16) if args.quick else (1, 4, 16, 64)
    if args.levels:
        levels = tuple(int(x) for x in args.levels.split(","))
        if 16 not in levels:
            ap.error("--levels must include 16 (the throughput goal is stated at 16 streams)")
    system = args.system or (128 if args.quick else 256)
    output = args.output or (8 if args.quick else 24)
    loaded = load_model("bench-throughput", args.preset, RevisionSpec(label="r1", seed=11), device=args.device)
    model, bs = loaded.model, loaded.block_size
    params = SamplingParams(max_tokens=output, stop_at_eos=False)
    per_req = -(-(system + args.question + output) // bs)
    max_batch = max(levels) + 4

    def batched(policy: str = "cache_aware", budget: int | None = None) -> CompletionRunner:
        engine = CacheEngine(loaded.layout, num_blocks=max(256, 4 * max_batch * per_req), device=model.device)
        for owner in ("a", "b"):
            engine.set_inflight_limit(owner, engine.pool.num_blocks * bs)
        # a step under contention keeps room for every running decode plus a chunk (64 streams: 68 requests)
        sched = Scheduler(engine, token_budget=max(budget or args.token_budget, max_batch + 1),
                          max_batch=max_batch, policy=policy,
                          contended_budget=max(SchedulerSettings().contended_budget, max_batch + 1))
        return CompletionRunner(model, engine, loaded.tokenizer, model_name="bench", revision="r1", scheduler=sched,
                         prefill_chunk=args.chunk)

    def serial() -> SerialGenerator:
        engine = CacheEngine(loaded.layout, num_blocks=max(256, 4 * max_batch * per_req), device=model.device)
        engine.set_inflight_limit("a", engine.pool.num_blocks * bs)
        return SerialGenerator(model, engine)

    ns = loaded.namespace(secrets.token_bytes(32))
    drive(batched(), ns, [([1] * 40, "a")] * 2, 2, params)  # warm-up: allocator, kernels

    # 1. concurrency sweep
    print(f"shared-prefix workload: {args.groups} groups x {system}-token system prompt + {args.question}-token "
          f"question, {output} output tokens; preset {args.preset}, device {model.device}, "
          f"threads {torch.get_num_threads()}, token budget {max(args.token_budget, max_batch + 1)}, "
          f"chunk {args.chunk}")
    print(f"{'streams':>7} {'mode':<8} {'reqs':>4} {'out tok/s':>9} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} "
          f"{'hit':>6} {'speedup':>7}")
    sweep: dict[int, tuple[Run, Run]] = {}
    for c in levels:
        n = max(c, 8) if not args.quick else max(c, 4)
        prompts = workload(random.Random(c), args.groups, -(-n // args.groups), system, args.question)[:n]
        jobs = [(p, "a") for p in prompts]
        s = drive(serial(), ns, jobs, c, params)
        b = drive(batched(), ns, jobs, c, params)
        sweep[c] = (s, b)
        for name, r in (("serial", s), ("batched", b)):
            print(f"{c:>7} {name:<8} {len(jobs):>4} {r.tps:>9.1f} {r.p(0.5) * 1000:>11.1f} {r.p(0.99) * 1000:>11.1f} "
                  f"{r.hit:>6.1%} {r.tps / s.tps:>6.2f}x")
    c16 = 16
    speedup16 = sweep[c16][1].tps / sweep[c16][0].tps
    p99_lower = all(b.p(0.99) < s.p(0.99) for s, b in sweep.values())

    # 2. two tenants, one bursting
    rng = random.Random(99)
    steady_n, steady_len = (4, 4 * system) if args.quick else (8, 4 * system)
    steady = [([rng.randrange(32, 127) for _ in range(steady_len)], "b") for _ in range(steady_n)]
    alone = drive(batched(), ns, steady, 1, params, think=THINK)
    gen = batched()
    burst_prompts = workload(random.Random(7), args.groups, 8, system, args.question)
    go = threading.Event()
    burst: dict = {}
    bt = threading.Thread(target=lambda: burst.setdefault("run", drive(gen, ns, [(p, "a") for p in burst_prompts],
                                                                        16, params, started=go)))
    bt.start()
    go.wait()
    time.sleep(0.2)  # the burst is queued and running before the steady tenant starts
    under = drive(gen, ns, steady, 1, params, think=THINK)
    bt.join()
    ratio = under.p(0.99) / alone.p(0.99)
    print(f"\ntwo tenants: steady tenant ({steady_n} requests of {steady_len} private tokens, one at a time, "
          f"{THINK}s apart) alone vs while another bursts {len(burst_prompts)} requests at 16 streams")
    print(f"{'case':<14} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11}")
    print(f"{'alone':<14} {alone.p(0.5) * 1000:>11.1f} {alone.p(0.99) * 1000:>11.1f}")
    print(f"{'under burst':<14} {under.p(0.5) * 1000:>11.1f} {under.p(0.99) * 1000:>11.1f}   "
          f"p99 {ratio:.2f}x of alone (goal <= 1.5x)")

    # 3. cache-aware ordering with aging vs FCFS
    prompts = workload(random.Random(5), args.groups, 4, system, args.question)
    order: dict[str, tuple[Run, dict]] = {}
    for policy in ("cache_aware", "fcfs"):
        g = batched(policy, budget=ORDER_BUDGET_X * args.token_budget)
        r = drive(g, ns, [(p, "a") for p in prompts], 16, params)
        order[policy] = (r, g.scheduler.snapshot())
    print(f"\nordering: {len(prompts)} shared-prefix requests at once (16 streams), token budget "
          f"{ORDER_BUDGET_X * args.token_budget}")
    print(f"{'policy':<12} {'hit':>6} {'out tok/s':>9} {'TTFT p99 ms':>11} {'longest wait ms':>15} {'wait steps':>10}")
    for policy, (r, snap) in order.items():
        print(f"{policy:<12} {r.hit:>6.1%} {r.tps:>9.1f} {r.p(0.99) * 1000:>11.1f} "
              f"{snap['max_wait_seconds'] * 1000:>15.1f} {snap.get('max_wait_steps', 0):>10}")
    ca, fc = order["cache_aware"][0], order["fcfs"][0]
    print(f"\nat 16 streams: {speedup16:.2f}x serial throughput (goal >= 4x); p99 TTFT lower at every "
          f"concurrency: {'yes' if p99_lower else 'no'}; burst p99 {ratio:.2f}x alone (goal <= 1.5x); "
          f"cache-aware hit {ca.hit:.1%} vs FCFS {fc.hit:.1%}")
    result = (f"RESULT speedup_16={speedup16:.2f} " + " ".join(
        f"tps_{c}={b.tps:.1f} serial_tps_{c}={s.tps:.1f} p99_{c}_ms={b.p(0.99) * 1000:.1f} "
        f"serial_p99_{c}_ms={s.p(0.99) * 1000:.1f}" for c, (s, b) in sweep.items())
        + f" p99_lower_all={int(p99_lower)} burst_p99_ratio={ratio:.2f} hit_cache_aware={ca.hit:.3f} "
        f"hit_fcfs={fc.hit:.3f} longest_wait_cache_aware_ms={order['cache_aware'][1]['max_wait_seconds'] * 1000:.1f} "
        f"longest_wait_fcfs_ms={order['fcfs'][1]['max_wait_seconds'] * 1000:.1f} device={model.device}")
    print(result)
    return dict(kv.split("=") for kv in result.split()[1:])


if __name__ == "__main__":
    main()
