"""L3's store: :class:`RemoteStore`, encrypted chunks on one backend (filesystem directory or Redis),
shared by workers and restarts. The contract (chunks, names, expiry, what a read and a write do,
capacity, pins, listeners) is the package's: :mod:`cachecore.tiers.remote`. Composes the names
(:mod:`~cachecore.tiers.remote.names`), the frame (:mod:`~cachecore.tiers.remote.frame`), the
accounting (:mod:`~cachecore.tiers.remote.capacity`) and a circuit breaker in front of the backend
(:mod:`~cachecore.tiers.remote.breaker`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence

import torch

from cachecore import crypto
from cachecore.errors import BackendUnavailable, DecryptError, InvalidKV, KeyUnavailable
from cachecore.eviction.base import EvictionPolicy
from cachecore.eviction.registry import DEFAULT_EVICTION_POLICY
from cachecore.hashing import token_buffer
from cachecore.layout import KVLayout
from cachecore.tiers.backends.base import Backend, ObjectInfo, PartialWrite
from cachecore.tiers.base import Fetched, Tag
from cachecore.tiers.remote.breaker import CLOSED, CircuitBreaker
from cachecore.tiers.remote.capacity import L3Index, Victim
from cachecore.tiers.remote.frame import ChunkFrame, expiry, head_expired, legacy
from cachecore.tiers.remote.names import (
    TenantKeys,
    chunk_hex,
    chunk_key,
    chunk_name,
    in_scope,
    parse_name,
    scope_matcher,
    scope_prefix,
    tenant_component,
)

__all__ = ["DEFAULT_CHUNK_BLOCKS", "RemoteStore"]

DEFAULT_CHUNK_BLOCKS = 16
#: Most frame bytes one ``put_new_many`` carries (each writer thread keeps that many sealed frames).
MAX_BATCH_BYTES = 16 * 2**20


# ---------------------------------------------------------------------- the store
class RemoteStore:
    """The L3 store over one :class:`~cachecore.tiers.backends.base.Backend` (see
    :mod:`cachecore.tiers.remote`)."""

    name = "l3"

    def __init__(
        self,
        backend: Backend,
        keyring: crypto.Keyring,
        layout: KVLayout,
        *,
        chunk_blocks: int = DEFAULT_CHUNK_BLOCKS,
        capacity_bytes: int | None = None,
        clock: Callable[[], float] = time.time,
        retry_after_seconds: float = 1.0,
        temp_grace_seconds: float = 300.0,
        refresh_seconds: float = 30.0,
        eviction_policy: EvictionPolicy | str = DEFAULT_EVICTION_POLICY,
    ) -> None:
        if isinstance(chunk_blocks, bool) or not isinstance(chunk_blocks, int) or chunk_blocks <= 0:
            raise ValueError(f"chunk_blocks must be a positive int, got {chunk_blocks!r}")
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0 or None, got {capacity_bytes!r}")
        self.backend = backend
        self.keyring = keyring
        self.layout = layout
        self.chunk_blocks = chunk_blocks
        self.chunk_tokens = chunk_blocks * layout.block_size
        self.capacity_bytes = capacity_bytes
        self.clock = clock
        # A backend failure skips the backend for retry_after_seconds (then it is tried again).
        self._breaker = CircuitBreaker(failure_threshold=1, cooldown_seconds=retry_after_seconds)
        self.temp_grace_seconds = temp_grace_seconds
        self.refresh_seconds = refresh_seconds  # the figures re-list the backend when older (other writers)
        self._listed_at = 0.0  # time.monotonic() of the index's last listing
        self._frame = ChunkFrame(layout, chunk_blocks)
        self._frame_bytes = self._frame.frame_bytes
        self._lock = threading.RLock()
        self._index = L3Index(eviction_policy)  # what each tenant holds, by encoded tenant; loaded lazily
        self._tenants = TenantKeys()  # encoded tenant <-> tenant id
        self.put_listeners: list[Callable[[Sequence[bytes]], None]] = []
        self.drop_listeners: list[Callable[[list[bytes], str], None]] = []
        self.stats: dict[str, int] = dict.fromkeys(
            (
                "probes", "hits", "misses", "blocks_out", "corrupt", "quarantined", "failures", "unavailable",
                "expired", "shredded", "bytes_in", "bytes_out", "objects_written", "duplicates",
                "skipped", "rejected", "evicted", "evicted_bytes", "deleted", "deleted_bytes", "temp_removed",
            ),
            0,
        )  # fmt: skip

    @property
    def retry_after_seconds(self) -> float:
        """How long the backend is skipped after a failure (the breaker's cooldown)."""
        return self._breaker.cooldown_seconds

    @retry_after_seconds.setter
    def retry_after_seconds(self, seconds: float) -> None:
        self._breaker.cooldown_seconds = seconds

    # ------------------------------------------------------------------ reads
    def probe(self, hashes: Sequence[bytes], tag: Tag) -> int:
        """Leading blocks of ``hashes`` held in L3 (a multiple of ``chunk_blocks``): asks the backend
        at once whether the object of each chunk exists (``exists_many``), counting up to the first
        missing one. A metadata answer only: ``get`` says what really arrives. A backend error is 0
        (counted)."""
        cb = self.chunk_blocks
        versions = self.keyring.versions(tag.owner)
        self._count("probes")
        if not versions or len(hashes) < cb:
            return 0
        if not self._available():
            return 0
        k = len(versions)
        names = [self._name(tag, v, key) for key in self.chunk_keys(hashes) for v in versions]
        try:
            held = self.backend.exists_many(names)  # one round trip for the whole chain
        except BackendUnavailable:
            self._trip()
            return 0
        self._breaker.record_success()
        found = 0
        for c in range(len(held) // k):
            if not any(held[c * k : (c + 1) * k]):
                break
            found += cb
        return found

    def get(
        self,
        hashes: Sequence[bytes],
        tokens: Sequence[int],
        tag: Tag,
        n_blocks: int,
        *,
        first_block: int = 0,
        retention_seconds: float | None = None,
    ) -> Fetched:
        """Fetch, decrypt and verify blocks ``first_block .. n_blocks-1`` of the request
        (``hashes``: its chain, ``tokens``: its token ids, at least ``n_blocks`` blocks of each),
        reading the chunks that cover them in order and stopping at the first that fails (see the
        package doc). ``kv`` row 0 is block ``first_block``; ``stopped`` is None, ``"miss"`` or
        ``"corrupt"``. An object older than ``retention_seconds`` is not served."""
        cb, bs = self.chunk_blocks, self.layout.block_size
        n_blocks = min(n_blocks, len(hashes), len(tokens) // bs)
        first_chunk, end_chunk = first_block // cb, -(-n_blocks // cb)
        end_chunk = min(end_chunk, len(hashes) // cb, len(tokens) // self.chunk_tokens)
        empty = torch.empty((0, *self.layout.page_shape), dtype=self.layout.torch_dtype)
        if n_blocks <= first_block:
            return Fetched(empty, None)
        if end_chunk <= first_chunk:  # the request's blocks do not fill a chunk: never stored in L3
            return Fetched(empty, "miss")
        versions = self.keyring.versions(tag.owner)
        if not versions:
            self._count("misses")
            return Fetched(empty, "miss")
        if not self._available():
            return Fetched(empty, "miss")
        # One buffer for every chunk's plaintext, decrypted in place: chunk i's KV lands in its rows and
        # its trailer (token ids, shape, ...) just after them, where chunk i+1's KV then overwrites it.
        kvb = self._frame.kv_bytes
        buf = torch.empty((end_chunk - first_chunk) * kvb + self._frame.trailer_bytes, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        got, stopped = 0, None
        for i, c in enumerate(range(first_chunk, end_chunk)):
            dest = view[i * kvb : i * kvb + self._frame.plaintext_bytes]
            why = self._fetch_chunk(hashes, tokens, tag, c, versions, retention_seconds, dest)
            if why is not None:
                stopped = why
                break
            got += cb
        out = buf[: (got // cb) * kvb].view(self.layout.torch_dtype).view(got, *self.layout.page_shape)
        start = first_block - first_chunk * cb
        stop = min(got, n_blocks - first_chunk * cb)
        kv = out[start:stop] if stop > start else empty
        if stopped is None and stop < n_blocks - first_chunk * cb:
            stopped = "miss"
        self._count("blocks_out", max(stop - start, 0))
        return Fetched(kv, stopped)

    def _fetch_chunk(
        self,
        hashes: Sequence[bytes],
        tokens: Sequence[int],
        tag: Tag,
        c: int,
        versions: list[int],
        retention_seconds: float | None,
        dest: memoryview,
    ) -> str | None:
        """Fetch chunk ``c`` and decrypt it into ``dest``; None when it arrived, else why not."""
        cb = self.chunk_blocks
        key = hashes[(c + 1) * cb - 1]
        buf = self._frame.read_buffer()
        size = name = None
        try:
            for v in versions:
                name = self._name(tag, v, key)
                size = self.backend.get_into(name, buf)
                if size is not None:
                    break
        except BackendUnavailable:
            self._trip()
            return "miss"
        self._breaker.record_success()
        if size is None or name is None:
            self._count("misses")
            return "miss"
        self._count("bytes_out", size)
        frame = buf[: min(size, len(buf))]
        try:
            header = crypto.frame_header(frame)
            if legacy(header.format_version):  # written before objects carried their expiry
                self._expire(tag, name)
                return "miss"
            if size != len(buf):
                raise DecryptError("object has the wrong length for this layout")
            if name != self._name(tag, header.key_version, key):
                raise DecryptError("frame key version differs from the object's name")
            want = token_buffer(tokens[c * self.chunk_tokens : (c + 1) * self.chunk_tokens])
            created = self._frame.open(self.keyring, frame, header, name=name, tag=tag, tokens=want, out=dest)
        except KeyUnavailable:
            self._count("shredded")
            self._count("misses")
            return "miss"
        except DecryptError:
            self._quarantine(tag, name)
            return "corrupt"
        if header.expires and self.clock() >= header.expires:  # authenticated above: the writer's own expiry
            self._expire(tag, name)
            return "miss"
        if retention_seconds is not None and self.clock() - created > retention_seconds:
            self._count("expired")
            self._count("misses")
            return "miss"
        self._count("hits")
        self._seen(tag, name, size, created)
        return None

    # ------------------------------------------------------------------ writes
    def put_chunk(
        self,
        hashes: Sequence[bytes],
        tokens: Sequence[int],
        tag: Tag,
        kv: torch.Tensor,
        *,
        created: float | None = None,
        retention_seconds: float | None = None,
    ) -> bool:
        """Seal and store one chunk: ``hashes`` (``chunk_blocks`` chain hashes, stored under the
        last), ``tokens`` (``chunk_blocks * block_size`` ids), ``kv`` ``[chunk_blocks, *page_shape]``.
        ``retention_seconds`` (the writer's retention: the minimum of the request's and the tenant's)
        sets the object's own authenticated expiry, ``created + retention_seconds`` rounded up to a
        second; None: no expiry of its own (only the readers' retention and the sweep's apply).

        Skipped (False) when ``tag.persist`` is False, the tenant has no active key, the chunk is
        already stored (under any key version held; the write itself is conditional, so of two
        concurrent writers of one chunk one writes), it does not fit the tenant's limit or the
        capacity, or the backend is down. True if written. Raises ``ValueError``/``InvalidKV`` only
        for arguments of the wrong size, shape or dtype."""
        return self.put_chunks([(hashes, tokens, kv)], tag, created=created, retention_seconds=retention_seconds)[0]

    def put_chunks(
        self,
        chunks: Sequence[tuple[Sequence[bytes], Sequence[int], torch.Tensor]],
        tag: Tag,
        *,
        created: float | None = None,
        retention_seconds: float | None = None,
    ) -> list[bool]:
        """:meth:`put_chunk` of each ``(hashes, tokens, kv)`` of one request (one ``tag``, one
        retention), batched: one ``exists_many`` for the set, then the chunks not stored yet are
        sealed and written together (``put_new_many``, conditional: Redis writes up to
        :data:`MAX_BATCH_BYTES` of them in one round trip). One result per chunk. A backend failure
        part way is counted, keeps what was written before it (accounted), and the rest is False."""
        checked = [self._check_chunk(h, t, kv) for h, t, kv in chunks]
        results = [False] * len(chunks)
        if not chunks:
            return results
        if not tag.persist or (active := self.keyring.active(tag.owner)) is None:
            self._count("skipped", len(chunks))
            return results
        version, data_key = active
        if not self._available():
            return results
        names = [self._name(tag, version, h[-1]) for h, _, _ in chunks]
        stamp = self.clock() if created is None else float(created)
        expires = expiry(stamp, retention_seconds)
        tenant = self._tenant_key(tag.owner)
        try:
            todo = self._not_stored(chunks, tag)
            self._ensure_index()
            per_batch = max(1, MAX_BATCH_BYTES // self._frame_bytes)
            for at in range(0, len(todo), per_batch):
                batch = todo[at : at + per_batch]
                frames = [self._frame.seal(data_key, version=version, name=names[i], tag=tag, tokens=checked[i],
                                           created=stamp, kv=chunks[i][2], expires=expires, slot=j)
                          for j, i in enumerate(batch)]
                self._write_batch(tenant, [(i, names[i], frames[j]) for j, i in enumerate(batch)], stamp, results)
        except BackendUnavailable:
            self._trip()
            self._announce_written(chunks, results)
            return results
        self._breaker.record_success()
        self._announce_written(chunks, results)
        return results

    def _check_chunk(self, hashes: Sequence[bytes], tokens: Sequence[int], kv: torch.Tensor):
        """The chunk's token ids as the frame stores them; ``ValueError``/``InvalidKV`` for arguments
        of the wrong size, shape or dtype."""
        cb = self.chunk_blocks
        if len(hashes) != cb:
            raise ValueError(f"put_chunk needs {cb} hashes, got {len(hashes)}")
        if len(tokens) != self.chunk_tokens:
            raise ValueError(f"put_chunk needs {self.chunk_tokens} tokens, got {len(tokens)}")
        if tuple(kv.shape) != self._frame.shape or kv.dtype != self.layout.torch_dtype:
            raise InvalidKV(
                f"chunk KV must be {self._frame.shape} {self.layout.dtype}, got {tuple(kv.shape)} {kv.dtype}"
            )
        return token_buffer(tokens)

    def _not_stored(self, chunks, tag: Tag) -> list[int]:
        """Indexes of ``chunks`` not stored under any key version the keyring holds: one
        ``exists_many`` for the whole set, so that a chunk already there costs neither its sealing
        nor its transfer (the write after it is conditional all the same). The others are counted as
        duplicates."""
        versions = self.keyring.versions(tag.owner)
        k = len(versions)
        held = self.backend.exists_many([self._name(tag, v, h[-1]) for h, _, _ in chunks for v in versions])
        todo = [i for i in range(len(chunks)) if not any(held[i * k : (i + 1) * k])]
        self._count("duplicates", len(chunks) - len(todo))
        return todo

    def _write_batch(self, tenant: str, batch: list[tuple[int, str, memoryview]], stamp: float,
                     results: list[bool]) -> None:
        """Reserve room for ``batch`` (``(chunk index, name, frame)``) in the accounting, evict what
        that takes, write the frames with one ``put_new_many`` and record the results (an object
        found already there stays accounted: it is there). Raises ``BackendUnavailable``, after
        releasing the reservations not written."""
        reserved: list[tuple[int, str, memoryview]] = []
        known: set[str] = set()  # accounted before this write: not ours to release
        victims: list[Victim] = []
        with self._lock:
            for i, name, frame in batch:
                if self._index.has(tenant, name):  # known here already: counted, and the write is conditional
                    reserved.append((i, name, frame))
                    known.add(name)
                    continue
                chosen = self._index.victims(tenant, len(frame), self.capacity_bytes, now=self.clock())
                if chosen is None:
                    self.stats["rejected"] += 1
                    continue
                for t, n, _ in chosen:
                    self._index.forget(t, n, evicted=True)
                self._index.remember(tenant, name, len(frame), stamp)
                victims.extend(chosen)
                reserved.append((i, name, frame))
        try:
            self._evict(victims)
            written = self.backend.put_new_many([(name, frame) for _, name, frame in reserved])
        except BackendUnavailable as exc:
            done = set(exc.written) if isinstance(exc, PartialWrite) else set()
            with self._lock:
                for i, name, frame in reserved:
                    if name in done:
                        results[i] = True
                        self.stats["objects_written"] += 1
                        self.stats["bytes_in"] += len(frame)
                    elif name not in known:
                        self._index.forget(tenant, name)
                self._listed_at = -math.inf  # what a lost reply wrote is found by the next listing
            raise
        with self._lock:
            for (i, _, frame), ok in zip(reserved, written, strict=True):
                results[i] = ok
                self.stats["objects_written" if ok else "duplicates"] += 1
                self.stats["bytes_in"] += len(frame) if ok else 0

    def _announce_written(self, chunks, results: list[bool]) -> None:
        for (hashes, _, _), ok in zip(chunks, results, strict=True):
            if ok:
                for listener in self.put_listeners:
                    listener(hashes)

    def set_tenant_limit(self, tenant: str, max_bytes: int | None) -> None:
        """Cap ``tenant``'s L3 bytes (``max_l3_bytes``); None removes the cap. Enforced by the next
        ``put_chunk`` of the tenant (evicting its own oldest objects) and by ``sweep``."""
        t = self._tenant_key(tenant)
        with self._lock:
            self._index.set_limit(t, max_bytes)

    def set_weight(self, tenant: str, weight: int | None) -> None:
        """Weight of ``tenant``'s fair share of the capacity (its ``share_weight``; None: 1, an equal
        share); ``ValueError`` unless an int >= 1. Takes effect at the next eviction."""
        t = self._tenant_key(tenant)
        with self._lock:
            self._index.set_weight(t, 1 if weight is None else weight)

    @property
    def eviction_policy(self) -> EvictionPolicy:
        return self._index.policy

    def use_eviction_policy(self, policy: EvictionPolicy | str) -> None:
        """Evict by ``policy`` (a registered name or an instance) from now on; pins and objects kept."""
        with self._lock:
            self._index.use_policy(policy)

    # ------------------------------------------------------------------ named caches (soft pins)
    def chunk_keys(self, hashes: Sequence[bytes]) -> list[bytes]:
        """The object keys (last-block chain hashes) of the whole chunks of a block chain."""
        cb = self.chunk_blocks
        return [hashes[(c + 1) * cb - 1] for c in range(len(hashes) // cb)]

    def pin(self, keys: Sequence[bytes], until: float | None) -> None:
        """Soft-pin the chunks stored under ``keys`` (``chunk_keys``) until ``until`` (``clock``
        time; None: unpin): evicted after their tenant's unpinned objects (package doc)."""
        with self._lock:
            self._index.pin([k.hex() for k in keys], until, self.clock())

    def pinned(self, key: bytes) -> bool:
        with self._lock:
            until = self._index.pins.get(key.hex())
            return until is not None and until > self.clock()

    def delete_keys(self, tag: Tag, keys: Sequence[bytes]) -> tuple[int, int]:
        """Delete the chunks stored under ``keys`` for ``tag``'s tenant, model and revision, under
        every key version (found by listing, so versions this worker does not hold go too), and
        their pins; ``(objects, bytes)``. Raises ``BackendUnavailable``."""
        wanted = {k.hex() for k in keys}
        self.pin(keys, None)
        if not wanted:
            return 0, 0
        objects = n_bytes = 0
        gone: list[str] = []
        for info in list(self.backend.list(scope_prefix(tag.owner, tag.model, tag.revision, None))):
            if chunk_hex(info.name) in wanted and parse_name(info.name) is not None \
                    and self.backend.delete(info.name):
                objects += 1
                n_bytes += info.size
                gone.append(info.name)
        t = self._tenant_key(tag.owner)
        with self._lock:
            for name in gone:
                self._index.forget(t, name)
            self.stats["deleted"] += objects
            self.stats["deleted_bytes"] += n_bytes
        self._announce_drop(gone, "flushed")
        return objects, n_bytes

    # ------------------------------------------------------------------ deletes and sweeps
    def delete_chunk(self, tag: Tag, key: bytes) -> bool:
        """Delete the chunk stored under chain hash ``key`` for ``tag`` (under every key version the
        keyring holds), e.g. one written while a flush of its scope ran. True if one was deleted.
        Never raises for the backend's state (a failure is counted; the flush's probe sees it)."""
        deleted = False
        t = self._tenant_key(tag.owner)
        try:
            for v in self.keyring.versions(tag.owner):
                name = self._name(tag, v, key)
                if self.backend.delete(name):
                    deleted = True
                    with self._lock:
                        self._index.forget(t, name)
                        self.stats["deleted"] += 1
        except BackendUnavailable:
            self._trip()
        if deleted:
            self._announce_keys([key], "flushed")
        return deleted

    def delete_scope(
        self,
        *,
        tenant: str | None = None,
        model: str | None = None,
        revision: str | None = None,
        key_version: int | None = None,
        revision_variants: bool = False,
    ) -> tuple[int, int]:
        """Delete every object of the scope (unset fields match anything; nothing set = all;
        ``revision_variants``: the revision's variants ``<revision>~...`` too, e.g. its LoRA adapters'
        KV); returns ``(objects, bytes)``. A prefix delete on the backend when the set fields lead
        (tenant, tenant+model, ...), else a listing filtered by name. Raises ``BackendUnavailable``."""
        variants = revision_variants and revision is not None
        prefix = scope_prefix(tenant, model, None if variants else revision, None if variants else key_version)
        match = scope_matcher(tenant, model, revision, key_version, revision_variants=variants)
        leading = not variants and prefix.count("/") == sum(
            f is not None for f in (tenant, model, revision, key_version))
        if leading:
            objects, n_bytes = self.backend.delete_prefix(prefix)
        else:
            objects = n_bytes = 0
            for info in list(self.backend.list(prefix)):
                parsed = parse_name(info.name)
                if parsed is not None and match(info.name) and self.backend.delete(info.name):
                    objects += 1
                    n_bytes += info.size
        forgotten: list[str] = []
        with self._lock:
            for t, n in self._index.matching(match):
                self._index.forget(t, n)
                forgotten.append(n)
            self.stats["deleted"] += objects
            self.stats["deleted_bytes"] += n_bytes
        self._announce_drop(forgotten, "flushed")
        return objects, n_bytes

    def count_scope(
        self,
        *,
        tenant: str | None = None,
        model: str | None = None,
        revision: str | None = None,
        key_version: int | None = None,
        written_before: float | None = None,
        revision_variants: bool = False,
    ) -> tuple[int, int]:
        """``(objects, bytes)`` the backend holds in the scope (the probe after a flush); with
        ``written_before`` (epoch seconds) only the objects written before then; ``revision_variants``
        as for ``delete_scope``. Raises ``BackendUnavailable``."""
        variants = revision_variants and revision is not None
        prefix = scope_prefix(tenant, model, None if variants else revision, None if variants else key_version)
        match = scope_matcher(tenant, model, revision, key_version, revision_variants=variants)
        objects = n_bytes = 0
        for info in self.backend.list(prefix):
            if match(info.name) and (written_before is None or info.mtime < written_before):
                objects += 1
                n_bytes += info.size
        return objects, n_bytes

    def sweep(
        self, retention_seconds_by_tenant: dict[str, float | None], default_seconds: float | None
    ) -> tuple[int, int]:
        """Delete every object past its own expiry (read from its clear header, see the package doc),
        of frame format 1, or older (by the backend's write time) than its tenant's retention
        (``default_seconds`` for tenants not in the dict; None = no tenant limit), trim tenants over
        their limit and the store over its capacity, remove interrupted writes' leftovers, and
        rebuild the index from the listing. Returns ``(objects, bytes)`` deleted for expiry,
        retention and limits. Raises ``BackendUnavailable``."""
        now = self.clock()
        retention = {self._tenant_key(t): s for t, s in retention_seconds_by_tenant.items()}
        objects = n_bytes = 0
        kept: list[tuple[str, ObjectInfo]] = []
        expired: list[str] = []
        for info in list(self.backend.list("")):
            if parse_name(info.name) is None:
                continue
            tenant = tenant_component(info.name)
            if self._expired(info, now, retention.get(tenant, default_seconds)):
                if self.backend.delete(info.name):
                    objects += 1
                    n_bytes += info.size
                    expired.append(info.name)
                continue
            kept.append((tenant, info))
        with self._lock:
            self._index.load(kept)
            victims = self._index.victims(None, 0, self.capacity_bytes, now=now) or []
            for t, n, _ in victims:
                self._index.forget(t, n, evicted=True)
        self._announce_drop(expired, "expired")
        evicted = self._evict(victims)
        removed = self.backend.sweep_temp(self.temp_grace_seconds, now=now)
        with self._lock:
            self.stats["deleted"] += objects
            self.stats["deleted_bytes"] += n_bytes
            self.stats["temp_removed"] += removed
        return objects + evicted[0], n_bytes + evicted[1]

    def expire_tenant(self, tenant: str, retention_seconds: float | None) -> tuple[int, int]:
        """Delete now every object of ``tenant`` past its own expiry or older than
        ``retention_seconds`` (the tenant's retention was lowered); ``(objects, bytes)`` deleted.
        Other tenants are not looked at. Raises ``BackendUnavailable``."""
        now = self.clock()
        objects = n_bytes = 0
        expired: list[str] = []
        for info in list(self.backend.list(scope_prefix(tenant, None, None, None))):
            if parse_name(info.name) is not None and self._expired(info, now, retention_seconds) \
                    and self.backend.delete(info.name):
                objects += 1
                n_bytes += info.size
                expired.append(info.name)
        with self._lock:
            for name in expired:
                self._index.forget(self._tenant_key(tenant), name)
            self.stats["deleted"] += objects
            self.stats["deleted_bytes"] += n_bytes
        self._announce_drop(expired, "expired")
        return objects, n_bytes

    def count_expired(self, *, tenant: str, retention_seconds: float | None) -> int:
        """Objects of ``tenant`` the backend holds that a ``sweep`` with this retention would delete
        (the probe after one: 0 means nothing too old is left). Raises ``BackendUnavailable``."""
        now = self.clock()
        prefix = scope_prefix(tenant, None, None, None)
        return sum(1 for info in self.backend.list(prefix)
                   if parse_name(info.name) is not None and self._expired(info, now, retention_seconds))

    def _expired(self, info: ObjectInfo, now: float, retention_seconds: float | None) -> bool:
        """Whether ``info``'s object is past its own expiry, of frame format 1, or older than
        ``retention_seconds``. Reads the object's clear header only (unauthenticated: it can make a
        sweep delete early, which anyone who can write the backend can do anyway, but a read never
        serves an object whose header was edited). A header too short to parse is left for a read
        to quarantine. Raises ``BackendUnavailable``."""
        if retention_seconds is not None and now - info.mtime > retention_seconds:
            return True
        return head_expired(self.backend.head(info.name, self._frame.head_bytes), now)

    def refresh(self) -> None:
        """Rebuild the index from a listing of the backend (picks up other processes' writes and
        deletes). Raises ``BackendUnavailable``."""
        listing = [(tenant_component(i.name), i) for i in self.backend.list("") if parse_name(i.name) is not None]
        self._breaker.record_success()  # the backend answered: an idle store's breaker closes here too
        with self._lock:
            self._index.load(listing)
            self._listed_at = time.monotonic()

    def _fresh_index(self) -> None:
        """The index, listed again when older than ``refresh_seconds``: the figures follow what other
        replicas, deployments and processes wrote or deleted in the shared store."""
        if self._index.loaded and time.monotonic() - self._listed_at > self.refresh_seconds:
            self.refresh()
        else:
            self._ensure_index()

    # ------------------------------------------------------------------ accounting
    def usage_by_tenant(self, *, refresh: bool = False, scope: tuple[str, str] | None = None) -> dict[str, int]:
        """Bytes held per tenant (index view; ``refresh=True`` re-lists the backend first, and then
        raises ``BackendUnavailable`` if it is down); ``scope`` ``(model, revision)``: only that
        deployment revision's objects. Tenants holding nothing are left out."""
        if refresh:
            self.refresh()
        try:
            self._fresh_index()
        except BackendUnavailable:
            self._trip()
            return {}
        with self._lock:
            if scope is None:
                usage = self._index.usage
            else:
                usage = self._index.usage_matching(lambda name: in_scope(name, scope))
            return {self._tenants.tenant(t): b for t, b in usage.items() if b > 0}

    def gauges(self, scope: tuple[str, str] | None = None) -> dict[str, int]:
        """``objects``, ``used_bytes``, ``capacity_bytes`` (0: unbounded; the whole store's, shared by
        every deployment that uses it), ``chunk_blocks`` and the counters; ``store_objects`` and
        ``store_used_bytes``: the whole store. ``scope`` ``(model, revision)``: ``objects`` and
        ``used_bytes`` count only that deployment revision's objects (what its replicas hold). The
        index is listed again when older than ``refresh_seconds``. ``breaker_open``: 1 while the
        backend's last call failed and none has succeeded since (the breaker is open, or half-open
        waiting for its probe), else 0; ``breaker_opens``: times the breaker opened. The listing
        above is such a call, so an idle store's figure follows the backend within
        ``refresh_seconds``."""
        try:
            self._fresh_index()
        except BackendUnavailable:
            self._trip()
        with self._lock:
            objects, used = self._index.objects(), self._index.total
            if scope is not None:
                objects, used = self._index.count_matching(lambda name: in_scope(name, scope))
            return {"objects": objects, "used_bytes": used, "store_objects": self._index.objects(),
                    "store_used_bytes": self._index.total, "capacity_bytes": self.capacity_bytes or 0,
                    "chunk_blocks": self.chunk_blocks, "breaker_open": int(self._breaker.state != CLOSED),
                    "breaker_opens": self._breaker.opened, **self.stats}

    def check_integrity(self) -> None:
        with self._lock:
            self._index.check()

    # ------------------------------------------------------------------ internals
    def _name(self, tag: Tag, version: int, key: bytes) -> str:
        return chunk_name(tag, version, key)

    def _tenant_key(self, tenant: str) -> str:
        return self._tenants.key(tenant)

    def _expire(self, tag: Tag, name: str) -> None:
        """A read found ``name`` past its own expiry (or of frame format 1): a miss, and deleted."""
        self._count("expired")
        self._count("misses")
        try:
            deleted = self.backend.delete(name)
        except BackendUnavailable:
            self._trip()
            return
        with self._lock:
            self.stats["deleted"] += int(deleted)
            self._index.forget(self._tenant_key(tag.owner), name)
        self._announce_drop([name], "expired")

    def _quarantine(self, tag: Tag, name: str) -> None:
        self._count("corrupt")
        try:
            self.backend.delete(name)
        except BackendUnavailable:
            self._trip()
            return
        with self._lock:
            self.stats["quarantined"] += 1
            self._index.forget(self._tenant_key(tag.owner), name)
        self._announce_drop([name], "corrupt")

    def _available(self) -> bool:
        """Whether the backend may be tried now (the breaker is not open); counted when not."""
        if self._breaker.allow():
            return True
        self._count("unavailable")
        return False

    def _trip(self) -> None:
        """The backend failed: counted, and skipped for ``retry_after_seconds``."""
        self._breaker.record_failure()
        self._count("failures")

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.stats[key] += n

    def _ensure_index(self) -> None:
        """List the backend once (outside the lock: it is I/O) to build the index."""
        if self._index.loaded:
            return
        listing = [(tenant_component(i.name), i) for i in self.backend.list("") if parse_name(i.name) is not None]
        self._breaker.record_success()
        with self._lock:
            if not self._index.loaded:
                self._index.load(listing)
                self._listed_at = time.monotonic()

    def _seen(self, tag: Tag, name: str, size: int, created: float) -> None:
        """A read delivered ``name``: the tenant's most recently used object now."""
        with self._lock:
            self._index.seen(self._tenant_key(tag.owner), name, size, created)

    def _evict(self, victims: list[Victim]) -> tuple[int, int]:
        objects = n_bytes = 0
        for _, name, size in victims:
            if self.backend.delete(name):
                objects += 1
                n_bytes += size
        with self._lock:
            self.stats["evicted"] += objects
            self.stats["evicted_bytes"] += n_bytes
        self._announce_drop([name for _, name, _ in victims], "evicted")
        return objects, n_bytes

    def _announce_drop(self, names: list[str], reason: str) -> None:
        """Tell ``drop_listeners`` the chunk keys of ``names`` (objects gone from this store's view)."""
        if names and self.drop_listeners:
            self._announce_keys([chunk_key(n) for n in names], reason)

    def _announce_keys(self, keys: list[bytes], reason: str) -> None:
        """Tell ``drop_listeners`` these chunk keys are gone from this store's view."""
        for listener in self.drop_listeners:
            listener(keys, reason)

