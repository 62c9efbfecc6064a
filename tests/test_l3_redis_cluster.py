"""The L3 Redis backend on a Redis Cluster (``redis+cluster://``), against the real three-node cluster of
:mod:`tests.test_l3` (the contract and store tests run there too, as ``raw``'s ``redis-cluster``): the
URL, keys spread over the nodes with an object's two keys in one slot, conditional writes racing
across slots, a node stopped or killed (``BackendUnavailable``, the other nodes still served), a
resharded slot followed, and the encrypted tier round-tripping chunks spread over the nodes.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch
from redis.cluster import RedisCluster

from cachecore.errors import BackendUnavailable
from cachecore.tiers.backends import open_backend
from cachecore.tiers.backends.base import PartialWrite
from cachecore.tiers.backends.redis import RedisBackend
from tests.test_l3 import (  # noqa: F401  (fixtures)
    CB,
    _free_port,
    _keyring,
    _names,
    _request,
    _store,
    _tag,
    redis_cluster,
    redis_cluster_up,
)

NAMES = [f"t1/m/r/v1/{i:04x}" for i in range(48)]


def _node_of(cluster, key: bytes):
    """The port of the node holding ``key``'s slot, as the cluster itself says."""
    client = cluster.client()
    return client.nodes_manager.get_node_from_slot(client.keyslot(key)).port


def _by_node(cluster, backend, names) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for name in names:
        out.setdefault(_node_of(cluster, backend._key(name)), []).append(name)
    return out


# ====================================================================== URLs and keys
def test_cluster_urls_and_key_layout():
    port = _free_port()  # nothing listens there: opening never connects
    b = open_backend(f"redis+cluster://:secret@127.0.0.1:{port}/?timeout=0.3&prefix=x:")
    assert isinstance(b, RedisBackend) and b.cluster and b.socket_timeout == 0.3 and b.prefix == "x:"
    assert b.url == f"redis+cluster://127.0.0.1:{port}/" and "secret" not in repr(b)
    assert b._key("a/b") == b"x:{a/b}" and b._mtime_key(b._key("a/b")) == b"x:.t/{a/b}"
    assert b._name(b"x:{a/b}") == "a/b"
    with pytest.raises(BackendUnavailable):
        b.get("a/b")  # the first call opens the cluster client: nobody there
    assert open_backend(f"rediss+cluster://127.0.0.1:{port}").cluster
    standalone = open_backend(f"redis://127.0.0.1:{port}/0")  # unchanged: existing deployments keep their objects
    assert not standalone.cluster and standalone._key("a/b") == b"strata:l3:a/b"
    for prefix in ("x{", "x}", "{x}:"):  # a hash tag in the prefix would put every key in one slot (or split pairs)
        with pytest.raises(ValueError):
            open_backend(f"redis+cluster://127.0.0.1:{port}/?prefix={prefix}")


def test_objects_spread_over_the_nodes_with_both_keys_of_an_object_in_one_slot(redis_cluster_up):  # noqa: F811
    backend = open_backend(redis_cluster_up.url)
    assert backend.put_new_many([(n, n.encode() * 3) for n in NAMES]) == [True] * len(NAMES)
    nodes = redis_cluster_up.nodes()
    held = [node.dbsize() for node in nodes]
    assert sum(held) == 2 * len(NAMES) and sum(1 for h in held if h) >= 2  # spread over the nodes
    for name in NAMES:
        key = backend._key(name)
        meta = backend._mtime_key(key)
        assert nodes[0].cluster("keyslot", key) == nodes[0].cluster("keyslot", meta)
        owner = nodes[redis_cluster_up.ports.index(_node_of(redis_cluster_up, key))]
        assert owner.exists(key) and owner.exists(meta) and float(owner.get(meta)) > 0
    # listing and prefix deletes scan every primary
    assert sorted(i.name for i in backend.list("")) == NAMES and backend.usage() == sum(3 * len(n) for n in NAMES)
    assert sorted(i.name for i in backend.list("t1/m/r/v1/000")) == NAMES[:16]
    assert backend.exists_many(NAMES[:3] + ["t1/m/r/v1/zz"]) == [True, True, True, False]
    assert backend.delete_prefix("t1/m/r/v1/001") == (16, sum(3 * len(n) for n in NAMES[16:32]))
    assert sorted(i.name for i in backend.list("")) == NAMES[:16] + NAMES[32:]
    assert backend.delete_prefix("") == (32, sum(3 * len(n) for n in NAMES[:16] + NAMES[32:]))
    assert [node.dbsize() for node in nodes] == [0, 0, 0]  # the write times' keys went with them
    backend.close()


# ====================================================================== conditional writes across slots
def test_racing_batches_across_slots_write_each_object_exactly_once_and_whole(redis_cluster_up):  # noqa: F811
    """Eight writers each write the same 24 names (on every node) in one ``put_new_many``. Defence: SET
    NX on both keys in one server-side step per object; without it several writers report a write and
    the last one's bytes replace the first's."""
    names = NAMES[:24]
    writers = 8
    payloads = [[bytes([w]) * 20_000 + name.encode() for name in names] for w in range(writers)]
    results: list[list[bool] | None] = [None] * writers
    start = threading.Barrier(writers)

    def write(w: int) -> None:
        backend = open_backend(redis_cluster_up.url)  # a client of its own, as another process has
        start.wait()
        results[w] = backend.put_new_many(list(zip(names, payloads[w], strict=True)))
        backend.close()

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reader = open_backend(redis_cluster_up.url)
    for i, name in enumerate(names):
        winners = [w for w in range(writers) if results[w][i]]
        assert len(winners) == 1, (name, winners)
        assert reader.get(name) == payloads[winners[0]][i]  # the winner's bytes, whole
    assert len(_by_node(redis_cluster_up, reader, names)) >= 2
    reader.close()


# ====================================================================== resharding
def test_a_slot_moved_to_another_node_is_followed(redis_cluster_up):  # noqa: F811
    """The slot of an object moves to another node (with its keys) after the backend read the slot map.
    Defence: a MOVED reply is followed (the transaction sent again once, a batched command alone);
    without it the object's reads and writes fail until the client reopens."""
    backend = open_backend(redis_cluster_up.url)
    name = NAMES[0]
    assert backend.put_new_many([(n, n.encode()) for n in NAMES[:8]]) == [True] * 8
    client = redis_cluster_up.client()
    key = backend._key(name)
    slot = client.keyslot(key)
    src_port = _node_of(redis_cluster_up, key)
    dst_port = next(p for p in redis_cluster_up.ports if p != src_port)
    nodes = {p: n for p, n in zip(redis_cluster_up.ports, redis_cluster_up.nodes(), strict=True)}
    src, dst = nodes[src_port], nodes[dst_port]
    src_id, dst_id = src.execute_command("CLUSTER MYID").decode(), dst.execute_command("CLUSTER MYID").decode()
    dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
    src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
    keys = src.execute_command("CLUSTER GETKEYSINSLOT", slot, 100)
    assert sorted(k.encode() if isinstance(k, str) else k for k in keys) == sorted([key, backend._mtime_key(key)])
    src.execute_command("MIGRATE", "127.0.0.1", dst_port, "", 0, 5000, "KEYS", *keys)
    for node in (dst, src, *(n for p, n in nodes.items() if p not in (src_port, dst_port))):
        node.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
    out = memoryview(bytearray(64))
    assert backend.get_into(name, out) == len(name) and bytes(out[: len(name)]) == name.encode()  # a transaction
    assert backend.exists_many(NAMES[:8]) == [True] * 8  # a batch
    assert backend.put_new_many([(name, b"other"), (NAMES[8], b"x")]) == [False, True]
    assert backend.delete(name) and not backend.exists(name)
    assert backend.put_new(name, b"again") and backend.get(name) == b"again"
    assert dst.cluster("countkeysinslot", slot) == 2 and src.cluster("countkeysinslot", slot) == 0
    backend.close()


# ====================================================================== the encrypted tier on the cluster
def test_the_l3_tier_round_trips_encrypted_chunks_spread_over_the_nodes(redis_cluster_up):  # noqa: F811
    backend = open_backend(redis_cluster_up.url + "?window=4096")
    store = _store(backend, _keyring("t1", "t2"))
    ns, tokens, hashes, kv = _request(61, 8 * CB)
    for owner in ("t1", "t2"):
        tag = _tag(ns, owner=owner)
        chunks = [(hashes[c * CB : (c + 1) * CB], tokens[c * CB * 16 : (c + 1) * CB * 16], kv[c * CB : (c + 1) * CB])
                  for c in range(8)]  # fmt: skip
        assert store.put_chunks(chunks, tag) == [True] * 8  # one batch over the slots
        assert store.probe(hashes, tag) == 8 * CB
        got = store.get(hashes, tokens, tag, 8 * CB)
        assert got.stopped is None and torch.equal(got.kv.view(torch.uint8), kv.contiguous().view(torch.uint8))
        names = _names(store, tag, hashes)
        assert len(_by_node(redis_cluster_up, backend, names)) >= 2
        frame = redis_cluster_up.client().get(backend._key(names[0]))
        assert kv[:CB].contiguous().view(torch.uint8).numpy().tobytes()[:64] not in frame  # sealed
    assert store.delete_scope(tenant="t1")[0] == 8 and store.count_scope(tenant="t2")[0] == 8
    store.check_integrity()
    backend.close()


# ====================================================================== a node down
def test_a_stopped_node_is_backend_unavailable_and_the_other_nodes_are_still_served(redis_cluster_up, monkeypatch):  # noqa: E501, F811
    """A node that stops answering (SIGSTOP) or is killed: the calls that need it raise
    ``BackendUnavailable`` (one timeout, no retries: no hang), a batch write reports exactly what the
    other nodes wrote, a listing fails rather than being partial, and keys on the other nodes are
    still read. Defence: no retries and per-node results (redis-py's cluster pipeline would send every
    command of the failed node again, one by one, each waiting out the timeout)."""
    backend = open_backend(redis_cluster_up.url + "?timeout=0.2&write_timeout=0.3")
    assert backend.put_new_many([(n, b"v" + n.encode()) for n in NAMES]) == [True] * len(NAMES)
    by_node = _by_node(redis_cluster_up, backend, NAMES)
    down = redis_cluster_up.ports[1]
    up = [p for p in by_node if p != down]
    assert by_node.get(down) and up
    proc = redis_cluster_up.procs[down]
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(BackendUnavailable):
            backend.get(by_node[down][0])
        with pytest.raises(BackendUnavailable):
            backend.get_into(by_node[down][0], memoryview(bytearray(64)))
        sent_alone: list = []  # commands resent one by one after the batch (redis-py's retry path)
        real = RedisCluster.execute_command
        monkeypatch.setattr(RedisCluster, "execute_command", lambda *a, **kw: sent_alone.append(a[1]) or real(*a, **kw))
        with pytest.raises(BackendUnavailable):
            backend.exists_many(NAMES)
        with pytest.raises(BackendUnavailable):
            list(backend.list(""))
        fresh = _by_node(redis_cluster_up, backend, [n + "n" for n in NAMES])
        with pytest.raises(PartialWrite) as failed:
            backend.put_new_many([(n + "n", b"new") for n in NAMES])
        monkeypatch.undo()
        assert sent_alone == []  # the node's timeout was its commands' reply: nothing waited out again
        assert sorted(failed.value.written) == sorted(n for p in fresh if p != down for n in fresh[p])
        assert fresh.get(down) and len(fresh) >= 2
        assert backend.get(by_node[up[0]][0]) == b"v" + by_node[up[0]][0].encode()  # the others still serve
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert backend.get(by_node[down][0]) == b"v" + by_node[down][0].encode()  # resumes, no reconnect needed
    # killed: connections are refused at once
    redis_cluster_up.stop_node(1)
    with pytest.raises(BackendUnavailable):
        backend.get(by_node[down][0])
    with pytest.raises(PartialWrite) as failed:
        backend.put_new_many([(n + "k", b"k") for n in NAMES])
    assert failed.value.written == []  # nothing sent: the dead node's connection failed before any write
    assert backend.exists(by_node[up[0]][0])
    backend.close()
