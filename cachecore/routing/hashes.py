"""A request's block hashes computed outside the worker, exactly as the worker computes them.

The worker keys every block by ``cachecore.hashing.chain_hashes`` over its namespace
(``Namespace.build`` of the model's fields and the tenant's scope salt). It publishes the fields
that are not secret (``CacheWorker.info()["namespace_fields"]``: every field of the namespace except
the scope salt, plus ``block_size``); the gateway already holds the scope salt of the tenant it
authenticated and the client's ``cache_salt``, so the router can compute the same keys without
seeing anything it did not already have. Since the scope salt is inside the chain, one tenant's
hashes never equal another's for the same tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

from cachecore.hashing import chain_hashes
from cachecore.namespace import Namespace

__all__ = ["namespace_fields", "request_hashes", "request_salt"]

_FIELDS = tuple(f.name for f in dataclasses.fields(Namespace) if f.name != "digest")


def namespace_fields(ns: Namespace, block_size: int) -> dict:
    """Plain data for ``request_hashes``: every field ``ns`` was built from except the scope salt
    (mappings as dicts), plus ``block_size``. Read from ``ns`` itself, so it cannot drift from the
    fields the worker builds its namespaces with."""
    out: dict = {}
    for name in _FIELDS:
        value = getattr(ns, name)
        out[name] = dict(value) if isinstance(value, tuple) else value
    out["block_size"] = int(block_size)
    return out


def request_salt(cache_salt: str | None) -> bytes:
    """The chain's per-request salt for a client's ``cache_salt`` (``b""`` for none): it narrows
    sharing inside the tenant's scope and never replaces the scope salt."""
    if not cache_salt:
        return b""
    return hashlib.sha256(b"strata.cache_salt\x00" + cache_salt.encode()).digest()


def request_hashes(namespace_fields: dict, scope_salt: bytes, tokens: Sequence[int],
                   request_salt: bytes = b"") -> list[bytes]:
    """The chain hashes of the full blocks of ``tokens`` under the namespace of ``namespace_fields``
    (``CacheWorker.info()["namespace_fields"]``) and ``scope_salt``; ``request_salt`` is the bytes of
    :func:`request_salt` for the request's ``cache_salt``. Raises ``ValueError`` when ``block_size``
    is missing, and the namespace's and the hash chain's typed errors for bad fields or tokens."""
    fields = dict(namespace_fields)
    block_size = fields.pop("block_size", None)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"namespace_fields must hold a positive int block_size, got {block_size!r}")
    ns = Namespace.build(scope_salt=scope_salt, **fields)
    return chain_hashes(ns, tokens, block_size, request_salt=request_salt)
