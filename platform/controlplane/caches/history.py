"""What the miss diagnostics remember of a tenant's prompts: keyed digests of their full blocks, never
their text, bounded per scope.

A scope is (tenant, model, ``cache_salt``). Block ``i``'s digest chains the ones before it
(``d_i = H(key; d_{i-1}, tokens of block i)``), keyed by a secret derived from the tenant's own scope
salt, so a digest says nothing about the tokens to anyone without the key, and the digests of two
tenants never meet: another tenant's prompt is, to this tenant's scope, never seen.

Each digest keeps when it was last seen, by which replica, under which revision, and whether it could
have been persisted (L3). To say *where* in a block a prompt departed from what was seen, each block
also keeps 16 masks: its token ids XORed with a pad derived from the key and its parent's digest
(``_pad``); two children of one parent compare equal token by token through their masks, while a mask
alone is unreadable without the key.

The history lives in the web process's memory (one uvicorn process serves the API). Each tenant has
a share of its own, so that no tenant's requests can push another's history out: at most
``MAX_SCOPES`` scopes and ``MAX_TENANT_BLOCKS`` digests per tenant (``MAX_BLOCKS`` in any one scope),
its least recently used scope first out; at most ``MAX_TENANTS`` tenants are held (tenants are made by
operators, not by requests), the least recently used tenant's share first out, and a tenant whose
share is empty is not held at all. The caps are attributes of each ``PrefixHistory`` (tests shrink
``HISTORY``'s). A restart forgets it all (later misses read ``no_prior_request`` until the prompts come
again).
"""

from __future__ import annotations

import hashlib
import threading
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

MAX_BLOCKS = 8192  # digests in one scope
MAX_TENANT_BLOCKS = 32_768  # digests of one tenant, over all its scopes
MAX_SCOPES = 256  # scopes of one tenant ((model, cache_salt) pairs)
MAX_TENANTS = 512  # tenants held (in all: MAX_TENANTS * MAX_TENANT_BLOCKS digests at most)
MAX_CHILDREN = 8  # blocks remembered under one parent (divergence candidates)
DIGEST = 16
ROOT = b"\x00" * DIGEST


@dataclass(slots=True)
class Seen:
    """One block of some prompt seen in scope."""

    at: float
    replica: str
    revision: str
    persist: bool
    masks: bytes = b""  # the block's tokens XOR the parent's pad (4 bytes each)
    deleted: str = ""  # the named cache whose deletion removed this block (its id)


@dataclass
class _Scope:
    blocks: OrderedDict[bytes, Seen] = field(default_factory=OrderedDict)
    children: dict[bytes, list[bytes]] = field(default_factory=dict)


@dataclass
class _Tenant:
    """One tenant's share: its scopes, least recently used first, and their digests counted."""

    scopes: OrderedDict[tuple, _Scope] = field(default_factory=OrderedDict)
    blocks: int = 0


def scope_key(tenant_salt: bytes, model: str, cache_salt: str | None) -> bytes:
    """The secret that keys one scope's digests."""
    h = hashlib.blake2b(b"strata-prefix-history-v1", key=bytes(tenant_salt)[:64], digest_size=32)
    h.update(model.encode() + b"\x00" + (cache_salt or "").encode())
    return h.digest()


def digests(key: bytes, tokens: list[int], block_size: int) -> list[bytes]:
    """The chained digest of every full block of ``tokens``."""
    raw = array("I", tokens).tobytes()
    step = 4 * block_size
    out, parent = [], ROOT
    for i in range(len(tokens) // block_size):
        parent = hashlib.blake2b(parent + raw[i * step:(i + 1) * step], key=key, digest_size=DIGEST).digest()
        out.append(parent)
    return out


def tail_digest(key: bytes, parent: bytes, tokens: list[int]) -> bytes:
    """A partial block's own name (never equal to a full block's digest: another domain)."""
    return hashlib.blake2b(parent + b"tail" + array("I", tokens).tobytes(), key=key, digest_size=DIGEST).digest()


def _pad(key: bytes, parent: bytes, block_size: int) -> bytes:
    out, counter = b"", 0
    while len(out) < 4 * block_size:
        out += hashlib.blake2b(parent + b"pad" + bytes([counter]), key=key, digest_size=64).digest()
        counter += 1
    return out[: 4 * block_size]


def masks(key: bytes, parent: bytes, block: list[int]) -> bytes:
    """``block``'s token ids XOR the pad of ``parent`` (comparable with its siblings' masks)."""
    raw = array("I", block).tobytes()
    pad = _pad(key, parent, len(block))
    return bytes(a ^ b for a, b in zip(raw, pad, strict=False))


class PrefixHistory:
    """Thread-safe; ``lookup`` before ``record`` tells what a request's prompt had in scope.

    A scope is ``(tenant, model, cache_salt)``; its first item names the tenant's share it lives in.
    Reads never add a tenant or a scope; only ``record`` does, and only ``record`` evicts: the scopes of
    the recording tenant (never the one recorded into), or the least recently used other tenant."""

    def __init__(self, *, max_blocks: int = MAX_BLOCKS, max_scopes: int = MAX_SCOPES,
                 max_tenant_blocks: int = MAX_TENANT_BLOCKS, max_tenants: int = MAX_TENANTS) -> None:
        self.max_blocks, self.max_scopes = max_blocks, max_scopes
        self.max_tenant_blocks, self.max_tenants = max_tenant_blocks, max_tenants
        self._tenants: OrderedDict[str, _Tenant] = OrderedDict()
        self._lock = threading.Lock()

    def _scope(self, scope: tuple, create: bool) -> _Scope | None:
        t = self._tenants.get(scope[0])
        if t is None:
            if not create:
                return None
            t = self._tenants[scope[0]] = _Tenant()
            while len(self._tenants) > self.max_tenants:
                self._tenants.popitem(last=False)
        self._tenants.move_to_end(scope[0])
        s = t.scopes.get(scope)
        if s is None and create:
            s = t.scopes[scope] = _Scope()
            while len(t.scopes) > self.max_scopes:
                t.blocks -= len(t.scopes.popitem(last=False)[1].blocks)
        if s is not None:
            t.scopes.move_to_end(scope)
        return s

    def lookup(self, scope: tuple, chain: list[bytes]) -> tuple[int, list[Seen]]:
        """How many leading blocks of ``chain`` were seen in ``scope``, and their records."""
        with self._lock:
            s = self._scope(scope, create=False)
            if s is None:
                return 0, []
            seen = []
            for d in chain:
                entry = s.blocks.get(d)
                if entry is None:
                    break
                seen.append(entry)
            return len(seen), seen

    def siblings(self, scope: tuple, parent: bytes) -> list[bytes]:
        """The masks of blocks seen right after ``parent`` (``ROOT``: first blocks)."""
        with self._lock:
            s = self._scope(scope, create=False)
            if s is None:
                return []
            return [s.blocks[c].masks for c in s.children.get(parent, ()) if c in s.blocks]

    def record(self, scope: tuple, chain: list[bytes], new_masks: dict[int, bytes], *, replica: str,
               revision: str, persist: bool, at: float | None = None,
               tail: tuple[bytes, bytes] | None = None) -> None:
        """``chain`` was served now; ``new_masks[i]`` for the blocks not yet in scope. ``tail``: the
        digest and masks of the prompt's last, partial block (never cached, but where a later prompt
        departs from it is worth knowing), kept as a child of the last full block."""
        at = time.time() if at is None else at
        with self._lock:
            s = self._scope(scope, create=True)
            before = len(s.blocks)
            parent = ROOT
            for i, d in enumerate(chain):
                entry = s.blocks.get(d)
                if entry is None:
                    s.blocks[d] = Seen(at, replica, revision, persist, new_masks.get(i, b""))
                    self._child(s, parent, d)
                else:
                    entry.at, entry.replica, entry.revision, entry.persist = at, replica, revision, persist
                    entry.deleted = ""
                    s.blocks.move_to_end(d)
                parent = d
            if tail is not None and tail[0] not in s.blocks:
                s.blocks[tail[0]] = Seen(at, replica, revision, persist, tail[1])
                self._child(s, parent, tail[0])
            while len(s.blocks) > min(self.max_blocks, self.max_tenant_blocks):
                gone, _ = s.blocks.popitem(last=False)
                s.children.pop(gone, None)
            t = self._tenants[scope[0]]
            t.blocks += len(s.blocks) - before
            while t.blocks > self.max_tenant_blocks:  # never this scope: it is the most recent one
                t.blocks -= len(t.scopes.popitem(last=False)[1].blocks)

    @staticmethod
    def _child(s: _Scope, parent: bytes, digest: bytes) -> None:
        kids = s.children.setdefault(parent, [])
        kids.append(digest)
        del kids[:-MAX_CHILDREN]

    def mark_deleted(self, scope: tuple, chain: list[bytes], cache_id: str) -> None:
        """The blocks of ``chain`` were deleted with the named cache ``cache_id`` (a later miss of them
        says so, until they are served again)."""
        with self._lock:
            s = self._scope(scope, create=False)
            for d in chain if s is not None else ():
                entry = s.blocks.get(d)
                if entry is not None:
                    entry.deleted = cache_id

    def forget_tenant(self, tenant: str) -> None:
        """Drop every scope of ``tenant`` (offboarded): its share is no longer held."""
        with self._lock:
            self._tenants.pop(tenant, None)

    def tenants(self) -> dict[str, tuple[int, int]]:
        """Each tenant held: its scopes and digests, least recently used tenant first."""
        with self._lock:
            return {name: (len(t.scopes), t.blocks) for name, t in self._tenants.items()}

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` unless every cap holds, every tenant held has a scope, every scope
        lives in its own tenant's share and each tenant's digest count is the sum of its scopes'."""
        with self._lock:
            assert len(self._tenants) <= self.max_tenants, "too many tenants held"
            for name, t in self._tenants.items():
                assert t.scopes, f"tenant {name} is held with no scope"
                assert len(t.scopes) <= self.max_scopes, f"tenant {name} holds too many scopes"
                assert all(k[0] == name for k in t.scopes), f"a scope in tenant {name}'s share is not its own"
                assert all(len(s.blocks) <= self.max_blocks for s in t.scopes.values()), "a scope is over its cap"
                assert t.blocks == sum(len(s.blocks) for s in t.scopes.values()), f"tenant {name}'s count is off"
                assert t.blocks <= self.max_tenant_blocks, f"tenant {name} holds too many digests"


HISTORY = PrefixHistory()
