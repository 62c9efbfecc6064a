"""Block keys: a keyed BLAKE2b hash chain over the full blocks of a prompt.

::

    H_0 = K(ns; request_salt, tokens_0, extras_0)
    H_i = K(ns; H_{i-1},      tokens_i, extras_i)        K = BLAKE2b-256 keyed with ns.digest

Each key binds the namespace and the whole token history before it, so equal keys mean an equal
prefix (up to a 2^-256 accident, and the pool still re-checks the stored token ids on a hit).

Message fed to K for one block (every field fixed-width or length-prefixed, so it is injective)::

    tag (1: 0x00 first block, 0x01 chained) | block_size (u32 LE) | extras | link | tokens
    extras = 0x00                                 (None)
           | 0x01 | len (u64 LE) | bytes          (multimodal item hash + offset, prompt-embeds hash)
    link   = len (u64 LE) | request_salt          (tag 0x00)
           | H_{i-1} (32 bytes)                   (tag 0x01)
    tokens = block_size x u32 LE

Speed: tokens are converted once (in C, via ``array``) to a little-endian uint32 buffer whose
per-block bytes a numpy void view hands out; the keyed state with the constant header
already absorbed is built once and ``.copy()``-ed per block, and each block is one ``update`` of its
link and tokens. ``python -m bench.prefix_index`` measures it against vLLM's sha256(pickle) chain.
"""

from __future__ import annotations

import array
import functools
import hashlib
import struct
from collections.abc import Sequence

import numpy as np

from cachecore.errors import InvalidPrompt
from cachecore.namespace import Namespace

__all__ = ["HASH_BYTES", "MAX_TOKEN_ID", "block_keys", "chain_hashes", "token_blocks", "token_buffer"]

HASH_BYTES = 32
#: Token ids are encoded as uint32.
MAX_TOKEN_ID = 2**32 - 1

_TAG_FIRST = b"\x00"
_TAG_CHAINED = b"\x01"
_NO_EXTRAS = b"\x00"
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


def token_buffer(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Validate ``tokens`` and return them as a contiguous little-endian ``uint32`` array. Pure.

    Raises ``InvalidPrompt`` if any token is not an integer (floats, strings, ``None``, ``bool`` and
    ``numpy.bool_`` included) or lies outside ``0..MAX_TOKEN_ID``.
    """
    if isinstance(tokens, np.ndarray):
        return _array_buffer(tokens)
    if isinstance(tokens, str | bytes | bytearray | memoryview):
        raise InvalidPrompt(f"tokens must be a sequence of ints, got {type(tokens).__name__}")
    if not isinstance(tokens, list | tuple):
        tokens = list(tokens)  # any other iterable: materialise once (the bool check indexes it)
    try:
        # array('I') does the int check and the range check in C, far faster than a Python loop.
        packed = array.array("I", tokens)
    except TypeError as exc:
        raise InvalidPrompt(f"tokens must be ints: {exc}") from None
    except OverflowError as exc:
        raise InvalidPrompt(f"token ids must be in 0..{MAX_TOKEN_ID}: {exc}") from None
    buf = np.frombuffer(packed, dtype=np.uint32)
    # bool is an int subclass, so array() took True/False as 1/0. Only positions holding 0 or 1 can
    # be bools: check those few in Python instead of the whole prompt.
    # (argmin: the cheapest numpy test of "any id <= 1" on a prompt, usually none)
    if len(buf) and buf[buf.argmin()] <= 1:
        for i in np.flatnonzero(buf <= 1).tolist():
            if isinstance(tokens[i], bool | np.bool_):
                raise InvalidPrompt(f"token {i} is a bool ({tokens[i]!r}), not a token id")
    return buf.astype("<u4", copy=False)


def _array_buffer(tokens: np.ndarray) -> np.ndarray:
    if tokens.dtype.kind == "O":
        return token_buffer(tokens.tolist())
    if tokens.dtype.kind not in "iu":
        raise InvalidPrompt(f"tokens must have an integer dtype, got {tokens.dtype}")
    if tokens.ndim != 1:
        raise InvalidPrompt(f"tokens must be 1-D, got shape {tokens.shape}")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > MAX_TOKEN_ID):
        raise InvalidPrompt(f"token ids must be in 0..{MAX_TOKEN_ID}")
    return np.ascontiguousarray(tokens, dtype="<u4")


def _extras_frame(extra: bytes | None) -> bytes:
    if extra is None:
        return _NO_EXTRAS
    if not isinstance(extra, bytes):
        raise TypeError(f"extras entries must be bytes or None, got {type(extra).__name__}")
    return b"\x01" + _U64.pack(len(extra)) + extra


def chain_hashes(
    ns: Namespace,
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    *,
    request_salt: bytes = b"",
    extras: Sequence[bytes | None] | None = None,
    parent: bytes | None = None,
) -> list[bytes]:
    """Return one 32-byte key per FULL block of ``tokens`` (a trailing partial block is ignored). Pure.

    ``parent`` is the key of the block just before ``tokens[0]``: hashing appended blocks with
    ``parent=hashes[-1]`` gives exactly the keys of hashing the whole sequence. ``request_salt`` is
    bound into the first block only, and is ignored when ``parent`` is given (the parent already
    binds it). ``extras[i]`` belongs to block ``i`` of this call; it must cover every full block
    (entries past the last full block are ignored).

    Raises ``InvalidPrompt`` for bad tokens (see ``token_buffer``), ``ValueError`` for a
    non-positive ``block_size``, a ``parent`` that is not 32 bytes or too few ``extras``, and
    ``TypeError`` for a non-bytes ``request_salt`` or extras entry.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if not isinstance(request_salt, bytes):
        raise TypeError(f"request_salt must be bytes, got {type(request_salt).__name__}")
    if parent is not None and (not isinstance(parent, bytes) or len(parent) != HASH_BYTES):
        raise ValueError(f"parent must be a {HASH_BYTES}-byte block hash")
    buf = token_buffer(tokens)
    n_full = len(buf) // block_size
    if extras is not None and len(extras) < n_full:
        raise ValueError(f"extras has {len(extras)} entries for {n_full} full blocks")
    if n_full == 0:
        return []

    if extras is None or not any(e is not None for e in extras[:n_full]):
        return block_keys(ns, _split(buf, block_size, n_full), request_salt=request_salt, parent=parent)

    raw = memoryview(buf[: n_full * block_size]).cast("B")  # no copy: one big allocation is enough
    step = block_size * 4
    keyed = hashlib.blake2b(key=ns.digest, digest_size=HASH_BYTES)
    header = _U32.pack(block_size)
    out: list[bytes] = []
    prev = parent
    for i in range(n_full):  # any extras: every block frames its own
        extra = _extras_frame(extras[i])
        h = keyed.copy()
        if prev is None:
            h.update(_TAG_FIRST + header + extra + _U64.pack(len(request_salt)) + request_salt)
        else:
            h.update(_TAG_CHAINED + header + extra + prev)
        h.update(raw[i * step : (i + 1) * step])
        prev = h.digest()
        out.append(prev)
    return out


def token_blocks(tokens: Sequence[int] | np.ndarray, block_size: int) -> list[bytes]:
    """Each FULL block of ``tokens`` (a trailing partial block is ignored) as the bytes its key hashes:
    ``block_size`` x u32 LE. Validated as ``token_buffer`` does (``InvalidPrompt``). Pure. These are
    also the link keys of :meth:`cachecore.block_pool.BlockPool.hit_prefix`."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    buf = token_buffer(tokens)
    return _split(buf, block_size, len(buf) // block_size)


def _split(buf: np.ndarray, block_size: int, n_full: int) -> list[bytes]:
    # One void item per block: tolist() hands out each block's bytes from C (a void item keeps
    # trailing zero bytes, which an "S" item would strip).
    return buf[: n_full * block_size].view(f"V{block_size * 4}").tolist() if n_full else []


def block_keys(ns: Namespace, blocks: Sequence[bytes], *, request_salt: bytes = b"",
               parent: bytes | None = None) -> list[bytes]:
    """``chain_hashes`` (no extras) of blocks already split by ``token_blocks`` (all of one block
    size, not re-checked): one key per entry, the first chained to ``parent`` or, without one, to
    ``request_salt``. Pure."""
    if not blocks:
        return []
    if not isinstance(request_salt, bytes):
        raise TypeError(f"request_salt must be bytes, got {type(request_salt).__name__}")
    first, chained = _keyed_states(ns.digest, len(blocks[0]) // 4)
    out: list[bytes] = []
    append = out.append
    if parent is None:
        h = first.copy()
        h.update(_U64.pack(len(request_salt)) + request_salt + blocks[0])
        prev = h.digest()
        append(prev)
        blocks = blocks[1:]
    else:
        if not isinstance(parent, bytes) or len(parent) != HASH_BYTES:
            raise ValueError(f"parent must be a {HASH_BYTES}-byte block hash")
        prev = parent
    # Hot path: the constant header is absorbed once; per block one update of link + tokens.
    copy = chained.copy
    for block in blocks:
        h = copy()
        h.update(prev + block)
        prev = h.digest()
        append(prev)
    return out


@functools.lru_cache(maxsize=256)
def _keyed_states(digest: bytes, block_size: int) -> tuple[hashlib.blake2b, hashlib.blake2b]:
    """The keyed states with a first block's and a chained block's constant header absorbed (never
    updated themselves: callers ``copy`` them)."""
    keyed = hashlib.blake2b(key=digest, digest_size=HASH_BYTES)
    header = _U32.pack(block_size)
    first, chained = keyed.copy(), keyed.copy()
    first.update(_TAG_FIRST + header + _NO_EXTRAS)
    chained.update(_TAG_CHAINED + header + _NO_EXTRAS)
    return first, chained
