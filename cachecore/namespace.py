"""Cache namespace: every field that decides whether two requests may share KV, folded into one digest.

``Namespace.build(...)`` validates the fields, encodes them canonically (type-tagged and
length-prefixed, mappings sorted by key) and hashes the result to a 32-byte ``digest``. The digest
keys the block hash chain (``cachecore.hashing``), so two namespaces that differ in any field (tenant
scope salt, model, weights, tokenizer, KV layout, RoPE, LoRA, TP shard) never produce the same block
key.

The digest is derived from the secret scope salt: treat it as a secret too. Only ``fingerprint`` (a
one-way hash of the digest) is safe to log or show; ``repr`` shows neither salt nor digest.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

from cachecore.errors import InvalidNamespace, UnknownNamespaceField

__all__ = ["FORMAT_VERSION", "SCOPE_SALT_BYTES", "Namespace", "canonical_encode"]

#: Bump when the canonical encoding or the field set changes: old keys then simply stop matching.
FORMAT_VERSION = 2
SCOPE_SALT_BYTES = 32

_DOMAIN = b"strata/namespace"
_FINGERPRINT_PERSON = b"strata-ns-fp"
_LEN = struct.Struct("<Q")


#: Where cached KV comes from: the model's own forward pass, or the KV API (untrusted).
ORIGINS = ("model", "upload")


def _frame(tag: bytes, payload: bytes) -> bytes:
    return tag + _LEN.pack(len(payload)) + payload


def _encode_one(part: object) -> bytes:
    # bool before int: bool is an int subclass, and True must not encode like 1.
    if part is None:
        return _frame(b"N", b"")
    if isinstance(part, bool):
        return _frame(b"?", b"\x01" if part else b"\x00")
    if isinstance(part, int):
        return _frame(b"I", part.to_bytes((part.bit_length() + 8) // 8, "little", signed=True))
    if isinstance(part, float):
        if not math.isfinite(part):
            raise ValueError(f"canonical_encode: non-finite float {part!r}")
        return _frame(b"F", struct.pack("<d", part + 0.0))  # + 0.0 folds -0.0 into 0.0
    if isinstance(part, str):
        return _frame(b"S", part.encode("utf-8"))
    if isinstance(part, bytes | bytearray | memoryview):
        return _frame(b"B", bytes(part))
    if isinstance(part, Mapping):
        items = []
        for key, value in part.items():
            if not isinstance(key, str):
                raise TypeError(f"canonical_encode: mapping keys must be str, got {type(key).__name__}")
            items.append((key, value))
        items.sort()
        body = b"".join(_encode_one(k) + _encode_one(v) for k, v in items)
        return _frame(b"M", _LEN.pack(len(items)) + body)
    if isinstance(part, tuple | list):
        return _frame(b"L", _LEN.pack(len(part)) + b"".join(_encode_one(p) for p in part))
    raise TypeError(f"canonical_encode: unsupported type {type(part).__name__}")


def canonical_encode(*parts: object) -> bytes:
    """Injective byte encoding of ``parts``: equal output iff equal (type, value) sequence.

    Every part is framed as ``tag (1 byte) | payload length (u64 LE) | payload``, so
    ``("org_1", "2345")`` and ``("org_12345", "")`` differ, and ``1``, ``1.0``, ``True``, ``"1"`` and
    ``b"1"`` all differ from each other. Supported: ``None``, ``bool``, ``int``, ``float`` (finite;
    ``-0.0`` equals ``0.0``), ``str`` (UTF-8), bytes-like, ``Mapping`` with ``str`` keys (items sorted
    by key, so insertion order does not matter), ``tuple``/``list`` (order matters), nested freely.

    Pure; raises ``TypeError`` for unsupported types or non-``str`` mapping keys and ``ValueError``
    for NaN/infinite floats.
    """
    return b"".join(_encode_one(p) for p in parts)


def _check_str(name: str, value: object, *, allow_empty: bool) -> str:
    if not isinstance(value, str):
        raise InvalidNamespace(f"namespace field {name!r} must be str, got {type(value).__name__}")
    if not allow_empty and not value:
        raise InvalidNamespace(f"namespace field {name!r} must not be empty")
    return value


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidNamespace(f"namespace field {name!r} must be int, got {type(value).__name__}")
    return value


def _check_mapping(name: str, value: object, allowed: tuple[type, ...]) -> tuple[tuple[str, object], ...]:
    if not isinstance(value, Mapping):
        raise InvalidNamespace(f"namespace field {name!r} must be a mapping, got {type(value).__name__}")
    items = []
    for key, item in value.items():
        if not isinstance(key, str) or not key:
            raise InvalidNamespace(f"namespace field {name!r}: keys must be non-empty str, got {key!r}")
        if isinstance(item, bool) or not isinstance(item, allowed):
            kinds = "|".join(t.__name__ for t in allowed)
            raise InvalidNamespace(f"namespace field {name}[{key!r}] must be {kinds}, got {type(item).__name__}")
        if isinstance(item, float) and not math.isfinite(item):
            raise InvalidNamespace(f"namespace field {name}[{key!r}] must be finite, got {item!r}")
        items.append((key, item))
    return tuple(sorted(items))


@dataclass(frozen=True)
class Namespace:
    """A validated cache namespace. Build it with ``Namespace.build``; equality and hashing use ``digest``.

    The scope salt is not kept: only its effect on ``digest`` is. Mapping fields are stored as sorted
    ``(key, value)`` tuples so the object is immutable and hashable.
    """

    digest: bytes = field(repr=False)
    model_id: str = field(compare=False)
    weight_digest: str = field(compare=False, repr=False)
    tokenizer_digest: str = field(compare=False, repr=False)
    layout: tuple[tuple[str, int | str], ...] = field(compare=False, repr=False)
    rope: tuple[tuple[str, int | float | str], ...] = field(compare=False, repr=False)
    lora_id: str = field(compare=False)
    tp_rank: int = field(compare=False)
    tp_size: int = field(compare=False)
    origin: str = field(default="model", compare=False)

    @classmethod
    def build(
        cls,
        *,
        scope_salt: bytes,
        model_id: str,
        weight_digest: str,
        tokenizer_digest: str,
        layout: Mapping[str, int | str],
        rope: Mapping[str, int | float | str],
        lora_id: str = "",
        tp_rank: int = 0,
        tp_size: int = 1,
        origin: str = "model",
        **unknown: object,
    ) -> Namespace:
        """Validate every field and derive the digest. Pure.

        ``scope_salt`` is the tenant's (or share group's) secret, exactly 32 bytes, chosen by the
        server. Mapping values keep their type in the key (``10000`` and ``10000.0`` are different
        namespaces), so build the mappings from one canonical source (e.g. ``KVLayout.canonical()``).
        ``origin`` says where the KV comes from: ``"model"`` (computed by Strata's own forward pass,
        what completions reuse) or ``"upload"`` (untrusted bytes from the KV API, never read by a
        completion); the two never share a key.

        Raises ``UnknownNamespaceField`` (naming the field) for any keyword outside the schema and
        ``InvalidNamespace`` for a wrong type, an empty ``model_id``/digest, a salt that is not
        exactly 32 bytes, a non-finite float, or ``tp_rank``/``tp_size`` out of range. A missing
        required field is a plain ``TypeError`` from Python.
        """
        if unknown:
            names = ", ".join(sorted(unknown))
            raise UnknownNamespaceField(f"unknown namespace field(s): {names}")
        if not isinstance(scope_salt, bytes):
            raise InvalidNamespace(f"scope_salt must be bytes, got {type(scope_salt).__name__}")
        if len(scope_salt) != SCOPE_SALT_BYTES:
            raise InvalidNamespace(f"scope_salt must be exactly {SCOPE_SALT_BYTES} bytes, got {len(scope_salt)}")
        model_id = _check_str("model_id", model_id, allow_empty=False)
        weight_digest = _check_str("weight_digest", weight_digest, allow_empty=False)
        tokenizer_digest = _check_str("tokenizer_digest", tokenizer_digest, allow_empty=False)
        lora_id = _check_str("lora_id", lora_id, allow_empty=True)
        layout_items = _check_mapping("layout", layout, (int, str))
        rope_items = _check_mapping("rope", rope, (int, float, str))
        tp_rank = _check_int("tp_rank", tp_rank)
        tp_size = _check_int("tp_size", tp_size)
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise InvalidNamespace(f"need 0 <= tp_rank < tp_size, got tp_rank={tp_rank} tp_size={tp_size}")
        if origin not in ORIGINS:
            raise InvalidNamespace(f"namespace field 'origin' must be one of {', '.join(ORIGINS)}, got {origin!r}")

        # Field names travel with their values so the encoding stays self-describing when fields
        # are added (with a FORMAT_VERSION bump).
        encoded = canonical_encode(
            _DOMAIN,
            FORMAT_VERSION,
            ("scope_salt", scope_salt),
            ("model_id", model_id),
            ("weight_digest", weight_digest),
            ("tokenizer_digest", tokenizer_digest),
            ("layout", dict(layout_items)),
            ("rope", dict(rope_items)),
            ("lora_id", lora_id),
            ("tp_rank", tp_rank),
            ("tp_size", tp_size),
            ("origin", origin),
        )
        return cls(
            digest=hashlib.blake2b(encoded, digest_size=32).digest(),
            model_id=model_id,
            weight_digest=weight_digest,
            tokenizer_digest=tokenizer_digest,
            layout=layout_items,
            rope=rope_items,
            lora_id=lora_id,
            tp_rank=tp_rank,
            tp_size=tp_size,
            origin=origin,
        )

    @property
    def fingerprint(self) -> str:
        """First 12 hex chars of a one-way hash of ``digest``: safe to log, show and use as a label."""
        return hashlib.blake2b(self.digest, digest_size=16, person=_FINGERPRINT_PERSON).hexdigest()[:12]

    def __repr__(self) -> str:
        return (
            f"Namespace(model_id={self.model_id!r}, lora_id={self.lora_id!r}, "
            f"tp={self.tp_rank}/{self.tp_size}, origin={self.origin!r}, fingerprint={self.fingerprint!r})"
        )
