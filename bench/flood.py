"""Cache flood: does tenant B's hot prefix keep hitting, and its first token stay fast, while tenant A
floods the same worker with completions and KV uploads?

    .venv/bin/python -m bench.flood [--quick] [--preset small] [--l1-mb 48] [--requests 30] [--uploaders 1]

End to end over HTTP on a throwaway platform (uvicorn + a real Ray worker whose page pool is
``--l1-mb`` MiB, so the flood overruns it many times). Phases, in the same run:

- **alone**: B sends ``--requests`` streamed completions, each its hot prefix plus a fresh suffix;
- **flood**: the same, while A runs ``--streams`` concurrent completion loops over fresh prompts and
  ``--uploaders`` KV-upload loops of fresh tokens (default one; A gets 429s when it passes its own
  in-flight or concurrency bound; those are counted, not retried early).

Per phase: B's cached-token ratio (cached / prompt tokens, token-weighted), B's TTFT p50/p99 (request
sent -> first token event), and A's served / throttled requests and uploaded blocks. The flood phase
is compared with the alone phase. A third phase, **A alone**, floods as long as the flood phase lasted
with B silent: A's output tokens per second there vs beside B says what B's fair share cost A.

Where B's first token goes (from the worker's scheduler counters, per phase): the mean scheduler step
(forward seconds, tokens per step), B's mean wait in the worker's queue (arrival -> the step computing
its prompt began: the step in flight when it arrived, and prefetch) and B's mean worker-side TTFT
(arrival -> first token); the rest of the client's TTFT is the web process and the HTTP path. ``uploads``
/ ``upload ms``: A's KV stores the worker ran between steps (``Scheduler.submit_work``: value check and
page writes, charged to A) and their mean time; the base64 decode and transfer before them are the web
process's and Ray's, outside the scheduler. ``holds`` / ``B came``: steps the worker held for B after
B's request finished (``STRATA_ANTICIPATE_MS``) and how many of those B's next request ended early.
Goals: B's hit ratio under flood >= 95% of alone; TTFT p50 <= 1.5x and p99 <= 2x of alone.

**On vLLM** (``--engine vllm``; the default ``--engine strata`` is the run above):

    .venv/bin/python -m bench.flood --engine vllm [--quick] [--l1-mb 8] [--l2-mb 4] [--connector both|on|off]

One random Llama checkpoint vLLM's CPU build runs (``tests.hf_checkpoints.build_checkpoint``, head
size 64, context 2048), a deployment ``engine="vllm"`` on it, and the phases **alone** and **flood**
(A: ``--streams`` completion loops of long fresh prompts; no KV uploads, the KV API is the strata
engine's) twice, each on a platform of its own (a fresh process, so a fresh local Ray whose replica
inherits the environment): **vllm+strata** (``STRATA_VLLM_CONNECTOR=1``: a prefix evicted from vLLM's
device cache comes back from Strata's L2, fair share per tenant) and **vllm alone**
(``STRATA_VLLM_CONNECTOR=0``: vLLM's global LRU only). vLLM's device cache is ``--l1-mb`` MiB (8:
``VllmRevision`` raises anything smaller to two context lengths plus 4 MiB, 256 blocks of 32 tokens
here), so A's flood evicts B's prefix from it; L2 is ``--l2-mb`` MiB (4: 128 blocks, A's flood
overruns it while B's half holds its prefix); L3 is off (``STRATA_L3_URL=none``), so a hit under flood
is vLLM's or L2's. Printed side by side: B's cached/prompt ratio and TTFT p50/p99 alone and under
flood, vLLM's evictions and L2's hits during the flood phase; goals: B's hit ratio under flood >= 95%
of alone, TTFT p50 <= 1.5x of alone. ``--connector on`` / ``off`` runs one configuration only.

Under flood B waits, before each request, until none of its blocks is left in vLLM's cache by the
worker's mirror of vLLM's LRU (``workers.vllm_blocks``; at most a minute): on a CPU A pushes far fewer
tokens per second than vLLM's cache holds, and B's back-to-back requests would keep their prefix the
most recently used. So every flood request of B finds its prefix evicted from vLLM; the question is
whether it comes back (from L2) or is recomputed. ``--no-pace``: back to back, as on the strata engine.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench._platform import throwaway_platform


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def _first_token(client: httpx.Client, url: str, headers: dict, body: dict) -> tuple[float, int, int]:
    """(TTFT seconds, prompt tokens, cached tokens) of one streamed completion."""
    t0 = time.perf_counter()
    ttft = None
    usage = None
    with client.stream("POST", f"{url}/v1/completions", headers=headers,
                       json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            if '"usage"' in line:
                import json

                usage = json.loads(line[6:]).get("usage")
    if ttft is None or usage is None:
        raise RuntimeError("stream ended without a token or usage")
    return ttft, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


class Flood:
    """Tenant A's traffic: ``streams`` completion loops and one KV-upload loop, until stopped. Runs in
    its own process (``FloodProcess``) so the attacker's client work does not share this process's GIL
    with B's client and the server: an attacker is another machine."""

    def __init__(self, *, url: str, headers: dict, model: str, streams: int, prompt_tokens: int,
                 upload_blocks: int, layout: dict, seed: int, uploaders: int = 1) -> None:
        self.url, self.headers, self.model = url, headers, model
        self.streams, self.prompt_tokens, self.upload_blocks = streams, prompt_tokens, upload_blocks
        self.layout = layout
        self.uploaders = uploaders
        self.stop = threading.Event()
        self.counts = {"served": 0, "throttled": 0, "other": 0, "uploaded_blocks": 0, "completion_tokens": 0}
        self._lock = threading.Lock()
        self._seed = seed
        self._threads: list[threading.Thread] = []

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def _completions(self, i: int) -> None:
        rng = random.Random(self._seed * 1000 + i)
        with httpx.Client(timeout=300) as client:
            while not self.stop.is_set():
                r = client.post(f"{self.url}/v1/completions", headers=self.headers, json={
                    "model": self.model, "prompt": _tokens(rng, self.prompt_tokens), "max_tokens": 8,
                    "temperature": 0})
                self._outcome(r)
                if r.status_code == 200:
                    self._count("completion_tokens", r.json()["usage"]["completion_tokens"])

    def _uploads(self) -> None:
        import torch

        rng = random.Random(self._seed)
        bs, shape = self.layout["block_size"], self.layout["page_shape"]
        kv = torch.randn(self.upload_blocks, *shape, dtype=getattr(torch, self.layout["dtype"]))
        payload = base64.b64encode(kv.numpy().tobytes()).decode()
        with httpx.Client(timeout=300) as client:
            while not self.stop.is_set():
                r = client.post(f"{self.url}/v1/kv/store", headers=self.headers, json={
                    "model": self.model, "tokens": _tokens(rng, self.upload_blocks * bs), "kv": payload})
                self._outcome(r)
                if r.status_code == 200:
                    self._count("uploaded_blocks", r.json()["stored_blocks"])

    def _outcome(self, r: httpx.Response) -> None:
        if r.status_code == 200:
            self._count("served")
        elif r.status_code == 429:
            self._count("throttled")
            time.sleep(float(r.headers.get("Retry-After", "1")) * 0.1)  # an impatient attacker
        else:
            self._count("other")

    def run(self, stop, out) -> None:
        self._threads = [threading.Thread(target=self._completions, args=(i,), daemon=True)
                         for i in range(self.streams)]
        self._threads += [threading.Thread(target=self._uploads, daemon=True) for _ in range(self.uploaders)]
        t0 = time.perf_counter()
        for t in self._threads:
            t.start()
        stop.wait()
        self.stop.set()
        for t in self._threads:
            t.join(timeout=300)
        out.put({**self.counts, "seconds": time.perf_counter() - t0})


def _flood_main(kwargs: dict, stop, out) -> None:
    Flood(**kwargs).run(stop, out)


class FloodProcess:
    """``with FloodProcess(...) as f:`` floods while the block runs; ``f.counts`` afterwards."""

    def __init__(self, **kwargs) -> None:
        import multiprocessing as mp

        self._ctx = mp.get_context("spawn")
        self._kwargs = kwargs
        self.counts: dict[str, float] = {}
        self.seconds = 0.0  # wall time of the block, start-up wait included

    def __enter__(self) -> FloodProcess:
        self._stop, self._out = self._ctx.Event(), self._ctx.Queue()
        self._proc = self._ctx.Process(target=_flood_main, args=(self._kwargs, self._stop, self._out), daemon=True)
        self._proc.start()
        self._t0 = time.perf_counter()
        time.sleep(3.0)  # the child starts, then fills the pool before B measures
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.seconds = time.perf_counter() - self._t0
        self.counts = self._out.get(timeout=600)
        self._proc.join(timeout=60)


def _sched(actor) -> dict:
    import ray

    return ray.get(actor.stats.remote())["scheduler"]


def _breakdown(before: dict, after: dict, owner: str, sent: int) -> dict:
    """The worker's scheduler figures between two snapshots: mean step, B's queue wait and worker TTFT.
    The scheduler must have counted a first token for each of the ``sent`` requests B sent meanwhile."""
    steps = after["steps"] - before["steps"]
    mine_b, mine_a = before["tenants"].get(owner, {}), after["tenants"].get(owner, {})
    firsts = mine_a.get("first_tokens", 0) - mine_b.get("first_tokens", 0)
    if firsts < sent or steps <= 0:
        raise SystemExit(f"the worker's scheduler counted {firsts} first tokens of B's ({steps} steps) for the "
                         f"{sent} requests B sent: its figures would not describe them; nothing measured")

    def per_first(key: str) -> float:
        return (mine_a.get(key, 0) - mine_b.get(key, 0)) / firsts * 1e3 if firsts else 0.0

    jobs = after.get("work_jobs", 0) - before.get("work_jobs", 0)
    job_s = after.get("work_seconds", 0.0) - before.get("work_seconds", 0.0)
    return {"step_ms": (after["step_seconds"] - before["step_seconds"]) / steps * 1e3 if steps else 0.0,
            "jobs": jobs, "job_ms": job_s / jobs * 1e3 if jobs else 0.0,
            "holds": after.get("holds", 0) - before.get("holds", 0),
            "held_arrivals": after.get("held_arrivals", 0) - before.get("held_arrivals", 0),
            "tokens_per_step": (after["tokens"] - before["tokens"]) / steps if steps else 0.0,
            "lean_steps": after.get("lean_steps", 0) - before.get("lean_steps", 0), "steps": steps,
            "queue_ms": per_first("queue_seconds"), "worker_ttft_ms": per_first("ttft_seconds"),
            "queue_steps": per_first("queue_steps") / 1e3}


def _phase(url: str, headers: dict, model: str, hot: list[int], rng: random.Random, n: int, pace=None) -> dict:
    """B's ``n`` requests, one after another; ``pace()``, when given, runs before each."""
    ttfts, prompt, cached = [], 0, 0
    with httpx.Client(timeout=300) as client:
        for _ in range(n):
            if pace is not None:
                pace()
            t, p, c = _first_token(client, url, headers, {
                "model": model, "prompt": hot + _tokens(rng, 8), "max_tokens": 1, "temperature": 0})
            ttfts.append(t)
            prompt += p
            cached += c
    ttfts.sort()
    return {"requests": n, "ratio": cached / prompt, "p50": statistics.median(ttfts),
            "p99": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="tenant B's hits and TTFT while tenant A floods")
    ap.add_argument("--engine", choices=("strata", "vllm"), default="strata",
                    help="strata: the reference engine (default); vllm: vLLM with and without Strata's connector")
    ap.add_argument("--quick", action="store_true", help="tiny model, few requests (under a minute; vllm: minutes)")
    ap.add_argument("--preset", default=None, help="model preset (default small; tiny with --quick; strata only)")
    ap.add_argument("--l1-mb", type=int, default=None, help="page pool per worker in MiB (vllm: its KV cache, 8)")
    ap.add_argument("--l2-mb", type=int, default=None, help="vllm: Strata's L2 per worker in MiB (default 4)")
    ap.add_argument("--requests", type=int, default=None, help="B's requests per phase")
    ap.add_argument("--hot-tokens", type=int, default=None,
                    help="B's shared prefix (512 tiny, 1024 small; vllm 1024)")
    ap.add_argument("--streams", type=int, default=3, help="A's concurrent completion loops")
    ap.add_argument("--uploaders", type=int, default=1,
                    help="A's concurrent KV-upload loops (0: completions only; strata only)")
    ap.add_argument("--connector", choices=("both", "on", "off"), default="both",
                    help="vllm: with Strata's connector (on), without (off) or both, one platform each")
    ap.add_argument("--no-pace", action="store_true",
                    help="vllm: under flood, B sends back to back instead of after A evicted its prefix from vLLM")
    ap.add_argument("--checkpoint", type=Path, default=None, help="vllm: serve this checkpoint directory")
    ap.add_argument("--json", type=Path, default=None, help="vllm, one configuration: write its figures here")
    args = ap.parse_args(argv)
    if args.engine == "vllm":
        _vllm_main(args)
        return
    preset = args.preset or ("tiny" if args.quick else "small")
    n = args.requests or (10 if args.quick else 30)
    l1_mb = args.l1_mb or (1 if preset == "tiny" else 48)
    args.hot_tokens = args.hot_tokens or (512 if preset == "tiny" else 1024)
    os.environ["STRATA_L1_MB"] = str(l1_mb)  # read by the worker actor (started by the platform below)

    with throwaway_platform(preset=preset, tenants=2, model="flood-model", log_level="ERROR") as p:
        info = p.actor().info.remote()
        import ray

        info = ray.get(info)
        layout = httpx.get(f"{p.url}/v1/kv/layout", params={"model": p.model}, headers=p.headers(1)).json()
        pool_tokens = info["num_blocks"] * p.block_size
        rng = random.Random(1)
        hot = _tokens(rng, args.hot_tokens)
        b_owner = str(p.tenants[1].pk)
        warm = _phase(p.url, p.headers(1), p.model, hot, rng, 2)  # caches B's prefix; warms kernels
        s0 = _sched(p.actor())
        alone = _phase(p.url, p.headers(1), p.model, hot, rng, n)
        s1 = _sched(p.actor())
        a_kwargs = dict(url=p.url, headers=p.headers(0), model=p.model, streams=args.streams,
                        prompt_tokens=min(512, pool_tokens // 4), upload_blocks=16, layout=layout,
                        uploaders=args.uploaders)
        flood = FloodProcess(**a_kwargs, seed=2)
        with flood:
            s2 = _sched(p.actor())
            under = _phase(p.url, p.headers(1), p.model, hot, rng, n)
            s3 = _sched(p.actor())
        solo = FloodProcess(**a_kwargs, seed=3)
        with solo:  # A alone, as long as it flooded beside B (less the same start-up wait)
            time.sleep(max(1.0, flood.seconds - 3.0))
        stats = ray.get(p.actor().stats.remote())

    a, a_alone = flood.counts, solo.counts
    if a["served"] == 0 or under["requests"] != n:
        raise SystemExit("the flood never reached the worker: nothing measured")
    why_alone, why_flood = _breakdown(s0, s1, b_owner, n), _breakdown(s2, s3, b_owner, n)
    a_tps = a["completion_tokens"] / a["seconds"]
    a_alone_tps = a_alone["completion_tokens"] / a_alone["seconds"]
    flooded_tokens = a["uploaded_blocks"] * p.block_size
    print(f"cache flood, preset {preset}, pool {info['num_blocks']} blocks ({pool_tokens} tokens), "
          f"B hot prefix {args.hot_tokens} tokens, A {args.streams} completion streams + {args.uploaders} uploader(s), "
          f"step budget contended {s0.get('contended_budget')} / lean {s0.get('lean_budget')}, "
          f"anticipation {s0.get('anticipate_ms')} ms")
    print(f"{'phase':<8} {'B req':>6} {'B cached/prompt':>16} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} "
          f"{'A served':>9} {'A 429':>6} {'A out tok/s':>12} {'A uploaded tok':>15}")
    print(f"{'alone':<8} {alone['requests']:>6} {alone['ratio']:>16.3f} {alone['p50'] * 1e3:>12.1f} "
          f"{alone['p99'] * 1e3:>12.1f} {0:>9} {0:>6} {0:>12} {0:>15}")
    print(f"{'flood':<8} {under['requests']:>6} {under['ratio']:>16.3f} {under['p50'] * 1e3:>12.1f} "
          f"{under['p99'] * 1e3:>12.1f} {a['served']:>9} {a['throttled']:>6} {a_tps:>12.1f} {flooded_tokens:>15}")
    print(f"{'A alone':<8} {0:>6} {'':>16} {'':>12} {'':>12} {a_alone['served']:>9} {a_alone['throttled']:>6} "
          f"{a_alone_tps:>12.1f} {a_alone['uploaded_blocks'] * p.block_size:>15}")
    print(f"{'worker':<8} {'steps':>6} {'step ms':>8} {'tok/step':>9} {'lean':>5} {'uploads':>8} {'upload ms':>10} "
          f"{'holds':>6} {'B came':>7} {'B queue ms':>11} {'B queue steps':>14} {'B worker TTFT ms':>17}")
    for name, w in (("alone", why_alone), ("flood", why_flood)):
        print(f"{name:<8} {w['steps']:>6} {w['step_ms']:>8.1f} {w['tokens_per_step']:>9.1f} {w['lean_steps']:>5} "
              f"{w['jobs']:>8} {w['job_ms']:>10.1f} {w['holds']:>6} {w['held_arrivals']:>7} {w['queue_ms']:>11.1f} "
              f"{w['queue_steps']:>14.2f} {w['worker_ttft_ms']:>17.1f}")
    hit_vs = under["ratio"] / alone["ratio"] if alone["ratio"] else 0.0
    p50_x = under["p50"] / alone["p50"]
    p99_x = under["p99"] / alone["p99"]
    a_x = a_tps / a_alone_tps if a_alone_tps else 0.0
    evictions = stats.get("evictions", 0)
    print(f"B's hit ratio under flood: {hit_vs:.3f} of alone (goal >= 0.95); TTFT p50 {p50_x:.2f}x, "
          f"p99 {p99_x:.2f}x of alone (goals p50 <= 1.5x, p99 <= 2x); A's output {a_tps:.1f} tok/s beside B, "
          f"{a_x:.2f}x of A alone; pool evictions {evictions}; warm-up ratio {warm['ratio']:.3f}")
    print(f"RESULT hit_ratio_alone={alone['ratio']:.3f} hit_ratio_flood={under['ratio']:.3f} "
          f"hit_vs_alone={hit_vs:.3f} ttft_p50_alone_ms={alone['p50'] * 1e3:.1f} "
          f"ttft_p50_flood_ms={under['p50'] * 1e3:.1f} ttft_p50_ratio={p50_x:.2f} "
          f"ttft_p99_alone_ms={alone['p99'] * 1e3:.1f} ttft_p99_flood_ms={under['p99'] * 1e3:.1f} "
          f"ttft_p99_ratio={p99_x:.2f} flood_served={a['served']} flood_throttled={a['throttled']} "
          f"a_tok_s={a_tps:.1f} a_alone_tok_s={a_alone_tps:.1f} a_tok_s_ratio={a_x:.2f} "
          f"step_ms_alone={why_alone['step_ms']:.1f} step_ms_flood={why_flood['step_ms']:.1f} "
          f"upload_jobs_flood={why_flood['jobs']} upload_ms_flood={why_flood['job_ms']:.1f} "
          f"holds_flood={why_flood['holds']} held_arrivals_flood={why_flood['held_arrivals']} "
          f"b_queue_ms_flood={why_flood['queue_ms']:.1f} b_worker_ttft_ms_flood={why_flood['worker_ttft_ms']:.1f} "
          f"flood_uploaded_tokens={flooded_tokens} pool_tokens={pool_tokens} "
          f"goal_hit={int(hit_vs >= 0.95)} goal_ttft={int(p50_x <= 1.5 and p99_x <= 2.0)}")



# ---------------------------------------------------------------------- vLLM (``--engine vllm``)
VLLM_CONFIGS = (("on", "strata", "vllm+strata"), ("off", "vllm", "vllm alone"))  # --connector, RESULT key, name
PACE_TIMEOUT_S = 60.0  # B's longest wait for A to evict its prefix from vLLM's cache


def _build_vllm_checkpoint(path: Path) -> None:
    from transformers.utils import logging as hf_logging

    from tests.hf_checkpoints import VLLM_CPU_SHAPE, build_checkpoint

    hf_logging.disable_progress_bar()
    build_checkpoint("llama", path, seed=11, max_pos=2048, **VLLM_CPU_SHAPE)


def _l2(stats: dict) -> dict:
    return stats.get("tiers", {}).get("l2") or {}


def _vllm_one(args, ckpt: Path, connector: bool) -> dict:
    """One configuration on a platform of its own (this process's only one): B alone, then B under A's
    flood; the figures as a dict."""
    name = "vllm+strata" if connector else "vllm alone"
    os.environ["STRATA_VLLM_CONNECTOR"] = "1" if connector else "0"  # read by the replica actor (via Ray)
    os.environ["STRATA_L1_MB"] = str(args.l1_mb)
    os.environ["STRATA_L2_MB"] = str(args.l2_mb)
    os.environ["STRATA_L3_URL"] = "none"  # a hit under flood is vLLM's or L2's
    with throwaway_platform(preset=None, tenants=2, model="flood-vllm", log_level="ERROR") as p:
        import ray

        deployment = p.add_model("flood-vllm", revision={"label": "r1", "path": str(ckpt)}, engine="vllm")
        try:
            actor = p.actor()
            info = ray.get(actor.info.remote())
            if (info["tiers"] == "strata") != connector:
                raise SystemExit(f"{name}: the replica runs tiers {info['tiers']!r}, not what was asked")
            pool_tokens = info["num_blocks"] * p.block_size
            a_prompt = min(1536, pool_tokens // 4, info["max_seq_len"] - 16)
            rng = random.Random(1)
            hot = _tokens(rng, args.hot_tokens)
            warm = _phase(p.url, p.headers(1), p.model, hot, rng, 2)  # caches B's prefix; warms the engine
            alone = _phase(p.url, p.headers(1), p.model, hot, rng, args.requests)
            flood = FloodProcess(url=p.url, headers=p.headers(0), model=p.model, streams=args.streams,
                                 prompt_tokens=a_prompt, upload_blocks=0, layout={}, uploaders=0, seed=2)
            b_owner = str(p.tenants[1].pk)
            waits: list[float] = []

            def b_resident() -> int:
                return ray.get(actor.__ray_call__.remote(lambda a: a.worker.blocks.by_owner().get(b_owner, 0)))

            if not b_resident():
                raise SystemExit(f"{name}: the worker's mirror of vLLM's cache holds nothing of B's")

            def evicted() -> None:
                """Wait until, by the worker's mirror of vLLM's LRU (``workers.vllm_blocks``), none of B's
                blocks is left in vLLM's cache: A pushed a whole cache past B since its last request."""
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < PACE_TIMEOUT_S:
                    if b_resident() == 0:
                        break
                    time.sleep(0.05)
                waits.append(time.perf_counter() - t0)

            with flood:
                s0 = ray.get(actor.stats.remote())
                under = _phase(p.url, p.headers(1), p.model, hot, rng, args.requests,
                               pace=None if args.no_pace else evicted)
                s1 = ray.get(actor.stats.remote())
        finally:
            p.stop_model(deployment)
    a = flood.counts
    if a["served"] == 0 or under["requests"] != args.requests:
        raise SystemExit(f"{name}: the flood never reached the worker: nothing measured")
    l2_0, l2_1 = _l2(s0), _l2(s1)
    return {
        "name": name, "tiers": info["tiers"], "num_blocks": info["num_blocks"], "block_size": p.block_size,
        "pool_tokens": pool_tokens, "l2_blocks": info["l2_blocks"], "a_prompt_tokens": a_prompt,
        "warm": warm, "alone": alone, "flood": under,
        "a_served": a["served"], "a_throttled": a["throttled"], "a_other": a["other"],
        "a_tok_s": a["completion_tokens"] / a["seconds"] if a["seconds"] else 0.0,
        "l1_evictions_flood": s1.get("evictions", 0) - s0.get("evictions", 0),
        "l2_hit_tokens_flood": l2_1.get("hit_tokens", 0) - l2_0.get("hit_tokens", 0),
        "l2_evictions_flood": l2_1.get("evictions", 0) - l2_0.get("evictions", 0),
        "l2_resident_b": s1.get("resident_blocks", {}).get("l2", {}).get(b_owner, 0),
        "paced": not args.no_pace, "pace_s": statistics.mean(waits) if waits else 0.0,
        "pace_timeouts": sum(1 for w in waits if w >= PACE_TIMEOUT_S),
    }


def _figures(r: dict) -> dict:
    alone, under = r["alone"], r["flood"]
    hit_vs = under["ratio"] / alone["ratio"] if alone["ratio"] else 0.0
    p50_x, p99_x = under["p50"] / alone["p50"], under["p99"] / alone["p99"]
    return {"hit_vs": hit_vs, "p50_x": p50_x, "p99_x": p99_x, "goal_hit": int(hit_vs >= 0.95),
            "goal_ttft": int(p50_x <= 1.5)}


def _vllm_print_one(r: dict) -> None:
    print(f"{r['name']}: vLLM cache {r['num_blocks']} blocks of {r['block_size']} ({r['pool_tokens']} tokens), "
          f"L2 {r['l2_blocks']} blocks, tiers {r['tiers']}; A {r['a_prompt_tokens']}-token prompts: "
          f"{r['a_served']} served, {r['a_throttled']} throttled, {r['a_tok_s']:.1f} out tok/s; during the flood "
          f"phase vLLM evicted {r['l1_evictions_flood']} blocks, L2 served {r['l2_hit_tokens_flood']} tokens "
          f"and evicted {r['l2_evictions_flood']} blocks, B holds {r['l2_resident_b']} L2 blocks; "
          f"B waited {r['pace_s']:.1f} s per flood request for its prefix to leave vLLM's cache "
          f"({r['pace_timeouts']} timed out); warm-up ratio {r['warm']['ratio']:.3f}", flush=True)


def _vllm_main(args) -> None:
    args.requests = args.requests or (10 if args.quick else 30)
    args.l1_mb = args.l1_mb or 8
    args.l2_mb = args.l2_mb if args.l2_mb is not None else 4
    args.hot_tokens = args.hot_tokens or 1024
    if args.connector != "both":  # one configuration, in this process
        work = None
        if args.checkpoint is None:
            work = Path(tempfile.mkdtemp(prefix="strata-bench-flood-"))
            args.checkpoint = work / "llama"
            _build_vllm_checkpoint(args.checkpoint)
        try:
            r = _vllm_one(args, args.checkpoint, args.connector == "on")
        finally:
            if work is not None:
                shutil.rmtree(work, ignore_errors=True)
        _vllm_print_one(r)
        if args.json is not None:
            args.json.write_text(json.dumps(r))
        else:
            _vllm_report({r["name"]: r}, args)
        return
    work = Path(tempfile.mkdtemp(prefix="strata-bench-flood-"))
    try:
        ckpt = args.checkpoint or work / "llama"
        if args.checkpoint is None:
            _build_vllm_checkpoint(ckpt)
        results = {}
        for connector, _, name in VLLM_CONFIGS:  # one process each: a fresh platform, a fresh Ray
            out = work / f"{connector}.json"
            cmd = [sys.executable, "-m", "bench.flood", "--engine", "vllm", "--connector", connector,
                   "--checkpoint", str(ckpt), "--json", str(out), "--requests", str(args.requests),
                   "--l1-mb", str(args.l1_mb), "--l2-mb", str(args.l2_mb), "--hot-tokens", str(args.hot_tokens),
                   "--streams", str(args.streams), *(["--quick"] if args.quick else []),
                   *(["--no-pace"] if args.no_pace else [])]
            env = {**os.environ, "STRATA_VLLM_CONNECTOR": "1" if connector == "on" else "0"}
            print(f"[flood] {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
            done = subprocess.run(cmd, env=env, cwd=str(Path(__file__).resolve().parents[1]))
            if done.returncode != 0 or not out.is_file():
                raise SystemExit(f"{name}: the run failed (exit status {done.returncode})")
            results[name] = json.loads(out.read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _vllm_report(results, args)


def _vllm_report(results: dict[str, dict], args) -> None:
    first = next(iter(results.values()))
    print(f"cache flood on vLLM{' [quick]' if args.quick else ''}: vLLM cache {first['pool_tokens']} tokens "
          f"(STRATA_L1_MB={args.l1_mb}), L2 {args.l2_mb} MiB, B hot prefix {args.hot_tokens} tokens + 8 fresh, "
          f"{args.requests} requests per phase; A {args.streams} completion streams of "
          f"{first['a_prompt_tokens']}-token fresh prompts; under flood B sends "
          + ("each request once its prefix left vLLM's cache (worker's LRU mirror)" if first["paced"]
             else "back to back"))
    print(f"{'config':<12} {'B cached/prompt':>15} {'':>6} {'':>9} {'TTFT p50 ms':>11} {'':>8} {'':>6} "
          f"{'TTFT p99 ms':>11} {'':>8} {'':>6} {'A':>6} {'A':>5} {'vLLM':>8} {'L2 hit':>8}")
    print(f"{'':<12} {'alone':>15} {'flood':>6} {'vs alone':>9} {'alone':>11} {'flood':>8} {'x':>6} "
          f"{'alone':>11} {'flood':>8} {'x':>6} {'served':>6} {'429':>5} {'evicted':>8} {'tokens':>8}")
    for name, r in results.items():
        f, alone, under = _figures(r), r["alone"], r["flood"]
        print(f"{name:<12} {alone['ratio']:>15.3f} {under['ratio']:>6.3f} {f['hit_vs']:>9.3f} "
              f"{alone['p50'] * 1e3:>11.1f} {under['p50'] * 1e3:>8.1f} {f['p50_x']:>6.2f} "
              f"{alone['p99'] * 1e3:>11.1f} {under['p99'] * 1e3:>8.1f} {f['p99_x']:>6.2f} "
              f"{r['a_served']:>6} {r['a_throttled']:>5} {r['l1_evictions_flood']:>8} {r['l2_hit_tokens_flood']:>8}")
    for name, r in results.items():
        f = _figures(r)
        print(f"{name}: B's hit ratio under flood {f['hit_vs']:.3f} of alone (goal >= 0.95: "
              f"{'met' if f['goal_hit'] else 'MISSED'}); TTFT p50 {f['p50_x']:.2f}x of alone (goal <= 1.5x: "
              f"{'met' if f['goal_ttft'] else 'MISSED'}), p99 {f['p99_x']:.2f}x")
    fields: dict[str, str] = {}
    for _, key, name in VLLM_CONFIGS:
        r = results.get(name)
        if r is None:
            continue
        f, alone, under = _figures(r), r["alone"], r["flood"]
        fields.update({
            f"hit_ratio_alone_{key}": f"{alone['ratio']:.3f}", f"hit_ratio_flood_{key}": f"{under['ratio']:.3f}",
            f"hit_vs_alone_{key}": f"{f['hit_vs']:.3f}",
            f"ttft_p50_alone_ms_{key}": f"{alone['p50'] * 1e3:.1f}",
            f"ttft_p50_flood_ms_{key}": f"{under['p50'] * 1e3:.1f}", f"ttft_p50_ratio_{key}": f"{f['p50_x']:.2f}",
            f"ttft_p99_alone_ms_{key}": f"{alone['p99'] * 1e3:.1f}",
            f"ttft_p99_flood_ms_{key}": f"{under['p99'] * 1e3:.1f}", f"ttft_p99_ratio_{key}": f"{f['p99_x']:.2f}",
            f"flood_served_{key}": str(r["a_served"]), f"flood_throttled_{key}": str(r["a_throttled"]),
            f"a_tok_s_{key}": f"{r['a_tok_s']:.1f}", f"vllm_evictions_flood_{key}": str(r["l1_evictions_flood"]),
            f"l2_hit_tokens_flood_{key}": str(r["l2_hit_tokens_flood"]),
            f"l2_evictions_flood_{key}": str(r["l2_evictions_flood"]), f"b_pace_s_{key}": f"{r['pace_s']:.2f}",
            f"goal_hit_{key}": str(f["goal_hit"]), f"goal_ttft_{key}": str(f["goal_ttft"]),
        })
    fields.update(pool_tokens=str(first["pool_tokens"]), l2_blocks=str(max(r["l2_blocks"] for r in results.values())),
                  hot_tokens=str(args.hot_tokens), requests=str(args.requests))
    print("RESULT " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)


if __name__ == "__main__":
    main()
