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

A chat's ``part`` is found on demand (``ChatParts``): a binary search over prefixes of the chat, each
rendered and checked to be a prefix of the prompt, at most ``MAX_PART_RENDERS`` renders per request
(rendering every prefix costs the square of the chat's length). A search cut short by that budget
names no part, and the diagnosis then says ``"diagnostics_truncated": true``.

It only speaks of the tenant's own scope: a prefix another tenant cached was never seen here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from controlplane.caches import history as hist

LOAD_FAILED = {"failed": "the tier failed", "corrupt": "a stored block failed its integrity check",
               "unavailable": "the tier was unreachable"}
TOO_SLOW = {"late": "the load missed its deadline", "recompute": "recomputing was estimated faster"}
LEDGER_REASON = {"diverged_at": "diverged"}  # the ledger's name for a reason
MAX_PART_RENDERS = 16  # prefix renders per chat to name the message of a divergence (2**16 messages)


@dataclass
class ChatParts:
    """Which message of a chat holds a token of its rendered prompt, rendering prefixes only on demand.

    ``tokens``: the prompt as served; ``roles[i]``: message ``i``'s role; ``render(k)``: the first ``k``
    messages rendered without the generation prompt (``0 < k < len(roles)``). ``part_at`` renders at
    most ``max_renders`` prefixes over this object's life (``MAX_PART_RENDERS`` when built), each once;
    it trusts a render only when it is a prefix of ``tokens`` (a template that renders a message
    differently once another follows it gives no part, never a wrong one). A render that raises
    gives no part either; ``part_at`` itself never raises."""

    tokens: list[int]
    roles: list[str]
    render: Callable[[int], list[int]]
    max_renders: int = field(default_factory=lambda: MAX_PART_RENDERS)
    renders: int = field(default=0, init=False)  # prefixes rendered so far
    truncated: bool = field(default=False, init=False)  # a search stopped at ``max_renders``
    _starts: dict[int, int | None] = field(default_factory=dict, init=False, repr=False)

    def part_at(self, index: int) -> str | None:
        """``"system"`` or ``"messages[i]"``: the last message starting at or before token ``index``;
        None when the budget ran out first (``truncated``) or the template is not prefix-stable."""
        if not self.roles:
            return None
        lo, hi = 0, len(self.roles) - 1  # message lo starts at or before index; none after hi does
        while lo < hi:
            mid = (lo + hi + 1) // 2
            start = self._start(mid)
            if start is None:
                return None
            lo, hi = (mid, hi) if start <= index else (lo, mid - 1)
        return self._name(lo)

    def _start(self, k: int) -> int | None:
        """Where message ``k`` starts (the length of the first ``k`` rendered); None when unknown."""
        if k not in self._starts:
            if self.renders >= self.max_renders:
                self.truncated = True
                return None
            self.renders += 1
            try:
                ids = list(self.render(k))
            except Exception:  # a template that cannot render a prefix: no attribution, still a diagnosis
                ids = None
            self._starts[k] = len(ids) if ids is not None and ids == self.tokens[:len(ids)] else None
        return self._starts[k]

    def _name(self, i: int) -> str:
        return "system" if i == 0 and self.roles[0] in ("system", "developer") else f"messages[{i}]"


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
    parts: ChatParts | None = None  # chats: which message holds a token


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds")


def diagnose(req: Request, *, history: hist.PrefixHistory = hist.HISTORY, flushes=None,
             now: float | None = None, record: bool = True) -> dict:
    """The diagnosis of ``req`` (and, with ``record``, ``req``'s prompt remembered in scope), with
    ``"diagnostics_truncated": true`` when naming a chat's diverging message ran out of its budget.

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
                part = req.parts.part_at(at) if req.parts is not None else None
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
    out = {"prompt_tokens": n, "cached_tokens": cached, "reusable_tokens": cached + reusable, "lost": spans}
    if req.parts is not None and req.parts.truncated:
        out["diagnostics_truncated"] = True
    return out


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
