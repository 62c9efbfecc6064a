"""L3, the encrypted remote tier, at the store level: envelope keys, the filesystem and Redis backends,
RemoteStore round trips, retention, quotas, scoped deletes, and the fault matrix (F1-F6 + no plaintext).

Redis tests run against a real ``redis-server`` this module starts on a free port (never 6379) and
stops at the end, and the backend and store tests (``raw``) again against a real three-node Redis
Cluster (``redis+cluster://``, started the same way); the filesystem tests use ``tmp_path``. Each
fault test would fail if its defence were removed (noted per test).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import zlib

import numpy as np
import pytest
import torch

from cachecore import crypto
from cachecore.crypto import Keyring, generate_key
from cachecore.errors import BackendUnavailable, DecryptError, KeyUnavailable
from cachecore.hashing import chain_hashes
from cachecore.layout import KVLayout
from cachecore.namespace import Namespace
from cachecore.tiers.backends import open_backend
from cachecore.tiers.backends.base import check_name
from cachecore.tiers.backends.fs import FileBackend
from cachecore.tiers.base import Tag
from cachecore.tiers.remote import RemoteStore, object_name, parse_name

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CB = 4  # blocks per chunk in most tests (the default 16 is exercised too)
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16)


# ---------------------------------------------------------------------- material
def _ns(salt: bytes, *, model: str = "m1", layout: KVLayout = LAYOUT) -> Namespace:
    return Namespace.build(
        scope_salt=salt, model_id=model, weight_digest="w-" + model, tokenizer_digest="tok",
        layout=layout.canonical(), rope={"theta": 10000},
    )  # fmt: skip


def _request(seed: int, n_blocks: int, *, salt: bytes = b"\x01" * 32, request_salt: bytes = b"", layout=LAYOUT):
    """(namespace, tokens, hashes, kv) of a deterministic request. Token ids are large (> 2**16) so
    their uint32 byte patterns are distinctive in the no-plaintext test."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(70_000, 2**31, (n_blocks * layout.block_size,), generator=g).tolist()
    ns = _ns(salt, layout=layout)
    hashes = chain_hashes(ns, tokens, layout.block_size, request_salt=request_salt)
    kv = torch.randn((n_blocks, *layout.page_shape), generator=g).to(layout.torch_dtype)
    return ns, tokens, hashes, kv


def _tag(ns: Namespace, owner: str = "t1", model: str = "m1", revision: str = "r1", persist: bool = True) -> Tag:
    return Tag(owner, model, revision, ns.digest, persist)


def _put_all(store: RemoteStore, hashes, tokens, tag, kv) -> int:
    cb, ct = store.chunk_blocks, store.chunk_tokens
    written = 0
    for c in range(len(hashes) // cb):
        written += store.put_chunk(
            hashes[c * cb : (c + 1) * cb], tokens[c * ct : (c + 1) * ct], tag, kv[c * cb : (c + 1) * cb]
        )
    return written


def _keyring(*tenants: str, key: bytes | None = None) -> Keyring:
    kr = Keyring()
    for t in tenants:
        kr.add(t, 1, key or generate_key())
    return kr


def _free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port != 6379:
            return port


# ---------------------------------------------------------------------- a real redis-server
class RedisServer:
    def __init__(self, workdir: str) -> None:
        self.port = _free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        import redis

        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.workdir, "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=self.port, socket_timeout=1).ping()
                return
            except redis.RedisError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def client(self):
        import redis

        return redis.Redis(port=self.port, socket_timeout=10)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH (the Redis backend tests need a real server)")
    server = RedisServer(str(tmp_path_factory.mktemp("redis")))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_up(redis_server):
    """The module's server, running and empty (restarted if a test stopped it)."""
    if redis_server.proc is None or redis_server.proc.poll() is not None:
        redis_server.start()
    redis_server.client().flushall()
    return redis_server


# ---------------------------------------------------------------------- a real Redis Cluster
class RedisClusterNodes:
    """Three ``redis-server`` processes in cluster mode (three primaries, no replicas) on free ports,
    joined by ``redis-cli --cluster create``: what ``redis+cluster://`` URLs are tested against."""

    def __init__(self, workdir: str, n: int = 3) -> None:
        ports: list[int] = []
        while len(ports) < 2 * n:  # a client port and a cluster bus port per node
            port = _free_port()
            if port not in ports:
                ports.append(port)
        self.ports, self.bus_ports = ports[:n], ports[n:]
        self.workdir = workdir
        self.procs: dict[int, subprocess.Popen] = {}
        self._client = None

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.ports[0]}/"

    def start_node(self, i: int) -> None:
        import redis

        port = self.ports[i]
        self.procs[port] = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-port", str(self.bus_ports[i]),
             "--cluster-config-file", os.path.join(self.workdir, f"nodes-{port}.conf"),
             "--save", "", "--appendonly", "no", "--dir", self.workdir, "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=port, socket_timeout=1).ping()
                return
            except redis.RedisError:
                if time.monotonic() > deadline or self.procs[port].poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)

    def stop_node(self, i: int) -> None:
        proc = self.procs.pop(self.ports[i], None)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(5)

    def running(self) -> bool:
        return all(p in self.procs and self.procs[p].poll() is None for p in self.ports)

    def create(self) -> None:
        for i in range(len(self.ports)):
            self.start_node(i)
        subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                        "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)  # fmt: skip
        self.wait_ok()

    def start(self) -> None:
        """Start the nodes that are not running (each rejoins from its nodes file, empty)."""
        for i, port in enumerate(self.ports):
            if port not in self.procs or self.procs[port].poll() is not None:
                self.start_node(i)
        self.wait_ok()

    def stop(self) -> None:
        for i in range(len(self.ports)):
            self.stop_node(i)

    def wait_ok(self) -> None:
        """Until every node reports ``cluster_state:ok`` (the only wait the fixture has)."""
        import redis

        deadline = time.monotonic() + 30
        for port in self.ports:
            node = redis.Redis(port=port, socket_timeout=1)
            while node.execute_command("CLUSTER INFO").get("cluster_state") != "ok":
                if time.monotonic() > deadline:
                    raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")
                time.sleep(0.02)

    def nodes(self) -> list:
        """A plain client per node."""
        import redis

        return [redis.Redis(port=port, socket_timeout=10) for port in self.ports]

    def client(self):
        """A cluster client (follows the slot map), opened once."""
        from redis.cluster import RedisCluster

        if self._client is None:
            self._client = RedisCluster(host="127.0.0.1", port=self.ports[0], socket_timeout=10)
        return self._client

    def flushall(self) -> None:
        """Empty every node; the cluster client reads the slot map again (a test may have moved a slot)."""
        for node in self.nodes():
            node.flushall()
        if self._client is not None:
            self._client.nodes_manager.initialize()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server/redis-cli are not on PATH (the Redis Cluster tests need real servers)")
    nodes = RedisClusterNodes(str(tmp_path_factory.mktemp("redis-cluster")))
    try:
        nodes.create()
        yield nodes
    finally:
        nodes.stop()


@pytest.fixture
def redis_cluster_up(redis_cluster):
    """The module's cluster, every node running, empty (nodes a test stopped are restarted)."""
    if not redis_cluster.running():
        redis_cluster.start()
    redis_cluster.flushall()
    return redis_cluster


@pytest.fixture(params=["redis", "redis-cluster"])
def redis_any(request):
    """A standalone server, then a cluster: for the Redis backend's own tests (``.url``, ``.client()``,
    ``.stop()``, ``.start()`` on either)."""
    return request.getfixturevalue("redis_up" if request.param == "redis" else "redis_cluster_up")


class Raw:
    """Direct access to a backend's stored bytes, around the store (to damage or move objects)."""

    def __init__(self, kind: str, backend, server: RedisServer | RedisClusterNodes | None = None) -> None:
        self.kind, self.backend, self.server = kind, backend, server

    def _path(self, name: str) -> str:
        return os.path.join(self.backend.root, *name.split("/"))

    def _key(self, name: str) -> bytes:
        return self.backend._key(name)

    def get(self, name: str) -> bytes:
        if self.kind == "fs":
            with open(self._path(name), "rb") as f:
                return f.read()
        return self.server.client().get(self._key(name))

    def set(self, name: str, data: bytes) -> None:
        """Overwrite in place (no temp file, no rename): what a torn or damaged write leaves."""
        if self.kind == "fs":
            with open(self._path(name), "wb") as f:
                f.write(data)
        else:
            self.server.client().set(self._key(name), data)

    def move(self, src: str, dst: str, *, copy: bool = False) -> None:
        """Rename the file / copy the Redis value (``copy=True`` keeps the source)."""
        if self.kind == "fs":
            os.makedirs(os.path.dirname(self._path(dst)), exist_ok=True)
            if copy:
                shutil.copyfile(self._path(src), self._path(dst))
            else:
                os.rename(self._path(src), self._path(dst))
        else:
            client, meta = self.server.client(), self.backend._mtime_key
            for a, b in ((self._key(src), self._key(dst)), (meta(self._key(src)), meta(self._key(dst)))):
                client.set(b, client.get(a))  # not COPY: on a cluster the two names are in two slots
                if not copy:
                    client.delete(a)


@pytest.fixture(params=["fs", "redis", "redis-cluster"])
def raw(request, tmp_path):
    if request.param == "fs":
        backend = open_backend(f"file://{tmp_path / 'l3'}")
        yield Raw("fs", backend)
    else:
        server = request.getfixturevalue("redis_up" if request.param == "redis" else "redis_cluster_up")
        backend = open_backend(server.url)
        yield Raw(request.param, backend, server)
        backend.close()


def _store(raw_or_backend, keyring, **kw) -> RemoteStore:
    backend = raw_or_backend.backend if isinstance(raw_or_backend, Raw) else raw_or_backend
    kw.setdefault("chunk_blocks", CB)
    return RemoteStore(backend, keyring, LAYOUT, **kw)


def _names(store: RemoteStore, tag: Tag, hashes, version: int = 1) -> list[str]:
    cb = store.chunk_blocks
    return [
        object_name(tag.owner, tag.model, tag.revision, version, hashes[(c + 1) * cb - 1])
        for c in range(len(hashes) // cb)
    ]


# ====================================================================== crypto
def test_wrap_unwrap_round_trip_and_every_wrong_context_fails():
    master, dk = generate_key(), generate_key()
    wrapped = crypto.wrap_key(master, dk, tenant="t1", version=3)
    assert dk not in wrapped
    assert crypto.unwrap_key(master, wrapped, tenant="t1", version=3) == dk
    with pytest.raises(DecryptError):
        crypto.unwrap_key(generate_key(), wrapped, tenant="t1", version=3)  # wrong master key
    with pytest.raises(DecryptError):
        crypto.unwrap_key(master, wrapped, tenant="t2", version=3)  # wrong tenant
    with pytest.raises(DecryptError):
        crypto.unwrap_key(master, wrapped, tenant="t1", version=4)  # wrong version
    flipped = bytearray(wrapped)
    flipped[20] ^= 1
    with pytest.raises(DecryptError):
        crypto.unwrap_key(master, bytes(flipped), tenant="t1", version=3)
    with pytest.raises(DecryptError):
        crypto.unwrap_key(master, wrapped[:-1], tenant="t1", version=3)
    assert crypto.wrap_key(master, dk, tenant="t1", version=3) != wrapped  # fresh nonce each time


def test_seal_open_frame_layout_and_failures():
    key = generate_key()
    aad = crypto.associated_data(
        object_key=b"k", ns_digest=b"n" * 32, layout=LAYOUT.canonical(), tenant="t1", key_version=7,
        format_version=crypto.FORMAT_VERSION,
    )  # fmt: skip
    frame = crypto.seal(key, version=7, aad=aad, plaintext=b"hello world")
    assert frame[0] == crypto.FORMAT_VERSION and int.from_bytes(frame[1:5], "little") == 7
    assert len(frame) == len(b"hello world") + crypto.FRAME_OVERHEAD
    assert crypto.frame_header(frame) == (crypto.FORMAT_VERSION, 7, 0)
    assert crypto.open_frame(key, frame, aad) == b"hello world"
    kr = Keyring()
    kr.add("t1", 7, key)
    assert crypto.open_frame(kr, frame, aad, tenant="t1") == b"hello world"
    with pytest.raises(KeyUnavailable):
        crypto.open_frame(kr, frame, aad, tenant="t2")
    with pytest.raises(DecryptError):
        crypto.open_frame(generate_key(), frame, aad)
    with pytest.raises(DecryptError):
        crypto.open_frame(key, frame, aad + b"x")
    with pytest.raises(DecryptError):
        crypto.open_frame(key, frame[:10], aad)
    with pytest.raises(DecryptError):
        crypto.open_frame(key, bytes([crypto.FORMAT_VERSION + 1]) + frame[1:], aad)
    with pytest.raises(DecryptError):
        crypto.open_frame(key, bytes([1]) + frame[1:], aad)  # format 1 frames are no longer opened


def test_associated_data_is_canonical_and_binds_every_field():
    base = dict(object_key=b"k", ns_digest=b"n", layout={"a": 1, "b": "x"}, tenant="t", key_version=1, format_version=1)
    ad = crypto.associated_data(**base)
    assert crypto.associated_data(**{**base, "layout": {"b": "x", "a": 1}}) == ad  # mapping order irrelevant
    for field, other in [("object_key", b"k2"), ("ns_digest", b"n2"), ("layout", {"a": 2, "b": "x"}),
                         ("tenant", "t2"), ("key_version", 2), ("format_version", 2), ("expires", 1)]:  # fmt: skip
        assert crypto.associated_data(**{**base, field: other}) != ad, field
    # length-prefixed: moving bytes between fields changes the encoding
    assert crypto.associated_data(**{**base, "object_key": b"kn", "ns_digest": b""}) != ad


def test_keyring_versions_active_drop_and_no_key_in_repr():
    kr = Keyring()
    k1, k2 = generate_key(), generate_key()
    assert kr.active("t") is None
    kr.add("t", 1, k1)
    kr.add("t", 2, k2)
    assert kr.active("t") == (2, k2) and kr.get("t", 1) == k1 and kr.versions("t") == [2, 1]
    assert ("t", 1) in kr and ("t", 3) not in kr
    assert k1.hex() not in repr(kr) and str(k1) not in repr(kr)
    assert kr.drop("t", 2) and not kr.drop("t", 2)
    assert kr.active("t") == (1, k1)
    assert kr.drop_tenant("t") == 1 and kr.active("t") is None
    with pytest.raises(ValueError):
        kr.add("t", 1, b"short")
    with pytest.raises(TypeError):
        import pickle

        pickle.dumps(kr)

    def churn(i):
        for v in range(200):
            kr.add(f"x{i}", v, k1)
            kr.active(f"x{i}")
            kr.drop(f"x{i}", v)

    threads = [threading.Thread(target=churn, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert kr.tenants() == []


# ====================================================================== backends
def test_open_backend_urls(tmp_path, redis_up):
    assert open_backend("none") is None and open_backend("NONE") is None
    fs = open_backend(f"file://{tmp_path}/l3?fsync=0")
    assert isinstance(fs, FileBackend) and not fs.fsync and fs.root == str(tmp_path / "l3")
    hidden = open_backend(f"redis://:secret@127.0.0.1:{redis_up.port}/0")  # opening never connects
    assert "secret" not in hidden.url and "secret" not in repr(hidden)
    r = open_backend(f"redis://127.0.0.1:{redis_up.port}/0?timeout=0.3&prefix=x:")
    assert r.socket_timeout == 0.3 and r.connect_timeout == 0.3 and r.prefix == "x:"
    r.put("a/b", b"1")
    assert redis_up.client().get(b"x:a/b") == b"1"
    for bad in ("", "ftp://x", "file://relative/path"):
        with pytest.raises(ValueError):
            open_backend(bad)


@pytest.mark.parametrize("name", ["../x", "/abs", "a//b", "a/../b", ".hidden", "a/.tmp", "a\\b", "a\x00b", ""])
def test_backend_names_are_validated(tmp_path, name):
    backend = FileBackend(tmp_path / "l3")
    with pytest.raises(ValueError):
        check_name(name)
    with pytest.raises(ValueError):
        backend.put(name, b"x")
    with pytest.raises(ValueError):
        backend.get(name)


def test_backend_contract(raw):
    b = raw.backend
    assert b.get("a/b/c") is None and not b.exists("a/b/c") and not b.delete("a/b/c")
    b.put("a/b/c", b"123")
    b.put("a/b/c", b"1234")  # atomic replace
    b.put("a/bb/d", b"56")
    b.put("z/e", b"7")
    assert b.get("a/b/c") == b"1234" and b.exists("a/b/c") and not b.exists("a/b")
    listed = sorted((i.name, i.size) for i in b.list("a/"))
    assert listed == [("a/b/c", 4), ("a/bb/d", 2)]
    assert sorted(i.name for i in b.list("a/b/")) == ["a/b/c"]  # "a/b/" does not match "a/bb/"
    assert sorted(i.name for i in b.list("a/b")) == ["a/b/c", "a/bb/d"]  # plain string prefix
    assert all(abs(i.mtime - time.time()) < 60 for i in b.list(""))
    assert b.usage() == 7
    assert b.delete_prefix("a/") == (2, 6)
    assert [i.name for i in b.list("")] == ["z/e"]
    assert b.delete("z/e") and b.usage() == 0


def test_fs_backend_modes_and_temp_files_are_invisible(tmp_path):
    root = tmp_path / "l3"
    b = FileBackend(root)
    b.put("t/m/r/v1/ab", b"x" * 10)
    assert oct(os.stat(root).st_mode & 0o777) == "0o700"
    assert oct(os.stat(root / "t" / "m").st_mode & 0o777) == "0o700"
    assert oct(os.stat(root / "t/m/r/v1/ab").st_mode & 0o777) == "0o600"
    (root / "t/m/r/v1/.ab.tmp-0123456789abcdef").write_bytes(b"partial")
    assert [i.name for i in b.list("")] == ["t/m/r/v1/ab"] and b.usage() == 10
    assert b.sweep_temp(3600) == 0  # fresh: may belong to a write in progress
    assert b.sweep_temp(0, now=time.time() + 1) == 1
    assert not (root / "t/m/r/v1/.ab.tmp-0123456789abcdef").exists()


# ====================================================================== round trips
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_bytes_exact(raw, dtype):
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype=dtype)
    kr = _keyring("t1")
    store = RemoteStore(raw.backend, kr, layout, chunk_blocks=CB)
    ns, tokens, hashes, kv = _request(1, 3 * CB + 2, layout=layout)
    tag = _tag(ns)
    assert _put_all(store, hashes, tokens, tag, kv) == 3
    assert store.probe(hashes, tag) == 3 * CB
    got = store.get(hashes, tokens, tag, len(hashes))
    assert got.kv.dtype == layout.torch_dtype and got.kv.shape == (3 * CB, *layout.page_shape)
    assert torch.equal(got.kv.view(torch.uint8), kv[: 3 * CB].contiguous().view(torch.uint8))  # bit-exact
    assert got.stopped == "miss"  # the last 2 blocks do not fill a chunk
    part = store.get(hashes, tokens, tag, 2 * CB + 1, first_block=CB + 1)
    assert torch.equal(part.kv, kv[CB + 1 : 2 * CB + 1]) and part.stopped is None
    assert store.stats["hits"] == 3 + 2 and store.stats["objects_written"] == 3
    assert store.stats["bytes_in"] > 3 * CB * layout.bytes_per_block
    assert store.usage_by_tenant() == {"t1": store.stats["bytes_in"]}
    store.check_integrity()


def test_default_chunk_is_sixteen_blocks(raw):
    store = RemoteStore(raw.backend, _keyring("t1"), LAYOUT)
    assert store.chunk_blocks == 16 and store.chunk_tokens == 256
    ns, tokens, hashes, kv = _request(2, 40)
    tag = _tag(ns)
    assert _put_all(store, hashes, tokens, tag, kv) == 2
    assert store.probe(hashes, tag) == 32
    assert torch.equal(store.get(hashes, tokens, tag, 40).kv, kv[:32])


def test_two_processes_share_one_backend(raw):
    """A chunk written by another process (its own keyring holding the same data key, as the control
    plane gives every worker) is found and loaded here."""
    key = generate_key()
    url = f"file://{raw.backend.root}" if raw.kind == "fs" else raw.server.url
    assert _child(url, key, seed=3, mode="complete").wait(60) == 0
    ns, tokens, hashes, kv = _request(3, 2 * CB)
    store = _store(raw, _keyring("t1", key=key))
    tag = _tag(ns)
    assert store.probe(hashes, tag) == 2 * CB
    got = store.get(hashes, tokens, tag, 2 * CB)
    assert got.stopped is None and torch.equal(got.kv, kv)
    assert store.usage_by_tenant(refresh=True)["t1"] > 0


def test_duplicates_written_once_and_persist_or_key_gate_writes(raw):
    store = _store(raw, _keyring("t1"))
    ns, tokens, hashes, kv = _request(4, CB)
    tag = _tag(ns)
    assert store.put_chunk(hashes, tokens, tag, kv)
    assert not store.put_chunk(hashes, tokens, tag, kv)
    assert store.stats["duplicates"] == 1 and store.stats["objects_written"] == 1
    # persist False (prompt_cache_retention "in_memory", or the tenant forbids persistence): nothing written
    ns2, tokens2, hashes2, kv2 = _request(5, CB)
    assert not store.put_chunk(hashes2, tokens2, _tag(ns2, persist=False), kv2)
    # a tenant without an active data key: nothing written
    assert not store.put_chunk(hashes2, tokens2, _tag(ns2, owner="nokey"), kv2)
    assert store.stats["skipped"] == 2
    assert [i.name for i in raw.backend.list("")] == _names(store, tag, hashes)


def test_other_tokens_under_the_same_hashes_are_never_served(raw):
    store = _store(raw, _keyring("t1"))
    ns, tokens, hashes, kv = _request(6, CB)
    tag = _tag(ns)
    store.put_chunk(hashes, tokens, tag, kv)
    wrong = list(tokens)
    wrong[5] += 1
    got = store.get(hashes, wrong, tag, CB)
    assert got.kv.shape[0] == 0 and got.stopped == "corrupt" and store.stats["corrupt"] == 1


# ====================================================================== retention, quotas, deletes
def test_retention_on_read_and_sweep(raw):
    now = [time.time()]
    kr = _keyring("t1", "t2")
    store = _store(raw, kr, clock=lambda: now[0])
    ns, tokens, hashes, kv = _request(7, CB)
    old = _tag(ns, owner="t1")
    store.put_chunk(hashes, tokens, old, kv, created=now[0] - 100)
    assert store.get(hashes, tokens, old, CB, retention_seconds=1000).stopped is None
    got = store.get(hashes, tokens, old, CB, retention_seconds=50)
    assert got.kv.shape[0] == 0 and got.stopped == "miss" and store.stats["expired"] == 1
    other = _tag(ns, owner="t2")
    store.put_chunk(hashes, tokens, other, kv)
    size = store.stats["bytes_in"] // 2
    now[0] += 100  # both objects are now >= 100 s old by their backend write time
    assert store.sweep({"t1": 50}, None) == (1, size)
    assert store.count_scope(tenant="t1") == (0, 0) and store.count_scope(tenant="t2")[0] == 1
    assert store.usage_by_tenant() == {"t2": raw.backend.usage()}
    assert store.sweep({}, 3600) == (0, 0)
    assert store.sweep({"t2": None}, 10) == (0, 0)  # None keeps
    assert store.sweep({}, 10)[0] == 1 and raw.backend.usage() == 0


def test_capacity_is_shared_fairly_between_tenants(raw):
    kr = _keyring("a", "b")
    probe = _store(raw, _keyring("x"))
    ns, tokens, hashes, kv = _request(8, 10 * CB)
    assert probe.put_chunk(hashes[:CB], tokens[: CB * 16], _tag(ns, owner="x"), kv[:CB])
    size = probe.stats["bytes_in"]
    raw.backend.delete_prefix("")
    store = _store(raw, kr, capacity_bytes=4 * size)
    ta, tb = _tag(ns, owner="a"), _tag(ns, owner="b")
    assert _put_all(store, hashes[: 4 * CB], tokens[: 4 * CB * 16], ta, kv[: 4 * CB]) == 4  # a fills L3
    a_names = _names(store, ta, hashes[: 4 * CB])
    # b writes 2: a is over its share (2 of 4), so a's OLDEST go first
    assert _put_all(store, hashes[: 2 * CB], tokens[: 2 * CB * 16], tb, kv[: 2 * CB]) == 2
    assert [n for n in a_names if raw.backend.exists(n)] == a_names[2:]
    # a floods: it evicts its own objects, never b's share
    off = 4 * CB
    assert _put_all(store, hashes[off : off + 4 * CB][: 4 * CB], tokens[off * 16 : (off + 4 * CB) * 16], ta,
                    kv[off : off + 4 * CB]) == 4  # fmt: skip
    assert store.usage_by_tenant() == {"a": 2 * size, "b": 2 * size}
    assert store.count_scope(tenant="b") == (2, 2 * size)
    assert raw.backend.usage() == 4 * size and store.stats["evicted"] == 6
    store.check_integrity()
    # b may grow into the share a no longer needs? No: a holds exactly its share, nobody is over it
    # except b's new object itself, and b has older objects, so b evicts its own
    assert store.put_chunk(hashes[8 * CB : 9 * CB], tokens[8 * CB * 16 : 9 * CB * 16], tb, kv[8 * CB : 9 * CB])
    assert store.usage_by_tenant() == {"a": 2 * size, "b": 2 * size}
    # an object larger than the whole capacity is refused
    tiny = _store(raw, kr, capacity_bytes=size - 1)
    assert not tiny.put_chunk(hashes[9 * CB :], tokens[9 * CB * 16 :], ta, kv[9 * CB :])
    assert tiny.stats["rejected"] == 1


def test_tenant_limit_evicts_own_oldest_and_refuses_what_cannot_fit(raw):
    store = _store(raw, _keyring("a", "b"))
    ns, tokens, hashes, kv = _request(9, 5 * CB)
    ta, tb = _tag(ns, owner="a"), _tag(ns, owner="b")
    assert _put_all(store, hashes[:CB], tokens[: CB * 16], tb, kv[:CB]) == 1
    size = store.stats["bytes_in"]
    store.set_tenant_limit("a", 2 * size)
    assert _put_all(store, hashes, tokens, ta, kv) == 5
    names = _names(store, ta, hashes)
    assert [n for n in names if raw.backend.exists(n)] == names[3:]
    assert store.usage_by_tenant() == {"a": 2 * size, "b": size}
    store.set_tenant_limit("a", size - 1)
    ns2, tokens2, hashes2, kv2 = _request(10, CB)
    assert not store.put_chunk(hashes2, tokens2, _tag(ns2, owner="a"), kv2)
    assert store.stats["rejected"] == 1
    store.set_tenant_limit("a", size)  # lowered: the sweep trims a to its limit
    assert store.sweep({}, None) == (1, size)
    assert store.usage_by_tenant() == {"a": size, "b": size}
    store.set_tenant_limit("a", None)
    assert store.put_chunk(hashes2, tokens2, _tag(ns2, owner="a"), kv2)


def test_delete_and_count_by_scope(raw):
    kr = _keyring("t1", "t2")
    kr.add("t1", 2, generate_key())  # t1 rotated: new objects under v2
    store = _store(raw, kr)
    ns, tokens, hashes, kv = _request(11, CB)
    layout = [("t1", "m1", "r1"), ("t1", "m1", "r2"), ("t1", "m2", "r1"), ("t2", "m1", "r1"), ("t2", "m2", "r1")]
    for owner, model, rev in layout:
        assert store.put_chunk(hashes, tokens, _tag(ns, owner, model, rev), kv)
    size = raw.backend.usage() // 5
    assert store.count_scope() == (5, 5 * size)
    assert store.count_scope(tenant="t1", key_version=2) == (3, 3 * size)
    assert store.count_scope(tenant="t1", key_version=1) == (0, 0)
    assert store.count_scope(model="m2") == (2, 2 * size)  # across tenants (filtered listing)
    assert store.delete_scope(tenant="t1", model="m1", revision="r2") == (1, size)  # rollout
    assert store.delete_scope(model="m2") == (2, 2 * size)
    assert store.delete_scope(tenant="t1") == (1, size)  # tenant flush / offboarding
    assert store.count_scope(tenant="t1") == (0, 0) and "t1" not in store.usage_by_tenant()
    tag2 = _tag(ns, "t2", "m1", "r1")
    assert store.get(hashes, tokens, tag2, CB).stopped is None  # the other tenant still hits
    assert store.get(hashes, tokens, _tag(ns, "t1", "m1", "r1"), CB).stopped == "miss"
    assert store.delete_scope() == (1, size) and raw.backend.usage() == 0
    store.check_integrity()


def test_names_escape_every_component():
    key = bytes(range(32))
    name = object_name("org/../x", "m.1", "", 7, key)
    check_name(name)
    assert name.count("/") == 4
    assert parse_name(name) == ("org/../x", "m.1", "", 7, key)
    assert parse_name("not/an/object") is None
    long_name = object_name("t" * 500, "m", "r", 1, key)
    check_name(long_name)


# ====================================================================== F1: backend down
def _timed(fn):
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0


def test_f1_redis_stopped_is_a_bounded_counted_miss_and_l3_resumes(redis_up):
    """Defence: BackendUnavailable is caught and turned into a miss (without it, probe/get raise)."""
    backend = open_backend(redis_up.url)
    store = _store(backend, _keyring("t1"), retry_after_seconds=0.2)
    ns, tokens, hashes, kv = _request(12, 2 * CB)
    tag = _tag(ns)
    assert _put_all(store, hashes, tokens, tag, kv) == 2
    redis_up.stop()
    n, dt = _timed(lambda: store.probe(hashes, tag))
    assert n == 0 and dt < 1.0
    got, dt = _timed(lambda: store.get(hashes, tokens, tag, 2 * CB))
    assert got.kv.shape[0] == 0 and got.stopped == "miss" and dt < 1.0
    assert not store.put_chunk(hashes[:CB], tokens[: CB * 16], tag, kv[:CB])
    assert store.stats["failures"] >= 1 and store.stats["failures"] + store.stats["unavailable"] >= 3
    with pytest.raises(BackendUnavailable):
        store.count_scope(tenant="t1")  # a flush job must know it did not happen
    redis_up.start()  # same port; the server comes back empty
    time.sleep(0.25)
    assert _put_all(store, hashes, tokens, tag, kv) == 2
    assert store.probe(hashes, tag) == 2 * CB
    assert torch.equal(store.get(hashes, tokens, tag, 2 * CB).kv, kv)
    backend.close()


def _f1_fs(tmp_path, break_it, restore):
    root = tmp_path / "l3"
    backend = FileBackend(root)
    store = _store(backend, _keyring("t1"), retry_after_seconds=0.05)
    ns, tokens, hashes, kv = _request(13, 2 * CB)
    tag = _tag(ns)
    assert _put_all(store, hashes, tokens, tag, kv) == 2
    break_it(root)
    try:
        n, dt = _timed(lambda: store.probe(hashes, tag))
        assert n == 0 and dt < 1.0
        time.sleep(0.06)
        got, dt = _timed(lambda: store.get(hashes, tokens, tag, 2 * CB))
        assert got.kv.shape[0] == 0 and got.stopped == "miss" and dt < 1.0
        time.sleep(0.06)
        assert not store.put_chunk(hashes[:CB], tokens[: CB * 16], _tag(ns, revision="r9"), kv[:CB])
        assert store.stats["failures"] == 3 and store.stats["corrupt"] == 0
        with pytest.raises(BackendUnavailable):
            backend.usage()
    finally:
        restore(root)
    time.sleep(0.06)
    assert store.probe(hashes, tag) == 2 * CB  # resumes, and the objects survived
    assert torch.equal(store.get(hashes, tokens, tag, 2 * CB).kv, kv)


def test_f1_fs_root_replaced_by_a_file_is_a_bounded_counted_miss_and_l3_resumes(tmp_path):
    """The directory is unusable (here: its path is a file, which blocks root too). Defence: every
    OSError is BackendUnavailable and a miss, not an exception and not 'object missing'."""

    def break_it(root):
        os.rename(root, str(root) + ".away")
        root.write_bytes(b"not a directory")

    def restore(root):
        os.unlink(root)
        os.rename(str(root) + ".away", root)

    _f1_fs(tmp_path, break_it, restore)


@pytest.mark.skipif(os.geteuid() == 0, reason="running as root: chmod 000 does not block root's reads "
                    "(the root-replaced-by-a-file test covers the unreadable directory)")  # fmt: skip
def test_f1_fs_directory_chmod_000_is_a_bounded_counted_miss_and_l3_resumes(tmp_path):
    _f1_fs(tmp_path, lambda root: os.chmod(root, 0), lambda root: os.chmod(root, 0o700))


# ====================================================================== F2: slow backend
def test_f2_paused_redis_returns_a_miss_within_the_socket_timeout(redis_up):
    """Defence: short socket timeouts, no retries, then the backend is skipped for a while. Without
    them the call waits out the 2 s pause."""
    backend = open_backend(redis_up.url)  # default 0.2 s timeouts
    store = _store(backend, _keyring("t1"), retry_after_seconds=0.5)
    ns, tokens, hashes, kv = _request(14, 2 * CB)
    tag = _tag(ns)
    assert _put_all(store, hashes, tokens, tag, kv) == 2
    t_pause = time.monotonic()
    redis_up.client().client_pause(2000)
    got, dt = _timed(lambda: store.get(hashes, tokens, tag, 2 * CB))
    assert got.kv.shape[0] == 0 and got.stopped == "miss"
    assert dt < 0.6, dt
    assert store.stats["failures"] == 1
    n, dt = _timed(lambda: store.probe(hashes, tag))  # skipped while the backend is known bad
    assert n == 0 and dt < 0.05 and store.stats["unavailable"] == 1
    time.sleep(0.55)
    n, dt = _timed(lambda: store.probe(hashes, tag))  # tried again: still paused, bounded again
    assert n == 0 and dt < 0.6 and store.stats["failures"] == 2
    time.sleep(max(0.0, 2.1 - (time.monotonic() - t_pause)))
    time.sleep(0.5)
    assert store.probe(hashes, tag) == 2 * CB
    assert torch.equal(store.get(hashes, tokens, tag, 2 * CB).kv, kv)
    backend.close()


# ====================================================================== F3: crash mid-write
_CHILD = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {repo!r})
    from cachecore.crypto import Keyring
    from cachecore.tiers.backends import open_backend
    from tests.test_l3 import CB, LAYOUT, _put_all, _request, _tag
    from cachecore.tiers.remote import RemoteStore
    url, key, seed, mode, marker = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    backend = open_backend(url)
    if mode == "hang":
        def hang(tmp):
            with open(marker + ".part", "w") as f:
                f.write(tmp)
            os.replace(marker + ".part", marker)
            time.sleep(600)
        backend.before_rename = hang
    kr = Keyring()
    kr.add("t1", 1, key)
    store = RemoteStore(backend, kr, LAYOUT, chunk_blocks=CB)
    ns, tokens, hashes, kv = _request(seed, 2 * CB)
    assert _put_all(store, hashes, tokens, _tag(ns), kv) == 2
    """
)


def _child(url: str, key: bytes, *, seed: int, mode: str, marker: str = "-") -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": REPO}
    script = _CHILD.format(repo=REPO)
    return subprocess.Popen([sys.executable, "-c", script, url, key.hex(), str(seed), mode, marker], env=env, cwd=REPO)


def test_f3_writer_killed_between_write_and_rename_leaves_nothing_readable(tmp_path):
    """Defence: write to a temporary name, rename last; readers and listings ignore temporary files.
    Without it the killed writer would leave a partial object under the final name."""
    root = tmp_path / "l3"
    key = generate_key()
    marker = tmp_path / "marker"
    child = _child(f"file://{root}", key, seed=15, mode="hang", marker=str(marker))
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert child.poll() is None and time.monotonic() < deadline, "the writer died before the rename"
            time.sleep(0.02)
        tmp = marker.read_text()
        assert os.path.exists(tmp) and os.path.getsize(tmp) > 0
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGKILL
    # The killed write: its bytes sit in a temporary file, never under the final name.
    with open(tmp, "rb") as f:
        partial = f.read()
    with open(tmp, "wb") as f:  # and make the leftover truly partial (torn), as a crash mid-write() would
        f.write(partial[: len(partial) // 2])
    backend = FileBackend(root)
    store = _store(backend, _keyring("t1", key=key))
    ns, tokens, hashes, kv = _request(15, 2 * CB)
    tag = _tag(ns)
    assert [i.name for i in backend.list("")] == [] and backend.usage() == 0
    assert store.probe(hashes, tag) == 0
    got = store.get(hashes, tokens, tag, 2 * CB)
    assert got.kv.shape[0] == 0 and got.stopped == "miss" and store.stats["corrupt"] == 0
    assert store.usage_by_tenant() == {}
    # A later write of the same chunk succeeds; a later sweep cleans the leftover.
    assert _put_all(store, hashes, tokens, tag, kv) == 2
    assert torch.equal(store.get(hashes, tokens, tag, 2 * CB).kv, kv)
    store.sweep({}, None)
    assert os.path.exists(tmp)  # too fresh: it might be a write in progress
    store.temp_grace_seconds = 0.0
    store.clock = lambda: time.time() + 1
    store.sweep({}, None)
    assert not os.path.exists(tmp) and store.stats["temp_removed"] == 1


# ====================================================================== F4: damaged objects
def _flip(i):
    def f(frame: bytes) -> bytes:
        b = bytearray(frame)
        b[i] ^= 0x10
        return bytes(b)

    return f


DAMAGES = {
    "truncated_half": lambda f, other: f[: len(f) // 2],
    "truncated_tag": lambda f, other: f[:-1],
    "truncated_to_header": lambda f, other: f[:8],
    "empty": lambda f, other: b"",
    "torn": lambda f, other: f[: len(f) // 2] + other[len(f) // 2 :],  # two writes interleaved
    "bitflip_ciphertext": lambda f, other: _flip(len(f) // 2)(f),
    "bitflip_expiry": lambda f, other: _flip(6)(f),  # the expiry is authenticated with the frame
    "bitflip_nonce": lambda f, other: _flip(crypto.HEADER_BYTES + 2)(f),
    "bitflip_tag": lambda f, other: _flip(len(f) - 1)(f),
    "wrong_format_version": lambda f, other: bytes([crypto.FORMAT_VERSION + 1]) + f[1:],
    "other_key_version": lambda f, other: f[:1] + (2).to_bytes(4, "little") + f[5:],
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_f4_damaged_object_is_a_miss_quarantined_and_counted_corrupt(raw, damage):
    """Defence: AES-GCM authentication + format/version checks, then quarantine. Without
    quarantine the same object is retried (and counted corrupt) on every read."""
    kr = _keyring("t1")
    kr.add("t1", 2, kr.get("t1", 1))  # v2 held too, with the same key: only the header check stops it
    store = _store(raw, kr)
    kr.drop("t1", 2)
    ns, tokens, hashes, kv = _request(16, 3 * CB)
    tag = _tag(ns)
    assert _put_all(store, hashes, tokens, tag, kv) == 3
    kr.add("t1", 2, kr.get("t1", 1))
    names = _names(store, tag, hashes)
    raw.set(names[1], DAMAGES[damage](raw.get(names[1]), raw.get(names[2])))
    got = store.get(hashes, tokens, tag, 3 * CB)
    assert got.stopped == "corrupt"
    assert torch.equal(got.kv, kv[:CB])  # the chunk before is delivered, nothing from or after the bad one
    assert store.stats["corrupt"] == 1 and store.stats["quarantined"] == 1
    assert not raw.backend.exists(names[1])  # quarantined: not retried forever
    again = store.get(hashes, tokens, tag, 3 * CB)
    assert again.stopped == "miss" and store.stats["corrupt"] == 1
    assert store.probe(hashes, tag) == CB
    assert store.put_chunk(hashes[CB : 2 * CB], tokens[CB * 16 : 2 * CB * 16], tag, kv[CB : 2 * CB])  # rewritable
    assert torch.equal(store.get(hashes, tokens, tag, 3 * CB).kv, kv)


# ====================================================================== F5: moved objects
MOVES = ["other_key", "other_tenant", "other_model", "other_revision", "other_namespace"]


@pytest.mark.parametrize("move", MOVES)
@pytest.mark.parametrize("copy", [False, True], ids=["rename", "copy"])
def test_f5_object_moved_elsewhere_fails_on_associated_data(raw, move, copy):
    """Every reader below holds the SAME data key as the writer and asks with its own real tokens, so
    only the associated data (object key, tenant, namespace digest) can stop it."""
    key = generate_key()
    kr = _keyring("t1", "t2", key=key)
    store = _store(raw, kr)
    ns, tokens, hashes, kv = _request(17, CB)
    tag = _tag(ns)
    assert store.put_chunk(hashes, tokens, tag, kv)
    if move == "other_key":  # same tokens, another request salt: another chain, same token ids
        ns2, tokens2, hashes2, _ = _request(17, CB, request_salt=b"end-user-2")
        assert tokens2 == tokens and hashes2 != hashes
        reader = tag
    elif move == "other_namespace":  # another scope salt (another share group): another ns digest
        ns2, tokens2, hashes2, _ = _request(17, CB, salt=b"\x02" * 32)
        reader = _tag(ns2)
    else:
        ns2, tokens2, hashes2 = ns, tokens, hashes
        reader = {
            "other_tenant": _tag(ns, owner="t2"),
            "other_model": _tag(ns, model="m2"),
            "other_revision": _tag(ns, revision="r2"),
        }[move]
    src = _names(store, tag, hashes)[0]
    dst = _names(store, reader, hashes2)[0]
    assert src != dst
    raw.move(src, dst, copy=copy)
    assert store.probe(hashes2, reader) == CB  # the metadata says yes ...
    got = store.get(hashes2, tokens2, reader, CB)
    assert got.kv.shape[0] == 0 and got.stopped == "corrupt"  # ... but the bytes never decrypt
    assert store.stats["corrupt"] == 1 and not raw.backend.exists(dst)
    if copy:  # the original still serves its rightful owner
        assert torch.equal(store.get(hashes, tokens, tag, CB).kv, kv)


def test_f5_same_name_read_in_another_namespace_fails_on_the_namespace_digest(raw):
    """The name (tenant/model/revision/version/chain hash) is the same; only the reader's namespace
    digest differs (a chain hash reused under another namespace). Defence: ns_digest in the AD."""
    store = _store(raw, _keyring("t1"))
    ns, tokens, hashes, kv = _request(20, CB)
    assert store.put_chunk(hashes, tokens, _tag(ns), kv)
    other = _ns(b"\x03" * 32)
    got = store.get(hashes, tokens, _tag(other), CB)
    assert got.kv.shape[0] == 0 and got.stopped == "corrupt" and store.stats["corrupt"] == 1


# ====================================================================== F6: shredded key version
def test_f6_shredded_key_version_makes_every_object_unreadable(raw):
    """Defence: the data key exists only wrapped by the master key (control plane) and unwrapped in
    keyrings; shredding deletes both. The objects' bytes are still there, the master key too."""
    master = generate_key()
    wrapped_db = {("t1", 1): crypto.wrap_key(master, generate_key(), tenant="t1", version=1)}
    kr = Keyring()
    kr.add("t1", 1, crypto.unwrap_key(master, wrapped_db[("t1", 1)], tenant="t1", version=1))
    store = _store(raw, kr)
    ns, tokens, hashes, kv = _request(18, 3 * CB)
    tag = _tag(ns)
    assert _put_all(store, hashes, tokens, tag, kv) == 3
    assert torch.equal(store.get(hashes, tokens, tag, 3 * CB).kv, kv)  # control: readable before
    # rotate: v2 becomes active; v1 objects stay readable
    wrapped_db[("t1", 2)] = crypto.wrap_key(master, generate_key(), tenant="t1", version=2)
    kr.add("t1", 2, crypto.unwrap_key(master, wrapped_db[("t1", 2)], tenant="t1", version=2))
    assert store.get(hashes, tokens, tag, 3 * CB).stopped is None
    # crypto-shred v1: delete the wrapped key, every worker drops it
    del wrapped_db[("t1", 1)]
    kr.drop("t1", 1)
    before = raw.backend.usage()
    assert before > 0 and store.count_scope(tenant="t1", key_version=1) == (3, before)  # bytes still there
    got = store.get(hashes, tokens, tag, 3 * CB)
    assert got.kv.shape[0] == 0 and got.stopped == "miss"
    assert store.probe(hashes, tag) == 0
    assert store.stats["misses"] >= 1 and store.stats["corrupt"] == 0
    # Not even the master key and the "database" (wrapped keys that remain) open them.
    frame = raw.get(_names(store, tag, hashes)[0])
    for (t, v), w in wrapped_db.items():
        candidate = crypto.unwrap_key(master, w, tenant=t, version=v)
        aad = crypto.associated_data(object_key=_names(store, tag, hashes)[0].encode(), ns_digest=ns.digest,
                                     layout=LAYOUT.canonical(), tenant="t1", key_version=1,
                                     format_version=crypto.FORMAT_VERSION)  # fmt: skip
        with pytest.raises(DecryptError):
            crypto.open_frame(candidate, frame, aad)
    # Not quarantined as corrupt (another worker may not have the key yet): the shred job deletes the bytes.
    assert raw.backend.usage() == before
    assert store.delete_scope(tenant="t1", key_version=1) == (3, before)
    assert store.count_scope(tenant="t1") == (0, 0) and store.usage_by_tenant() == {}
    # new writes use v2 and are readable
    assert _put_all(store, hashes, tokens, tag, kv) == 3
    assert store.count_scope(tenant="t1", key_version=2)[0] == 3
    assert torch.equal(store.get(hashes, tokens, tag, 3 * CB).kv, kv)


# ====================================================================== no plaintext at rest
def test_stored_frames_hold_no_plaintext_and_do_not_compress(raw):
    """Defence: encryption. Without it the frame holds the token ids and the KV bytes in clear, and a
    compressible KV (here: a repetitive pattern) compresses."""
    store = _store(raw, _keyring("t1"))
    ns, tokens, hashes, _ = _request(19, CB)
    kv = (torch.arange(CB * LAYOUT.bytes_per_block // 4) % 7).float().view(CB, *LAYOUT.page_shape)
    assert store.put_chunk(hashes, tokens, _tag(ns), kv)
    frame = raw.get(_names(store, _tag(ns), hashes)[0])
    tok = np.asarray(tokens, dtype="<u4").tobytes()
    for i in range(0, len(tokens) - 2):
        assert tok[4 * i : 4 * i + 12] not in frame  # no 3 consecutive token ids
    raw_kv = kv.contiguous().view(torch.uint8).numpy().tobytes()
    assert len(zlib.compress(raw_kv)) < len(raw_kv) / 10  # the plaintext compresses a lot ...
    for off in range(0, len(raw_kv) - 64, 4093):
        assert raw_kv[off : off + 64] not in frame
    assert len(zlib.compress(frame, 9)) >= 0.99 * len(frame)  # ... the frame does not


# ====================================================================== concurrency
def test_concurrent_writers_and_readers_in_threads(raw):
    """put_chunk reuses per-thread buffers: threads writing and reading at once never mix bytes."""
    store = _store(raw, _keyring("t1"))
    reqs = [_request(100 + i, 3 * CB) for i in range(4)]
    errors: list[BaseException] = []

    def work(ns, tokens, hashes, kv):
        try:
            tag = _tag(ns)
            for _ in range(2):  # the second round finds every chunk already there
                _put_all(store, hashes, tokens, tag, kv)
                got = store.get(hashes, tokens, tag, 3 * CB)
                assert got.stopped is None and torch.equal(got.kv, kv)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=r) for r in reqs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert store.stats["objects_written"] == 12 and store.stats["duplicates"] == 12
    store.check_integrity()


def test_seal_and_open_in_place_buffers():
    key = generate_key()
    out = bytearray(5 + crypto.FRAME_OVERHEAD)
    frame = crypto.seal(key, version=1, aad=b"a", plaintext=b"hello", out=out)
    assert frame is out
    dest = bytearray(5)
    assert crypto.open_frame(key, out, b"a", out=dest) is dest and dest == b"hello"
    with pytest.raises(ValueError):
        crypto.seal(key, version=1, aad=b"a", plaintext=b"hello", out=bytearray(3))
    with pytest.raises(DecryptError):
        crypto.open_frame(key, out, b"a", out=bytearray(4))


def test_delete_chunk_removes_one_chunk_under_any_held_version(raw):
    kr = _keyring("t1")
    store = _store(raw, kr)
    ns, tokens, hashes, kv = _request(21, 2 * CB)
    tag = _tag(ns)
    assert _put_all(store, hashes, tokens, tag, kv) == 2
    kr.add("t1", 2, generate_key())  # rotated since: the chunk is still found under v1
    assert store.delete_chunk(tag, hashes[CB - 1]) and not store.delete_chunk(tag, hashes[CB - 1])
    assert store.probe(hashes, tag) == 0 and store.count_scope(tenant="t1")[0] == 1
    assert store.gauges()["objects"] == 1
    store.check_integrity()


def test_delete_chunk_announces_the_chunk_key_to_drop_listeners(raw):
    kr = _keyring("t1")
    store = _store(raw, kr)
    dropped: list[tuple[list[bytes], str]] = []
    store.drop_listeners.append(lambda keys, reason: dropped.append((keys, reason)))
    ns, tokens, hashes, kv = _request(22, CB)
    tag = _tag(ns)
    assert _put_all(store, hashes, tokens, tag, kv) == 1
    assert store.delete_chunk(tag, hashes[CB - 1])
    assert dropped == [([hashes[CB - 1]], "flushed")]
    assert not store.delete_chunk(tag, hashes[CB - 1]) and len(dropped) == 1
