"""The stats sampler and its selector: samples of canned worker snapshots (only
``controlplane.runtime.gateway.call`` is replaced, as in test_stats.py), deltas between consecutive
samples, token-weighted ratios of those deltas, worker restarts (counters back to zero), pruning,
and the sampler thread and where ``make run`` starts it."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest

from controlplane.timeseries.models import StatSample
from controlplane.timeseries.selectors import TOTAL, ratio, series_for, series_from_rows
from controlplane.timeseries.services import sample_take, sample_time
from tests.controlplane.test_stats import canned_snapshots, install_gateway, setup_cluster

T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
COUNTERS = ("requests", "query_tokens", "lookup_hit_tokens", "load_success_tokens", "effective_hit_tokens")


def bump(snap: dict, tenant_id: str, **deltas) -> None:
    """Add ``deltas`` to one tenant's usage row of a worker snapshot and to the worker's totals."""
    row = next(r for r in snap["usage"] if r["tenant"] == tenant_id)
    for key, value in deltas.items():
        row[key] += value
        snap["totals"][key] += value


def restarted(snap: dict) -> None:
    """The worker came back with fresh counters: every usage counter and tier counter from zero."""
    for row in snap["usage"]:
        for key in (*COUNTERS, "stored_tokens", "saved_prefill_seconds", "prefill_seconds"):
            row[key] = 0
    for key in snap["totals"]:
        snap["totals"][key] = 0
    for tier in snap["tiers"].values():
        for key in ("hits", "hit_tokens", "evictions", "bytes_out"):
            tier[key] = 0
    snap["load_policy"]["decisions"] = {"load": 0, "recompute": 0}


@pytest.fixture
def cluster(db, actor, monkeypatch):
    ids = setup_cluster(actor, monkeypatch)
    snaps = canned_snapshots(ids)

    def answer() -> None:
        install_gateway(monkeypatch, snaps)

    return ids, snaps, answer


# ---------------------------------------------------------------------- sampling
def test_a_sample_records_each_running_worker_per_tenant_model_and_tier(cluster):
    result = sample_take(now=T0)
    assert result.at == T0 and result.written == StatSample.objects.count()
    rows = {(r.kind, r.name, r.model): r.values for r in StatSample.objects.filter(at=T0)}
    assert {m for _, _, m in rows} == {"tiny-llama", "small-llama"}  # down-llama answered nothing
    acme = rows[("tenant", "acme", "tiny-llama")]
    assert (acme["query_tokens"], acme["effective_hit_tokens"], acme["requests"]) == (1000, 496, 4)
    assert acme["resident_bytes_l1"] == 30 * 1024 and acme["resident_bytes_l2"] == 8 * 1024
    assert acme["saved_prefill_seconds"] == 0.25 and acme["prefill_seconds"] == 1.0
    tiny = rows[("model", "tiny-llama", "tiny-llama")]
    assert (tiny["query_tokens"], tiny["evictions"], tiny["decisions_load"], tiny["decisions_recompute"]) == (
        1200, 5, 5, 3)
    l2 = rows[("tier", "l2", "tiny-llama")]
    assert (l2["hits"], l2["capacity_bytes"], l2["used_bytes"], l2["rejected_puts"]) == (4, 400 * 1024, 8 * 1024, 2)
    assert ("tier", "l2", "small-llama") not in rows


def test_sample_times_are_floored_to_the_interval_and_a_second_sampler_adds_nothing(cluster):
    assert sample_time(T0 + timedelta(seconds=29.9), 30) == T0
    assert sample_time(T0 + timedelta(seconds=30), 30) == T0 + timedelta(seconds=30)
    first = sample_take(now=T0 + timedelta(seconds=3))
    count = StatSample.objects.count()
    second = sample_take(now=T0 + timedelta(seconds=20))  # e.g. a second web process, same interval
    assert first.at == second.at == T0
    assert StatSample.objects.count() == count


def test_two_samples_give_deltas_and_the_ratio_of_token_deltas(cluster):
    ids, snaps, answer = cluster
    sample_take(now=T0)
    # In the next 30 s acme sends one long prompt, mostly cached, on tiny-llama; beta one uncached.
    bump(snaps["tiny-llama"], ids["acme"], requests=1, query_tokens=400, lookup_hit_tokens=380,
         load_success_tokens=360, effective_hit_tokens=360, saved_prefill_seconds=0.5)
    bump(snaps["tiny-llama"], ids["beta"], requests=3, query_tokens=100)
    snaps["tiny-llama"]["tiers"]["l1"].update(hit_tokens=400 + 360, evictions=5 + 2, used_blocks=70)
    snaps["tiny-llama"]["load_policy"]["decisions"] = {"load": 6, "recompute": 3}
    answer()
    sample_take(now=T0 + timedelta(seconds=30))

    series = series_for(since=T0)
    assert series.times == (T0 + timedelta(seconds=30),) and series.seconds == (30.0,)
    (acme,), (beta,), (total,) = series.scope("tenant", "acme"), series.scope("tenant", "beta"), series.scope(TOTAL)
    assert (acme["query_tokens"], acme["effective_hit_tokens"], acme["requests"]) == (400, 360, 1)
    assert acme["saved_prefill_seconds"] == pytest.approx(0.5)
    # over the interval (acme's ratio since its workers started is 1,112 / 1,700 = 65%)
    assert ratio(acme, "effective_hit_tokens") == pytest.approx(0.9)
    assert ratio(beta, "effective_hit_tokens") == 0.0 and beta["requests"] == 3
    assert (total["query_tokens"], total["effective_hit_tokens"], total["requests"]) == (500, 360, 4)
    # token-weighted: 4 requests of which 1 hit, yet 72% of the tokens skipped prefill
    assert ratio(total, "effective_hit_tokens") == pytest.approx(0.72)
    assert (total["decisions_load"], total["decisions_recompute"], total["evictions"]) == (1, 0, 0)
    (l1,) = series.scope("tier", "l1")
    assert (l1["hit_tokens"], l1["evictions"], l1["hits"]) == (360, 2, 0)  # deltas summed over both workers
    assert l1["used_bytes"] == 70 * 1024 + 20 * 2048 and l1["capacity_bytes"] == 100 * 1024 + 50 * 2048  # levels


def test_a_worker_restart_counts_what_came_after_it_not_a_negative_delta(cluster):
    ids, snaps, answer = cluster
    sample_take(now=T0)
    restarted(snaps["tiny-llama"])
    bump(snaps["tiny-llama"], ids["acme"], requests=1, query_tokens=50, effective_hit_tokens=40)
    bump(snaps["tiny-llama"], ids["beta"], requests=2, query_tokens=250)  # more than beta's 200 before
    bump(snaps["small-llama"], ids["acme"], requests=1, query_tokens=10, effective_hit_tokens=10)
    answer()
    sample_take(now=T0 + timedelta(seconds=30))

    series = series_for(since=T0)
    (acme,), (beta,), (total,) = series.scope("tenant", "acme"), series.scope("tenant", "beta"), series.scope(TOTAL)
    assert (acme["query_tokens"], acme["effective_hit_tokens"]) == (50 + 10, 40 + 10)
    # beta's own counter rose (200 -> 250), but its worker restarted: 250 since then, not 50
    assert beta["query_tokens"] == 250
    assert (total["query_tokens"], total["requests"]) == (310, 4)
    assert all(v >= 0 for scope in series.scopes.values() for values in scope if values
               for k, v in values.items())
    (tiny_l1,) = series_from_rows(StatSample.objects.filter(kind="tier", name="l1", model="tiny-llama")
                                  .values_list("at", "kind", "name", "model", "values")).scope("tier", "l1")
    assert tiny_l1["evictions"] == 0 and tiny_l1["hit_tokens"] == 0  # reset by the tier's own drop


def test_a_worker_that_missed_samples_is_counted_over_the_gap(cluster):
    ids, snaps, answer = cluster
    sample_take(now=T0)
    small = snaps.pop("small-llama")
    answer()
    sample_take(now=T0 + timedelta(seconds=30))  # small-llama did not answer
    bump(small, ids["acme"], requests=2, query_tokens=70, effective_hit_tokens=7)
    snaps["small-llama"] = small
    answer()
    sample_take(now=T0 + timedelta(seconds=60))
    series = series_for(since=T0)
    first, second = series.scope("model", "small-llama")
    assert first is None  # no answer: no figure for that interval
    assert (second["query_tokens"], second["requests"]) == (70, 2)  # what it counted since its last sample


def test_a_tenant_first_seen_while_its_worker_was_sampled_counts_from_zero_and_a_baseline_does_not():
    def row(at, kind, name, model, **values):
        return (at, kind, name, model, values)

    t1, t2 = T0 + timedelta(seconds=30), T0 + timedelta(seconds=60)
    series = series_from_rows([
        row(T0, "model", "m", "m", query_tokens=100),
        row(t1, "model", "m", "m", query_tokens=100), row(t1, "model", "n", "n", query_tokens=5000),
        row(t2, "model", "m", "m", query_tokens=130), row(t2, "model", "n", "n", query_tokens=5010),
        row(t2, "tenant", "new", "m", query_tokens=30),
    ])
    assert series.scope("tenant", "new") == (None, {"query_tokens": 30})  # first request after t1
    # n was first sampled at t1: that sample is its baseline, not 5,000 tokens in 30 s
    assert series.scope("model", "n") == (None, {"query_tokens": 10})
    assert [v["query_tokens"] for v in series.scope(TOTAL)] == [0, 40]
    assert series.scope("tenant", "absent") == (None, None)


def test_two_replicas_of_one_deployment_are_two_workers_whose_deltas_add_up():
    t1 = T0 + timedelta(seconds=30)
    rows = [(T0, "model", "m", "m", 0, {"query_tokens": 100}), (T0, "model", "m", "m", 1, {"query_tokens": 900}),
            (t1, "model", "m", "m", 0, {"query_tokens": 130}), (t1, "model", "m", "m", 1, {"query_tokens": 20})]
    series = series_from_rows(rows)
    # replica 1 restarted (900 -> 20): its delta is what it counted since, replica 0's is +30
    assert series.scope("model", "m") == ({"query_tokens": 50},)
    # keyed by deployment alone, the replicas would overwrite each other: one row per interval survives
    assert series_from_rows([(at, k, n, m, v) for at, k, n, m, _r, v in rows[::2]]).scope("model", "m") == (
        {"query_tokens": 30},)


def test_sample_take_keeps_one_row_per_replica(cluster, monkeypatch):
    from controlplane.timeseries import services

    real = services.cluster_stats

    def two_replicas(**kwargs):
        stats = real(**kwargs)
        extra = [dict(w, replica=1) for w in stats["workers"] if w.get("status") == "ok"]
        return {**stats, "workers": [dict(w, replica=0) for w in stats["workers"]] + extra}

    monkeypatch.setattr(services, "cluster_stats", two_replicas)
    sample_take(now=T0)
    assert set(StatSample.objects.filter(kind="model", name="tiny-llama").values_list("replica", flat=True)) == {0, 1}


def test_series_for_one_tenant_leaves_other_tenants_out(cluster):
    ids, snaps, answer = cluster
    sample_take(now=T0)
    bump(snaps["tiny-llama"], ids["beta"], requests=1, query_tokens=10)
    answer()
    sample_take(now=T0 + timedelta(seconds=30))
    series = series_for(since=T0, tenant="beta")
    assert series.names("tenant") == ["beta"] and series.scope("tenant", "beta")[0]["query_tokens"] == 10
    assert series.names("tier") == []
    assert series_for(since=T0).names("tenant") == ["acme", "beta"]
    assert series_for(since=T0 + timedelta(seconds=1)).times == ()  # a single sample: no interval yet


def test_each_sample_prunes_rows_older_than_the_retention(cluster, settings):
    settings.STRATA_SAMPLE_RETENTION_SECONDS = 60
    sample_take(now=T0)
    sample_take(now=T0 + timedelta(seconds=30))
    assert StatSample.objects.filter(at=T0).exists()
    result = sample_take(now=T0 + timedelta(seconds=90))
    assert result.pruned > 0 and not StatSample.objects.filter(at=T0).exists()
    assert sorted(set(StatSample.objects.values_list("at", flat=True))) == [
        T0 + timedelta(seconds=30), T0 + timedelta(seconds=90)]


def test_the_retention_may_not_be_shorter_than_the_interval(settings):
    from controlplane.timeseries.config import SamplerConfig, sampler_config

    assert sampler_config() == SamplerConfig(interval_seconds=30, retention_seconds=24 * 3600)
    with pytest.raises(ValueError, match="shorter than the interval"):
        SamplerConfig(interval_seconds=30, retention_seconds=10)


# ---------------------------------------------------------------------- the sampler thread
def test_the_sampler_thread_keeps_sampling_after_a_failed_sample():
    from controlplane.timeseries.sampler import Sampler

    calls: list[int] = []
    done = threading.Event()

    def take() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("Ray is not up yet")
        if len(calls) >= 3:
            done.set()

    sampler = Sampler(interval_seconds=0.05, take=take)
    sampler.start()
    try:
        assert done.wait(5), calls
    finally:
        sampler.stop()
        sampler.join(5)
    assert not sampler.is_alive() and len(calls) >= 3


def test_the_sampler_waits_for_the_next_interval_boundary():
    from controlplane.timeseries.sampler import Sampler

    sampler = Sampler(interval_seconds=30, take=lambda: None, clock=lambda: 1_800_000_010.0)  # 10 s past a boundary
    assert sampler.delay() == pytest.approx(20.05)


def test_only_a_process_with_strata_sampler_set_samples():
    from controlplane.timeseries.apps import sampler_enabled

    assert sampler_enabled({"STRATA_SAMPLER": "1"}) and sampler_enabled({"STRATA_SAMPLER": "true"})
    assert not sampler_enabled({}) and not sampler_enabled({"STRATA_SAMPLER": "0"})
    assert "strata-sampler" not in {t.name for t in threading.enumerate()}  # not in the test process


def test_make_run_starts_the_sampler_in_the_web_process_only(tmp_path, monkeypatch):
    from tests.test_launcher import _RecordingSupervisor
    from workers.launcher import Config, Launcher, LaunchError

    monkeypatch.delenv("STRATA_SAMPLER", raising=False)
    sup = _RecordingSupervisor()
    launcher = Launcher(Config(home=tmp_path, port=1, demo=False, verbose=False, ray_address=None), sup)
    try:
        launcher.start_celery()
        with pytest.raises(LaunchError, match="web server exited"):
            launcher.start_web()
    finally:
        sup.stop()
    envs = {name: env for name, _, env in sup.started}
    assert envs["web"]["STRATA_SAMPLER"] == "1"
    assert "STRATA_SAMPLER" not in envs["celery"] and "STRATA_SAMPLER" not in launcher.env
