"""The contract of an L3 backend: a flat store of named byte objects (filesystem directory, Redis).

A backend knows nothing about keys, tenants or encryption: the store above it
(:class:`cachecore.tiers.remote.RemoteStore`) builds the names (``/``-separated paths such as
``<tenant>/<model>/<revision>/v<key version>/<hex key>``) and seals the bytes.

- ``put`` is atomic: a reader sees the previous object, or the new one in full, never a part.
- The state of the backend (down, unreachable, unreadable, a socket timeout) is reported by one
  typed error only, :class:`~cachecore.errors.BackendUnavailable`, from every method. A name that
  the backend cannot hold (``..``, absolute) is a caller bug: ``ValueError``.
- Thread-safe: every method may be called from any thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import NamedTuple


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
    def get(self, name: str) -> bytes | None:
        """The bytes under ``name``, or None if there is no such object."""

    def head(self, name: str, n: int) -> bytes | None:
        """The first ``n`` (at most :data:`HEAD_BYTES`) bytes under ``name`` (fewer if the object is
        shorter), or None if there is no such object: what a sweep reads of each object (an L3
        frame's clear header) without fetching it whole. Backends override it with a partial read."""
        data = self.get(name)
        return None if data is None else bytes(data[:n])

    @abstractmethod
    def exists(self, name: str) -> bool:
        """Whether an object is stored under ``name``."""

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
