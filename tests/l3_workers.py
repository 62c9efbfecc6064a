"""Real cache workers over one file L3 directory and one master key, and the worker requests the
control plane would send them (data keys wrapped by that master key), for the L3 policy tests."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from cachecore import crypto
from workers.cache_worker import CacheWorker
from workers.config import WorkerConfig

DAY = 86_400
CHUNK_TOKENS = 256  # the worker's default L3 chunk: 16 blocks of 16 tokens


class L3Site:
    """An L3 directory, a master key file and one data key per tenant."""

    def __init__(self, root: Path) -> None:
        self.l3 = root / "l3"
        self.key_file = root / "master.key"
        self.master = crypto.generate_key()
        self.key_file.write_bytes(self.master)
        os.chmod(self.key_file, 0o600)
        self._keys: dict[str, bytes] = {}

    def worker(self, deployment: str = "l3-policy", seed: int = 31) -> CacheWorker:
        """A fresh worker (empty L1, no L2) over this site's L3: only L3 can give it a hit."""
        # load_policy always_load: what may be read from L3 is under test here, not the cost model,
        # which picks recompute for this tiny model whenever earlier tests left its kernels fast
        cfg = WorkerConfig(l1_mb=8, l2_mb=0, l3_url=self.l3.as_uri(), master_key_file=str(self.key_file),
                           torch_threads=1, load_policy="always_load")
        return CacheWorker(deployment=deployment, preset="tiny", revision={"label": "r1", "seed": seed},
                           device="cpu", config=cfg)

    def data_key(self, tenant: str) -> dict:
        key = self._keys.setdefault(tenant, crypto.generate_key())
        wrapped = crypto.wrap_key(self.master, key, tenant=tenant, version=1)
        return {"version": 1, "wrapped": wrapped, "readable": [{"version": 1, "wrapped": wrapped}], "shredded": []}

    def request(self, tenant: str, prompt: list[int], *, scope_salt: bytes, persist: bool = True,
                retention: int = DAY, tenant_retention: int = DAY) -> dict:
        return {"tenant": tenant, "scope_salt": scope_salt, "prompt": prompt, "max_tokens": 1,
                "persist": persist, "retention_seconds": retention, "tenant_retention_seconds": tenant_retention,
                "data_key": self.data_key(tenant)}

    def files(self, tenant: str | None = None) -> list[Path]:
        """L3 objects on disk (of ``tenant``'s directory when given)."""
        base = self.l3 if tenant is None else self.l3 / tenant
        return sorted(p for p in base.rglob("*") if p.is_file() and not p.name.startswith(".")) if base.exists() else []


def cached_tokens(worker: CacheWorker, req: dict) -> int:
    """Run ``req`` on ``worker`` and return its ``cached_tokens`` (its L3 writes landed after)."""
    events = worker.collect(req)
    finished = [e for e in events if e["type"] == "finished"]
    assert finished, events
    worker.engine.drain_writes()
    return finished[0]["usage"]["cached_tokens"]


def prompt(n: int, seed: int) -> list[int]:
    """``n`` deterministic byte-level token ids."""
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
