"""What an API key resolves to, kept in this process while the access generation stands still.

An entry is made for an active key after the database said so (``admission``): the ``AuthResult``
(its tenant with quotas, cache policy and share group loaded, and the key), the tenant's granted
deployments with their active revisions and the LoRA adapters it may use. It is served only while
``access_generation.current`` is the number read *before* the entry's rows were read, so a change
that committed at any time after that read (in any process) makes the entry unusable on the next
request: a revoked key or a suspended tenant is refused at once, a withdrawn grant is a 404 at once,
a changed quota applies at once. Where there is no generation (no triggers on the database's vendor) nothing is kept.

Entries are found by the SHA-256 of the key (the key itself is never kept), at most ``MAX_ENTRIES``
(all forgotten when full). What an entry holds is shared by concurrent requests: read-only.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any

MAX_ENTRIES = 10_000


@dataclass(frozen=True)
class Entry:
    generation: int
    result: Any  # tenants.selectors.AuthResult, status "active"
    deployments: dict[str, Any]  # name -> ModelDeployment (active revision loaded)
    adapters: dict[str, Any] = field(default_factory=dict)  # name -> adapters.selectors.AdapterRef


_lock = threading.Lock()
_entries: dict[bytes, Entry] = {}


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def get(key_digest: bytes, generation: int | None) -> Entry | None:
    """The entry of a key if it was made at ``generation`` (None: never)."""
    if generation is None:
        return None
    entry = _entries.get(key_digest)
    return entry if entry is not None and entry.generation == generation else None


def put(key_digest: bytes, entry: Entry) -> None:
    with _lock:
        if len(_entries) >= MAX_ENTRIES:
            _entries.clear()
        _entries[key_digest] = entry


def forget_all() -> None:
    """Forget every entry of this process (tests)."""
    with _lock:
        _entries.clear()


def size() -> int:
    return len(_entries)
