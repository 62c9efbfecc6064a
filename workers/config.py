"""The cache worker's configuration: the one place that reads its environment variables.

``STRATA_L1_MB`` (device pages per worker, default 256), ``STRATA_L2_MB`` (host-memory pool per
worker, default 1024; 0 disables L2), ``STRATA_WRITE_POLICY`` (``write_back`` | ``write_through`` |
``selective``), ``STRATA_SELECTIVE_MIN_HITS`` (default 2), ``STRATA_LOAD_POLICY`` (``cost`` |
``always_load`` | ``always_recompute``), ``STRATA_LOAD_DEADLINE_MS`` (default 500),
``STRATA_EVICTION_POLICY`` (which cached KV every tier gives up first: ``fair_lru``, the default, or
another name of ``cachecore.eviction.registry.EVICTION_POLICIES`` such as ``value_aware``),
``STRATA_L3_URL`` (the encrypted remote tier: ``file:///path``, default ``$STRATA_HOME/l3``;
``redis://host:port/db``; ``none``), ``STRATA_L3_MB`` (its capacity, default 4096),
``STRATA_L3_SWEEP_SECONDS`` (retention sweep period, default 300), the master key
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
(default: every core), ``STRATA_WEIGHTS_ROOT`` (when set, a checkpoint and every file in it must
resolve inside it, symlinks followed), ``STRATA_VLLM_CONNECTOR`` (default 1; 0: a vLLM deployment keeps its
prefixes in vLLM's device cache only, without Strata's L2 and L3). Read in the worker's process (the Ray actor inherits
the environment of the process that started Ray).
"""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass
from pathlib import Path

from cachecore.config import EngineConfig


class WorkerConfigError(ValueError):
    """A worker environment variable holds a value that cannot be used."""


def _int(name: str, default: int, *, minimum: int = 0) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise WorkerConfigError(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise WorkerConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class WorkerConfig:
    l1_mb: int = 256
    l2_mb: int = 1024
    write_policy: str = "write_back"
    selective_min_hits: int = 2
    load_policy: str = "cost"
    load_deadline_ms: int = 500
    eviction_policy: str = "fair_lru"
    torch_threads: int = 0  # 0: every core
    prefill_chunk: int = 256
    token_budget: int = 512
    max_batch: int = 32
    lean_budget: int = 8
    contended_budget: int = 64
    anticipate_ms: int = 40
    l3_url: str = "none"
    l3_mb: int = 4096
    l3_sweep_seconds: int = 300
    master_key_file: str = ""
    weights_root: str | None = None  # STRATA_WEIGHTS_ROOT: checkpoints (and their files) must resolve inside it
    vllm_connector: bool = True  # STRATA_VLLM_CONNECTOR=0: vLLM deployments keep vLLM's device cache only

    @classmethod
    def from_env(cls) -> WorkerConfig:
        cfg = cls(
            l1_mb=_int("STRATA_L1_MB", 256, minimum=1),
            l2_mb=_int("STRATA_L2_MB", 1024),
            write_policy=os.environ.get("STRATA_WRITE_POLICY", "write_back").strip() or "write_back",
            selective_min_hits=_int("STRATA_SELECTIVE_MIN_HITS", 2, minimum=1),
            load_policy=os.environ.get("STRATA_LOAD_POLICY", "cost").strip() or "cost",
            load_deadline_ms=_int("STRATA_LOAD_DEADLINE_MS", 500, minimum=1),
            eviction_policy=os.environ.get("STRATA_EVICTION_POLICY", "fair_lru").strip() or "fair_lru",
            torch_threads=_int("STRATA_TORCH_THREADS", 0),
            prefill_chunk=_int("STRATA_PREFILL_CHUNK", 256, minimum=1),
            token_budget=_int("STRATA_TOKEN_BUDGET", 512, minimum=2),
            max_batch=_int("STRATA_MAX_BATCH", 32, minimum=1),
            lean_budget=_int("STRATA_LEAN_BUDGET", 8, minimum=0),
            contended_budget=_int("STRATA_CONTENDED_BUDGET", 64),
            anticipate_ms=_int("STRATA_ANTICIPATE_MS", 40),
            l3_url=_l3_url(),
            l3_mb=_int("STRATA_L3_MB", 4096),
            l3_sweep_seconds=_int("STRATA_L3_SWEEP_SECONDS", 300, minimum=1),
            master_key_file=os.environ.get("STRATA_MASTER_KEY_FILE", "").strip() or str(_home() / "master.key"),
            weights_root=os.environ.get("STRATA_WEIGHTS_ROOT", "").strip() or None,
            vllm_connector=_int("STRATA_VLLM_CONNECTOR", 1) != 0,
        )
        cfg.engine(bytes_per_block=1)  # validate the policies now, not at the first request
        if cfg.token_budget <= cfg.max_batch:
            raise WorkerConfigError(f"STRATA_TOKEN_BUDGET ({cfg.token_budget}) must exceed STRATA_MAX_BATCH "
                                    f"({cfg.max_batch})")
        if cfg.contended_budget and cfg.contended_budget <= cfg.max_batch:
            raise WorkerConfigError(f"STRATA_CONTENDED_BUDGET ({cfg.contended_budget}) must be 0 (no bound) or "
                                    f"exceed STRATA_MAX_BATCH ({cfg.max_batch})")
        if cfg.anticipate_ms > 1000:
            raise WorkerConfigError(f"STRATA_ANTICIPATE_MS must be at most 1000, got {cfg.anticipate_ms}")
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


REPO_ROOT = Path(__file__).resolve().parents[1]

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


def _home() -> Path:
    """``STRATA_HOME`` as the control plane reads it: a relative path is relative to the repository
    (a Ray actor's working directory is Ray's, not ours)."""
    home = Path(os.environ.get("STRATA_HOME", "").strip() or ".strata").expanduser()
    return home if home.is_absolute() else REPO_ROOT / home


def _l3_url() -> str:
    raw = os.environ.get("STRATA_L3_URL", "").strip()
    if raw:
        return raw
    return (_home() / "l3").as_uri()


def master_key(cfg: WorkerConfig) -> bytes | None:
    """The key-encryption key, or None when none is configured yet (L3 then stores nothing: without
    data keys nothing can be sealed). Never logged."""
    raw = os.environ.get("STRATA_MASTER_KEY", "").strip()
    if raw:
        try:
            key = base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError):
            raise WorkerConfigError("STRATA_MASTER_KEY must be base64 of 32 bytes") from None
    else:
        path = Path(cfg.master_key_file)
        if not path.is_file():
            return None
        if path.stat().st_mode & 0o077:
            raise WorkerConfigError(f"master key file {path} may be read by group/others; chmod 600 it")
        key = path.read_bytes()
        if len(key) != 32:  # the file may hold base64 text of the key
            try:
                key = base64.b64decode(key.strip(), validate=True)
            except (binascii.Error, ValueError):
                raise WorkerConfigError(f"master key file {path} holds neither 32 bytes nor base64 of them") from None
    if len(key) != 32:
        raise WorkerConfigError("the master key must be 32 bytes")
    return key
