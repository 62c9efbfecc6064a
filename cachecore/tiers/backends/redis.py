"""L3 backend: objects in Redis (``redis://host:port/db``), shared by every node and replica.

Each object is one hash ``<key prefix><name>`` with three fields, ``d`` (the bytes), ``h`` (a copy of
their first ``HEAD_BYTES``, which ``head`` reads so that a sweep need not fetch whole objects) and
``t`` (the write time, seconds since the epoch, for retention sweeps): one ``HSET`` writes them,
atomically, so a reader sees the old object or the whole new one. Listing and prefix deletes use ``SCAN MATCH``
(glob characters in the prefix escaped) and ``UNLINK``.

Every call is bounded: short socket connect/read timeouts (0.2 s by default) and no retries, so a
down, paused or unreachable server costs a caller at most about one timeout. Every Redis error
(connection refused, timeout, a server-side error) is ``BackendUnavailable``.

URL options (query string): ``timeout`` (read, seconds), ``connect_timeout`` (seconds) and
``prefix`` (key prefix, default ``strata:l3:``); the rest of the URL goes to ``redis.Redis.from_url``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from cachecore.errors import BackendUnavailable
from cachecore.tiers.backends.base import HEAD_BYTES, Backend, ObjectInfo, check_name

DEFAULT_PREFIX = "strata:l3:"
DEFAULT_TIMEOUT = 0.2
_SCAN_COUNT = 512
_DATA, _HEAD, _MTIME = b"d", b"h", b"t"


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "\\*?[]^" else c for c in text)


def _public_url(url: str) -> str:
    """``url`` without credentials and without our own query options."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


class RedisBackend(Backend):
    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str | None = None,
        socket_timeout: float | None = None,
        connect_timeout: float | None = None,
    ) -> None:
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        self.prefix = prefix if prefix is not None else query.pop("prefix", DEFAULT_PREFIX)
        query.pop("prefix", None)
        timeout = socket_timeout if socket_timeout is not None else float(query.pop("timeout", DEFAULT_TIMEOUT))
        query.pop("timeout", None)
        connect = (
            connect_timeout if connect_timeout is not None else float(query.pop("connect_timeout", timeout))
        )
        query.pop("connect_timeout", None)
        self.socket_timeout, self.connect_timeout = timeout, connect
        self.url = _public_url(url)
        self._client = redis.Redis.from_url(
            urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(query), "")),
            socket_timeout=timeout,
            socket_connect_timeout=connect,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            health_check_interval=0,
            driver_info=None,  # no CLIENT SETINFO round trips on connect
        )

    # ------------------------------------------------------------------ contract
    def put(self, name: str, data: bytes) -> None:
        key = self._key(name)
        try:
            value = data if isinstance(data, bytes) else memoryview(data).cast("B")  # no copy
            head = bytes(value[:HEAD_BYTES])
            self._client.hset(key, mapping={_DATA: value, _HEAD: head, _MTIME: repr(time.time()).encode()})
        except (redis.RedisError, OSError) as exc:
            raise _down("put", exc) from None

    def get(self, name: str) -> bytes | None:
        key = self._key(name)
        try:
            return self._client.hget(key, _DATA)
        except (redis.RedisError, OSError) as exc:
            raise _down("get", exc) from None

    def head(self, name: str, n: int) -> bytes | None:
        key = self._key(name)
        try:
            head = self._client.hget(key, _HEAD) if n <= HEAD_BYTES else None
            if head is None:  # written before heads were kept, or a longer read: the whole object
                data = self._client.hget(key, _DATA)
                return None if data is None else data[:n]
            return head[:n]
        except (redis.RedisError, OSError) as exc:
            raise _down("head", exc) from None

    def exists(self, name: str) -> bool:
        key = self._key(name)
        try:
            return bool(self._client.exists(key))
        except (redis.RedisError, OSError) as exc:
            raise _down("exists", exc) from None

    def delete(self, name: str) -> bool:
        key = self._key(name)
        try:
            return bool(self._client.unlink(key))
        except (redis.RedisError, OSError) as exc:
            raise _down("delete", exc) from None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        check_name(prefix, prefix=True)
        try:
            for keys in self._scan(prefix):
                pipe = self._client.pipeline(transaction=False)
                for key in keys:
                    pipe.hstrlen(key, _DATA)
                    pipe.hget(key, _MTIME)
                replies = pipe.execute(raise_on_error=False)
                for i, key in enumerate(keys):
                    size, mtime = replies[2 * i], replies[2 * i + 1]
                    if isinstance(size, Exception) or isinstance(mtime, Exception) or mtime is None:
                        continue  # not one of ours (another type), or deleted meanwhile
                    yield ObjectInfo(key[len(self._raw_prefix) :].decode("utf-8"), int(size), float(mtime))
        except (redis.RedisError, OSError) as exc:
            raise _down("list", exc) from None

    def delete_prefix(self, prefix: str) -> tuple[int, int]:
        check_name(prefix, prefix=True)
        objects = n_bytes = 0
        try:
            for keys in self._scan(prefix):
                pipe = self._client.pipeline(transaction=False)
                for key in keys:
                    pipe.hstrlen(key, _DATA)
                    pipe.unlink(key)
                replies = pipe.execute(raise_on_error=False)
                for i in range(len(keys)):
                    size, gone = replies[2 * i], replies[2 * i + 1]
                    if gone == 1:
                        objects += 1
                        n_bytes += size if isinstance(size, int) else 0
        except (redis.RedisError, OSError) as exc:
            raise _down("delete_prefix", exc) from None
        return objects, n_bytes

    def usage(self) -> int:
        return sum(info.size for info in self.list(""))

    def close(self) -> None:
        with contextlib.suppress(redis.RedisError, OSError):
            self._client.close()

    # ------------------------------------------------------------------ internals
    @property
    def _raw_prefix(self) -> bytes:
        return self.prefix.encode("utf-8")

    def _key(self, name: str) -> bytes:
        return (self.prefix + check_name(name)).encode("utf-8")

    def _scan(self, prefix: str) -> Iterator[list[bytes]]:
        """Batches of the keys under ``prefix`` (SCAN may repeat a key; batches are de-duplicated)."""
        seen: set[bytes] = set()
        match = _glob_escape(self.prefix + prefix) + "*"
        cursor = 0
        while True:
            cursor, keys = self._client.scan(cursor=cursor, match=match, count=_SCAN_COUNT)
            batch = [k for k in keys if k not in seen]
            seen.update(batch)
            if batch:
                yield batch
            if cursor == 0:
                return


def _down(op: str, exc: BaseException) -> BackendUnavailable:
    return BackendUnavailable(f"l3 redis {op} failed: {type(exc).__name__}: {exc}")
