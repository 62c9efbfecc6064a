"""Names of L3 objects: ``<tenant>/<model>/<revision>/v<key version>/<hex chain hash>``, each of tenant,
model and revision escaped to ``[A-Za-z0-9_-]`` and ``%XX`` (so that deletes by tenant, model, revision or
key version are prefix operations on the backend), parsed back (:func:`parse_name`), the prefixes and
matchers that select a scope (tenant, model, revision, key version) by name, and the parts of a name
the store reads (tenant component, chunk key, deployment revision). :class:`TenantKeys` maps encoded
tenant components back to tenant ids (an over-long id is encoded as a digest, not reversible).
Plain Python: no I/O, no tensors.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple
from urllib.parse import unquote

if TYPE_CHECKING:
    from cachecore.tiers.base import Tag

__all__ = [
    "ObjectName", "TenantKeys", "chunk_hex", "chunk_key", "chunk_name", "dec", "enc", "in_scope", "object_name",
    "parse_name", "scope_matcher", "scope_prefix", "tenant_component",
]

_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
_MAX_COMPONENT = 150


def enc(text: str) -> str:
    """Escape one name component: ``[A-Za-z0-9_-]`` kept, every other UTF-8 byte as ``%XX`` (so no
    ``/``, no leading ``.``); ``""`` is ``%``. Over-long components become ``%%`` + a digest."""
    if text == "":
        return "%"
    out = "".join(c if c in _SAFE else "".join(f"%{b:02X}" for b in c.encode("utf-8")) for c in text)
    if len(out) > _MAX_COMPONENT:
        out = "%%" + hashlib.blake2b(text.encode("utf-8"), digest_size=20).hexdigest()
    return out


def dec(component: str) -> str:
    if component == "%":
        return ""
    if component.startswith("%%"):
        return component  # a digest of an over-long value: not reversible
    return unquote(component, errors="strict")


class ObjectName(NamedTuple):
    """The parts of an L3 object's name (tenant, model, revision decoded)."""

    tenant: str
    model: str
    revision: str
    key_version: int
    key: bytes


def object_name(tenant: str, model: str, revision: str, key_version: int, key: bytes) -> str:
    return f"{enc(tenant)}/{enc(model)}/{enc(revision)}/v{key_version}/{key.hex()}"


def chunk_name(tag: Tag, key_version: int, key: bytes) -> str:
    """The name of the chunk stored under chain hash ``key`` for ``tag``'s tenant, model and revision,
    sealed under ``key_version``."""
    return object_name(tag.owner, tag.model, tag.revision, key_version, key)


def tenant_component(name: str) -> str:
    """The encoded tenant component of an object name (the index's tenant key)."""
    return name.split("/", 1)[0]


def chunk_hex(name: str) -> str:
    """The last component of an object name: the hex chain hash of its chunk's last block."""
    return name.rsplit("/", 1)[-1]


def chunk_key(name: str) -> bytes:
    """The chunk key (chain hash of the chunk's last block) of an object name."""
    return bytes.fromhex(chunk_hex(name))


def in_scope(name: str, scope: tuple[str, str] | None) -> bool:
    """Whether an object name belongs to deployment revision ``scope`` ``(model, revision)`` (None: all)."""
    if scope is None:
        return True
    parts = name.split("/", 3)
    return len(parts) > 2 and parts[1] == enc(scope[0]) and parts[2] == enc(scope[1])


def parse_name(name: str) -> ObjectName | None:
    """The parts of ``name``, or None if it is not an L3 object name."""
    parts = name.split("/")
    if len(parts) != 5 or not parts[3].startswith("v") or not parts[3][1:].isdigit():
        return None
    try:
        key = bytes.fromhex(parts[4])
        return ObjectName(dec(parts[0]), dec(parts[1]), dec(parts[2]), int(parts[3][1:]), key)
    except (ValueError, UnicodeDecodeError):
        return None


def scope_prefix(tenant: str | None, model: str | None, revision: str | None, key_version: int | None) -> str:
    """The longest literal name prefix of a scope (fields after the first unset one are filtered)."""
    prefix = ""
    for part in (
        None if tenant is None else enc(tenant),
        None if model is None else enc(model),
        None if revision is None else enc(revision),
        None if key_version is None else f"v{key_version}",
    ):
        if part is None:
            break
        prefix += part + "/"
    return prefix


VARIANT = "~"  # ``<revision>~<variant>``: KV of a revision's variant (a LoRA adapter's), flushed with it


def scope_matcher(tenant: str | None, model: str | None, revision: str | None, key_version: int | None,
                  *, revision_variants: bool = False) -> Callable[[str], bool]:
    """Whether an object name is in the scope (unset fields match anything). ``revision_variants``:
    the revision's variants ``<revision>~...`` match too."""
    variant = None if revision is None or not revision_variants else enc(revision + VARIANT)
    want = (
        None if tenant is None else enc(tenant),
        None if model is None else enc(model),
        None if revision is None else enc(revision),
        None if key_version is None else f"v{key_version}",
    )

    def match(name: str) -> bool:
        parts = name.split("/")
        if variant is not None and len(parts) == 5 and parts[2].startswith(variant):
            parts[2] = want[2]  # a variant of the revision: the other fields decide
        return len(parts) == 5 and all(w is None or w == p for w, p in zip(want, parts, strict=False))

    return match


class TenantKeys:
    """Tenant id <-> encoded tenant component (:func:`enc`), the key the store's accounting uses. An
    over-long id is encoded as a digest (``%%...``), which :func:`dec` cannot reverse: the ids seen by
    :meth:`key` are remembered so :meth:`tenant` can answer for them."""

    def __init__(self) -> None:
        self._long: dict[str, str] = {}  # encoded (digest) -> tenant id

    def key(self, tenant: str) -> str:
        key = enc(tenant)
        if key.startswith("%%"):
            self._long[key] = tenant
        return key

    def tenant(self, key: str) -> str:
        return self._long.get(key, dec(key))
