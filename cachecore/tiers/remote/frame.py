"""The bytes of one L3 object: a chunk's plaintext inside a :mod:`cachecore.crypto` frame.

The frame (header, nonce, AES-256-GCM ciphertext and tag; the header carries format version, key
version and the object's own expiry) is :mod:`cachecore.crypto`'s: this module only says what goes in
it for a chunk of one :class:`~cachecore.layout.KVLayout` and checks what comes out. The associated
data is computed by the READER from its own request: object key (= the object's name),
``tag.ns_digest``, the KV layout, ``tag.owner`` as tenant id, and the frame's key version, format
version and expiry; so an object moved to another name, tenant, model or revision, or whose expiry
was edited, fails to decrypt.

The plaintext (KV first, so that a read decrypts it straight into the output tensor)::

    KV bytes ([chunk_blocks, *page_shape], C order) | token ids (n_tokens x u32 LE) | ndim (u8)
    | shape (ndim x u32) | len(dtype) (u8) | dtype (ascii) | created (f64, epoch s) | n_tokens (u32)

Everything after the token ids but ``created`` is fixed by the layout, so every chunk of a layout
has the same size (:attr:`ChunkFrame.frame_bytes`). Frames of format 1 (written before objects
carried their expiry) are :func:`legacy`: treated as expired, never opened.
"""

from __future__ import annotations

import math
import struct
import threading
from typing import TYPE_CHECKING

import numpy as np
import torch

from cachecore import crypto
from cachecore.errors import DecryptError
from cachecore.layout import KVLayout

if TYPE_CHECKING:
    from cachecore.tiers.base import Tag

__all__ = ["ChunkFrame", "expiry", "head_expired", "legacy"]

_PT_END = struct.Struct("<dI")  # created, n_tokens


def legacy(format_version: int) -> bool:
    """A frame of a format older than :data:`cachecore.crypto.FORMAT_VERSION` (1: no expiry of its own)."""
    return 0 < format_version < crypto.FORMAT_VERSION


def expiry(created: float, retention_seconds: float | None) -> int:
    """The header's ``expires`` for an object written at ``created`` under the writer's retention:
    ``created + retention_seconds`` rounded up to a second (at least 1); 0 (none) for None."""
    return 0 if retention_seconds is None else max(1, math.ceil(created + float(retention_seconds)))


def head_expired(head: bytes | None, now: float) -> bool:
    """Whether an object's clear header (its first :data:`cachecore.crypto.HEADER_BYTES` bytes, read
    without decryption; unauthenticated) says it is past its own expiry at ``now`` or of a legacy
    format. A header missing or too short to parse is not (a read quarantines such an object)."""
    if head is None:
        return False
    try:
        fmt, _, expires = crypto.frame_header(head)
    except DecryptError:
        return False
    return legacy(fmt) or (expires != 0 and now >= expires)


class ChunkFrame:
    """The frame of a chunk of ``chunk_blocks`` blocks of ``layout``: sizes, :meth:`seal` and
    :meth:`open`. Thread-safe (each thread seals into its own reusable buffers)."""

    def __init__(self, layout: KVLayout, chunk_blocks: int) -> None:
        self.layout = layout
        self.chunk_blocks = chunk_blocks
        self.chunk_tokens = chunk_blocks * layout.block_size
        self.shape = (chunk_blocks, *layout.page_shape)
        #: KV bytes of a chunk (the head of the plaintext).
        self.kv_bytes = math.prod(self.shape) * layout.element_size
        self._layout_canonical = layout.canonical()
        self._trailer = self._trailer_bytes(np.zeros(self.chunk_tokens, dtype="<u4"), 0.0)
        #: Bytes after the KV in the plaintext (token ids, shape, dtype, created, n_tokens).
        self.trailer_bytes = len(self._trailer)
        #: Plaintext bytes of a chunk.
        self.plaintext_bytes = self.kv_bytes + self.trailer_bytes
        #: Bytes of a whole object.
        self.frame_bytes = crypto.FRAME_OVERHEAD + self.plaintext_bytes
        #: Bytes of the clear header (what a sweep reads).
        self.head_bytes = crypto.HEADER_BYTES
        self._local = threading.local()

    def associated_data(self, name: str, tag: Tag, key_version: int, format_version: int, expires: int) -> bytes:
        return crypto.associated_data(
            object_key=name.encode("utf-8"),
            ns_digest=tag.ns_digest,
            layout=self._layout_canonical,
            tenant=tag.owner,
            key_version=key_version,
            format_version=format_version,
            expires=expires,
        )

    # ------------------------------------------------------------------ writing
    def seal(
        self,
        data_key: bytes,
        *,
        version: int,
        name: str,
        tag: Tag,
        tokens: np.ndarray,
        created: float,
        kv: torch.Tensor,
        expires: int,
        slot: int = 0,
    ) -> memoryview:
        """The object ``name`` for chunk ``kv`` (``shape``, the layout's dtype) and its token ids
        (``chunk_tokens`` u32), sealed under ``data_key`` (key ``version``). The frame is this
        thread's reusable buffer number ``slot``: valid until the thread's next ``seal`` into the same
        slot (a batch of writes seals each into its own slot; a backend's ``put`` does not keep
        ``data`` after it returns: the Backend contract)."""
        pt_buf, frame_buf = self._scratch_buffers(slot)
        plaintext = self._plaintext(tokens, created, kv, pt_buf)
        aad = self.associated_data(name, tag, version, crypto.FORMAT_VERSION, expires)
        return crypto.seal(data_key, version=version, aad=aad, plaintext=plaintext, out=frame_buf, expires=expires)

    def _trailer_bytes(self, tok: np.ndarray, created: float) -> bytes:
        dtype = self.layout.dtype.encode("ascii")
        shape = self.shape
        return b"".join((
            tok.tobytes(), struct.pack(f"<B{len(shape)}I", len(shape), *shape), struct.pack("<B", len(dtype)), dtype,
            _PT_END.pack(created, len(tok)),
        ))  # fmt: skip

    def _plaintext(self, tok: np.ndarray, created: float, kv: torch.Tensor, out: memoryview) -> memoryview:
        """The chunk's plaintext, written into ``out`` (``plaintext_bytes`` bytes)."""
        flat = kv.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        kvb = self.kv_bytes
        out[:kvb] = memoryview(flat)
        out[kvb:] = self._trailer_bytes(tok, created)
        return out

    def _scratch_buffers(self, slot: int) -> tuple[memoryview, memoryview]:
        """This thread's reusable plaintext buffer and frame buffer number ``slot``: fresh multi-MB
        buffers per write cost more in page faults than the encryption itself."""
        local = self._local
        if getattr(local, "plaintext", None) is None:
            local.plaintext, local.frames = memoryview(bytearray(self.plaintext_bytes)), []
        while len(local.frames) <= slot:
            local.frames.append(memoryview(bytearray(self.frame_bytes)))
        return local.plaintext, local.frames[slot]

    def read_buffer(self) -> memoryview:
        """This thread's reusable buffer of ``frame_bytes`` that a read fetches an object into
        (:meth:`cachecore.tiers.backends.base.Backend.get_into`) before :meth:`open` decrypts it."""
        local = self._local
        if getattr(local, "read", None) is None:
            local.read = memoryview(bytearray(self.frame_bytes))
        return local.read

    # ------------------------------------------------------------------ reading
    def open(
        self,
        keyring: crypto.Keyring,
        frame: bytes | bytearray | memoryview,
        header: crypto.FrameHeader,
        *,
        name: str,
        tag: Tag,
        tokens: np.ndarray,
        out: memoryview,
    ) -> float:
        """Decrypt object ``name`` (its ``header`` as :func:`cachecore.crypto.frame_header` read it)
        into ``out`` (``plaintext_bytes``) and verify it against the reader's request (``tag``, the
        chunk's token ids ``tokens``); returns the chunk's creation time. ``DecryptError`` for a
        frame of the wrong length, one that does not open (torn, flipped, moved, edited) or not one
        of this layout's chunks for these tokens; ``KeyUnavailable`` (a ``DecryptError``) when the
        keyring does not hold its key version."""
        if len(frame) != self.frame_bytes:
            raise DecryptError("object has the wrong length for this layout")
        fmt, key_version, expires = header
        aad = self.associated_data(name, tag, key_version, fmt, expires)
        crypto.open_frame(keyring, frame, aad, tenant=tag.owner, out=out)
        return self._check_trailer(out, tokens)

    def _check_trailer(self, pt: memoryview, want_tokens: np.ndarray) -> float:
        """Verify the trailer of a decrypted chunk (right after its KV bytes) against this layout and
        the request's token ids; returns the chunk's creation time. ``DecryptError`` if it is not one
        of this layout's chunks (authentic but malformed, of another shape/dtype) or holds other
        token ids."""
        off = self.kv_bytes
        n = self.chunk_tokens
        stored = np.frombuffer(pt, dtype="<u4", count=n, offset=off)
        if not np.array_equal(stored, want_tokens):
            raise DecryptError("chunk holds other token ids than the request")
        created, n_tok = _PT_END.unpack_from(pt, len(pt) - _PT_END.size)
        # Everything between the token ids and the end is fixed by the layout.
        fixed = self._trailer[4 * n : -_PT_END.size]
        if n_tok != n or bytes(pt[off + 4 * n : len(pt) - _PT_END.size]) != fixed:
            raise DecryptError("chunk of another layout")
        return created
