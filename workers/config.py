"""The cache worker's configuration, built from its view of the environment (``strata_env.load_worker``:
every variable below is read and typed there; the checks across variables are here).

``STRATA_L1_MB`` (device pages per worker, default 256; for a vLLM deployment on CUDA, its KV cache
only when set: unset, vLLM sizes it from ``STRATA_GPU_MEMORY_UTILIZATION``, its share of each GPU,
default 0.9; ``workers.vllm_sizing``), ``STRATA_L2_MB`` (host-memory pool per
worker, default 1024; 0 disables L2), ``STRATA_WRITE_POLICY`` (``write_back`` | ``write_through`` |
``selective``), ``STRATA_SELECTIVE_MIN_HITS`` (default 2), ``STRATA_LOAD_POLICY`` (``cost`` |
``always_load`` | ``always_recompute``), ``STRATA_LOAD_DEADLINE_MS`` (default 500),
``STRATA_EVICTION_POLICY`` (which cached KV every tier gives up first: ``fair_lru``, the default, or
another name of ``cachecore.eviction.registry.EVICTION_POLICIES`` such as ``value_aware``),
``STRATA_L3_URL`` (the encrypted remote tier: ``file:///path``, default ``$STRATA_HOME/l3``;
``redis://host:port/db``; ``redis+cluster://host:port``, a Redis Cluster; ``none``), ``STRATA_L3_MB``
(its capacity, default 4096), ``STRATA_L3_SWEEP_SECONDS`` (retention sweep period, default 300), the master key
(``STRATA_MASTER_KEY``, base64 of 32 bytes, or the file ``STRATA_MASTER_KEY_FILE``, default
``$STRATA_HOME/master.key``: the control plane creates it; the worker only reads it),
``STRATA_PREFILL_CHUNK`` (tokens per prefill turn, default 256: smaller bounds how long one tenant's
prefill delays another's first token, larger computes long prompts faster), ``STRATA_TOKEN_BUDGET``
(tokens one scheduler step computes at most, decode tokens and prefill chunks together, default
512), ``STRATA_MAX_BATCH`` (requests running at once, default 32; the budget must exceed it),
``STRATA_LEAN_BUDGET`` (tokens every other tenant shares in a step that carries the first-token prefill of
a tenant below its share, default 8), ``STRATA_CONTENDED_BUDGET`` (tokens per step while two or more
tenants had work in the last few steps, default 64; 0 = the full budget always; else it must exceed
``STRATA_MAX_BATCH``), ``STRATA_ANTICIPATE_MS`` (how long the next step may wait for the next request of
a tenant below its share that just finished one, default 40; 0 = never, at most 1000),
``STRATA_TORCH_THREADS``
(compute threads of the engine; default 0: every core but one, at least one, so the scheduler's loop,
the stream threads and the web tier keep a core, as vLLM's CPU build leaves one to its front end; a
step of prompt chunks alone runs on every core, ``cachecore.scheduler.threads``; when set, every step
runs on that many),
``STRATA_WEIGHTS_ROOT`` (when set, a checkpoint and every file in it must
resolve inside it, symlinks followed), ``STRATA_VLLM_CONNECTOR`` (default 1; 0: a vLLM deployment keeps its
prefixes in vLLM's device cache only, without Strata's L2 and L3). Read in the worker's process (the Ray actor inherits
the environment of the process that started Ray). A malformed value raises ``strata_env.EnvError``
(``WorkerConfigError`` is the same class) naming the variable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import strata_env
from cachecore.config import EngineConfig
from cachecore.eviction.registry import DEFAULT_EVICTION_POLICY
from strata_env import WorkerEnv
from strata_env import masterkey as keyreader

if TYPE_CHECKING:  # torch stays out of the processes that only read the configuration (the web tier)
    from cachecore.scheduler.threads import StepThreads

# A worker environment variable holds a value that cannot be used (the one error of strata_env; the
# checks across variables below raise it too).
WorkerConfigError = strata_env.EnvError


@dataclass(frozen=True)
class WorkerConfig:
    # Defaults: strata_env.WorkerEnv's (one definition); l3_url, master_key_file and weights_root
    # default to "none" here (a config built in code), to $STRATA_HOME's from the environment.
    l1_mb: int = WorkerEnv.l1_mb
    l1_mb_explicit: bool = WorkerEnv.l1_mb_explicit  # STRATA_L1_MB was set (a vLLM KV cache of that size on CUDA)
    gpu_memory_utilization: float = WorkerEnv.gpu_memory_utilization  # STRATA_GPU_MEMORY_UTILIZATION
    l2_mb: int = WorkerEnv.l2_mb
    write_policy: str = WorkerEnv.write_policy
    selective_min_hits: int = WorkerEnv.selective_min_hits
    load_policy: str = WorkerEnv.load_policy
    load_deadline_ms: int = WorkerEnv.load_deadline_ms
    eviction_policy: str = DEFAULT_EVICTION_POLICY  # STRATA_EVICTION_POLICY: cachecore.eviction.registry's names
    torch_threads: int = WorkerEnv.torch_threads  # 0: every core but one (compute_threads)
    prefill_chunk: int = WorkerEnv.prefill_chunk
    token_budget: int = WorkerEnv.token_budget
    max_batch: int = WorkerEnv.max_batch
    lean_budget: int = WorkerEnv.lean_budget
    contended_budget: int = WorkerEnv.contended_budget
    anticipate_ms: int = WorkerEnv.anticipate_ms
    l3_url: str = "none"
    l3_mb: int = WorkerEnv.l3_mb
    l3_sweep_seconds: int = WorkerEnv.l3_sweep_seconds
    master_key_file: str = ""
    weights_root: str | None = None  # STRATA_WEIGHTS_ROOT: checkpoints (and their files) must resolve inside it
    vllm_connector: bool = WorkerEnv.vllm_connector  # STRATA_VLLM_CONNECTOR=0: vLLM keeps vLLM's device cache only

    def compute_threads(self, cores: int | None = None) -> int:
        """The engine's compute threads: ``torch_threads`` when set, else every core but one (at least
        one). On 2 cores shared with the web tier, one compute thread served 16 streams over HTTP at
        218-222 tok/s and two at 188-192 (the second waits at every parallel region for a core the
        web tier and the client hold); on cores of its own the engine scales (``bench.vllm_cpu``
        in-process: 300 -> 406-438 tok/s on two). Steps of prompt chunks alone run on every core
        (``step_threads``). Set ``STRATA_TORCH_THREADS`` to every core where the web tier runs elsewhere."""
        if self.torch_threads:
            return self.torch_threads
        n = cores if cores is not None else (os.cpu_count() or 1)
        return max(1, n - 1)

    def step_threads(self, device: str, cores: int | None = None, *, set_threads=None) -> StepThreads:
        """The scheduler's per-step threads (``cachecore.scheduler.threads``): steps with a decode on
        ``compute_threads``; on a CPU, steps of prompt chunks alone on every core (``torch_threads``
        when set: every step on that many). On other devices every step on ``compute_threads``: the
        kernels run there, only the loop's host work runs on these. ``set_threads``: see ``StepThreads``."""
        from cachecore.scheduler.threads import StepThreads

        steady = self.compute_threads(cores)
        if not str(device).startswith("cpu") or self.torch_threads:
            return StepThreads(steady, steady, set_threads=set_threads)
        return StepThreads(steady, max(1, cores if cores is not None else (os.cpu_count() or 1)),
                           set_threads=set_threads)

    @classmethod
    def from_env(cls, environ=None) -> WorkerConfig:
        """From ``strata_env.load_worker(environ)`` (default: this process's environment), checked."""
        env = strata_env.load_worker(environ)
        cfg = cls(
            l1_mb=env.l1_mb,
            l1_mb_explicit=env.l1_mb_explicit,
            gpu_memory_utilization=env.gpu_memory_utilization,
            l2_mb=env.l2_mb,
            write_policy=env.write_policy,
            selective_min_hits=env.selective_min_hits,
            load_policy=env.load_policy,
            load_deadline_ms=env.load_deadline_ms,
            eviction_policy=env.eviction_policy or DEFAULT_EVICTION_POLICY,
            torch_threads=env.torch_threads,
            prefill_chunk=env.prefill_chunk,
            token_budget=env.token_budget,
            max_batch=env.max_batch,
            lean_budget=env.lean_budget,
            contended_budget=env.contended_budget,
            anticipate_ms=env.anticipate_ms,
            l3_url=env.l3_url,
            l3_mb=env.l3_mb,
            l3_sweep_seconds=env.l3_sweep_seconds,
            master_key_file=str(env.master_key_file),
            weights_root=str(env.weights_root) if env.weights_root else None,
            vllm_connector=env.vllm_connector,
        )
        cfg.engine(bytes_per_block=1)  # validate the policies now, not at the first request
        if cfg.token_budget <= cfg.max_batch:
            raise WorkerConfigError(f"STRATA_TOKEN_BUDGET ({cfg.token_budget}) must exceed STRATA_MAX_BATCH "
                                    f"({cfg.max_batch})")
        if cfg.contended_budget and cfg.contended_budget <= cfg.max_batch:
            raise WorkerConfigError(f"STRATA_CONTENDED_BUDGET ({cfg.contended_budget}) must be 0 (no bound) or "
                                    f"exceed STRATA_MAX_BATCH ({cfg.max_batch})")
        return cfg

    def blocks(self, mb: int, bytes_per_block: int) -> int:
        return mb * 2**20 // bytes_per_block

    def engine(self, *, bytes_per_block: int) -> EngineConfig:
        try:
            return EngineConfig(
                l2_blocks=self.blocks(self.l2_mb, bytes_per_block), write_policy=self.write_policy,
                selective_min_hits=self.selective_min_hits, load_policy=self.load_policy,
                load_deadline_s=self.load_deadline_ms / 1000, eviction_policy=self.eviction_policy,
            )
        except ValueError as exc:
            raise WorkerConfigError(str(exc)) from None


# Ray starts every worker process at niceness 15 unless told otherwise (its raylet's
# ``worker_niceness``): the replicas (and the vLLM engine core they spawn) would then yield the CPU to
# the web process, Celery and anything else on the machine, so that a flood of requests handled in
# the web tier slows every tenant's forward pass. Replicas are the serving path: their raylet starts
# them at the normal priority. Set in the environment of every ``ray start`` / local ``ray.init``.
RAY_PROCESS_ENV = {"RAY_worker_niceness": "0"}


def apply_ray_env(environ: dict | None = None) -> None:
    """``RAY_PROCESS_ENV`` into ``environ`` (``os.environ`` by default) where not set already."""
    target = os.environ if environ is None else environ
    for key, value in RAY_PROCESS_ENV.items():
        target.setdefault(key, value)


def master_key(cfg: WorkerConfig) -> bytes | None:
    """The key-encryption key, or None when none is there yet (L3 then stores nothing: without data
    keys nothing can be sealed; the control plane creates the file, and the worker asks again).
    ``STRATA_MASTER_KEY`` from this process's environment, else the file ``cfg.master_key_file``;
    read by ``strata_env.masterkey`` (the control plane's reader: both variables set, a malformed
    key, a file others may read or that is not a regular file are each a ``MasterKeyError``, an
    ``EnvError``). Never logged."""
    keys = strata_env.master_key_env()
    if keyreader.resolve(keys)[0] == "env":
        return keyreader.read(keys)
    if not cfg.master_key_file:
        return None
    return keyreader.read_key_file(Path(cfg.master_key_file), missing_ok=True)
