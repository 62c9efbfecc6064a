"""Why a request's prompt was not reused: one reason per lost span, from the tenant's own history
(``caches.history``), the worker's account of this request (cached tokens per tier, why a load stopped
short, which replica served) and the control plane's own records (flush jobs, revisions, retention).

Spans cover ``[cached_tokens, prompt_tokens)``; reasons:

- ``below_block``: the tail that can never be reused (less than a full block, and the last prompt
  token, whose logits are needed);
- seen in scope before but not reused: ``deleted`` (the tenant deleted a named cache holding it:
  ``cache``), ``revision_changed`` (it was cached under another revision),
  ``flushed`` (a flush or rollout job covering it finished since: ``job``), ``load_failed`` /
  ``too_slow_to_load`` (a tier held it, the load did not arrive: ``tier``-less ``detail``),
  ``expired`` (older than the retention its KV was kept under), ``routed_elsewhere`` (another replica
  served it, and it was not persisted where every replica reads), else ``evicted`` (dropped by every
  tier that held it, some time after ``last_seen``);
- never seen: ``diverged_at`` (``index``: the first token that differs from the longest prefix seen
  in scope, and ``part`` for chats: ``system`` or ``messages[i]``) or ``no_prior_request``.

It only speaks of the tenant's own scope: a prefix another tenant cached was never seen here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime

from controlplane.caches import history as hist

LOAD_FAILED = {"failed": "the tier failed", "corrupt": "a stored block failed its integrity check",
               "unavailable": "the tier was unreachable"}
TOO_SLOW = {"late": "the load missed its deadline", "recompute": "recomputing was estimated faster"}
LEDGER_REASON = {"diverged_at": "diverged"}  # the ledger's name for a reason


@dataclass(frozen=True)
class Request:
    """What the diagnosis needs of one served request."""

    tenant: str
    tenant_salt: bytes
    model: str
    cache_salt: str | None
    tokens: list[int]
    block_size: int
    revision: str
    persist: bool
    retention_seconds: int
    usage: dict  # the worker's finished usage
    parts: list[tuple[int, str]] | None = None  # chats: (first token, "system" | "messages[i]")


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds")


def _part(parts: list[tuple[int, str]] | None, index: int) -> str | None:
    found = None
    for start, name in parts or ():
        if start <= index:
            found = name
    return found


def diagnose(req: Request, *, history: hist.PrefixHistory = hist.HISTORY, flushes=None,
             now: float | None = None, record: bool = True) -> dict:
    """The diagnosis of ``req`` (and, with ``record``, ``req``'s prompt remembered in scope).

    ``flushes(since: float) -> job id | None``: the newest flush of this tenant and model finished
    after ``since`` (the control plane's jobs)."""
    now = time.time() if now is None else now
    bs, n = req.block_size, len(req.tokens)
    key = hist.scope_key(req.tenant_salt, req.model, req.cache_salt)
    scope = (req.tenant, req.model, req.cache_salt or "")
    chain = hist.digests(key, req.tokens, bs)
    seen_blocks, seen = history.lookup(scope, chain)
    usage = req.usage
    cached = int(usage.get("cached_tokens", 0))
    usable = max(0, (n - 1) // bs * bs)
    spans: list[dict] = []
    seen_end = min(seen_blocks * bs, usable)
    if seen_end > cached:
        first = seen[cached // bs]
        spans.append({"start": cached, "end": seen_end, **_seen_reason(req, first, usage, flushes, now)})
    start = max(cached, seen_end)
    new_masks: dict[int, bytes] = {}
    if start < usable or (record and seen_blocks < len(chain)):
        parent = chain[seen_blocks - 1] if seen_blocks else hist.ROOT
        if seen_blocks < len(chain):
            mine = hist.masks(key, parent, req.tokens[seen_blocks * bs:(seen_blocks + 1) * bs])
            new_masks[seen_blocks] = mine
            same = max((_common(mine, other) for other in history.siblings(scope, parent)), default=-1)
        else:
            same = -1
        if start < usable:
            if seen_blocks == 0 and same <= 0:
                spans.append({"start": start, "end": usable, "reason": "no_prior_request"})
            else:
                at = seen_blocks * bs + max(0, same)
                span = {"start": start, "end": usable, "reason": "diverged_at", "index": at}
                part = _part(req.parts, at)
                if part is not None:
                    span["part"] = part
                spans.append(span)
    if usable < n:
        spans.append({"start": max(usable, cached), "end": n, "reason": "below_block"})
    for s in spans:
        s["tokens"] = s["end"] - s["start"]
    if record:
        for i in range(seen_blocks + 1, len(chain)):
            new_masks[i] = hist.masks(key, chain[i - 1], req.tokens[i * bs:(i + 1) * bs])
        tail = None
        if n % bs:
            last = chain[-1] if chain else hist.ROOT
            rest = req.tokens[len(chain) * bs:]
            tail = (hist.tail_digest(key, last, rest), hist.masks(key, last, rest))
        history.record(scope, chain, new_masks, replica=str(usage.get("replica") or ""), revision=req.revision,
                       persist=req.persist, at=now, tail=tail)
    reusable = sum(s["tokens"] for s in spans if s["reason"] not in ("no_prior_request", "diverged_at",
                                                                      "below_block", "deleted"))
    return {"prompt_tokens": n, "cached_tokens": cached, "reusable_tokens": cached + reusable, "lost": spans}


def misses(diagnosis: dict) -> dict[str, int]:
    """Tokens lost per reason (the ledger's counters)."""
    out: dict[str, int] = {}
    for s in diagnosis["lost"]:
        name = LEDGER_REASON.get(s["reason"], s["reason"])
        out[name] = out.get(name, 0) + s["tokens"]
    return out


def _common(a: bytes, b: bytes) -> int:
    """Leading tokens two mask strings share."""
    k = 0
    while k * 4 + 4 <= min(len(a), len(b)) and a[k * 4:k * 4 + 4] == b[k * 4:k * 4 + 4]:
        k += 1
    return k


def _seen_reason(req: Request, first: hist.Seen, usage: dict, flushes, now: float) -> dict:
    if first.deleted:
        return {"reason": "deleted", "cache": first.deleted}
    if first.revision and first.revision != req.revision:
        return {"reason": "revision_changed", "cached_under": first.revision}
    job = flushes(first.at) if flushes is not None else None
    if job is not None:
        return {"reason": "flushed", "job": job}
    stop = usage.get("load_stop")
    if stop in LOAD_FAILED:
        return {"reason": "load_failed", "detail": LOAD_FAILED[stop]}
    if stop in TOO_SLOW:
        return {"reason": "too_slow_to_load", "detail": TOO_SLOW[stop]}
    if stop == "expired" or (first.persist and now - first.at > req.retention_seconds):
        return {"reason": "expired", "last_seen": _iso(first.at)}
    if first.replica and usage.get("replica") and first.replica != usage.get("replica") and not first.persist:
        return {"reason": "routed_elsewhere", "last_seen": _iso(first.at)}
    tiers = ["l1", "l2"] + (["l3"] if first.persist else [])
    return {"reason": "evicted", "tiers": tiers, "after": _iso(first.at)}
