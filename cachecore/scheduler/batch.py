"""One step's batch within a token budget: decode tokens and prefill chunks, fair between tenants.

``build_batch`` is the policy, the loop (``loop.py``) the mechanism: it hands in the running set, the
waiting queue and ``try_start`` (admission, preemption, lower-tier loads), and gets back the items to
compute. Each tenant with work gets a token allowance for the step (``fairness.plan_step``: weighted
max-min over what its decodes, prefill chunks and startable waiting requests could compute) and may
start new requests only up to its share of the running slots (``fairness.slot_shares``). Order:
decodes within their tenant's allowance (planned first, so admission never preempts them), overdue
waiting requests (oldest first: the aging bound goes before fairness), then chunks by the fair queue
between tenants (lowest virtual time first), each within its tenant's allowance; within a tenant its
requests already prefilling, then waiting ones by ``queue.order_key``. What allowances could not use
(a prefetch in flight, a request held behind a shared prefix) goes to the others' remaining items, so
the step stays work conserving. A lean step (a tenant below its share has a first-token prefill)
carries that tenant's work and at most ``lean_budget`` tokens of everyone else's; if that tenant
cannot start after all, the step is filled as usual. Under ``cache_aware`` a waiting request whose
next block is being computed in this very batch by another request is held back one step: it will
hit that block instead of computing it twice (requests sharing a prefix are grouped behind the one
that computes it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from cachecore.scheduler.fairness import TenantDemand, plan_step, slot_shares
from cachecore.scheduler.queue import CachedPrefixes, FairQueue, is_overdue, order_key
from cachecore.scheduler.request import Request, State

Item = tuple[Request, int, int]  # compute seq.tokens[start:end] of the request


@dataclass
class Plan:
    items: list[Item] = field(default_factory=list)
    started: list[Request] = field(default_factory=list)  # waiting requests that start this step
    deferred: int = 0  # waiting requests held back behind a shared prefix computed this step
    lean: bool = False  # kept short for the first token of a tenant below its share

    @property
    def tokens(self) -> int:
        return sum(end - start for _, start, end in self.items)


def _block_range(start: int, end: int, bs: int) -> range:
    return range(start // bs, -(-end // bs))


def _follows(req: Request, computing: set[bytes] | frozenset[bytes], index: CachedPrefixes, bs: int) -> bool:
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
    index: CachedPrefixes,
    block_size: int,
    try_start: Callable[[Request, Plan], bool],
    computing: frozenset[bytes] = frozenset(),
    lean_budget: int = 8,
    urgent_budget: int | None = None,
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
    decodes: dict[str, list[Request]] = {}
    prefilling: dict[str, list[Request]] = {}
    for req in running:
        if len(req.seq.tokens) - req.seq.num_computed == 1:
            decodes.setdefault(req.owner, []).append(req)
        else:
            prefilling.setdefault(req.owner, []).append(req)
    left = token_budget
    slots = max_batch - len(running)
    blocked = None  # rid of the oldest overdue request that could not start: younger ones wait for it
    active: dict[str, int] = {}  # running requests per tenant (slot shares)
    for req in running:
        active[req.owner] = active.get(req.owner, 0) + 1
    allow: dict[str, int] = {}  # this step's token allowance per tenant (``fairness.plan_step``)

    def take(req: Request, cap: int | None) -> None:
        nonlocal left, slots, blocked
        room = left if cap is None else min(left, cap)
        if room <= 0:
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
            active[req.owner] = active.get(req.owner, 0) + 1
            plan.started.append(req)
        seq = req.seq
        start = seq.num_computed
        end = min(len(seq.tokens), start + req.chunk, start + room)
        add(req, start, end)
        left -= end - start
        allow[req.owner] = allow.get(req.owner, 0) - (end - start)

    key = dict(step=step, age_steps=age_steps, policy=policy, index=index, block_size=bs)
    taken = {id(r) for r in overdue}
    queued: dict[str, list[Request]] = {}
    for req in sorted((r for r in waiting if id(r) not in taken), key=lambda r: order_key(r, **key)):
        queued.setdefault(req.owner, []).append(req)
    owners = {*decodes, *prefilling, *queued}
    counts = {o: active.get(o, 0) + len(queued.get(o, [])) for o in owners}
    slot_cap = slot_shares(counts, {o: fair.weight(o) for o in owners}, max_batch)
    per_tenant: dict[str, list[Request]] = {}
    demands = []
    for owner in sorted(owners):
        startable = queued.get(owner, [])[:max(0, slot_cap[owner] - active.get(owner, 0))]
        per_tenant[owner] = [*prefilling.get(owner, []), *startable]
        tokens = len(decodes.get(owner, [])) + sum(
            min(r.chunk, len(r.tokens) - (r.seq.num_computed if r.seq is not None else 0)) for r in per_tenant[owner])
        first = any(not r.prefilled for r in per_tenant[owner])
        demands.append(TenantDemand(owner, fair.weight(owner), fair.vtime(owner), tokens, first))
    shares = plan_step(demands, budget=left, lean_budget=lean_budget, urgent_budget=urgent_budget)
    allow.update(shares.allowance)
    plan.lean = shares.lean
    left = shares.budget if shares.lean else left  # a lean step may pass a contended bound for the victim
    # decodes within their tenant's allowance first: planned before any admission, so none is preempted;
    # decodes beyond it (a lean step, or a tenant over its share) wait a step
    for owner in shares.order:
        later = []
        for req in decodes.get(owner, []):
            if allow.get(owner, 0) > 0 and left > 0:
                take(req, None)
            else:
                later.append(req)
        per_tenant[owner][:0] = later
    for req in overdue:  # the aging bound goes before fairness (charged to its tenant's allowance)
        take(req, None)

    def pick(capped: bool) -> None:
        """Items by the fair queue (lowest virtual time first); ``capped``: within allowances."""
        cursor = {o: 0 for o, q in per_tenant.items() if q}
        while left > 0 and cursor:
            owner = min(cursor, key=lambda o: (fair.vtime(o), o))
            queue = per_tenant[owner]
            req = queue[cursor[owner]]
            cursor[owner] += 1
            if cursor[owner] >= len(queue):
                del cursor[owner]
            if capped and allow.get(owner, 0) <= 0:
                cursor.pop(owner, None)
                continue
            if id(req) in tried:
                continue
            tried.add(id(req))
            # still where it was at the start of the step (a request preempted this step waits for the next)
            if (req.state is State.WAITING) == (id(req) in was_waiting) and req.state is not State.DONE:
                take(req, allow.get(owner, 0) if capped else None)

    tried: set[int] = set(taken)
    tried.update(id(r) for r, _, _ in plan.items)
    pick(capped=True)
    if shares.lean and not any(r.owner == shares.urgent for r, _, _ in plan.items):
        # the tenant the step was kept short for could not start (its prefetch is in flight, no blocks):
        # nobody's first token waits on this step, so the others may use the whole budget
        plan.lean = False
        left = token_budget - plan.tokens
    if not plan.lean:
        # work conserving: what a tenant's allowance could not use (a prefetch in flight, a request held
        # behind a shared prefix) goes to the others' remaining items
        for owner in per_tenant:
            per_tenant[owner] = [r for r in per_tenant[owner] if id(r) not in tried]
        pick(capped=False)
    return plan
