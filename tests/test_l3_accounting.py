"""L3 figures that are right when several deployments share one store (the default file L3): each
replica counts what its model and revision hold, the capacity is the store's (once), and the figures
follow deletes, flushes and other writers; compared with the bytes on disk after each step. Then the
cluster view (``runtime.stats.cluster_stats``) sums each deployment once, whatever its replicas."""

from __future__ import annotations

from pathlib import Path

from cachecore.tiers.backends import open_backend
from cachecore.tiers.remote import RemoteStore
from tests.test_l3 import CB, LAYOUT, _keyring, _put_all, _request, _tag


def _disk(root: Path) -> tuple[int, int]:
    files = [p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")]
    return len(files), sum(p.stat().st_size for p in files)


def test_each_deployment_counts_its_own_objects_and_the_figures_follow_the_disk(tmp_path):
    root = tmp_path / "l3"
    kr = _keyring("t1", "t2")
    cap = 10_000_000
    a = RemoteStore(open_backend(f"file://{root}"), kr, LAYOUT, chunk_blocks=CB, capacity_bytes=cap, refresh_seconds=0)
    b = RemoteStore(open_backend(f"file://{root}"), kr, LAYOUT, chunk_blocks=CB, capacity_bytes=cap, refresh_seconds=0)
    ns, tokens, hashes, kv = _request(1, 2 * CB)
    assert _put_all(a, hashes, tokens, _tag(ns, "t1", model="ma"), kv) == 2
    ns2, tokens2, hashes2, kv2 = _request(2, 3 * CB, salt=b"\x02" * 32)
    assert _put_all(b, hashes2, tokens2, _tag(ns2, "t2", model="mb"), kv2) == 3

    def check():
        objects, size = _disk(root)
        ga, gb = a.gauges(("ma", "r1")), b.gauges(("mb", "r1"))
        assert ga["objects"] + gb["objects"] == objects
        assert ga["used_bytes"] + gb["used_bytes"] == size
        assert ga["store_used_bytes"] == gb["store_used_bytes"] == size  # each sees the other's writes
        assert ga["capacity_bytes"] == gb["capacity_bytes"] == cap  # the store's, not per deployment
        return ga, gb

    ga, gb = check()
    assert (ga["objects"], gb["objects"]) == (2, 3)
    assert a.usage_by_tenant(scope=("ma", "r1")) == {"t1": ga["used_bytes"]}
    assert a.usage_by_tenant(scope=("mb", "r1")) == {"t2": gb["used_bytes"]}
    # a flush of deployment b's revision, by b: a's figures follow at its next look
    assert b.delete_scope(tenant=None, model="mb", revision="r1")[0] == 3
    ga, gb = check()
    assert gb["objects"] == 0 and ga["objects"] == 2
    # an object deleted behind everyone's back (another process, an operator): followed too
    next(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")).unlink()
    ga, _ = check()
    assert ga["objects"] == 1


def test_the_cluster_view_counts_each_deployment_once(monkeypatch, db):
    from controlplane.common.actor import Actor
    from controlplane.registry.services import model_create
    from controlplane.runtime import gateway, stats

    actor = Actor.system("test")
    for name in ("ma", "mb"):
        model_create(actor=actor, name=name, preset="tiny", revision={"label": "r1", "seed": 1})
    held = {"ma": 300, "mb": 500}

    def snap(spec, method, *args, replica=0, **kw):
        used = held[spec.deployment]
        return {"usage": [], "totals": {}, "bytes_per_block": 10, "pool": {},
                "tiers": {"l3": {"capacity_blocks": 64, "capacity_bytes": 9000, "used_blocks": used // 10,
                                 "used_bytes": used, "hits": 1}},
                "resident_blocks": {"l3": {"t1": used // 10}}}

    monkeypatch.setattr(gateway, "call", snap)
    monkeypatch.setattr(gateway, "replica_set", lambda spec: type("RS", (), {
        "indices": lambda self: [0, 1], "describe": lambda self, i: {"state": "up"}})())
    out = stats.cluster_stats()
    l3 = out["tiers"]["l3"]
    assert (l3["used_bytes"], l3["capacity_bytes"]) == (800, 9000)  # each deployment once, the store once
    assert l3["hits"] == 4  # traffic counters still add up over every replica
    assert {t["tenant"]: t["resident_bytes"]["l3"] for t in out["tenants"]} == {"t1": 800}
