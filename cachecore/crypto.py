"""Envelope encryption of L3 objects (docs/design.md section 2, "Encryption at rest (L3)").

Two levels of keys:

- the **master key** (key-encryption key, 32 bytes) never leaves the control plane's configuration;
  it only wraps and unwraps data keys (:func:`wrap_key`, :func:`unwrap_key`);
- a **data key** (32 random bytes) per tenant per key version. The control plane stores it wrapped;
  workers hold the unwrapped keys in memory only, in a :class:`Keyring`. Crypto-shredding a version
  deletes its wrapped key and drops it from every keyring, after which every object sealed with it is
  unreadable, even to someone holding the master key and the database.

An object is sealed with AES-256-GCM under a fresh random 96-bit nonce. The frame (format 2)::

    format version (u8) | key version (u32 LE) | expires (u64 LE, epoch s; 0 = none) | nonce (12)
    | ciphertext | tag (16)

``expires`` is the object's own expiry (the writer's retention: the minimum of the request's and the
tenant's), readable without the key so that sweeps need no decryption, and authenticated: the
associated data (:func:`associated_data`) binds object key, namespace digest, KV layout, tenant,
key version, format version and expiry, so an object copied or moved to another key, tenant, model
or revision, or whose header (its expiry included) was edited, fails to decrypt. Format 1 frames
(no expiry) are no longer opened: :func:`frame_header` reports their version and the L3 store
treats them as expired. Every failure to decrypt or verify raises
:class:`~cachecore.errors.DecryptError` (a version the keyring does not hold raises its subclass
:class:`~cachecore.errors.KeyUnavailable`). Nothing here logs or formats key material.
"""

from __future__ import annotations

import secrets
import struct
import threading
from collections.abc import Mapping
from typing import NamedTuple

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from cachecore.errors import DecryptError, KeyUnavailable
from cachecore.namespace import canonical_encode

__all__ = [
    "FORMAT_VERSION",
    "DecryptError",
    "KeyUnavailable",
    "FRAME_OVERHEAD",
    "KEY_BYTES",
    "NONCE_BYTES",
    "TAG_BYTES",
    "FrameHeader",
    "Keyring",
    "associated_data",
    "frame_header",
    "generate_key",
    "open_frame",
    "seal",
    "unwrap_key",
    "wrap_key",
]

#: Format version of an object frame (and of the plaintext layout inside it). Bump on any change.
FORMAT_VERSION = 2
#: Format version of a wrapped data key.
WRAP_FORMAT_VERSION = 1
KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
MAX_KEY_VERSION = 2**32 - 1

_HEADER = struct.Struct("<BIQ")  # format version, key version, expires
HEADER_BYTES = _HEADER.size
_V1_HEADER = struct.Struct("<BI")  # format 1: no expiry
MAX_EXPIRES = 2**64 - 1
#: Bytes a frame adds to its plaintext.
FRAME_OVERHEAD = HEADER_BYTES + NONCE_BYTES + TAG_BYTES

_OBJECT_DOMAIN = b"strata/l3/object"
_WRAP_DOMAIN = b"strata/l3/wrapped-data-key"


class FrameHeader(NamedTuple):
    """The clear header of a frame: unauthenticated until the frame is opened (every field is part
    of the associated data). ``expires`` is 0 for format 1 frames and for objects without one."""

    format_version: int
    key_version: int
    expires: int


def generate_key() -> bytes:
    """A fresh random 256-bit key (a data key or a master key)."""
    return secrets.token_bytes(KEY_BYTES)


def _check_key(key: object, what: str) -> bytes:
    if not isinstance(key, bytes | bytearray) or len(key) != KEY_BYTES:
        # Never echo the value: it may be key material.
        raise ValueError(f"{what} must be {KEY_BYTES} bytes")
    return bytes(key)


def _check_tenant(tenant: object) -> str:
    if not isinstance(tenant, str) or not tenant:
        raise ValueError(f"tenant must be a non-empty str, got {type(tenant).__name__}")
    return tenant


def _check_version(version: object) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_KEY_VERSION:
        raise ValueError(f"key version must be an int in 0..{MAX_KEY_VERSION}, got {version!r}")
    return version


class Keyring:
    """The unwrapped data keys a worker holds, per ``(tenant, version)``, in memory only. Thread-safe.

    The active version of a tenant (the one new objects are sealed with) is the highest version
    held: a rotation adds a higher version, older ones stay readable until they are dropped
    (crypto-shredded). ``repr`` shows counts, never keys.
    """

    def __init__(self) -> None:
        self._keys: dict[str, dict[int, bytes]] = {}
        self._lock = threading.Lock()

    def add(self, tenant: str, version: int, key: bytes) -> None:
        """Hold ``key`` as ``tenant``'s data key ``version`` (replacing a key already held there)."""
        tenant, version, key = _check_tenant(tenant), _check_version(version), _check_key(key, "data key")
        with self._lock:
            self._keys.setdefault(tenant, {})[version] = key

    def drop(self, tenant: str, version: int) -> bool:
        """Forget ``tenant``'s key ``version`` (crypto-shred on this worker); True if it was held."""
        with self._lock:
            versions = self._keys.get(tenant)
            if versions is None or version not in versions:
                return False
            del versions[version]
            if not versions:
                del self._keys[tenant]
            return True

    def drop_tenant(self, tenant: str) -> int:
        """Forget every key of ``tenant`` (offboarding); returns how many versions were held."""
        with self._lock:
            return len(self._keys.pop(tenant, {}))

    def active(self, tenant: str) -> tuple[int, bytes] | None:
        """``(version, key)`` new objects of ``tenant`` are sealed with (highest held), or None."""
        with self._lock:
            versions = self._keys.get(tenant)
            if not versions:
                return None
            version = max(versions)
            return version, versions[version]

    def get(self, tenant: str, version: int) -> bytes | None:
        with self._lock:
            return self._keys.get(tenant, {}).get(version)

    def versions(self, tenant: str) -> list[int]:
        """Versions held for ``tenant``, newest first."""
        with self._lock:
            return sorted(self._keys.get(tenant, {}), reverse=True)

    def tenants(self) -> list[str]:
        with self._lock:
            return sorted(self._keys)

    def __contains__(self, item: object) -> bool:
        if not isinstance(item, tuple) or len(item) != 2:
            return False
        tenant, version = item
        return self.get(tenant, version) is not None  # type: ignore[arg-type]

    def __repr__(self) -> str:
        with self._lock:
            n = sum(len(v) for v in self._keys.values())
            return f"Keyring(tenants={len(self._keys)}, keys={n})"

    def __reduce__(self):  # keys must never travel by pickling (Ray, multiprocessing) by accident
        raise TypeError("a Keyring cannot be pickled")


# ---------------------------------------------------------------------- wrapping (key-encryption key)
def _wrap_aad(tenant: str, version: int) -> bytes:
    return canonical_encode(
        _WRAP_DOMAIN, ("format_version", WRAP_FORMAT_VERSION), ("tenant", tenant), ("key_version", version)
    )


def wrap_key(master: bytes, data_key: bytes, *, tenant: str, version: int) -> bytes:
    """Encrypt ``data_key`` under the master key, bound to ``(tenant, version)``.

    Wrapped form: ``WRAP_FORMAT_VERSION (u8) | nonce (12) | ciphertext | tag (16)``.
    """
    master = _check_key(master, "master key")
    data_key = _check_key(data_key, "data key")
    tenant, version = _check_tenant(tenant), _check_version(version)
    nonce = secrets.token_bytes(NONCE_BYTES)
    ct = AESGCM(master).encrypt(nonce, data_key, _wrap_aad(tenant, version))
    return bytes([WRAP_FORMAT_VERSION]) + nonce + ct


def unwrap_key(master: bytes, wrapped: bytes, *, tenant: str, version: int) -> bytes:
    """Inverse of :func:`wrap_key`. Raises :class:`DecryptError` for a wrong master key, tenant or
    version, or a damaged wrapped key."""
    master = _check_key(master, "master key")
    tenant, version = _check_tenant(tenant), _check_version(version)
    if not isinstance(wrapped, bytes | bytearray | memoryview):
        raise DecryptError("wrapped key must be bytes")
    wrapped = bytes(wrapped)
    if len(wrapped) != 1 + NONCE_BYTES + KEY_BYTES + TAG_BYTES or wrapped[0] != WRAP_FORMAT_VERSION:
        raise DecryptError("wrapped key has the wrong length or format version")
    nonce, ct = wrapped[1 : 1 + NONCE_BYTES], wrapped[1 + NONCE_BYTES :]
    try:
        return AESGCM(master).decrypt(nonce, ct, _wrap_aad(tenant, version))
    except InvalidTag:
        raise DecryptError("wrapped key failed to decrypt (wrong master key, tenant or version)") from None


# ---------------------------------------------------------------------- objects
def associated_data(
    *,
    object_key: bytes,
    ns_digest: bytes,
    layout: Mapping[str, int | str],
    tenant: str,
    key_version: int,
    format_version: int,
    expires: int = 0,
) -> bytes:
    """Canonical (type-tagged, length-prefixed, mapping keys sorted) encoding of everything an
    object is bound to. Computed by the reader from its own request, never read from the object,
    except the header fields (key version, format version, expiry), which a reader takes from the
    frame and which therefore only open the frame if nobody changed them."""
    return canonical_encode(
        _OBJECT_DOMAIN,
        ("format_version", format_version),
        ("object_key", bytes(object_key)),
        ("ns_digest", bytes(ns_digest)),
        ("layout", dict(layout)),
        ("tenant", tenant),
        ("key_version", key_version),
        ("expires", expires),
    )


def seal(
    key: bytes,
    *,
    version: int,
    aad: bytes,
    plaintext: bytes | bytearray | memoryview,
    out: bytearray | memoryview | None = None,
    expires: int = 0,
) -> bytearray | memoryview:
    """Encrypt ``plaintext`` under data key ``key`` (its ``version`` and ``expires`` go into the
    frame) with a fresh random nonce; returns the frame (see the module docstring), encrypted in
    place into one buffer: a new one, or ``out`` (writable, exactly ``len(plaintext) +
    FRAME_OVERHEAD`` bytes). ``aad`` must have been built by :func:`associated_data` with the same
    ``version``, ``expires`` and :data:`FORMAT_VERSION`."""
    key = _check_key(key, "data key")
    version = _check_version(version)
    if isinstance(expires, bool) or not isinstance(expires, int) or not 0 <= expires <= MAX_EXPIRES:
        raise ValueError(f"expires must be an int in 0..{MAX_EXPIRES}, got {expires!r}")
    nonce = secrets.token_bytes(NONCE_BYTES)
    size = FRAME_OVERHEAD + len(memoryview(plaintext).cast("B"))
    if out is None:
        frame: bytearray | memoryview = bytearray(size)
    else:
        frame = memoryview(out).cast("B")
        if len(frame) != size:
            raise ValueError(f"seal: out must be {size} bytes, got {len(frame)}")
    _HEADER.pack_into(frame, 0, FORMAT_VERSION, version, expires)
    frame[HEADER_BYTES : HEADER_BYTES + NONCE_BYTES] = nonce
    AESGCM(key).encrypt_into(nonce, plaintext, aad, memoryview(frame)[HEADER_BYTES + NONCE_BYTES :])
    return out if out is not None else frame


def frame_header(frame: bytes | bytearray | memoryview) -> FrameHeader:
    """The header of a frame (or of its first :data:`HEADER_BYTES` bytes, as a sweep reads them),
    unauthenticated (checked through the associated data when the frame is opened). A format 1
    header is reported with ``expires=0``. Raises :class:`DecryptError` if it is too short."""
    if len(frame) >= 1 and frame[0] == 1 and len(frame) >= _V1_HEADER.size:
        return FrameHeader(*_V1_HEADER.unpack_from(frame, 0), 0)
    if len(frame) < HEADER_BYTES:
        raise DecryptError("object is too short to be a frame")
    return FrameHeader(*_HEADER.unpack_from(frame, 0))


def open_frame(
    key: bytes | Keyring,
    frame: bytes | bytearray | memoryview,
    aad: bytes,
    *,
    tenant: str | None = None,
    out: bytearray | memoryview | None = None,
) -> bytearray | memoryview:
    """Decrypt and verify ``frame`` against ``aad``; returns the plaintext: a fresh writable buffer,
    or ``out`` (a writable buffer of exactly ``len(frame) - FRAME_OVERHEAD`` bytes) decrypted in place.
    After a failure ``out`` holds garbage: never use it.

    ``key`` is the data key itself, or a :class:`Keyring` from which ``tenant``'s key of the frame's
    key version is taken (:class:`KeyUnavailable` if it is not held). Raises :class:`DecryptError`
    for a frame of another format version, a torn or truncated frame, a flipped bit, a wrong key or
    associated data that differs from the writer's.
    """
    if len(frame) < FRAME_OVERHEAD:
        raise DecryptError("object is too short to be a frame")
    fmt, version, _ = frame_header(frame)
    if fmt != FORMAT_VERSION:
        raise DecryptError(f"unknown frame format version {fmt}")
    if isinstance(key, Keyring):
        if tenant is None:
            raise ValueError("open_frame with a Keyring needs tenant=")
        data_key = key.get(tenant, version)
        if data_key is None:
            raise KeyUnavailable(f"key version {version} is not held (shredded or not yet delivered)")
    else:
        data_key = _check_key(key, "data key")
    view = memoryview(frame)
    nonce = view[HEADER_BYTES : HEADER_BYTES + NONCE_BYTES]
    body = view[HEADER_BYTES + NONCE_BYTES :]
    if out is None:
        out = bytearray(len(body) - TAG_BYTES)
    elif len(memoryview(out).cast("B")) != len(body) - TAG_BYTES:
        raise DecryptError("object has the wrong length")
    try:
        AESGCM(data_key).decrypt_into(nonce, body, aad, out)
    except InvalidTag:
        raise DecryptError("object failed to decrypt (damaged, moved, or sealed under other context)") from None
    return out
