"""Names of L3 objects: ``<tenant>/<model>/<revision>/v<key version>/<hex chain hash>``, each of tenant,
model and revision escaped to ``[A-Za-z0-9_-]`` and ``%XX`` (see :mod:`cachecore.tiers.remote`), and the
prefixes and matchers that select a scope (tenant, model, revision, key version) by name.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import NamedTuple
from urllib.parse import unquote

__all__ = ["ObjectName", "dec", "enc", "object_name", "parse_name", "scope_matcher", "scope_prefix"]

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


def scope_matcher(tenant: str | None, model: str | None, revision: str | None, key_version: int | None
                  ) -> Callable[[str], bool]:
    """Whether an object name is in the scope (unset fields match anything)."""
    want = (
        None if tenant is None else enc(tenant),
        None if model is None else enc(model),
        None if revision is None else enc(revision),
        None if key_version is None else f"v{key_version}",
    )

    def match(name: str) -> bool:
        parts = name.split("/")
        return len(parts) == 5 and all(w is None or w == p for w, p in zip(want, parts, strict=False))

    return match
