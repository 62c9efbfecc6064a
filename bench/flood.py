"""Cache flood: does tenant B's hot prefix keep hitting, and its first token stay fast, while tenant A
floods the same worker with completions and KV uploads?

    .venv/bin/python -m bench.flood [--quick] [--preset small] [--l1-mb 48] [--requests 30]

End to end over HTTP on a throwaway platform (uvicorn + a real Ray worker whose page pool is
``--l1-mb`` MiB, so the flood overruns it many times). Two phases, in the same run:

- **alone**: B sends ``--requests`` streamed completions, each its hot prefix plus a fresh suffix;
- **flood**: the same, while A runs ``--streams`` concurrent completion loops over fresh prompts and
  one KV-upload loop of fresh tokens (A gets 429s when it passes its own in-flight or concurrency
  bound; those are counted, not retried early).

Per phase: B's cached-token ratio (cached / prompt tokens, token-weighted), B's TTFT p50/p99 (request
sent -> first token event), and A's served / throttled requests and uploaded blocks. The flood phase
is compared with the alone phase. Goals: B's hit ratio under flood >= 95% of alone; TTFT p50 <= 1.2x.
"""

from __future__ import annotations

import argparse
import base64
import os
import random
import statistics
import threading
import time

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
                 upload_blocks: int, layout: dict, seed: int) -> None:
        self.url, self.headers, self.model = url, headers, model
        self.streams, self.prompt_tokens, self.upload_blocks = streams, prompt_tokens, upload_blocks
        self.layout = layout
        self.stop = threading.Event()
        self.counts = {"served": 0, "throttled": 0, "other": 0, "uploaded_blocks": 0}
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
        self._threads.append(threading.Thread(target=self._uploads, daemon=True))
        for t in self._threads:
            t.start()
        stop.wait()
        self.stop.set()
        for t in self._threads:
            t.join(timeout=300)
        out.put(dict(self.counts))


def _flood_main(kwargs: dict, stop, out) -> None:
    Flood(**kwargs).run(stop, out)


class FloodProcess:
    """``with FloodProcess(...) as f:`` floods while the block runs; ``f.counts`` afterwards."""

    def __init__(self, **kwargs) -> None:
        import multiprocessing as mp

        self._ctx = mp.get_context("spawn")
        self._kwargs = kwargs
        self.counts: dict[str, int] = {}

    def __enter__(self) -> FloodProcess:
        self._stop, self._out = self._ctx.Event(), self._ctx.Queue()
        self._proc = self._ctx.Process(target=_flood_main, args=(self._kwargs, self._stop, self._out), daemon=True)
        self._proc.start()
        time.sleep(3.0)  # the child starts, then fills the pool before B measures
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.counts = self._out.get(timeout=600)
        self._proc.join(timeout=60)


def _phase(url: str, headers: dict, model: str, hot: list[int], rng: random.Random, n: int) -> dict:
    ttfts, prompt, cached = [], 0, 0
    with httpx.Client(timeout=300) as client:
        for _ in range(n):
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
    ap.add_argument("--quick", action="store_true", help="tiny model, few requests (under a minute)")
    ap.add_argument("--preset", default=None, help="model preset (default small; tiny with --quick)")
    ap.add_argument("--l1-mb", type=int, default=None, help="page pool per worker in MiB")
    ap.add_argument("--requests", type=int, default=None, help="B's requests per phase")
    ap.add_argument("--hot-tokens", type=int, default=None, help="B's shared prefix (512 tiny, 1024 small)")
    ap.add_argument("--streams", type=int, default=3, help="A's concurrent completion loops")
    args = ap.parse_args(argv)
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
        warm = _phase(p.url, p.headers(1), p.model, hot, rng, 2)  # caches B's prefix; warms kernels
        alone = _phase(p.url, p.headers(1), p.model, hot, rng, n)
        flood = FloodProcess(url=p.url, headers=p.headers(0), model=p.model, streams=args.streams,
                             prompt_tokens=min(512, pool_tokens // 4), upload_blocks=16, layout=layout, seed=2)
        with flood:
            under = _phase(p.url, p.headers(1), p.model, hot, rng, n)
        stats = ray.get(p.actor().stats.remote())

    a = flood.counts
    if a["served"] == 0 or under["requests"] != n:
        raise SystemExit("the flood never reached the worker: nothing measured")
    flooded_tokens = a["uploaded_blocks"] * p.block_size
    print(f"cache flood, preset {preset}, pool {info['num_blocks']} blocks ({pool_tokens} tokens), "
          f"B hot prefix {args.hot_tokens} tokens, A {args.streams} completion streams + 1 uploader")
    print(f"{'phase':<8} {'B req':>6} {'B cached/prompt':>16} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} "
          f"{'A served':>9} {'A 429':>6} {'A uploaded tok':>15}")
    print(f"{'alone':<8} {alone['requests']:>6} {alone['ratio']:>16.3f} {alone['p50'] * 1e3:>12.1f} "
          f"{alone['p99'] * 1e3:>12.1f} {0:>9} {0:>6} {0:>15}")
    print(f"{'flood':<8} {under['requests']:>6} {under['ratio']:>16.3f} {under['p50'] * 1e3:>12.1f} "
          f"{under['p99'] * 1e3:>12.1f} {a['served']:>9} {a['throttled']:>6} {flooded_tokens:>15}")
    hit_vs = under["ratio"] / alone["ratio"] if alone["ratio"] else 0.0
    p50_x = under["p50"] / alone["p50"]
    p99_x = under["p99"] / alone["p99"]
    evictions = stats.get("evictions", 0)
    print(f"B's hit ratio under flood: {hit_vs:.3f} of alone (goal >= 0.95); TTFT p50 {p50_x:.2f}x, "
          f"p99 {p99_x:.2f}x of alone (goal p50 <= 1.2x); pool evictions {evictions}; warm-up ratio "
          f"{warm['ratio']:.3f}")
    print(f"RESULT hit_ratio_alone={alone['ratio']:.3f} hit_ratio_flood={under['ratio']:.3f} "
          f"hit_vs_alone={hit_vs:.3f} ttft_p50_alone_ms={alone['p50'] * 1e3:.1f} "
          f"ttft_p50_flood_ms={under['p50'] * 1e3:.1f} ttft_p50_ratio={p50_x:.2f} "
          f"ttft_p99_alone_ms={alone['p99'] * 1e3:.1f} ttft_p99_flood_ms={under['p99'] * 1e3:.1f} "
          f"ttft_p99_ratio={p99_x:.2f} flood_served={a['served']} flood_throttled={a['throttled']} "
          f"flood_uploaded_tokens={flooded_tokens} pool_tokens={pool_tokens} "
          f"goal_hit={int(hit_vs >= 0.95)} goal_ttft={int(p50_x <= 1.2)}")


if __name__ == "__main__":
    main()
