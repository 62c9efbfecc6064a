"""One step's batch within a token budget: every running request's decode token, then prefill chunks.

``build_batch`` is the policy, the loop (``loop.py``) the mechanism: it hands in the running set, the
waiting queue and ``try_start`` (admission, preemption, lower-tier loads), and gets back the items to
compute. Order of the prefill budget: overdue waiting requests first (oldest first), then chunks by
the fair queue between tenants, and within a tenant its requests already prefilling, then waiting
ones by ``queue.order_key``. A step in which a tenant behind its fair share (an idle tenant that just
sent a request, under a tenant's burst) starts a request carries no other tenant's prefill chunks:
its time to first token is one short step, not a full budget's. Under ``cache_aware`` a waiting
request whose next block is being computed in this very batch by another request is held back one
step: it will hit that block instead of computing it twice (requests sharing a prefix are grouped
behind the one that computes it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from cachecore.scheduler.queue import FairQueue, PrefixIndex, is_overdue, order_key
from cachecore.scheduler.request import Request, State

Item = tuple[Request, int, int]  # compute seq.tokens[start:end] of the request


@dataclass
class Plan:
    items: list[Item] = field(default_factory=list)
    started: list[Request] = field(default_factory=list)  # waiting requests that start this step
    deferred: int = 0  # waiting requests held back behind a shared prefix computed this step
    lean: bool = False  # kept short for a request of a tenant behind its share (its time to first token)

    @property
    def tokens(self) -> int:
        return sum(end - start for _, start, end in self.items)


def _block_range(start: int, end: int, bs: int) -> range:
    return range(start // bs, -(-end // bs))


def _follows(req: Request, computing: set[bytes] | frozenset[bytes], index: PrefixIndex, bs: int) -> bool:
    """Whether the first block of ``req``'s prompt that is neither held nor known committed is one
    another request is computing now (uncommitted blocks of running requests, or this step's)."""
    seq = req.seq
    hashes = seq.hashes if seq is not None else req.extra.get("hashes", [])
    limit = (len(req.tokens) - 1) // bs
    done = seq.num_computed // bs if seq is not None else 0
    nxt = max(done, index.prefix_blocks(hashes, limit))
    return nxt < min(limit, len(hashes)) and hashes[nxt] in computing


def build_batch(
    running: list[Request],
    waiting: list[Request],
    *,
    step: int,
    token_budget: int,
    max_batch: int,
    fair: FairQueue,
    policy: str,
    age_steps: int,
    index: PrefixIndex,
    block_size: int,
    try_start: Callable[[Request, Plan], bool],
    computing: frozenset[bytes] = frozenset(),
) -> Plan:
    """Plan one step. ``try_start(req, plan)`` makes a waiting request computable (admitted, its
    loads landed) or returns False (no blocks even after preemption, or its prefetch still in
    flight); it may preempt requests that have no item in ``plan`` yet (they leave ``running`` and
    rejoin ``waiting``, and are not taken again this step). ``computing``: prompt blocks running
    requests will compute and have not committed (a waiting request that needs one next waits for
    it, under ``cache_aware``, until it is overdue)."""
    plan = Plan()
    inflight: set[bytes] = set()
    bs = block_size
    was_waiting = {id(r) for r in waiting}

    def add(req: Request, start: int, end: int) -> None:
        plan.items.append((req, start, end))
        hashes = req.seq.hashes
        inflight.update(hashes[i] for i in _block_range(start, end, bs) if i < len(hashes))
        fair.grant(req.owner)
        fair.charge(req.owner, end - start)

    overdue = sorted((r for r in waiting if is_overdue(r, step, age_steps)), key=lambda r: r.rid)
    # overdue requests are admitted before anything is planned, so they may preempt any younger
    # running request (planned ones are safe from preemption)
    room = max_batch - len(running)
    for req in overdue:
        if room <= 0 or not try_start(req, plan):
            break
        room -= 1
    prefilling = []
    for req in running:
        remaining = len(req.seq.tokens) - req.seq.num_computed
        if remaining == 1:
            add(req, req.seq.num_computed, len(req.seq.tokens))
        else:
            prefilling.append(req)
    left = token_budget - len(plan.items)
    slots = max_batch - len(running)
    blocked = None  # rid of the oldest overdue request that could not start: younger ones wait for it

    def take(req: Request) -> None:
        nonlocal left, slots, blocked
        if left <= 0:
            return
        if req.state is State.WAITING:
            overdue = is_overdue(req, step, age_steps)
            if policy == "cache_aware" and not overdue and _follows(req, computing | inflight, index, bs):
                plan.deferred += 1  # another request is computing its next block: it will hit it
                return
            if (blocked is not None and req.rid > blocked) or slots <= 0 or not try_start(req, plan):
                if overdue and req.state is State.WAITING:
                    blocked = req.rid if blocked is None else min(blocked, req.rid)
                return
            seq = req.seq
            nxt = seq.num_computed // bs
            if (policy == "cache_aware" and not overdue and nxt < len(seq.hashes)
                    and seq.hashes[nxt] in inflight):
                plan.deferred += 1
                return
            slots -= 1
            plan.started.append(req)
        seq = req.seq
        start = seq.num_computed
        end = min(len(seq.tokens), start + req.chunk, start + left)
        add(req, start, end)
        left -= end - start

    key = dict(step=step, age_steps=age_steps, policy=policy, index=index, block_size=bs)
    for req in overdue:
        take(req)
    taken = {id(r) for r in overdue}
    per_tenant: dict[str, list[Request]] = {}
    for req in prefilling:
        per_tenant.setdefault(req.owner, []).append(req)
    for req in sorted((r for r in waiting if id(r) not in taken), key=lambda r: order_key(r, **key)):
        per_tenant.setdefault(req.owner, []).append(req)
    cursor = {owner: 0 for owner in per_tenant}
    lean = None  # a tenant behind its share started a request: the step carries no one else's prefill
    while left > 0 and cursor:
        owner = min(cursor, key=lambda o: (fair.vtime(o), o))
        if lean is not None and owner != lean:
            break
        behind = all(fair.vtime(owner) < fair.vtime(o) for o in cursor if o != owner) and len(cursor) > 1
        queue = per_tenant[owner]
        req = queue[cursor[owner]]
        cursor[owner] += 1
        if cursor[owner] >= len(queue):
            del cursor[owner]
        # still where it was at the start of the step (a request preempted this step waits for the next)
        if (req.state is State.WAITING) == (id(req) in was_waiting) and req.state is not State.DONE:
            before = len(plan.started)
            take(req)
            if behind and len(plan.started) > before:
                lean = owner  # its first token comes after this step: keep the step short
    plan.lean = lean is not None
    return plan
