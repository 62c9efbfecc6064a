"""L3 backend: objects in Redis (``redis://host:port/db``) or a Redis Cluster (``redis+cluster://host:port``),
shared by every node and replica.

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

A Redis Cluster (``redis+cluster://host:port``, ``rediss+cluster://`` for TLS; any one node, the
others are found from it): the name is the keys' hash tag, ``<key prefix>{<name>}`` and ``<key
prefix>.t/{<name>}`` (a prefix holds no braces), so an object's two keys share a slot, and objects
spread over the nodes. Per-object transactions (``put``, ``delete``, ``get_into``'s windows) are the
same ``MULTI``/``EXEC`` on the object's node. ``put_new_many`` cannot be one transaction across slots:
each object is one script doing ``SET NX`` on both of its keys (atomic on its node: of two writers of
one name exactly one writes, a reader sees no object or the whole one), the scripts of every node
sent at once (one round trip per node); a node that fails fails its objects only, and
``PartialWrite.written`` names what the other nodes wrote. ``exists_many`` and the listings' batches
go the same way; listings and prefix deletes ``SCAN`` every primary. redis-py's own pipeline retry is
not used (it would send a failed node's commands again one by one, each waiting out the timeout): a
timeout or a refused connection is the reply of that node's commands, a ``MOVED``/``ASK`` (a
resharding) is followed (a transaction is sent again once, to the slot's new node; while a slot is
still migrating, one on an object already moved may fail: ``BackendUnavailable``, a miss). The
cluster client is opened (the slot map read) by the first call, not when the backend is: a cluster
that is down then is ``BackendUnavailable`` from that call, and the next one tries again. A node
that is down costs the calls that need it about one timeout (two when a new connection to it fails
and redis-py reads the slot map again, from that node among others); the others still serve.

URL options (query string): ``timeout`` (read, seconds), ``connect_timeout`` (seconds),
``write_timeout`` (seconds, default the larger of ``timeout`` and 2 s), ``window`` (bytes) and
``prefix`` (key prefix, default ``strata:l3:``); the rest of the URL goes to ``redis.Redis.from_url``
(on a cluster to ``RedisCluster.from_url``, as ``redis://`` / ``rediss://``; db 0 only).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.exceptions import AskError, RedisClusterException, ResponseError, TryAgainError
from redis.retry import Retry

from cachecore.errors import BackendUnavailable
from cachecore.tiers.backends.base import Backend, Data, ObjectInfo, PartialWrite, check_name

DEFAULT_PREFIX = "strata:l3:"
DEFAULT_TIMEOUT = 0.2
MIN_WRITE_TIMEOUT = 2.0
DEFAULT_WINDOW = 512 * 1024
_SCAN_COUNT = 512
_MTIME = ".t/"  # the write time's key: <prefix>.t/<name>
#: Schemes of a Redis Cluster and the plain scheme redis-py is given for them.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
# What a call may raise for a backend that is down or refuses (RedisClusterException is not a RedisError).
_ERRORS = (redis.RedisError, OSError, RedisClusterException)
# put_new in one atomic server-side step on a cluster (both keys share a slot): SET NX on both, as the
# standalone transaction does; 1 if the object was written.
_PUT_NEW = ("local ok = redis.call('SET', KEYS[1], ARGV[1], 'NX') "
            "redis.call('SET', KEYS[2], ARGV[2], 'NX') if ok then return 1 end return 0")


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


def connect_cluster(url: str, *, timeout: float, connect_timeout: float):
    """A redis-py ``RedisCluster`` set up as :func:`connect_client` sets up a client (``url`` is
    ``redis://`` or ``rediss://`` of one seed node). Unlike it, this contacts the cluster: redis-py
    reads the slot map (``CLUSTER SLOTS``) and the command table when it opens a cluster client."""
    from redis.cluster import RedisCluster

    return RedisCluster.from_url(
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
        scheme = parts.scheme.lower()
        self.cluster = scheme in CLUSTER_SCHEMES
        if self.cluster and ("{" in self.prefix or "}" in self.prefix):
            raise ValueError(f"a Redis Cluster key prefix holds no '{{' or '}}' (its hash tag is the name's), "
                             f"got {self.prefix!r}")
        target = urlunsplit((CLUSTER_SCHEMES.get(scheme, parts.scheme), parts.netloc, parts.path, urlencode(query), ""))
        self._target = target
        self._open_lock = threading.Lock()
        self._clients: tuple | None = None  # (reads, writes); a cluster's are opened by the first call
        if not self.cluster:
            self._clients = (
                connect_client(target, timeout=timeout, connect_timeout=connect),
                # a pool of its own: reads never wait behind writes
                connect_client(target, timeout=writes, connect_timeout=connect),
            )

    @property
    def _client(self):
        return (self._clients or self._open())[0]

    @property
    def _writes(self):
        return (self._clients or self._open())[1]

    def _open(self) -> tuple:
        """A cluster's two clients, opened now (opening reads the slot map: a cluster that is down at
        start is reported by the calls, as a standalone server is, and the next call tries again)."""
        with self._open_lock:
            if self._clients is None:
                reads = connect_cluster(self._target, timeout=self.socket_timeout, connect_timeout=self.connect_timeout)
                try:
                    writes = connect_cluster(self._target, timeout=self.write_timeout,
                                             connect_timeout=self.connect_timeout)
                except BaseException:
                    reads.close()
                    raise
                self._clients = (reads, writes)
            return self._clients

    # ------------------------------------------------------------------ contract
    def put(self, name: str, data: Data) -> None:
        key = self._key(name)
        try:
            self._transaction(self._writes, [("SET", key, _bytes(data)), ("SET", self._mtime_key(key), _now())])
        except _ERRORS as exc:
            raise _down("put", exc) from None

    def put_new(self, name: str, data: Data) -> bool:
        return self.put_new_many([(name, data)])[0]

    def put_new_many(self, items: Sequence[tuple[str, Data]]) -> list[bool]:
        if not items:
            return []
        keys = [self._key(name) for name, _ in items]
        if self.cluster:
            return self._put_new_many_cluster(items, keys)
        try:
            pipe = self._writes.pipeline(transaction=True)
            stamp = _now()
            for key, (_, data) in zip(keys, items, strict=True):
                pipe.set(key, _bytes(data), nx=True)
                pipe.set(self._mtime_key(key), stamp, nx=True)
            replies = pipe.execute()
        except _ERRORS as exc:
            # One transaction: the server applied all of it or (almost always) none; which, a lost reply
            # does not say, and the store then re-lists.
            raise PartialWrite(f"l3 redis put failed: {type(exc).__name__}: {exc}") from None
        return [bool(replies[2 * i]) for i in range(len(items))]

    def _put_new_many_cluster(self, items: Sequence[tuple[str, Data]], keys: list[bytes]) -> list[bool]:
        """One script per object (its two keys share a slot: SET NX on both in one atomic step), the
        scripts of every node sent together: one round trip per node, all nodes at once. A node that
        fails fails its objects only: the others' are reported written (``PartialWrite.written``)."""
        stamp = _now()
        commands = [("EVAL", _PUT_NEW, 2, key, self._mtime_key(key), _bytes(data), stamp)
                    for key, (_, data) in zip(keys, items, strict=True)]
        try:
            replies = _cluster_batch(self._writes, commands)
        except _ERRORS as exc:
            raise PartialWrite(f"l3 redis put failed: {type(exc).__name__}: {exc}") from None
        failed = next((r for r in replies if isinstance(r, BaseException)), None)
        if failed is not None:
            written = [name for (name, _), r in zip(items, replies, strict=True) if r == 1]
            raise PartialWrite(f"l3 redis put failed: {type(failed).__name__}: {failed}", written)
        return [r == 1 for r in replies]

    def get(self, name: str) -> bytes | None:
        key = self._key(name)
        try:
            return self._client.get(key)
        except _ERRORS as exc:
            if _wrong_type(exc):
                return None
            raise _down("get", exc) from None

    def get_into(self, name: str, out: memoryview) -> int | None:
        key = self._key(name)
        w = self.window
        commands = [("EXISTS", key), ("STRLEN", key)]
        commands += [("GETRANGE", key, start, min(start + w, len(out)) - 1) for start in range(0, len(out), w)]
        try:
            exists, size, *windows = self._transaction(self._client, commands)
        except _ERRORS as exc:
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
        except _ERRORS as exc:
            if _wrong_type(exc):
                return None
            raise _down("head", exc) from None

    def exists(self, name: str) -> bool:
        key = self._key(name)
        try:
            return bool(self._client.exists(key))
        except _ERRORS as exc:
            raise _down("exists", exc) from None

    def exists_many(self, names: Sequence[str]) -> list[bool]:
        keys = [self._key(name) for name in names]
        if not keys:
            return []
        try:
            replies = self._batch([("EXISTS", key) for key in keys])
            _raise_first(replies)
            return [bool(r) for r in replies]
        except _ERRORS as exc:
            raise _down("exists", exc) from None

    def delete(self, name: str) -> bool:
        key = self._key(name)
        try:
            return bool(self._transaction(self._client, [("UNLINK", key), ("UNLINK", self._mtime_key(key))])[0])
        except _ERRORS as exc:
            raise _down("delete", exc) from None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        check_name(prefix, prefix=True)
        try:
            for keys in self._scan(prefix):
                commands: list[tuple] = []
                for key in keys:
                    commands += [("STRLEN", key), ("GET", self._mtime_key(key))]
                replies = self._batch(commands)
                _raise_down(replies)
                for i, key in enumerate(keys):
                    size, mtime = replies[2 * i], replies[2 * i + 1]
                    if isinstance(size, Exception):
                        if not _wrong_type(size):
                            continue
                        size, mtime = 0, None  # the earlier layout: for the next sweep to delete
                    elif isinstance(mtime, Exception) or not size:
                        continue  # deleted meanwhile
                    yield ObjectInfo(self._name(key), int(size), float(mtime or 0))  # no write time: swept
        except _ERRORS as exc:
            raise _down("list", exc) from None

    def delete_prefix(self, prefix: str) -> tuple[int, int]:
        check_name(prefix, prefix=True)
        objects = n_bytes = 0
        try:
            for keys in self._scan(prefix):
                commands: list[tuple] = []
                for key in keys:
                    commands += [("STRLEN", key), ("UNLINK", key, self._mtime_key(key))]
                replies = self._batch(commands)
                _raise_down(replies)
                for i in range(len(keys)):
                    size, gone = replies[2 * i], replies[2 * i + 1]
                    if isinstance(gone, int) and gone >= 1:
                        objects += 1
                        n_bytes += size if isinstance(size, int) else 0
        except _ERRORS as exc:
            raise _down("delete_prefix", exc) from None
        return objects, n_bytes

    def usage(self) -> int:
        return sum(info.size for info in self.list(""))

    def close(self) -> None:
        for client in self._clients or ():
            with contextlib.suppress(*_ERRORS):
                client.close()

    # ------------------------------------------------------------------ internals
    @property
    def _raw_prefix(self) -> bytes:
        return self.prefix.encode("utf-8")

    def _key(self, name: str) -> bytes:
        """The object's key: ``<prefix><name>``, on a cluster ``<prefix>{<name>}`` (the name is the hash
        tag, so the write time's key lands in the same slot)."""
        check_name(name)
        return (self.prefix + ("{" + name + "}" if self.cluster else name)).encode("utf-8")

    def _mtime_key(self, key: bytes) -> bytes:
        return self._raw_prefix + _MTIME.encode() + key[len(self._raw_prefix) :]

    def _name(self, key: bytes) -> str:
        tail = key[len(self._raw_prefix) :]
        return (tail[1:-1] if self.cluster else tail).decode("utf-8")

    def _transaction(self, client, commands: Sequence[tuple]) -> list:
        """The replies of ``commands`` (one object's keys: on a cluster, one slot) in one ``MULTI``/``EXEC``.
        On a cluster, a transaction sent to the node that held the slot before a resharding is refused
        whole (``MOVED``): redis-py then takes the slot's new node, and it is sent again, once."""

        def run() -> list:
            pipe = client.pipeline(transaction=True)
            for command in commands:
                pipe.execute_command(*command)
            return pipe.execute()

        try:
            return run()
        except AskError:  # MovedError is an AskError
            if not self.cluster:
                raise
        return run()

    def _batch(self, commands: Sequence[tuple]) -> list:
        """The replies of single-slot ``commands`` sent in one pipeline (a cluster: one per node, all
        at once), not in a transaction; a command's error is its reply (raised for a server that is
        down: a standalone pipeline raises it, :func:`_raise_down` on a cluster's)."""
        if self.cluster:
            return _cluster_batch(self._client, commands)
        pipe = self._client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return pipe.execute(raise_on_error=False)

    def _scan(self, prefix: str) -> Iterator[list[bytes]]:
        """Batches of the object keys under ``prefix`` (not the write times' keys; SCAN may repeat a
        key: batches are de-duplicated). A cluster is scanned node by node, every primary."""
        seen: set[bytes] = set()
        if self.cluster:
            match = _glob_escape(self.prefix) + "{" + _glob_escape(prefix) + "*"
            cluster = self._client
            servers = [cluster.get_redis_connection(node) for node in cluster.get_primaries()]
        else:
            match = _glob_escape(self.prefix + prefix) + "*"
            servers = [self._client]
        hidden = self._raw_prefix + b"."
        for server in servers:
            cursor = 0
            while True:
                cursor, keys = server.scan(cursor=cursor, match=match, count=_SCAN_COUNT)
                batch = [k for k in keys if k not in seen and not k.startswith(hidden)
                         and (not self.cluster or k.endswith(b"}"))]
                seen.update(batch)
                if batch:
                    yield batch
                if cursor == 0:
                    break


def _cluster_batch(cluster, commands: Sequence[tuple]) -> list:
    """``commands`` (each on one slot) through a cluster pipeline, one reply or error per command. A
    command sent to a node that no longer holds its slot (``MOVED``/``ASK``/``TRYAGAIN``, a
    resharding) is sent again alone, which follows the redirection; a connection error or timeout is
    NOT retried (redis-py would send every failed command again, one by one, each waiting out its
    timeout): it is the reply of that node's commands."""
    from redis.cluster import PipelineCommand

    stack = [PipelineCommand(tuple(args), {}, i) for i, args in enumerate(commands)]
    replies = cluster.pipeline().send_cluster_commands(stack, raise_on_error=False, allow_redirections=False)
    for i, reply in enumerate(replies):
        if isinstance(reply, AskError | TryAgainError):  # MovedError is an AskError
            try:
                replies[i] = cluster.execute_command(*commands[i])
            except ResponseError as exc:
                replies[i] = exc
    return replies


def _raise_down(replies: list) -> None:
    """Raise the first error of ``replies`` other than ``WRONGTYPE`` (a key of the earlier layout): a
    node down, a timeout, a cluster that is down; a listing must be whole or fail."""
    for reply in replies:
        if isinstance(reply, BaseException) and not _wrong_type(reply):
            raise reply


def _raise_first(replies: list) -> None:
    for reply in replies:
        if isinstance(reply, BaseException):
            raise reply


def _bytes(data: Data) -> bytes | memoryview:
    """``data`` as redis-py sends it without a copy (a memoryview is written to the socket as is)."""
    return data if isinstance(data, bytes) else memoryview(data).cast("B")


def _now() -> bytes:
    return repr(time.time()).encode()


def _down(op: str, exc: BaseException) -> BackendUnavailable:
    return BackendUnavailable(f"l3 redis {op} failed: {type(exc).__name__}: {exc}")
