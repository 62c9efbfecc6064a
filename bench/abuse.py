"""Oversized requests: can one tenant's maximal bodies slow the web process down for another tenant?

    .venv/bin/python -m bench.abuse [--quick] [--requests 300] [--attackers 4] [--rate 20]

End to end over HTTP on a throwaway platform (uvicorn in this process + a real Ray worker, tiny
model). Tenant A (``requests_per_minute=2`` or ``--rpm``, ``max_prompt_tokens=256``, as in issue 17) runs
``--attackers`` loops in another process, ``--rate`` requests a second in all (0: each loop as fast
as it is answered, which measures the refusal rate more than any body), each sending in turn the
largest body of each kind:

- ``chat``: as many empty chat messages as fit the serving body limit (``STRATA_SERVING_MAX_BODY_BYTES``);
- ``string``: a string prompt of that size;
- ``tokens``: a token-id list of that size;
- ``kv_store``: a KV upload of the largest body its model can need (``serving.bounds.kv_store_body_limit``);
- ``oversize``: a 31 MiB chat (1,000,000 messages), the size of the issue's requests.

Tenant B meanwhile measures, one request at a time, ``GET /v1/models`` and a small completion
(``max_tokens=1``): first alone, then under the attack. Printed: B's p50/p99 of each alone and under
attack and their ratio, A's responses by status (a refused upload the server cut off is ``closed``),
and the web process's RSS growth (this process: it runs uvicorn) from before the attack to its peak
during it. Goal: B's p50 within 1.5x of alone, RSS growth under 200 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from collections import Counter

import httpx

from bench._platform import throwaway_platform

MiB = 1024 * 1024


def rss_mb(pid: int | str = "self") -> float:
    """Resident set size of ``pid`` in MB (psutil when installed, else /proc)."""
    try:
        import psutil

        return psutil.Process(None if pid == "self" else int(pid)).memory_info().rss / 1e6
    except ImportError:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024 / 1e6
    return 0.0


def bodies(model: str, serving_limit: int, kv_limit: int) -> dict[str, tuple[str, bytes]]:
    """The attacker's bodies by kind: (path, JSON bytes), each at (just under) its limit."""
    def fill(prefix: bytes, item: bytes, suffix: bytes, limit: int, sep: bytes = b",") -> bytes:
        n = max(1, (limit - len(prefix) - len(suffix)) // (len(item) + len(sep)))
        return prefix + sep.join([item] * n) + suffix

    head = b'{"model":' + json.dumps(model).encode()
    return {
        "chat": ("/v1/chat/completions",
                 fill(head + b',"messages":[', b'{"role":"user","content":""}', b"]}", serving_limit)),
        "string": ("/v1/completions", head + b',"prompt":"' + b"x" * (serving_limit - len(head) - 16) + b'"}'),
        "tokens": ("/v1/completions", fill(head + b',"prompt":[', b"7", b"]}", serving_limit)),
        "kv_store": ("/v1/kv/store", head + b',"tokens":[' + b",".join([b"1"] * 16) + b'],"kv":"'
                     + b"A" * (kv_limit - len(head) - 64) + b'"}'),
        "oversize": ("/v1/chat/completions",
                     fill(head + b',"messages":[', b'{"role":"user","content":""}', b"]}", 31 * MiB)),
    }


def _attack_main(url: str, key: str, kinds: dict, threads: int, rate: float, stop, out) -> None:
    counts: Counter = Counter()
    lock = threading.Lock()

    def loop(offset: int) -> None:
        names = sorted(kinds)
        i, period = offset, threads / rate if rate > 0 else 0.0
        next_at = time.perf_counter()
        with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {key}",
                                               "Content-Type": "application/json"}) as client:
            while not stop.is_set():
                next_at += period  # paced: each loop sends its share of ``rate`` (0: as fast as answered)
                if stop.wait(max(0.0, next_at - time.perf_counter())):
                    break
                name = names[i % len(names)]
                path, body = kinds[name]
                i += 1
                try:
                    status = str(client.post(f"{url}{path}", content=body).status_code)
                except httpx.HTTPError:  # the server answered 413 and closed while the body was going out
                    status = "closed"
                with lock:
                    counts[status] += 1
                    counts[f"{name}:{status}"] += 1

    workers = [threading.Thread(target=loop, args=(n,), daemon=True) for n in range(threads)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    stop.wait()
    for w in workers:
        w.join(timeout=120)
    out.put({**counts, "seconds": time.perf_counter() - t0})


def _victim(url: str, headers: dict, model: str, n: int) -> dict[str, list[float]]:
    """``n`` sequential ``/v1/models`` and ``n`` small completions, interleaved; seconds each."""
    out: dict[str, list[float]] = {"models": [], "completion": []}
    body = {"model": model, "prompt": "hello", "max_tokens": 1, "temperature": 0}
    with httpx.Client(timeout=120, headers=headers) as client:
        for _ in range(n):
            t0 = time.perf_counter()
            assert client.get(f"{url}/v1/models").status_code == 200
            out["models"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            r = client.post(f"{url}/v1/completions", json=body)
            assert r.status_code == 200, r.text[:200]
            out["completion"].append(time.perf_counter() - t0)
    return out


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class _PeakRSS:
    """The highest RSS of this process while the block runs, sampled every 50 ms."""

    def __enter__(self) -> _PeakRSS:
        self.peak, self._stop = rss_mb(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, rss_mb())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="tenant B's latency while tenant A sends maximal bodies")
    ap.add_argument("--quick", action="store_true", help="fewer samples (under a minute)")
    ap.add_argument("--requests", type=int, default=None, help="B's requests of each kind per phase (100 quick)")
    ap.add_argument("--attackers", type=int, default=4, help="A's concurrent request loops")
    ap.add_argument("--rate", type=float, default=20.0,
                    help="A's requests per second over all loops, each a maximal body (0: unpaced)")
    ap.add_argument("--rpm", type=int, default=2,
                    help="A's requests_per_minute (0: unlimited, so every body is parsed and bounded)")
    args = ap.parse_args(argv)
    n = args.requests or (100 if args.quick else 300)

    with throwaway_platform(preset="tiny", tenants=2, model="abuse-model", log_level="ERROR") as p:
        import logging
        import multiprocessing as mp

        logging.getLogger("django.request").setLevel(logging.ERROR)  # one warning per refused request

        from django.conf import settings

        from controlplane.common.actor import Actor
        from controlplane.serving.bounds import kv_store_body_limit
        from controlplane.serving.model_facts import model_facts
        from controlplane.tenants.services import tenant_update

        tenant_update(actor=Actor.system("bench"), tenant=p.tenants[0],
                      quotas={"requests_per_minute": args.rpm or None, "max_prompt_tokens": 256})
        kinds = bodies(p.model, settings.STRATA_SERVING_MAX_BODY_BYTES, kv_store_body_limit(model_facts(p.deployment)))
        _victim(p.url, p.headers(1), p.model, 3)  # warm-up: connections, the worker's first step
        alone = _victim(p.url, p.headers(1), p.model, n)
        before = rss_mb()
        ctx = mp.get_context("spawn")
        stop, out = ctx.Event(), ctx.Queue()
        attacker = ctx.Process(target=_attack_main, daemon=True,
                               args=(p.url, p.keys[0], kinds, args.attackers, args.rate, stop, out))
        attacker.start()
        time.sleep(2.0)  # the child imports httpx and starts sending
        with _PeakRSS() as peak:
            t0 = time.perf_counter()
            under = _victim(p.url, p.headers(1), p.model, n)
            seconds = time.perf_counter() - t0
        stop.set()
        counts = out.get(timeout=300)
        attacker.join(timeout=60)

    answered = sum(v for k, v in counts.items() if ":" not in k and k not in ("seconds", "closed"))
    if answered == 0:
        raise SystemExit("the attack never reached the server (no HTTP answer to any of A's requests): "
                         "nothing measured")
    growth = peak.peak - before
    sizes = ", ".join(f"{k} {len(v[1]) / MiB:.1f} MiB" for k, v in sorted(kinds.items()))
    offered = f"{args.rate:g} requests/s offered" if args.rate > 0 else "unpaced"
    print(f"oversized requests: tenant A ({args.attackers} loops, {offered}, "
          f"{args.rpm or 'unlimited'} requests/min allowed, max_prompt_tokens 256) "
          f"for {seconds:.1f} s; bodies: {sizes}")
    print(f"{'B request':<12} {'p50 alone ms':>13} {'p50 attack ms':>14} {'ratio':>6} "
          f"{'p99 alone ms':>13} {'p99 attack ms':>14} {'ratio':>6}")
    ratios = {}
    for kind in ("models", "completion"):
        a50, u50 = statistics.median(alone[kind]), statistics.median(under[kind])
        a99, u99 = _pct(alone[kind], 0.99), _pct(under[kind], 0.99)
        ratios[kind] = (u50 / a50, u99 / a99)
        print(f"{kind:<12} {a50 * 1e3:>13.1f} {u50 * 1e3:>14.1f} {u50 / a50:>6.2f} "
              f"{a99 * 1e3:>13.1f} {u99 * 1e3:>14.1f} {u99 / a99:>6.2f}")
    statuses = sorted(k for k in counts if ":" not in k and k != "seconds")
    rps = sum(counts[s] for s in statuses) / counts["seconds"]
    print(f"A's responses ({rps:.1f} per second over its {counts['seconds']:.1f} s): "
          + ", ".join(f"{s}: {counts[s]}" for s in statuses))
    for kind in sorted(kinds):
        print(f"  {kind:<9} " + ", ".join(f"{s}: {counts.get(f'{kind}:{s}', 0)}" for s in statuses))
    print(f"web process RSS: {before:.0f} MB before the attack, peak {peak.peak:.0f} MB during it "
          f"(+{growth:.0f} MB; goal < 200)")
    p50_x = max(r[0] for r in ratios.values())
    p99_x = max(r[1] for r in ratios.values())
    other = sum(counts[s] for s in statuses if s not in ("413", "429"))
    print(f"RESULT victim_p50_ratio={p50_x:.2f} victim_p99_ratio={p99_x:.2f} "
          f"models_p50_ratio={ratios['models'][0]:.2f} completion_p50_ratio={ratios['completion'][0]:.2f} "
          f"rss_growth_mb={growth:.0f} attacker_413={counts.get('413', 0)} attacker_429={counts.get('429', 0)} "
          f"attacker_other={other} attacker_rps={rps:.1f} goal_p50={int(p50_x <= 1.5)} goal_rss={int(growth < 200)}")


if __name__ == "__main__":
    os.environ.setdefault("STRATA_L1_MB", "8")
    main()
