"""L3 backend: objects in Redis (``redis://host:port/db``), shared by every node and replica.

Each object is two string keys: ``<key prefix><name>`` holds its bytes and ``<key prefix>.t/<name>`` its
write time (seconds since the epoch, for retention sweeps); names never start with ``.``, so the
second never collides with an object. Both are written in one ``MULTI``/``EXEC`` and deleted in one,
so a reader sees the old object or the whole new one. ``put_new`` is ``SET NX`` on both inside that
transaction: one round trip, no ``EXISTS`` before it, and of two writers of one name exactly one
writes; ``put_new_many`` sends the writes of several objects in one transaction (one round trip),
``exists_many`` the probes of several names in one pipeline. ``get_into`` reads a value in windows
(``GETRANGE`` of ``window`` bytes, 512 KiB by default) inside one ``MULTI``/``EXEC`` (one round trip,
one consistent version of the value: a value deleted or replaced meanwhile is seen whole or not at
all) into the caller's buffer: redis-py parses a multi-MB reply slower than the same bytes in windows.
``head`` is a ``GETRANGE`` of the first bytes (no copy of the header is kept). Listing and prefix
deletes use ``SCAN MATCH`` (glob characters in the prefix escaped) and ``UNLINK``. Writes use a
connection pool of their own, with their own timeout (``write_timeout``): they run off the request
path, and a multi-MB write on a busy server should not time out at a read's bound.

Every call is bounded: short socket connect/read timeouts (0.2 s by default for reads) and no
retries, so a down, paused or unreachable server costs a caller at most about one timeout. Every
Redis error (connection refused, timeout, a server-side error) is ``BackendUnavailable``, except a
key of another type under the prefix (an object of the earlier hash layout): a read of it is a miss,
and a listing reports it with size 0 and write time 0, so the next retention sweep deletes it.

URL options (query string): ``timeout`` (read, seconds), ``connect_timeout`` (seconds),
``write_timeout`` (seconds, default the larger of ``timeout`` and 2 s), ``window`` (bytes) and
``prefix`` (key prefix, default ``strata:l3:``); the rest of the URL goes to ``redis.Redis.from_url``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from cachecore.errors import BackendUnavailable
from cachecore.tiers.backends.base import Backend, Data, ObjectInfo, PartialWrite, check_name

DEFAULT_PREFIX = "strata:l3:"
DEFAULT_TIMEOUT = 0.2
MIN_WRITE_TIMEOUT = 2.0
DEFAULT_WINDOW = 512 * 1024
_SCAN_COUNT = 512
_MTIME = ".t/"  # the write time's key: <prefix>.t/<name>


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "\\*?[]^" else c for c in text)


def _public_url(url: str) -> str:
    """``url`` without credentials and without our own query options."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def connect_client(url: str, *, timeout: float, connect_timeout: float) -> redis.Redis:
    """A redis-py client as the backend opens one: these timeouts, no retries, no health checks, no
    ``CLIENT SETINFO`` round trips on connect (what ``bench.tiers`` compares the backend against)."""
    return redis.Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=connect_timeout,
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
        health_check_interval=0,
        driver_info=None,
    )


def _wrong_type(exc: BaseException) -> bool:
    """A server's WRONGTYPE reply: the key holds another type (an object of the earlier layout)."""
    return isinstance(exc, redis.ResponseError) and "WRONGTYPE" in str(exc)


class RedisBackend(Backend):
    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str | None = None,
        socket_timeout: float | None = None,
        connect_timeout: float | None = None,
        write_timeout: float | None = None,
        window: int | None = None,
    ) -> None:
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        options = {k: query.pop(k, None) for k in ("prefix", "timeout", "connect_timeout", "write_timeout", "window")}
        self.prefix = prefix if prefix is not None else (options["prefix"] or DEFAULT_PREFIX)
        timeout = socket_timeout if socket_timeout is not None else float(options["timeout"] or DEFAULT_TIMEOUT)
        connect = connect_timeout if connect_timeout is not None else float(options["connect_timeout"] or timeout)
        writes = (write_timeout if write_timeout is not None
                  else float(options["write_timeout"] or max(timeout, MIN_WRITE_TIMEOUT)))
        self.window = int(window if window is not None else (options["window"] or DEFAULT_WINDOW))
        if self.window <= 0:
            raise ValueError(f"window must be a positive number of bytes, got {self.window}")
        self.socket_timeout, self.connect_timeout, self.write_timeout = timeout, connect, writes
        self.url = _public_url(url)
        target = urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(query), ""))
        self._client = connect_client(target, timeout=timeout, connect_timeout=connect)
        # a pool of its own: reads never wait behind writes
        self._writes = connect_client(target, timeout=writes, connect_timeout=connect)

    # ------------------------------------------------------------------ contract
    def put(self, name: str, data: Data) -> None:
        key = self._key(name)
        try:
            pipe = self._writes.pipeline(transaction=True)
            pipe.set(key, _bytes(data))
            pipe.set(self._mtime_key(key), _now())
            pipe.execute()
        except (redis.RedisError, OSError) as exc:
            raise _down("put", exc) from None

    def put_new(self, name: str, data: Data) -> bool:
        return self.put_new_many([(name, data)])[0]

    def put_new_many(self, items: Sequence[tuple[str, Data]]) -> list[bool]:
        if not items:
            return []
        keys = [self._key(name) for name, _ in items]
        try:
            pipe = self._writes.pipeline(transaction=True)
            stamp = _now()
            for key, (_, data) in zip(keys, items, strict=True):
                pipe.set(key, _bytes(data), nx=True)
                pipe.set(self._mtime_key(key), stamp, nx=True)
            replies = pipe.execute()
        except (redis.RedisError, OSError) as exc:
            # One transaction: the server applied all of it or (almost always) none; which, a lost reply
            # does not say, and the store then re-lists.
            raise PartialWrite(f"l3 redis put failed: {type(exc).__name__}: {exc}") from None
        return [bool(replies[2 * i]) for i in range(len(items))]

    def get(self, name: str) -> bytes | None:
        key = self._key(name)
        try:
            return self._client.get(key)
        except (redis.RedisError, OSError) as exc:
            if _wrong_type(exc):
                return None
            raise _down("get", exc) from None

    def get_into(self, name: str, out: memoryview) -> int | None:
        key = self._key(name)
        w = self.window
        try:
            pipe = self._client.pipeline(transaction=True)
            pipe.exists(key)
            pipe.strlen(key)
            for start in range(0, len(out), w):
                pipe.getrange(key, start, min(start + w, len(out)) - 1)
            exists, size, *windows = pipe.execute()
        except (redis.RedisError, OSError) as exc:
            if _wrong_type(exc):
                return None
            raise _down("get", exc) from None
        if not exists:
            return None
        at = 0
        for part in windows:
            n = min(len(part), len(out) - at)
            out[at : at + n] = memoryview(part)[:n]
            at += n
        return int(size)

    def head(self, name: str, n: int) -> bytes | None:
        key = self._key(name)
        try:
            head = self._client.getrange(key, 0, n - 1) if n > 0 else b""
            if head:
                return head
            return b"" if self._client.exists(key) else None
        except (redis.RedisError, OSError) as exc:
            if _wrong_type(exc):
                return None
            raise _down("head", exc) from None

    def exists(self, name: str) -> bool:
        key = self._key(name)
        try:
            return bool(self._client.exists(key))
        except (redis.RedisError, OSError) as exc:
            raise _down("exists", exc) from None

    def exists_many(self, names: Sequence[str]) -> list[bool]:
        keys = [self._key(name) for name in names]
        if not keys:
            return []
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return [bool(r) for r in pipe.execute()]
        except (redis.RedisError, OSError) as exc:
            raise _down("exists", exc) from None

    def delete(self, name: str) -> bool:
        key = self._key(name)
        try:
            pipe = self._client.pipeline(transaction=True)
            pipe.unlink(key)
            pipe.unlink(self._mtime_key(key))
            return bool(pipe.execute()[0])
        except (redis.RedisError, OSError) as exc:
            raise _down("delete", exc) from None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        check_name(prefix, prefix=True)
        try:
            for keys in self._scan(prefix):
                pipe = self._client.pipeline(transaction=False)
                for key in keys:
                    pipe.strlen(key)
                    pipe.get(self._mtime_key(key))
                replies = pipe.execute(raise_on_error=False)
                for i, key in enumerate(keys):
                    size, mtime = replies[2 * i], replies[2 * i + 1]
                    if isinstance(size, Exception):
                        if not _wrong_type(size):
                            continue
                        size, mtime = 0, None  # the earlier layout: for the next sweep to delete
                    elif isinstance(mtime, Exception) or not size:
                        continue  # deleted meanwhile
                    yield ObjectInfo(self._name(key), int(size), float(mtime or 0))  # no write time: swept
        except (redis.RedisError, OSError) as exc:
            raise _down("list", exc) from None

    def delete_prefix(self, prefix: str) -> tuple[int, int]:
        check_name(prefix, prefix=True)
        objects = n_bytes = 0
        try:
            for keys in self._scan(prefix):
                pipe = self._client.pipeline(transaction=False)
                for key in keys:
                    pipe.strlen(key)
                    pipe.unlink(key, self._mtime_key(key))
                replies = pipe.execute(raise_on_error=False)
                for i in range(len(keys)):
                    size, gone = replies[2 * i], replies[2 * i + 1]
                    if isinstance(gone, int) and gone >= 1:
                        objects += 1
                        n_bytes += size if isinstance(size, int) else 0
        except (redis.RedisError, OSError) as exc:
            raise _down("delete_prefix", exc) from None
        return objects, n_bytes

    def usage(self) -> int:
        return sum(info.size for info in self.list(""))

    def close(self) -> None:
        for client in (self._client, self._writes):
            with contextlib.suppress(redis.RedisError, OSError):
                client.close()

    # ------------------------------------------------------------------ internals
    @property
    def _raw_prefix(self) -> bytes:
        return self.prefix.encode("utf-8")

    def _key(self, name: str) -> bytes:
        return (self.prefix + check_name(name)).encode("utf-8")

    def _mtime_key(self, key: bytes) -> bytes:
        return self._raw_prefix + _MTIME.encode() + key[len(self._raw_prefix) :]

    def _name(self, key: bytes) -> str:
        return key[len(self._raw_prefix) :].decode("utf-8")

    def _scan(self, prefix: str) -> Iterator[list[bytes]]:
        """Batches of the object keys under ``prefix`` (not the write times' keys; SCAN may repeat a
        key: batches are de-duplicated)."""
        seen: set[bytes] = set()
        match = _glob_escape(self.prefix + prefix) + "*"
        hidden = self._raw_prefix + b"."
        cursor = 0
        while True:
            cursor, keys = self._client.scan(cursor=cursor, match=match, count=_SCAN_COUNT)
            batch = [k for k in keys if k not in seen and not k.startswith(hidden)]
            seen.update(batch)
            if batch:
                yield batch
            if cursor == 0:
                return


def _bytes(data: Data) -> bytes | memoryview:
    """``data`` as redis-py sends it without a copy (a memoryview is written to the socket as is)."""
    return data if isinstance(data, bytes) else memoryview(data).cast("B")


def _now() -> bytes:
    return repr(time.time()).encode()


def _down(op: str, exc: BaseException) -> BackendUnavailable:
    return BackendUnavailable(f"l3 redis {op} failed: {type(exc).__name__}: {exc}")
