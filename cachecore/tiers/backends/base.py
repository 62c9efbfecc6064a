"""The contract of an L3 backend: a flat store of named byte objects (filesystem directory, Redis).

A backend knows nothing about keys, tenants or encryption: the store above it
(:class:`cachecore.tiers.remote.RemoteStore`) builds the names (``/``-separated paths such as
``<tenant>/<model>/<revision>/v<key version>/<hex key>``) and seals the bytes.

- ``put`` is atomic: a reader sees the previous object, or the new one in full, never a part.
- ``put_new`` is a conditional ``put`` (write only if no object is there, in one step: of two
  concurrent ``put_new`` of one name exactly one writes); ``put_new_many`` does it for several
  objects (Redis: one round trip), ``exists_many`` asks about several names at once.
- ``get_into`` reads an object into the caller's buffer (no fresh multi-MB object per read).
- The state of the backend (down, unreachable, unreadable, a socket timeout) is reported by one
  typed error only, :class:`~cachecore.errors.BackendUnavailable`, from every method. A name that
  the backend cannot hold (``..``, absolute) is a caller bug: ``ValueError``.
- Thread-safe: every method may be called from any thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from cachecore.errors import BackendUnavailable

Data = bytes | bytearray | memoryview


class ObjectInfo(NamedTuple):
    """One object of a listing: its name, size in bytes and modification time (seconds, epoch)."""

    name: str
    size: int
    mtime: float


class Backend(ABC):
    """Named byte objects. ``url`` says where (without credentials)."""

    url: str

    @abstractmethod
    def put(self, name: str, data: bytes | bytearray | memoryview) -> None:
        """Store ``data`` (any bytes-like) under ``name`` atomically (replacing what was there).
        ``data`` is only valid during the call (the caller reuses the buffer): copy it to keep it."""

    @abstractmethod
    def put_new(self, name: str, data: Data) -> bool:
        """Store ``data`` under ``name`` only if no object is stored there, atomically (check and write
        are one step: of concurrent ``put_new`` of one name exactly one writes, and a reader sees no
        object or a whole one). True if written, False if an object was already there. ``data`` is
        only valid during the call, as for :meth:`put`."""

    def put_new_many(self, items: Sequence[tuple[str, Data]]) -> list[bool]:
        """:meth:`put_new` of each ``(name, data)``, in order; one result per item. Backends override it
        to batch the writes. Raises :class:`PartialWrite` (a ``BackendUnavailable``) when the backend
        fails: its ``written`` names the objects this call wrote before the failure (each whole)."""
        results: list[bool] = []
        for name, data in items:
            try:
                results.append(self.put_new(name, data))
            except BackendUnavailable as exc:
                raise PartialWrite(str(exc), [n for (n, _), ok in zip(items, results, strict=False) if ok]) from None
        return results

    @abstractmethod
    def get(self, name: str) -> bytes | None:
        """The bytes under ``name``, or None if there is no such object."""

    def get_into(self, name: str, out: memoryview) -> int | None:
        """Read the object ``name`` into ``out`` (a writable byte buffer); returns its size, or None if
        there is no such object. ``out[:size]`` holds it when it fits; an object longer than ``out``
        leaves its first ``len(out)`` bytes there (the size says so). One consistent version of the
        object, never parts of two. Backends override it to read without an intermediate copy."""
        data = self.get(name)
        if data is None:
            return None
        n = min(len(data), len(out))
        out[:n] = memoryview(data)[:n]
        return len(data)

    def head(self, name: str, n: int) -> bytes | None:
        """The first ``n`` (at most :data:`HEAD_BYTES`) bytes under ``name`` (fewer if the object is
        shorter), or None if there is no such object: what a sweep reads of each object (an L3
        frame's clear header) without fetching it whole. Backends override it with a partial read."""
        data = self.get(name)
        return None if data is None else bytes(data[:n])

    @abstractmethod
    def exists(self, name: str) -> bool:
        """Whether an object is stored under ``name``."""

    def exists_many(self, names: Sequence[str]) -> list[bool]:
        """:meth:`exists` of each name, in order (Redis: one round trip for all)."""
        return [self.exists(name) for name in names]

    @abstractmethod
    def delete(self, name: str) -> bool:
        """Remove ``name``; True if it existed."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose name starts with ``prefix`` (plain string prefix), in no set order."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> tuple[int, int]:
        """Remove every object whose name starts with ``prefix``; returns ``(objects, bytes)``."""

    @abstractmethod
    def usage(self) -> int:
        """Bytes held by all objects."""

    def sweep_temp(self, older_than_seconds: float, *, now: float | None = None) -> int:
        """Remove leftovers of interrupted writes older than ``older_than_seconds``; returns how many.
        Backends whose writes leave none (Redis) have nothing to do."""
        return 0

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections or handles."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class PartialWrite(BackendUnavailable):
    """:meth:`Backend.put_new_many` failed part way: ``written`` names the objects it wrote before."""

    def __init__(self, message: str, written: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.written = list(written)


#: Most bytes :meth:`Backend.head` is asked for (an L3 frame's header is 13).
HEAD_BYTES = 32

#: Longest name component (bytes, UTF-8) a backend accepts: below every filesystem's NAME_MAX.
MAX_COMPONENT_BYTES = 200


def check_name(name: object, *, prefix: bool = False) -> str:
    """Validate an object name (or, with ``prefix=True``, a name prefix) and return it.

    A name is ``/``-separated components, each non-empty, at most :data:`MAX_COMPONENT_BYTES`, not
    starting with ``.`` (so no ``.``, no ``..``, and no clash with a backend's temporary files), with
    no NUL or backslash, and no leading ``/``. A prefix may be empty, end with ``/`` or end in the
    middle of a component. Raises ``ValueError``.
    """
    if not isinstance(name, str):
        raise ValueError(f"object name must be str, got {type(name).__name__}")
    if prefix and name == "":
        return name
    if not name or "\x00" in name or "\\" in name or name.startswith("/"):
        raise ValueError(f"bad object name {name!r}")
    parts = name.split("/")
    for i, part in enumerate(parts):
        if not part:
            if prefix and i == len(parts) - 1:
                continue  # "a/b/" as a prefix
            raise ValueError(f"bad object name {name!r}: empty component")
        if part.startswith("."):
            raise ValueError(f"bad object name {name!r}: a component starts with '.'")
        if len(part.encode("utf-8")) > MAX_COMPONENT_BYTES:
            raise ValueError(f"bad object name {name!r}: component longer than {MAX_COMPONENT_BYTES} bytes")
    return name
