"""The L3 store's part of a backup: where it is (``STRATA_L3_URL``, as the workers read it) and its objects.

Only a ``file://`` store is copied: its objects are read and written through the L3 code's own
:class:`~cachecore.tiers.backends.fs.FileBackend` (listing skips writes in progress; a restore writes
each object atomically, mode 0600 in 0700 folders, under the name it had). Objects are sealed by the
tenants' data keys, which travel wrapped in the database, so a copy is useful only with the
database and master key of the same backup. An object written after the database was dumped may be
sealed by a data-key version the restored database does not hold: the workers treat it as a miss
(and a same-named version created later fails authentication, so it is deleted as corrupt, never
served). A Redis store (``redis://``, ``redis+cluster://``) is Redis's to back up (RDB snapshots or
the AOF of its own persistence): the manifest names it and holds no objects. L3 is a cache: what is
not restored is computed again.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import strata_env
from controlplane.backups.manifest import BackupError

REDIS_NOTE = ("a Redis L3 is not copied: back it up with Redis's own persistence (an RDB snapshot, "
              "BGSAVE, or the AOF); the archive holds no L3 objects")


@dataclass(frozen=True)
class L3Store:
    kind: str  # the URL's scheme ("file", "redis", "redis+cluster", ...) or "none"
    url: str  # for display: credentials removed
    root: Path | None  # the directory of a file:// store


def shown(url: str) -> str:
    """``url`` without a password (what the manifest and the command's output may carry)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username}:***@{host}" if parts.username else f"***@{host}"
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def configured() -> L3Store:
    """The L3 store this installation's workers use (``STRATA_L3_URL``, default ``$STRATA_HOME/l3``)."""
    url = strata_env.load_worker().l3_url.strip()
    if url.lower() == "none":
        return L3Store("none", "none", None)
    kind = urlsplit(url).scheme.lower()
    if kind != "file":
        return L3Store(kind, shown(url), None)
    from cachecore.tiers.backends import open_backend

    try:
        backend = open_backend(url)
    except ValueError as exc:
        raise BackupError(f"STRATA_L3_URL: {exc}") from None
    return L3Store("file", url, Path(backend.root))  # type: ignore[union-attr]


def _backend(store: L3Store, *, fsync: bool):
    from cachecore.tiers.backends.fs import FileBackend

    assert store.root is not None
    return FileBackend(store.root, fsync=fsync)


def objects(store: L3Store) -> Iterator[tuple[str, bytes]]:
    """``(name, bytes)`` of every object of a file:// store (one at a time: objects are chunks of a
    few MiB at most); an object deleted while listed is skipped."""
    from cachecore.errors import BackendUnavailable

    backend = _backend(store, fsync=False)
    try:
        for info in backend.list(""):
            data = backend.get(info.name)
            if data is not None:
                yield info.name, data
    except BackendUnavailable as exc:
        raise BackupError(f"cannot read the L3 store {store.url}: {exc}") from None


def holds_objects(store: L3Store) -> bool:
    from cachecore.errors import BackendUnavailable

    if store.root is None or not store.root.exists():
        return False
    try:
        return any(True for _ in _backend(store, fsync=False).list(""))
    except BackendUnavailable:
        return False


def check_object_name(name: str) -> str:
    """``name`` if it is a valid object name by the backends' own rule (no ``..``, no absolute or
    empty parts, none starting with ``.``), else :class:`BackupError`."""
    from cachecore.tiers.backends import check_name

    try:
        return check_name(name)
    except ValueError as exc:
        raise BackupError(f"the archive names an L3 object {name!r} that is not a valid name: {exc}") from None


class Writer:
    """Puts restored objects into a file:// store, each written whole and fsynced."""

    def __init__(self, store: L3Store) -> None:
        self._backend = _backend(store, fsync=True)

    def put(self, name: str, data: bytes) -> None:
        from cachecore.errors import BackendUnavailable

        try:
            self._backend.put(check_object_name(name), data)
        except BackendUnavailable as exc:
            raise BackupError(f"cannot write the L3 object {name}: {exc}") from None
