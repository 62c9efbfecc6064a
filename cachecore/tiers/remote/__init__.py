"""L3: the encrypted remote store (filesystem directory or Redis), shared by workers and restarts.

The package, one module per job: :mod:`~cachecore.tiers.remote.names` (object names, scopes),
:mod:`~cachecore.tiers.remote.frame` (an object's bytes: the chunk inside a :mod:`cachecore.crypto`
frame), :mod:`~cachecore.tiers.remote.capacity` (capacity and per-tenant byte accounting, eviction
victims), :mod:`~cachecore.tiers.remote.breaker` (a generic circuit breaker) and
:mod:`~cachecore.tiers.remote.store` (:class:`RemoteStore`, composing them). The contract of the
whole follows.

An L3 object is a **chunk** of ``chunk_blocks`` consecutive blocks (default 16 = 256 tokens at
block size 16) stored under the chain hash of its LAST block, which binds the whole prefix before
it. Its name::

    <tenant>/<model>/<revision>/v<key version>/<hex chain hash of the chunk's last block>

(each of tenant, model and revision escaped to ``[A-Za-z0-9_-]`` and ``%XX``; :mod:`~cachecore.tiers.remote.names`),
so deletes by tenant, model, revision or key version are prefix operations on the backend.

The bytes are a frame of :mod:`cachecore.crypto` (AES-256-GCM under the tenant's active data-key
version) around the chunk's plaintext (:mod:`~cachecore.tiers.remote.frame`). The associated data is
computed by the READER from its own request: object key (= the object's name), ``tag.ns_digest``, the
KV layout, ``tag.owner`` as tenant id, and the frame's key version, format version and expiry; so an
object moved to another name, tenant, model or revision, or whose expiry was edited, fails to decrypt.

**Expiry.** Each object carries its own expiry in the frame header (``put_chunk``'s
``retention_seconds``: the writer's retention, the minimum of the request's and the tenant's, from
the write time; 0 = none), authenticated with it. A read serves nothing at or past it (and deletes
the object: nobody may read it again), nor anything older than the reading request's own retention
(the tenant's current one, so a lowered retention applies at once). ``sweep`` reads each object's
clear header (``Backend.head``, no decryption) and deletes what is past its own expiry or older than
its tenant's retention. Objects of frame format 1 (written before expiries existed) are treated as
expired: never served, deleted by the next read or sweep.

Reads (:meth:`RemoteStore.get`) stop at the first chunk that is missing, expired, unreadable or
fails verification; that chunk and every one after it is a miss, never wrong bytes:

- missing, past its own expiry, older than the request's retention, of frame format 1, or sealed
  under a key version this worker does not hold (shredded): a miss (``misses``; ``expired``,
  ``shredded``); an object past its own expiry or of format 1 is deleted;
- torn, truncated, bit-flipped, another format version, moved (associated data differs), wrong
  shape/dtype or other token ids: ``corrupt``, and the object is quarantined (deleted, so it is not
  retried forever and a later write can replace it);
- the backend down, unreachable or slow (``BackendUnavailable``): a miss counted in ``failures``;
  then L3 is skipped (``unavailable``) for ``retry_after_seconds`` so a dead backend does not cost
  every request a timeout, and used again after (a
  :class:`~cachecore.tiers.remote.breaker.CircuitBreaker` that opens at the first failure).

Writes (:meth:`RemoteStore.put_chunk`, :meth:`RemoteStore.put_chunks` for a request's chunk set)
are meant to run off the request path (the engine's writer thread). A set costs one existence probe
for all its chunks (under every key version held; what is there is neither sealed nor sent) and one
batched conditional write (``Backend.put_new_many``: an object is written only where none is, so of
two writers of one chunk exactly one writes and neither replaces the other's). Reads fetch each
chunk into a per-thread buffer (``Backend.get_into``) and decrypt it from there.

Capacity (``capacity_bytes``) is shared fairly, by the same eviction policy type as L1 and
L2 (``eviction_policy``, :mod:`cachecore.eviction`; ``fair_lru`` by default): when room is needed, an
object of a tenant over its share goes first (a tenant that floods L3 evicts its own objects); shares
are weighted by :meth:`set_weight` (the tenant's ``share_weight``, as in L1 and L2), and a tenant's
``max_bytes`` (:meth:`set_tenant_limit`) evicts its own objects. With ``fair_lru`` the oldest object
goes first; age order is write time, refreshed by reads in this process. The accounting
(:class:`~cachecore.tiers.remote.capacity.L3Index`, which asks the policy for the victims) is an
in-memory index of the backend listed once (lazily) and kept up to date by this store's own writes,
deletes and reads; objects written by other processes enter it when read, and :meth:`refresh` /
:meth:`sweep` re-list.

**Soft pins** (named caches): :meth:`RemoteStore.pin` pins chunks by chain hash until a time (this
process's view: another process sharing the backend does not see them); when room is needed, a
tenant's pinned objects go after its unpinned ones, and which tenant gives up an object is decided
as without pins. A pin never outlives an object's own expiry or its tenant's retention.
:meth:`RemoteStore.delete_keys` deletes the chunks covering a prefix (under every key version).

What it writes and deletes is announced (for KV events): ``put_listeners`` get the chain hashes of
every chunk written (``listener(hashes)``), ``drop_listeners`` the chunk keys (last-block hashes) of
objects it deleted or forgot, with a reason (``listener(keys, reason)``: ``"evicted"``, ``"flushed"``,
``"corrupt"``, ``"expired"``), outside the store's lock. A listener must not call back into the store.

Thread-safe. ``probe``, ``get`` and ``put_chunk`` never raise for the state of the backend;
``delete_scope``, ``count_scope``, ``sweep`` and ``refresh`` raise ``BackendUnavailable`` (a flush job
must know that it did not happen).
"""

from cachecore.tiers.remote.capacity import l3_figures
from cachecore.tiers.remote.names import ObjectName, object_name, parse_name
from cachecore.tiers.remote.store import DEFAULT_CHUNK_BLOCKS, RemoteStore

__all__ = ["DEFAULT_CHUNK_BLOCKS", "ObjectName", "RemoteStore", "l3_figures", "object_name", "parse_name"]
