"""L3 writes and reads at the backend's speed, and the safety they must keep: conditional writes (of
two writers of one object exactly one writes, nothing torn), batched writes that fail part way
(accounting equals the objects present), windowed Redis reads (bigger than a window; a value deleted
or replaced meanwhile is read whole or not at all), batched probes, objects of the earlier Redis
layout, and the engine's chunk writer batching a commit's chunks.

Redis tests run against the real ``redis-server`` of :mod:`tests.test_l3` (a free port, never 6379), and
those that are not about one server (pausing it) against its real Redis Cluster too.
"""

from __future__ import annotations

import os
import secrets
import threading

import pytest
import torch

from cachecore.errors import BackendUnavailable
from cachecore.tiers.backends import open_backend
from cachecore.tiers.backends.base import PartialWrite
from cachecore.tiers.remote import RemoteStore
from tests.test_l3 import (  # noqa: F401  (fixtures)
    CB,
    LAYOUT,
    _keyring,
    _names,
    _request,
    _store,
    _tag,
    raw,
    redis_any,
    redis_cluster,
    redis_cluster_up,
    redis_server,
    redis_up,
)


def _chunks(hashes, tokens, kv, store: RemoteStore) -> list:
    cb, ct = store.chunk_blocks, store.chunk_tokens
    return [(hashes[c * cb : (c + 1) * cb], tokens[c * ct : (c + 1) * ct], kv[c * cb : (c + 1) * cb])
            for c in range(len(hashes) // cb)]


def _present(store: RemoteStore) -> dict[str, int]:
    """Bytes per tenant of the objects the backend really holds (a listing)."""
    out: dict[str, int] = {}
    for info in store.backend.list(""):
        tenant = info.name.split("/", 1)[0]
        out[tenant] = out.get(tenant, 0) + info.size
    return out


def _accounted(store: RemoteStore) -> dict[str, int]:
    """Bytes per (encoded) tenant in the store's own accounting, without re-listing."""
    with store._lock:
        return {t: b for t, b in store._index.usage.items() if b > 0}


# ====================================================================== conditional writes
def test_concurrent_put_new_of_one_name_writes_exactly_once_and_whole(raw):  # noqa: F811
    """Defence: the check and the write are one step (SET NX in one transaction; a hard link). With an
    existence check before a plain put, several writers see 'absent' and each overwrites."""
    payloads = [bytes([i]) * 300_000 + os.urandom(64) for i in range(8)]
    results: list[bool | None] = [None] * len(payloads)
    start = threading.Barrier(len(payloads))

    def write(i: int) -> None:
        start.wait()
        results[i] = raw.backend.put_new("t1/m/r/v1/ab", payloads[i])

    threads = [threading.Thread(target=write, args=(i,)) for i in range(len(payloads))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(True) == 1 and results.count(False) == len(payloads) - 1
    assert raw.get("t1/m/r/v1/ab") == payloads[results.index(True)]  # the winner's bytes, whole
    assert raw.backend.put_new("t1/m/r/v1/ab", b"late") is False  # paired: an existing object is kept
    assert raw.backend.put_new("t1/m/r/v1/cd", b"new") is True and raw.get("t1/m/r/v1/cd") == b"new"
    assert [i.name for i in raw.backend.list("")] != [] and raw.backend.usage() == len(payloads[0]) + 3


def test_two_stores_writing_one_chunk_at_once_write_it_once(raw, monkeypatch):  # noqa: F811
    """Both stores pass the existence probe (forced here: it is what a race does), then race on the
    write. Defence: the conditional write; without it both report a write and the second replaces
    the first. The loser keeps the object in its accounting: it is there."""
    ring = _keyring("t1")
    a = _store(raw, ring)
    b = _store(open_backend(raw.backend.url) if raw.kind != "fs" else raw.backend, ring)
    ns, tokens, hashes, kv = _request(41, CB)
    tag = _tag(ns)
    for store in (a, b):
        monkeypatch.setattr(store.backend, "exists_many", lambda names: [False] * len(names))
    assert a.put_chunk(hashes, tokens, tag, kv) is True
    stored = raw.get(_names(a, tag, hashes)[0])
    assert b.put_chunk(hashes, tokens, tag, kv) is False
    assert raw.get(_names(a, tag, hashes)[0]) == stored  # not replaced
    assert a.stats["objects_written"] == 1 and b.stats["objects_written"] == 0 and b.stats["duplicates"] == 1
    monkeypatch.undo()
    assert torch.equal(b.get(hashes, tokens, tag, CB).kv, kv)
    for store in (a, b):
        store.check_integrity()
        assert _accounted(store) == _present(store)


# ====================================================================== batched writes, failing part way
def test_put_chunks_writes_what_is_missing_and_reports_each(raw):  # noqa: F811
    store = _store(raw, _keyring("t1"))
    ns, tokens, hashes, kv = _request(42, 3 * CB)
    tag = _tag(ns)
    chunks = _chunks(hashes, tokens, kv, store)
    h, t, k = chunks[1]
    assert store.put_chunk(h, t, tag, k) is True
    calls = {"exists_many": 0, "put_new_many": 0}
    for method in calls:
        real = getattr(store.backend, method)

        def counted(*args, _real=real, _name=method, **kw):
            calls[_name] += 1
            return _real(*args, **kw)

        setattr(store.backend, method, counted)
    assert store.put_chunks(chunks, tag) == [True, False, True]
    assert calls == {"exists_many": 1, "put_new_many": 1}  # one probe and one write for the set
    assert store.stats["duplicates"] == 1 and store.stats["objects_written"] == 3
    assert torch.equal(store.get(hashes, tokens, tag, 3 * CB).kv, kv)
    store.check_integrity()
    assert _accounted(store) == _present(store)


def test_a_batch_failing_part_way_keeps_what_was_written_and_accounts_for_it_exactly(tmp_path, monkeypatch):
    """The filesystem writes a batch object by object: the second fails. Defence: PartialWrite names
    what was written, so the store reports it and keeps it accounted, and releases the rest (without
    it, the first is counted as not written while it is there, or the rest stay accounted)."""
    store = _store(open_backend((tmp_path / "l3").as_uri()), _keyring("t1"), retry_after_seconds=0.0)
    ns, tokens, hashes, kv = _request(43, 3 * CB)
    tag = _tag(ns)
    store.refresh()  # the accounting is live from the start
    real, calls = store.backend.put_new, {"n": 0}

    def flaky(name, data):
        calls["n"] += 1
        if calls["n"] == 2:
            raise BackendUnavailable("disk full")
        return real(name, data)

    monkeypatch.setattr(store.backend, "put_new", flaky)
    assert store.put_chunks(_chunks(hashes, tokens, kv, store), tag) == [True, False, False]
    assert store.stats["failures"] == 1 and store.stats["objects_written"] == 1
    names = _names(store, tag, hashes)
    assert [store.backend.exists(n) for n in names] == [True, False, False]
    store.check_integrity()
    assert _accounted(store) == _present(store) != {}
    got = store.get(hashes, tokens, tag, 3 * CB)
    assert got.stopped == "miss" and torch.equal(got.kv, kv[:CB])  # what was written is whole


def test_a_redis_batch_whose_reply_is_lost_is_found_by_the_next_listing(redis_up):  # noqa: F811
    """The transaction times out (the server is paused for writes): whether it ran later, the reply
    does not say. Defence: the store releases its reservations and lists again before its next
    figures, so its accounting equals the objects present either way; whatever is present is whole."""
    backend = open_backend(redis_up.url + "?write_timeout=0.2")
    store = _store(backend, _keyring("t1"), retry_after_seconds=0.0)
    ns, tokens, hashes, kv = _request(44, 2 * CB)
    tag = _tag(ns)
    store.refresh()
    redis_up.client().client_pause(600, all=False)  # WRITE: reads go on, writes wait
    try:
        assert store.put_chunks(_chunks(hashes, tokens, kv, store), tag) == [False, False]
    finally:
        redis_up.client().client_unpause()
    assert store.stats["failures"] == 1 and store.stats["objects_written"] == 0
    assert _accounted(store) == {}  # released
    store.gauges()  # the next figures list the backend again
    assert _accounted(store) == _present(store)
    got = store.get(hashes, tokens, tag, 2 * CB)
    assert got.stopped in (None, "miss") and torch.equal(got.kv, kv[: len(got.kv)])
    backend.close()


def test_put_new_many_reports_a_redis_failure_as_a_partial_write(redis_up):  # noqa: F811
    """A Redis Cluster with a node down: tests/test_l3_redis_cluster.py (no restart of every node here)."""
    backend = open_backend(redis_up.url)
    redis_up.stop()
    try:
        with pytest.raises(PartialWrite) as failed:
            backend.put_new_many([("t1/m/r/v1/aa", b"x"), ("t1/m/r/v1/bb", b"y")])
        assert failed.value.written == [] and isinstance(failed.value, BackendUnavailable)
    finally:
        redis_up.start()
    assert backend.put_new_many([("t1/m/r/v1/aa", b"x"), ("t1/m/r/v1/bb", b"y")]) == [True, True]
    assert backend.put_new_many([("t1/m/r/v1/aa", b"z"), ("t1/m/r/v1/cc", b"w")]) == [False, True]
    assert backend.get("t1/m/r/v1/aa") == b"x"
    backend.close()


# ====================================================================== windowed reads (Redis)
def test_a_value_bigger_than_one_window_is_read_exactly(redis_any):  # noqa: F811
    backend = open_backend(redis_any.url + "?window=4096")
    data = os.urandom(4096 * 10 + 123)
    backend.put("t1/m/r/v1/aa", data)
    out = memoryview(bytearray(len(data)))
    assert backend.get_into("t1/m/r/v1/aa", out) == len(data) and bytes(out) == data
    short = memoryview(bytearray(5000))
    assert backend.get_into("t1/m/r/v1/aa", short) == len(data) and bytes(short) == data[:5000]  # says it is longer
    assert backend.get_into("t1/m/r/v1/zz", out) is None
    assert backend.head("t1/m/r/v1/aa", 13) == data[:13] and backend.head("t1/m/r/v1/zz", 13) is None
    # the store, on chunks of many windows
    store = _store(open_backend(redis_any.url + "?window=1000"), _keyring("t1"))
    ns, tokens, hashes, kv = _request(45, 2 * CB)
    tag = _tag(ns)
    assert store.put_chunks(_chunks(hashes, tokens, kv, store), tag) == [True, True]
    assert torch.equal(store.get(hashes, tokens, tag, 2 * CB).kv, kv)
    backend.close()


def test_a_value_replaced_or_deleted_while_read_in_windows_is_whole_or_missing_never_mixed(redis_any):  # noqa: F811
    """A writer replaces the value (same length, other bytes) and deletes it, over and over, while a
    reader reads it in 64 windows. Defence: the windows are read in one MULTI/EXEC; read one by one,
    reads mix the two values."""
    backend = open_backend(redis_any.url + "?window=4096")
    a, b = os.urandom(4096 * 64), os.urandom(4096 * 64)
    stop = threading.Event()
    client = redis_any.client()
    key = backend._key("t1/m/r/v1/aa")

    def churn() -> None:
        while not stop.is_set():
            client.set(key, a)
            client.set(key, b)
            client.delete(key)

    writer = threading.Thread(target=churn)
    writer.start()
    seen = {"a": 0, "b": 0, "missing": 0}
    out = memoryview(bytearray(len(a)))
    try:
        for _ in range(150):
            size = backend.get_into("t1/m/r/v1/aa", out)
            if size is None:
                seen["missing"] += 1
                continue
            assert size == len(a)
            value = bytes(out)
            assert value in (a, b), "a read mixed two versions of the value"
            seen["a" if value == a else "b"] += 1
    finally:
        stop.set()
        writer.join()
    assert seen["a"] + seen["b"] > 0  # paired: the reads did see the value
    backend.close()


def test_a_chunk_deleted_before_its_read_is_a_miss_not_garbage(redis_any):  # noqa: F811
    store = _store(open_backend(redis_any.url + "?window=1000"), _keyring("t1"))
    ns, tokens, hashes, kv = _request(46, 2 * CB)
    tag = _tag(ns)
    assert store.put_chunks(_chunks(hashes, tokens, kv, store), tag) == [True, True]
    store.backend.delete(_names(store, tag, hashes)[1])
    got = store.get(hashes, tokens, tag, 2 * CB)
    assert got.stopped == "miss" and torch.equal(got.kv, kv[:CB]) and store.stats["corrupt"] == 0


# ====================================================================== probes, layout, the chunk writer
def test_a_probe_asks_the_backend_once_for_the_whole_chain(raw):  # noqa: F811
    store = _store(raw, _keyring("t1"))
    ns, tokens, hashes, kv = _request(47, 4 * CB)
    tag = _tag(ns)
    chunks = _chunks(hashes, tokens, kv, store)
    assert store.put_chunks([chunks[0], chunks[1], chunks[3]], tag) == [True, True, True]
    calls = []
    real = store.backend.exists_many
    store.backend.exists_many = lambda names: calls.append(len(names)) or real(names)
    assert store.probe(hashes, tag) == 2 * CB  # stops counting at the missing third chunk
    assert calls == [4]


def test_an_object_of_the_earlier_redis_layout_is_a_miss_and_swept(redis_any):  # noqa: F811
    """Before, an object was a hash. Defence: a WRONGTYPE reply is a miss, not a backend failure (which
    would skip L3 for everyone), and the listing reports it for the sweep to delete."""
    backend = open_backend(redis_any.url)
    store = _store(backend, _keyring("t1"))
    ns, tokens, hashes, kv = _request(48, CB)
    tag = _tag(ns)
    name = _names(store, tag, hashes)[0]
    redis_any.client().hset(backend._key(name), mapping={"d": b"old", "h": b"old", "t": b"1.0"})
    got = store.get(hashes, tokens, tag, CB)
    assert got.stopped == "miss" and store.stats["failures"] == 0
    assert backend.head(name, 13) is None
    assert [(i.name, i.size, i.mtime) for i in backend.list("")] == [(name, 0, 0.0)]
    assert store.sweep({}, 3600.0) == (1, 0) and not backend.exists(name)
    assert store.put_chunk(hashes, tokens, tag, kv) is True  # the name is free again
    backend.close()


def test_the_engine_writes_a_commits_chunks_with_one_batched_call(tmp_path):
    from cachecore.engine import CacheEngine
    from cachecore.model.loader import RevisionSpec, load_model
    from cachecore.runner import CompletionRunner

    loaded = load_model("l3-batch", "tiny", RevisionSpec(label="r1", seed=6), device="cpu")
    ring = _keyring("t")
    store = RemoteStore(open_backend((tmp_path / "l3").as_uri()), ring, loaded.layout, chunk_blocks=2)
    calls = []
    real = store.put_chunks
    store.put_chunks = lambda chunks, tag, **kw: calls.append(len(chunks)) or real(chunks, tag, **kw)
    engine = CacheEngine(loaded.layout, num_blocks=24, device="cpu", l3=store)
    gen = CompletionRunner(loaded.model, engine, loaded.tokenizer, model_name="l3-batch", revision="r1")
    tokens = torch.randint(0, 256, (16 * 6 + 3,), generator=torch.Generator().manual_seed(3)).tolist()
    gen.prefill_logits(loaded.namespace(secrets.token_bytes(32)), tokens, owner="t")
    engine.drain_writes()
    assert calls == [3] and store.stats["objects_written"] == 3  # 6 blocks = 3 chunks, one call
    engine.check_integrity()


def test_a_set_larger_than_one_batch_is_written_in_several(raw, monkeypatch):  # noqa: F811
    """Each batch seals into its own per-thread frame buffers: a set above MAX_BATCH_BYTES goes in
    several ``put_new_many`` calls, every chunk whole."""
    from cachecore.tiers.remote import store as store_module

    store = _store(raw, _keyring("t1"))
    monkeypatch.setattr(store_module, "MAX_BATCH_BYTES", 2 * store._frame.frame_bytes)
    ns, tokens, hashes, kv = _request(49, 5 * CB)
    tag = _tag(ns)
    sizes = []
    real = store.backend.put_new_many
    monkeypatch.setattr(store.backend, "put_new_many", lambda items: sizes.append(len(items)) or real(items))
    assert store.put_chunks(_chunks(hashes, tokens, kv, store), tag) == [True] * 5
    assert sizes == [2, 2, 1]
    assert torch.equal(store.get(hashes, tokens, tag, 5 * CB).kv, kv)
    assert _accounted(store) == _present(store)
