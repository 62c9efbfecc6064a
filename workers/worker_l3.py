"""The worker's side of the encrypted remote tier (L3): the store, the tenants' data keys in memory,
and the retention sweep.

- ``WorkerL3.build(cfg, layout)`` opens ``STRATA_L3_URL``'s backend (``none``: no L3) with the
  capacity ``STRATA_L3_MB``.
- Data keys reach the worker only wrapped by the master key, inside the requests the control plane
  sends (``data_key``: the active version and the readable ones); ``learn`` unwraps each (version,
  wrapped key) once with the master key and keeps it in the keyring, in memory only. ``drop``
  (crypto-shredding) removes a version from the keyring at once; a request never brings a shredded
  version back, because the control plane no longer holds it.
- Retention: ``learn`` also records each tenant's retention (the tenant's own, not a request's
  narrowed one); a daemon thread sweeps every ``STRATA_L3_SWEEP_SECONDS`` (the worker sweeps: no
  Celery beat process needed) the objects past their own expiry or older than their tenant's
  retention, and reads never serve them in between (``RemoteStore.get`` checks both). ``expire``
  applies a lowered retention at once (the control plane's ``l3_expire`` job).
"""

from __future__ import annotations

import hashlib
import logging
import threading

from cachecore import crypto
from cachecore.errors import BackendUnavailable, CacheError
from cachecore.layout import KVLayout
from cachecore.tiers.backends import open_backend
from cachecore.tiers.remote import DEFAULT_CHUNK_BLOCKS, RemoteStore
from workers.config import WorkerConfig, master_key

logger = logging.getLogger("strata.worker.l3")
DEFAULT_RETENTION_SECONDS = 24 * 3600


class WorkerL3:
    def __init__(self, store: RemoteStore, keyring: crypto.Keyring, master: bytes | None, cfg: WorkerConfig) -> None:
        self.store = store
        self._cfg = cfg
        self.keyring = keyring
        self._master = master
        self._seen: set[tuple[str, int, bytes]] = set()  # (tenant, version, digest of wrapped key)
        self._shredded: set[tuple[str, int]] = set()  # never learned again, whatever a request carries
        self._retention: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_loop, args=(cfg.l3_sweep_seconds,), name="strata-l3-sweep",
                                         daemon=True)
        self._sweeper.start()

    @classmethod
    def build(cls, cfg: WorkerConfig, layout: KVLayout, *,
              chunk_blocks: int = DEFAULT_CHUNK_BLOCKS) -> WorkerL3 | None:
        try:
            backend = open_backend(cfg.l3_url)
        except (CacheError, ValueError, OSError) as exc:
            logger.warning("L3 disabled: cannot open %s: %s", cfg.l3_url.split("@")[-1], type(exc).__name__)
            return None
        if backend is None:
            return None
        keyring = crypto.Keyring()
        store = RemoteStore(backend, keyring, layout, chunk_blocks=chunk_blocks, capacity_bytes=cfg.l3_mb * 2**20,
                            eviction_policy=cfg.eviction_policy)
        return cls(store, keyring, master_key(cfg), cfg)

    # ------------------------------------------------------------------ keys
    def learn(self, tenant: str, data_key: dict | None, retention_seconds: float | None) -> None:
        """Take the wrapped keys a request carries (``{"version", "wrapped", "readable": [...]}``);
        unwrap new ones. A key that fails to unwrap is ignored (L3 then misses for it)."""
        if retention_seconds is not None:
            self._retention[tenant] = float(retention_seconds)
        if not data_key:
            return
        for version in data_key.get("shredded", ()):
            if isinstance(version, int) and (tenant, version) not in self._shredded:
                self.drop_key(tenant, version)
        if self._master is None:
            self._master = master_key(self._cfg)  # created by the control plane after this worker started
            if self._master is None:
                return
        entries = [data_key, *data_key.get("readable", ())]
        for entry in entries:
            version, wrapped = entry.get("version"), entry.get("wrapped")
            if not isinstance(version, int) or not isinstance(wrapped, bytes | bytearray):
                continue
            marker = (tenant, version, hashlib.sha256(bytes(wrapped)).digest())
            if marker in self._seen or (tenant, version) in self._shredded:
                continue
            try:
                key = crypto.unwrap_key(self._master, bytes(wrapped), tenant=tenant, version=version)
            except CacheError:
                logger.warning("a data key of tenant %s (version %d) did not unwrap", tenant, version)
                continue
            with self._lock:
                self.keyring.add(tenant, version, key)  # the highest version held seals new objects
                self._seen.add(marker)

    def drop_key(self, tenant: str, version: int) -> None:
        """Forget ``version`` of ``tenant`` for good on this worker (a request prepared before the
        shred and run after it cannot bring it back)."""
        with self._lock:
            self._shredded.add((tenant, version))
            self.keyring.drop(tenant, version)

    def drop(self, tenant: str, version: int) -> dict:
        """Crypto-shred ``version`` on this worker: forget the key at once, then delete its objects."""
        self.drop_key(tenant, version)
        objects, nbytes = self.store.delete_scope(tenant=tenant, key_version=version)
        return {"objects": objects, "bytes": nbytes}

    def retention(self, tenant: str) -> float:
        return self._retention.get(tenant, DEFAULT_RETENTION_SECONDS)

    def expire(self, tenant: str, retention_seconds: float) -> tuple[int, int]:
        """The tenant's retention was lowered: record it (this worker's sweeps apply it from now on)
        and delete now every object of the tenant that is older, or past its own expiry.
        ``(objects, bytes)`` deleted. Raises ``BackendUnavailable`` (the job retries)."""
        with self._lock:
            self._retention[tenant] = float(retention_seconds)
        return self.store.expire_tenant(tenant, float(retention_seconds))

    # ------------------------------------------------------------------ sweep
    def sweep(self) -> tuple[int, int]:
        return self.store.sweep(dict(self._retention), DEFAULT_RETENTION_SECONDS)

    def _sweep_loop(self, period: int) -> None:
        while not self._stop.wait(period):
            try:
                self.sweep()
            except BackendUnavailable:
                pass  # the next sweep retries; reads never serve expired objects meanwhile
            except Exception:  # never let the sweeper die
                logger.exception("L3 retention sweep failed")

    def close(self) -> None:
        self._stop.set()
