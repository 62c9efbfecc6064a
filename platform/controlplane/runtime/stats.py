"""Gather engine snapshots from every deployment's worker and label tenants by slug.

Every replica of every deployment is one entry of ``workers`` (``model``, ``replica`` index, actor
``name``, and ``routing``: the replica's state in this process's ``ReplicaSet``), addressed through
the gateway's ``ReplicaSet``; the cluster and tenant figures sum them.
Workers know tenants only by id (their cache owner key); the slug is attached here. Every figure
comes from the replica's last sample (``runtime.samples``): this never calls a replica on the
caller's thread, and each worker row says how old its figures are (``sampled_at``, ``age_s``,
``stale``) and how its last poll went (``status``: ok, starting, unreachable, not started, pending).
A replica that does not answer never fails the whole call; its last figures stay, marked stale.

The figures keep docs/design.md section 2's layers apart, all token-weighted against ``query_tokens``:
lookup hit (the index said present), load success (the bytes arrived), effective hit (prefill
actually skipped; the headline ``effective_hit_ratio``). Request counts are a secondary figure only.
Per tier (``l1``, ``l2``, later ``l3``) the workers' counters are summed, and per tenant its resident
bytes in each tier (blocks x the worker's bytes per block).
"""

from __future__ import annotations

from typing import Any

from cachecore.metrics import MAX_TENANT_LABELS
from controlplane.registry.models import ModelDeployment
from controlplane.runtime import gateway, samples
from controlplane.tenants.models import Tenant
from workers.actor import actor_name

TOKEN_LAYERS = ("lookup_hit_tokens", "load_success_tokens", "effective_hit_tokens")
USAGE_SUMS = ("query_tokens", *TOKEN_LAYERS, "stored_tokens", "requests")
USAGE_FLOAT_SUMS = ("saved_prefill_seconds", "prefill_seconds")
TIER_SUMS = ("hits", "hit_tokens", "bytes_in", "bytes_out", "failures", "corrupt_loads", "late_loads",
             "fallbacks_to_recompute", "promotions", "demotions", "capacity_blocks", "used_blocks",
             "capacity_bytes", "used_bytes", "evictions")
TIER_OPTIONAL_SUMS = ("rejected_puts",)  # summed where a tier reports them (L2 puts refused)
TIER_ORDER = ("l1", "l2", "l3")
SAMPLE_KEYS = ("status", "sampled_at", "age_s", "stale", "error")  # a worker row's freshness
OTHER = "other"  # the label that tenants beyond the label cap are folded into


def tier_names(names) -> list[str]:
    """Tier names in hierarchy order (l1, l2, l3), any unknown ones after them alphabetically."""
    return sorted(names, key=lambda n: (TIER_ORDER.index(n) if n in TIER_ORDER else len(TIER_ORDER), n))


def _ratio(part: int, whole: int) -> float:
    return round(part / whole, 4) if whole else 0.0


def _add_ratios(row: dict) -> dict:
    query = row.get("query_tokens", 0)
    for layer in TOKEN_LAYERS:
        row[layer.replace("_tokens", "_ratio")] = _ratio(row.get(layer, 0), query)
    return row


def _usage_row() -> dict[str, Any]:
    return {**{k: 0 for k in USAGE_SUMS}, **{k: 0.0 for k in USAGE_FLOAT_SUMS}}


def _tier_row() -> dict[str, Any]:
    return {**{k: 0 for k in TIER_SUMS}, "load_seconds": 0.0, "load_latency": {"p50": None, "p99": None}}


def _max(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else max(a, b)


# L3 figures that describe the shared store, not a replica's own traffic: summed once per deployment
# (its replicas see the same objects), the store's capacity counted once (not per deployment).
L3_SHARED = ("capacity_blocks", "capacity_bytes", "used_blocks", "used_bytes")


def _add_l3(tiers: dict, scopes: dict[str, dict[str, int]], resident: dict[str, dict[str, int]], tenant) -> None:
    """The cluster's L3 row: what each deployment holds, summed over deployments; the capacity of the
    store (the largest any replica reported: one store shared by all); per tenant its bytes, likewise."""
    if "l3" not in tiers:
        return
    row = tiers["l3"]
    for key in ("used_blocks", "used_bytes"):
        row[key] = sum(s.get(key, 0) for s in scopes.values())
    for key in ("capacity_blocks", "capacity_bytes"):
        row[key] = max((s.get(key, 0) for s in scopes.values()), default=0)
    for owners in resident.values():
        for slug, nbytes in owners.items():
            held = tenant(slug)["resident_bytes"]
            held["l3"] = held.get("l3", 0) + nbytes


def worker_tiers(snap: dict) -> dict[str, dict]:
    """One worker's tier rows with ``capacity_bytes`` / ``used_bytes`` added (blocks x bytes per block)."""
    per_block = int(snap.get("bytes_per_block") or 0)
    out = {}
    tiers = snap.get("tiers") or {}
    for name in tier_names(tiers):
        row = tiers[name]
        # L3 rows carry their own bytes (objects on the store, frames included); the pools' are blocks
        out[name] = {"capacity_bytes": int(row.get("capacity_blocks", 0)) * per_block,
                     "used_bytes": int(row.get("used_blocks", 0)) * per_block, **row}
    return out


def worker_resident_bytes(snap: dict, slugs: dict[str, str]) -> dict[str, dict[str, int]]:
    """``{tier: {slug: bytes}}`` of one worker. At most ``MAX_TENANT_LABELS`` tenants per tier (the
    largest); the rest are folded into ``"other"``, so label sets stay bounded as the usage rows are."""
    per_block = int(snap.get("bytes_per_block") or 0)
    out: dict[str, dict[str, int]] = {}
    for tier, owners in (snap.get("resident_blocks") or {}).items():
        ranked = sorted(owners.items(), key=lambda kv: (-int(kv[1]), str(kv[0])))
        row: dict[str, int] = {}
        for i, (owner, blocks) in enumerate(ranked):
            label = slugs.get(str(owner), str(owner)) if i < MAX_TENANT_LABELS else OTHER
            row[label] = row.get(label, 0) + int(blocks) * per_block
        out[tier] = row
    return out


def cluster_stats(*, refresh: bool = False) -> dict:
    """The cluster's figures from the last sample of every replica (``runtime.samples``): never a call
    to a replica on this thread. ``refresh`` polls every replica first and waits for the answers: for
    background callers only (the time-series sampler, tests), never a request."""
    slugs = {str(pk): slug for pk, slug in Tenant.objects.values_list("pk", "slug")}
    workers: list[dict] = []
    totals = _usage_row()
    tenants: dict[str, dict] = {}
    tiers: dict[str, dict] = {}
    l3_scopes: dict[str, dict[str, int]] = {}  # deployment -> its L3 figures (any replica's: they agree)
    l3_resident: dict[str, dict[str, int]] = {}  # deployment -> {slug: bytes} in L3

    def tenant(slug: str) -> dict:
        return tenants.setdefault(slug, {"tenant": slug, **_usage_row(), "hit_requests": 0, "resident_bytes": {}})

    targets = []
    for deployment in ModelDeployment.objects.select_related("active_revision").filter(
            active_revision__isnull=False).order_by("name"):
        spec = gateway.spec_for(deployment)
        targets += [(spec, i) for i in gateway.replica_set(spec).indices()]
    if refresh:
        samples.store().refresh(targets)
    latest = samples.read(targets)
    stale: list[float | None] = []
    for spec, replica in targets:
        model = spec.deployment
        ident = {"model": model, "replica": replica, "name": actor_name(model, replica),
                 "routing": gateway.replica_set(spec).describe(replica)}
        snap = latest[(model, replica)]
        freshness = {k: snap.pop(k) for k in SAMPLE_KEYS if k in snap}
        if freshness["stale"]:
            stale.append(freshness["age_s"])
        if "totals" not in snap:  # no figures yet (never answered, starting, not started)
            workers.append({**ident, **freshness})
            continue
        for row in snap.get("usage", []):
            row["tenant"] = slugs.get(row["tenant"], row["tenant"])
            agg = tenant(row["tenant"])
            for key in (*USAGE_SUMS, *USAGE_FLOAT_SUMS):
                agg[key] += row.get(key, 0)
            histogram = row.get("hit_histogram") or []
            if histogram:  # bucket 0 = requests with no prefill skipped
                agg["hit_requests"] += row.get("requests", 0) - histogram[0]
        for key in totals:
            totals[key] += snap.get("totals", {}).get(key, 0)
        snap["tiers"] = worker_tiers(snap)
        for name, row in snap["tiers"].items():
            agg = tiers.setdefault(name, _tier_row())
            for key in (*TIER_SUMS, "load_seconds"):
                if name == "l3" and key in L3_SHARED:
                    continue  # the shared store's figures: taken once per deployment below
                agg[key] += row.get(key, 0)
            if name == "l3":
                l3_scopes[model] = {k: int(row.get(k, 0)) for k in L3_SHARED}
            for key in TIER_OPTIONAL_SUMS:
                if key in row:
                    agg[key] = agg.get(key, 0) + row[key]
            # Quantiles do not add up across workers: the cluster figure is the worst worker's
            # p50/p99 (an upper bound of the true cluster quantile), not a merged distribution.
            latency = row.get("load_latency") or {}
            for q in ("p50", "p99"):
                agg["load_latency"][q] = _max(agg["load_latency"][q], latency.get(q))
        snap["resident_bytes"] = worker_resident_bytes(snap, slugs)
        for tier, owners in snap["resident_bytes"].items():
            if tier == "l3":  # every replica of a deployment sees the same objects: once per deployment
                l3_resident[model] = owners
                continue
            for slug, nbytes in owners.items():
                resident = tenant(slug)["resident_bytes"]
                resident[tier] = resident.get(tier, 0) + nbytes
        workers.append({**ident, **snap, **freshness})
    _add_l3(tiers, l3_scopes, l3_resident, tenant)

    names = tier_names(tiers)
    for agg in tenants.values():
        _add_ratios(agg)
        agg["resident_bytes"] = {name: agg["resident_bytes"].get(name, 0)
                                 for name in tier_names({*names, *agg["resident_bytes"]})}
    _add_ratios(totals)
    return {
        "totals": totals,
        "tiers": {name: tiers[name] for name in names},
        "tenants": sorted(tenants.values(), key=lambda r: r["tenant"]),
        "workers": workers,
        "stale": bool(stale),  # some replica's figures are not fresh (see each worker's ``stale``)
        "stale_workers": len(stale),
    }
