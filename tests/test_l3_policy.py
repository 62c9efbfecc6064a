"""Cache policy is a property of the data (issue 17, item 5), against the real store and workers.

Pins: a request that may not persist never reads L3 (a persisting request wrote it; a fresh worker
whose only source is L3 gives the non-persisting one nothing, and the persisting one the chunk);
every L3 object carries its own expiry (the request's retention, narrower than the tenant's),
authenticated in the frame's associated data, used by reads and sweeps; an edited expiry is a
decryption failure (miss, quarantined); objects of frame format 1 (no expiry) are never served and
are deleted; a lowered tenant retention is applied by ``WorkerL3.expire``.
"""

from __future__ import annotations

import secrets
import struct
import time

import pytest

from cachecore import crypto
from tests.l3_workers import CHUNK_TOKENS, DAY, L3Site, cached_tokens, prompt
from tests.test_l3 import (  # noqa: F401  (fixtures)
    CB,
    _keyring,
    _names,
    _put_all,
    _request,
    _store,
    _tag,
    raw,
    redis_cluster,
    redis_cluster_up,
    redis_server,
    redis_up,
)

_EXPIRES_AT = 5  # byte offset of the frame's expiry (after format version u8 and key version u32)


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.delenv("STRATA_MASTER_KEY", raising=False)  # the site's key file is the master key
    return L3Site(tmp_path)


# ---------------------------------------------------------------------- reads gated on persist
def test_a_request_that_may_not_persist_gets_nothing_from_l3(site):
    """Defence: ``CacheEngine.admit`` reads L3 only for a request that may persist. Without it, the
    ``persist=False`` request below is served the chunk the first request wrote."""
    salt = secrets.token_bytes(32)
    tokens = prompt(300, 1)
    writer = site.worker()
    assert cached_tokens(writer, site.request("7", tokens, scope_salt=salt)) == 0
    assert len(site.files("7")) == 1  # one 256-token chunk in L3
    reader = site.worker()  # empty L1, no L2: L3 is its only source
    assert cached_tokens(reader, site.request("7", tokens, scope_salt=salt, persist=False)) == 0
    assert reader.engine.l3.stats["probes"] == 0  # not even asked
    reader.engine.flush(lambda t: True)  # its L1 forgets that request: the next hit can only come from L3
    assert cached_tokens(reader, site.request("7", tokens, scope_salt=salt)) == CHUNK_TOKENS  # paired


# ---------------------------------------------------------------------- per-object expiry
def test_an_object_written_under_24h_is_not_served_after_it_even_when_the_tenant_keeps_longer(site):
    """Defence: the object's own expiry (the request's 24 h, not the tenant's 7 days), checked on
    read and by the sweep. Without it, the read 25 h later (with the tenant's 7-day retention) hits."""
    salt = secrets.token_bytes(32)
    tokens = prompt(300, 2)
    writer = site.worker()
    before = time.time()
    cached_tokens(writer, site.request("7", tokens, scope_salt=salt, retention=DAY, tenant_retention=7 * DAY))
    [path] = site.files("7")
    header = crypto.frame_header(path.read_bytes()[: crypto.HEADER_BYTES])
    assert header.format_version == crypto.FORMAT_VERSION
    assert before + DAY <= header.expires <= time.time() + DAY + 1

    later = site.worker()
    later.l3.store.clock = lambda: time.time() + 23 * 3600
    week = {"retention": 7 * DAY, "tenant_retention": 7 * DAY}
    assert cached_tokens(later, site.request("7", tokens, scope_salt=salt, persist=False, **week)) == 0
    later.engine.flush(lambda t: True)  # L1 forgets; the next hit can only come from L3
    assert cached_tokens(later, site.request("7", tokens, scope_salt=salt, **week)) == CHUNK_TOKENS  # paired: 23 h
    later.engine.flush(lambda t: True)

    late = site.worker()
    late.l3.store.clock = lambda: time.time() + 25 * 3600
    late.l3.learn("7", None, 7 * DAY)  # the tenant keeps 7 days: only the object's own expiry can sweep it
    size = path.stat().st_size
    assert late.l3.sweep() == (1, size)  # the sweep deletes it by its own expiry
    assert site.files("7") == []
    again = site.worker()
    cached_tokens(again, site.request("7", tokens, scope_salt=salt, retention=DAY, tenant_retention=7 * DAY))
    assert len(site.files("7")) == 1  # written again
    assert cached_tokens(late, site.request("7", tokens, scope_salt=salt, **week)) == 0  # read: a miss
    assert late.l3.store.stats["expired"] == 1 and late.l3.store.stats["deleted"] == 2  # sweep + this read
    [path] = site.files("7")  # what remains is the chunk that request wrote anew, on its own clock
    assert crypto.frame_header(path.read_bytes()[: crypto.HEADER_BYTES]).expires >= time.time() + 25 * 3600 + DAY - 5


def test_expiry_on_read_and_sweep_in_the_store(raw):  # noqa: F811 - the fixture of test_l3
    now = [time.time()]
    store = _store(raw, _keyring("t1"), clock=lambda: now[0])
    ns, tokens, hashes, kv = _request(31, 2 * CB)
    tag = _tag(ns)
    ct = store.chunk_tokens
    assert store.put_chunk(hashes[:CB], tokens[:ct], tag, kv[:CB], retention_seconds=DAY)
    assert store.put_chunk(hashes[CB:], tokens[ct:], tag, kv[CB:], retention_seconds=7 * DAY)
    now[0] += DAY + 60
    got = store.get(hashes, tokens, tag, 2 * CB, retention_seconds=7 * DAY)
    assert got.stopped == "miss" and got.kv.shape[0] == 0 and store.stats["expired"] == 1
    first, second = _names(store, tag, hashes)
    assert not raw.backend.exists(first) and raw.backend.exists(second)
    assert store.put_chunk(hashes[:CB], tokens[:ct], tag, kv[:CB], retention_seconds=DAY)  # rewritten at +1 d
    assert store.count_expired(tenant="t1", retention_seconds=None) == 0
    now[0] += DAY + 60  # the rewritten one (24 h) is past its expiry, the other (7 d) is not
    assert store.count_expired(tenant="t1", retention_seconds=None) == 1
    assert store.sweep({}, None)[0] == 1
    assert not raw.backend.exists(first) and raw.backend.exists(second)
    assert store.count_expired(tenant="t1", retention_seconds=None) == 0


def test_an_edited_expiry_fails_to_decrypt_and_is_quarantined(raw):  # noqa: F811
    """Defence: the expiry is part of the associated data. Without that, pushing the expiry of an
    expired object into the future makes it readable again."""
    now = [time.time()]
    store = _store(raw, _keyring("t1"), clock=lambda: now[0])
    ns, tokens, hashes, kv = _request(32, CB)
    tag = _tag(ns)
    assert store.put_chunk(hashes, tokens, tag, kv, retention_seconds=60)
    [name] = _names(store, tag, hashes)
    frame = bytearray(raw.get(name))
    struct.pack_into("<Q", frame, _EXPIRES_AT, int(now[0]) + 10 * DAY)
    raw.set(name, bytes(frame))
    now[0] += 120
    got = store.get(hashes, tokens, tag, CB, retention_seconds=DAY)
    assert got.stopped == "corrupt" and got.kv.shape[0] == 0
    assert store.stats["corrupt"] == 1 and store.stats["quarantined"] == 1 and not raw.backend.exists(name)


def test_objects_of_frame_format_1_are_never_served_and_are_deleted(raw):  # noqa: F811
    store = _store(raw, _keyring("t1"))
    ns, tokens, hashes, kv = _request(33, 2 * CB)
    tag = _tag(ns)
    assert _put_all(store, hashes, tokens, tag, kv) == 2
    first, second = _names(store, tag, hashes)
    for name in (first, second):  # what a format-1 writer left: no expiry in its header
        raw.set(name, bytes([1]) + raw.get(name)[1:5] + raw.get(name)[13:])
    got = store.get(hashes, tokens, tag, 2 * CB)
    assert got.stopped == "miss" and store.stats["expired"] == 1 and store.stats["corrupt"] == 0
    assert not raw.backend.exists(first)
    assert store.sweep({}, None)[0] == 1 and not raw.backend.exists(second)


def test_a_lowered_tenant_retention_deletes_what_is_now_too_old(site):
    worker = site.worker()
    for tenant in ("7", "8"):  # each tenant has its own scope salt
        cached_tokens(worker, site.request(tenant, prompt(300, 4), scope_salt=secrets.token_bytes(32)))
    worker.l3.store.clock = lambda: time.time() + 2 * 3600  # both objects are 2 h old, within 24 h
    assert worker.l3.sweep() == (0, 0)
    assert worker.l3.store.count_expired(tenant="7", retention_seconds=3600) == 1
    objects, _ = worker.l3.expire("7", 3600)
    assert objects == 1 and site.files("7") == [] and len(site.files("8")) == 1  # only that tenant
    assert worker.l3.retention("7") == 3600 and worker.l3.store.count_expired(tenant="7", retention_seconds=3600) == 0


def test_a_narrowed_request_does_not_lower_the_tenants_sweep_retention(site):
    """The worker's sweep applies the tenant's own retention (``tenant_retention_seconds``), never
    the narrower one of the last request (which would delete the tenant's longer-lived objects)."""
    worker = site.worker()
    req = site.request("7", prompt(40, 5), scope_salt=secrets.token_bytes(32), retention=DAY,
                       tenant_retention=7 * DAY)
    cached_tokens(worker, req)
    assert worker.l3.retention("7") == 7 * DAY
    del req["tenant_retention_seconds"]  # an older control plane: the request's own is all there is
    cached_tokens(worker, req)
    assert worker.l3.retention("7") == DAY
