"""The tenant cache ledger: recorded usage adds up exactly (also from many threads at once, on the
real database), pinned token-seconds come exactly from the named caches' lifetimes, the stats
sampler accrues L3 byte-seconds once per sample, the admin API serves it as JSON and CSV to
operators only, and /metrics exposes its counters."""

from __future__ import annotations

import csv
import io
import random
import threading
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection

from controlplane.ledger.models import ALL_MODELS, MISS_REASONS, LedgerHour
from controlplane.ledger.selectors import ledger_period, ledger_rows, ledger_totals
from controlplane.ledger.services import ledger_accrue_sample, ledger_record
from tests.controlplane.helpers import assert_error

T0 = datetime(2026, 3, 2, 10, 0, tzinfo=UTC)
H = timedelta(hours=1)
M = timedelta(minutes=1)


def usage(prompt: int, completion: int = 0, l1: int = 0, l2: int = 0, l3: int = 0, write: int = 0) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": l1 + l2 + l3, "cache_write_tokens": write,
                                      "cached_tokens_by_tier": {"l1": l1, "l2": l2, "l3": l3}}}


def random_call(rng: random.Random) -> tuple[dict, dict]:
    l1, l2, l3 = rng.randrange(0, 64), rng.randrange(0, 64), rng.randrange(0, 64)
    prompt = l1 + l2 + l3 + rng.randrange(0, 200)
    misses = {rng.choice(MISS_REASONS): rng.randrange(1, 50) for _ in range(rng.randrange(0, 3))}
    return usage(prompt, rng.randrange(1, 40), l1, l2, l3, write=rng.randrange(0, 100)), misses


def expected(calls: list[tuple[dict, dict]]) -> dict[str, int]:
    out = {"requests": len(calls), "prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0, "cached_l1": 0,
           "cached_l2": 0, "cached_l3": 0, "write_tokens": 0, **{f"miss_{r}": 0 for r in MISS_REASONS}}
    for u, misses in calls:
        d = u["prompt_tokens_details"]
        out["prompt_tokens"] += u["prompt_tokens"]
        out["completion_tokens"] += u["completion_tokens"]
        out["cached_tokens"] += d["cached_tokens"]
        out["write_tokens"] += d["cache_write_tokens"]
        for tier in ("l1", "l2", "l3"):
            out[f"cached_{tier}"] += d["cached_tokens_by_tier"][tier]
        for reason, n in misses.items():
            out[f"miss_{reason}"] += n
    return out


def counts(row) -> dict[str, int]:
    return {k: row.counts[k] for k in expected([])}


@pytest.fixture
def beta(db, actor):
    from controlplane.tenants.services import tenant_create

    return tenant_create(actor=actor, slug="beta", name="Beta")


# ---------------------------------------------------------------------- recording
def test_totals_over_a_period_equal_the_sum_of_the_recorded_usages(tenant, beta):
    rng = random.Random(5)
    calls = {(t, m, h): [random_call(rng) for _ in range(5)]
             for t in (tenant, beta) for m in ("tiny-llama", "small-llama") for h in (0, 1, 2)}
    for (t, m, h), items in calls.items():
        for i, (u, misses) in enumerate(items):
            ledger_record(tenant_id=t.pk, model=m, usage=u, misses=misses, at=T0 + h * H + i * M)

    everything = ledger_totals(since=T0, until=T0 + 3 * H)
    assert counts(everything) == expected([c for items in calls.values() for c in items])
    acme_tiny = ledger_totals(tenant=tenant, model="tiny-llama", since=T0, until=T0 + 3 * H)
    assert counts(acme_tiny) == expected([c for (t, m, _), items in calls.items() if t == tenant
                                          and m == "tiny-llama" for c in items])
    # The period is whole hours: 10:30-11:30 is the rows of 10:00 and 11:00, and not of 12:00.
    middle = ledger_totals(tenant=tenant, since=T0 + 30 * M, until=T0 + H + 30 * M)
    assert counts(middle) == expected([c for (t, _, h), items in calls.items() if t == tenant and h in (0, 1)
                                       for c in items])
    rows = ledger_rows(since=T0, until=T0 + 3 * H)
    assert len(rows) == 12 == LedgerHour.objects.count()
    assert [(r.hour, r.tenant, r.model) for r in rows] == sorted((r.hour, r.tenant, r.model) for r in rows)
    assert counts(rows[0]) == expected(calls[(tenant, "small-llama", 0)])


def test_an_unknown_miss_reason_counts_as_other_and_malformed_counts_count_zero(tenant):
    ledger_record(tenant_id=tenant.pk, model="m", at=T0,
                  usage={"prompt_tokens": "12", "completion_tokens": -3, "prompt_tokens_details": None},
                  misses={"diverged_at": 7, "cosmic_rays": 5, "evicted": -2})
    row = LedgerHour.objects.get()
    assert (row.requests, row.prompt_tokens, row.completion_tokens) == (1, 0, 0)
    assert row.misses == {"diverged": 7, "other": 5}
    assert ledger_rows(since=T0, until=T0 + H)[0].misses["other"] == 5


@pytest.mark.django_db(transaction=True)
def test_concurrent_recording_loses_no_increment(actor):
    """Threads (each its own database connection) record into the same hour, starting before its
    row exists: every increment lands."""
    from controlplane.tenants.services import tenant_create

    if connection.vendor != "postgresql":
        pytest.skip("concurrent writers need a server database (SQLite's test database is one connection)")
    tenant = tenant_create(actor=actor, slug="acme", name="Acme")
    threads_n, per_thread = 6, 30
    rng = random.Random(11)
    plan = [[random_call(rng) for _ in range(per_thread)] for _ in range(threads_n)]
    barrier = threading.Barrier(threads_n)
    errors: list[BaseException] = []

    def work(calls) -> None:
        try:
            barrier.wait()
            for u, misses in calls:
                ledger_record(tenant_id=tenant.pk, model="tiny-llama", usage=u, misses=misses, at=T0 + 5 * M)
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=work, args=(calls,)) for calls in plan]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    total = ledger_totals(tenant=tenant, since=T0, until=T0 + H)
    assert counts(total) == expected([c for calls in plan for c in calls])
    assert total.counts["requests"] == threads_n * per_thread
    assert LedgerHour.objects.count() == 1


# ---------------------------------------------------------------------- pinned token-seconds
def named_cache(tenant, model, *, pinned: int, created: datetime, expires: datetime, deleted: datetime | None = None):
    from controlplane.caches.models import NamedCache

    cache = NamedCache.objects.create(tenant=tenant, deployment=model, revision="r1", tokens=pinned + 5,
                                      pinned_tokens=pinned, expires_at=expires, deleted_at=deleted)
    NamedCache.objects.filter(pk=cache.pk).update(created=created)  # auto_now_add: set it afterwards
    return cache


def test_pinned_token_seconds_are_the_overlap_of_each_cache_with_each_hour(tenant, beta, model):
    now = T0 + 2 * H + 20 * M  # 12:20
    named_cache(tenant, model, pinned=100, created=T0 + 15 * M, expires=T0 + 2 * H + 30 * M)  # 10:15-12:20 (now)
    named_cache(tenant, model, pinned=10, created=T0 + 50 * M, expires=T0 + 4 * H,
                deleted=T0 + H + 10 * M)  # 10:50-11:10
    named_cache(tenant, model, pinned=1000, created=T0 - 2 * H, expires=T0 + 30 * M)  # expired 10:30
    named_cache(tenant, model, pinned=0, created=T0, expires=T0 + 9 * H)  # not pinned
    named_cache(tenant, model, pinned=7, created=T0 + 3 * H, expires=T0 + 9 * H)  # created after now (clock skew)
    named_cache(beta, model, pinned=50, created=T0, expires=T0 + 9 * H)  # another tenant

    rows = {r.hour: r for r in ledger_rows(tenant=tenant, since=T0, until=T0 + 4 * H, now=now)}
    assert set(rows) == {T0, T0 + H, T0 + 2 * H}  # rows without any request still appear
    assert rows[T0].pinned_token_seconds == 100 * 45 * 60 + 10 * 10 * 60 + 1000 * 30 * 60
    assert rows[T0 + H].pinned_token_seconds == 100 * 3600 + 10 * 10 * 60
    assert rows[T0 + 2 * H].pinned_token_seconds == 100 * 20 * 60  # up to now, not to expiry
    assert all(r.counts["requests"] == 0 and r.tenant == "acme" and r.model == model.name for r in rows.values())
    total = ledger_totals(tenant=tenant, since=T0, until=T0 + 4 * H, now=now)
    assert total.pinned_token_seconds == sum(r.pinned_token_seconds for r in rows.values())
    one_hour = ledger_totals(tenant=tenant, since=T0 + H, until=T0 + 2 * H, now=now)
    assert one_hour.pinned_token_seconds == 100 * 3600 + 6000
    other = ledger_totals(tenant=beta, since=T0, until=T0 + 4 * H, now=now)
    assert other.pinned_token_seconds == 50 * (2 * 3600 + 1200)
    assert ledger_totals(model="other-model", since=T0, until=T0 + 4 * H, now=now).pinned_token_seconds == 0


def test_a_period_must_be_ordered_and_bounded():
    from controlplane.common.errors import InvalidInput

    assert ledger_period(since=T0 + 10 * M, until=T0 + 70 * M) == (T0, T0 + 2 * H)
    assert ledger_period(since=None, until=T0) == (T0 - 24 * H, T0)
    for since, until in ((T0, T0), (T0 + H, T0), (T0 - 400 * 24 * H, T0), (T0, datetime.max.replace(tzinfo=UTC))):
        with pytest.raises(InvalidInput):
            ledger_period(since=since, until=until)


# ---------------------------------------------------------------------- L3 byte-seconds
def test_l3_bytes_of_a_shared_store_accrue_once_per_sample(tenant, beta):
    workers = [  # two workers see the same shared store (their blocks differ in size, not the bytes)
        {"status": "ok", "bytes_per_block": 1024, "resident_blocks": {"l3": {str(tenant.pk): 8, "junk": 3}}},
        {"status": "ok", "bytes_per_block": 2048, "resident_blocks": {"l3": {str(tenant.pk): 4, str(beta.pk): 1}}},
        {"status": "unreachable"},
    ]
    assert ledger_accrue_sample(at=T0, interval_seconds=30, workers=workers) == 2
    assert ledger_accrue_sample(at=T0, interval_seconds=30, workers=workers) == 0  # a second sampler
    assert ledger_accrue_sample(at=T0 + 30 * timedelta(seconds=1), interval_seconds=30, workers=workers) == 2
    rows = {r.tenant: r for r in ledger_rows(since=T0, until=T0 + H)}
    assert rows["acme"].model == ALL_MODELS and rows["acme"].counts["l3_byte_seconds"] == 2 * 8192 * 30
    assert rows["beta"].counts["l3_byte_seconds"] == 2 * 2048 * 30
    assert rows["acme"].counts["requests"] == 0


def test_the_stats_sampler_accrues_l3_bytes_into_the_ledger(db, actor, monkeypatch):
    from controlplane.timeseries.services import sample_take
    from tests.controlplane.test_stats import canned_snapshots, install_gateway, setup_cluster

    ids = setup_cluster(actor, monkeypatch)
    snaps = canned_snapshots(ids)
    snaps["tiny-llama"]["resident_blocks"]["l3"] = {ids["acme"]: 8}  # 8 x 1024 bytes
    snaps["small-llama"]["resident_blocks"]["l3"] = {ids["acme"]: 4}  # 4 x 2048: the same store
    install_gateway(monkeypatch, snaps)
    sample_take(now=T0 + 5 * M)
    sample_take(now=T0 + 5 * M + timedelta(seconds=1))  # the same interval again: nothing more
    sample_take(now=T0 + 6 * M)
    total = ledger_totals(model=ALL_MODELS, since=T0, until=T0 + H)
    assert total.counts["l3_byte_seconds"] == 2 * 8192 * 30


# ---------------------------------------------------------------------- admin API
def _record_some(tenant, beta) -> None:
    ledger_record(tenant_id=tenant.pk, model="tiny-llama", usage=usage(100, 5, l1=40, l2=10, write=50),
                  misses={"evicted": 30, "no_prior_request": 20}, at=T0 + 5 * M)
    ledger_record(tenant_id=tenant.pk, model="tiny-llama", usage=usage(60, 1, l3=16), at=T0 + H + 5 * M)
    ledger_record(tenant_id=beta.pk, model="small-llama", usage=usage(7), at=T0 + 5 * M)


PERIOD = {"since": "2026-03-02T10:00:00Z", "until": "2026-03-02T12:00:00Z"}


def test_the_tenant_ledger_as_json(admin_client, tenant, beta):
    _record_some(tenant, beta)
    body = admin_client.get("/api/admin/tenants/acme/ledger", PERIOD).json()
    assert body["tenant"] == "acme" and [r["hour"][:13] for r in body["rows"]] == ["2026-03-02T10", "2026-03-02T11"]
    first = body["rows"][0]
    assert (first["tenant"], first["model"], first["requests"]) == ("acme", "tiny-llama", 1)
    assert first["prompt_tokens"] == 100
    assert (first["cached_l1"], first["cached_l2"], first["write_tokens"]) == (40, 10, 50)
    assert first["misses"]["evicted"] == 30 and first["misses"]["no_prior_request"] == 20
    totals = body["totals"]
    assert (totals["requests"], totals["prompt_tokens"]) == (2, 160)
    assert (totals["cached_tokens"], totals["cached_l3"]) == (66, 16)
    narrowed = admin_client.get("/api/admin/tenants/acme/ledger", {**PERIOD, "model": "small-llama"}).json()
    assert narrowed["rows"] == [] and narrowed["totals"]["requests"] == 0


def test_all_tenants_ledger_names_the_tenant_in_each_row(viewer_client, tenant, beta):
    _record_some(tenant, beta)
    response = viewer_client.get("/api/admin/ledger", PERIOD)
    assert response.status_code == 200
    rows = response.json()["rows"]
    assert sorted((r["tenant"], r["model"]) for r in rows) == [("acme", "tiny-llama"), ("acme", "tiny-llama"),
                                                               ("beta", "small-llama")]
    assert response.json()["totals"]["requests"] == 3


def test_the_ledger_as_csv_is_an_attachment_with_a_header_row(admin_client, tenant, beta):
    _record_some(tenant, beta)
    response = admin_client.get("/api/admin/ledger", {**PERIOD, "format": "csv"})
    assert response.status_code == 200 and response["Content-Type"].startswith("text/csv")
    assert response["Content-Disposition"].startswith("attachment; filename=\"ledger-all-")
    lines = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert [(r["tenant"], r["model"], r["hour"][:13]) for r in lines] == [
        ("acme", "tiny-llama", "2026-03-02T10"), ("beta", "small-llama", "2026-03-02T10"),
        ("acme", "tiny-llama", "2026-03-02T11")]
    first = lines[0]
    assert (first["prompt_tokens"], first["miss_evicted"], first["pinned_token_seconds"]) == ("100", "30", "0.000000")
    empty = admin_client.get("/api/admin/tenants/acme/ledger", {"format": "csv", "since": "2020-01-01T00:00:00Z",
                                                                "until": "2020-01-01T01:00:00Z"})
    assert empty.content.decode().splitlines()[0].startswith("tenant,model,hour,requests,prompt_tokens")


def test_an_offboarded_tenant_keeps_its_ledger(admin_client, actor, tenant, beta):
    from controlplane.tenants.models import Tenant

    _record_some(tenant, beta)
    Tenant.objects.filter(pk=tenant.pk).update(status=Tenant.Status.OFFBOARDED)
    body = admin_client.get("/api/admin/tenants/acme/ledger", PERIOD).json()
    assert body["totals"]["requests"] == 2


def test_only_operators_read_the_ledger(client, tenant, beta, actor):
    from controlplane.tenants.services import api_key_create

    _record_some(tenant, beta)
    _, raw = api_key_create(actor=actor, tenant=tenant, name="k")
    assert_error(client.get("/api/admin/tenants/acme/ledger", headers={"Authorization": f"Bearer {raw}"}), 401)
    assert_error(client.get("/api/admin/ledger"), 401)


@pytest.mark.parametrize("query", [
    {"since": "yesterday"}, {"until": "2026-13-01T00:00:00Z"},
    {"since": "2026-03-02T12:00:00Z", "until": "2026-03-02T10:00:00Z"},
    {"since": "2020-01-01T00:00:00Z", "until": "2026-01-01T00:00:00Z"}, {"until": "9999-12-31T23:59:59Z"},
    {"format": "xml"}, {"model": "a\x00b"}, {"since": "0001-01-01T00:00:00+14:00"},
])
def test_bad_query_parameters_are_a_422(viewer_client, tenant, query):
    for url in ("/api/admin/tenants/acme/ledger", "/api/admin/ledger"):
        assert_error(viewer_client.get(url, query), 422)
    assert_error(viewer_client.get("/api/admin/tenants/nobody/ledger"), 404)


# ---------------------------------------------------------------------- /metrics
def test_metrics_expose_the_ledger_counters(admin_client, actor, monkeypatch, tenant, beta):
    from tests.controlplane.test_stats import setup_cluster

    setup_cluster(actor, monkeypatch)
    _record_some(tenant, beta)
    text = admin_client.get("/metrics").content.decode()
    assert 'strata_ledger_tokens_total{kind="prompt",model="tiny-llama",tenant="acme"} 160.0' in text
    assert 'strata_ledger_tokens_total{kind="cached_l1",model="tiny-llama",tenant="acme"} 40.0' in text
    assert 'strata_ledger_tokens_total{kind="write",model="tiny-llama",tenant="acme"} 50.0' in text
    assert 'strata_ledger_miss_tokens_total{model="tiny-llama",reason="evicted",tenant="acme"} 30.0' in text
    assert 'strata_ledger_miss_tokens_total{model="small-llama",reason="evicted",tenant="beta"} 0.0' in text
    assert 'reason="other"' not in text and f'model="{ALL_MODELS}"' not in text
