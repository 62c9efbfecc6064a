"""L3 backends, one per file behind :class:`~cachecore.tiers.backends.base.Backend`, and
:func:`open_backend` that picks one from ``STRATA_L3_URL``:

- ``file:///abs/path`` (``?fsync=0`` to skip fsyncs, for benchmarks only) -> :class:`FileBackend`
- ``redis://host:port/db`` (``rediss://`` for TLS; ``?timeout=0.2&connect_timeout=0.2&prefix=...``)
  -> :class:`RedisBackend` (imports redis-py only when used)
- ``redis+cluster://host:port`` (``rediss+cluster://`` for TLS; any one node of a Redis Cluster, the
  same options) -> :class:`RedisBackend` on the cluster
- ``none`` -> ``None`` (L3 disabled)
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import parse_qsl, unquote, urlsplit

from cachecore.tiers.backends.base import Backend, ObjectInfo, check_name

__all__ = ["Backend", "ObjectInfo", "check_name", "open_backend", "register_backend"]


def _open_file(url: str, **options: object) -> Backend:
    from cachecore.tiers.backends.fs import FileBackend

    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"file URL must be file:///absolute/path, got {url!r}")
    path = unquote(parts.path)
    if not path.startswith("/"):
        raise ValueError(f"file URL must hold an absolute path, got {url!r}")
    query = dict(parse_qsl(parts.query))
    fsync = query.get("fsync", "1").lower() not in ("0", "false", "no", "off")
    return FileBackend(path, fsync=bool(options.get("fsync", fsync)))


def _open_redis(url: str, **options: object) -> Backend:
    from cachecore.tiers.backends.redis import RedisBackend

    return RedisBackend(url, **options)  # type: ignore[arg-type]


_SCHEMES: dict[str, Callable[..., Backend]] = {
    "file": _open_file, "redis": _open_redis, "rediss": _open_redis,
    "redis+cluster": _open_redis, "rediss+cluster": _open_redis,
}  # fmt: skip


def register_backend(scheme: str, factory: Callable[..., Backend]) -> None:
    """Make ``open_backend`` open ``<scheme>://...`` URLs with ``factory(url, **options)``."""
    _SCHEMES[scheme.lower()] = factory


def open_backend(url: str, **options: object) -> Backend | None:
    """The backend ``url`` names, or None for ``none`` (L3 disabled). Opening never contacts the
    backend: one that is down at start reports ``BackendUnavailable`` from its operations. Raises
    ``ValueError`` for an empty URL or an unknown scheme."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError("L3 URL is empty (use 'none' to disable L3)")
    url = url.strip()
    if url.lower() == "none":
        return None
    scheme = urlsplit(url).scheme.lower()
    factory = _SCHEMES.get(scheme)
    if factory is None:
        raise ValueError(f"unknown L3 URL scheme {scheme!r} (expected one of {', '.join(sorted(_SCHEMES))}, or none)")
    return factory(url, **options)
