"""KV capacity hints: what each replica's cache holds, in tokens and in sequences of the model's full
context, so that an operator sees a 256 MiB cache for what it is.

The figures come from the replica's last stats sample (``runtime.samples``, never a call to the
replica): its block size (``pool.block_size``), bytes per block and each tier's ``capacity_blocks``
(L1 device pages, L2 host pool, L3 when its store is sized: the store is shared by every
deployment on it). The context length is the model's (``serving.model_facts``: the preset's or the
checkpoint's ``max_position_embeddings``). A sequence of the full context takes
``ceil(context / block_size)`` blocks, so ``sequences`` is the tier's blocks divided by that.
"""

from __future__ import annotations

import logging
from typing import Any

from controlplane.registry.models import ModelDeployment
from controlplane.runtime import gateway, samples

logger = logging.getLogger("controlplane.runtime")

TIERS = ("l1", "l2", "l3")
TIER_NAMES = {"l1": "device pages (L1)", "l2": "host pool (L2)", "l3": "shared store (L3)"}


def context_tokens(deployment: ModelDeployment) -> int | None:
    """The model's full context length in tokens; None when its checkpoint cannot be read now."""
    from controlplane.common.errors import Unavailable
    from controlplane.serving.model_facts import model_facts

    if deployment.active_revision_id is None:
        return None
    try:
        return int(model_facts(deployment).max_seq_len)
    except Unavailable as exc:
        logger.info("no context length for %s: %s", deployment.name, exc.message)
        return None


def replica_capacity(snap: dict, *, context: int | None) -> dict[str, Any] | None:
    """Capacity of one replica from its stats sample: ``{"block_size", "bytes_per_block", "tiers":
    {tier: {"blocks", "tokens", "bytes", "sequences"}}, "tokens", "sequences"}`` (totals over the
    tiers; ``sequences`` None without a context length). None when the sample has no layout yet."""
    block_size = int((snap.get("pool") or {}).get("block_size") or 0)
    per_block = int(snap.get("bytes_per_block") or 0)
    if block_size <= 0:
        return None
    per_sequence = -(-context // block_size) if context else 0
    tiers: dict[str, dict[str, Any]] = {}
    for name in TIERS:
        row = (snap.get("tiers") or {}).get(name) or {}
        blocks = int(row.get("capacity_blocks") or 0)
        if blocks <= 0:  # no such tier, or an L3 store of unbounded size
            continue
        tiers[name] = {"label": TIER_NAMES[name], "blocks": blocks, "tokens": blocks * block_size,
                       "bytes": int(row.get("capacity_bytes") or blocks * per_block),
                       "sequences": blocks // per_sequence if per_sequence else None}
    own = [t for name, t in tiers.items() if name != "l3"]  # L3 is shared: not this replica's own
    return {"block_size": block_size, "bytes_per_block": per_block, "context_tokens": context,
            "blocks_per_sequence": per_sequence or None, "tiers": tiers,
            "tokens": sum(t["tokens"] for t in own),
            "sequences": sum(t["sequences"] for t in own) if per_sequence else None}


def capacity_by_model(deployments) -> dict[str, list[dict[str, Any]]]:
    """``{deployment name: [each replica's capacity]}`` (see :func:`deployment_capacity`), from one
    read of the samples of every replica of ``deployments``."""
    deployments = [d for d in deployments if d.active_revision_id is not None]
    targets = {d.name: [(spec, i) for spec in [gateway.spec_for(d)] for i in gateway.replica_set(spec).indices()]
               for d in deployments}
    latest = samples.read([t for ts in targets.values() for t in ts])
    return {d.name: _rows(d, [i for _, i in targets[d.name]], latest) for d in deployments}


def deployment_capacity(deployment: ModelDeployment) -> list[dict[str, Any]]:
    """Each replica of ``deployment``: ``{"replica", "status", "stale", "age_s", "sampled_at",
    "context_tokens", **replica_capacity}`` from its last sample (no figures before it has one)."""
    return capacity_by_model([deployment]).get(deployment.name, [])


def _rows(deployment: ModelDeployment, replicas: list[int], latest: dict) -> list[dict[str, Any]]:
    context = context_tokens(deployment)
    out = []
    for replica in replicas:
        snap = latest.get((deployment.name, replica)) or {"status": "pending", "stale": True}
        row = {"replica": replica, **{k: snap.get(k) for k in ("status", "stale", "age_s", "sampled_at")},
               "context_tokens": context}
        figures = replica_capacity(snap, context=context) if "tiers" in snap else None
        if figures is not None:
            row.update(figures)
        out.append(row)
    return out
