"""Fair shares of one scheduler step between tenants: tokens and running slots, weighted max-min.

Engine-independent on purpose (no engine, model or request type here): the reference scheduler's batch
builder (``batch.py``) calls it every step, and an admission layer in front of another engine (vLLM's
scheduler takes a token budget per step too) can call it with the same inputs.

Contract of ``plan_step``: given, for every tenant with work this step, its weight (``share_weight``),
its virtual time (tokens served divided by weight, ``queue.FairQueue``) and its demand (the tokens its
running decodes, prefill chunks and startable waiting requests could compute this step, and whether one
of them is a prompt prefill before its first token), and the step's token budget, it returns each
tenant's token allowance for the step:

- **weighted max-min fair** (water-filling): a tenant demanding less than its weighted share of the
  budget gets its whole demand, the rest is split among the others by weight; so a tenant flooding with
  30 running requests gets what the others leave, and a tenant with one request gets its full chunk
  when that is within its share;
- **work conserving**: the allowances add up to ``min(budget, total demand)``; a tenant alone gets
  the whole budget;
- **latency-aware** (``lean``): when a tenant below its share (behind every other tenant by more than
  one full step of its own tokens: one that was idle and just sent work, never the see-saw between
  tenants that are both backlogged, which is split by weight within each step) has a prompt prefill
  waiting for its first token, it goes first with its whole demand (within ``urgent_budget``, the
  uncontended budget; its credit is bounded by the fair queue's quantum) and the step is bounded to that plus
  ``lean_budget`` tokens for all the others together, split among them by weight (the caller puts
  their decodes first: decodes beyond that wait a step). A step's time grows with its tokens, so the
  victim's first token costs short steps, not full budgets of the flooder's work.

``slot_shares`` splits the running slots (``max_batch``) the same way over request counts: a tenant
at or above its share starts no new request while another tenant's waiting request is below its own.

``step_budget`` and ``RecentTenants`` bound the step itself while tenants contend: a request arriving
mid-step waits for the step in flight, so while two or more tenants had work within the last
``window`` steps, each step carries at most ``contended_budget`` tokens (a tenant alone keeps the full
budget). The flooder's steps get shorter, not fewer: the device never idles while there is work.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TenantDemand:
    """One tenant's work this step. ``tokens``: what it could compute (decode tokens + chunk sizes);
    ``prefill_first``: one of those is a prompt prefill before its request's first token."""

    owner: str
    weight: float
    vtime: float
    tokens: int
    prefill_first: bool = False


@dataclass(frozen=True)
class StepShares:
    """``allowance``: tokens each tenant may compute this step (sums to ``budget`` at most);
    ``budget``: the step's token bound (the full budget, or the lean bound); ``order``: tenants by
    priority (below their share first); ``lean``: the step is bounded for ``urgent``'s first token."""

    allowance: dict[str, int]
    budget: int
    order: tuple[str, ...]
    lean: bool = False
    urgent: str | None = None


def water_fill(demands: Mapping[str, int], weights: Mapping[str, float], budget: int,
               order: Sequence[str] = ()) -> dict[str, int]:
    """Weighted max-min fair integer split of ``budget`` over ``demands``: each owner gets
    ``min(demand, level * weight)`` for the one level that uses ``min(budget, sum of demands)``. Rounding
    leftovers go to owners earlier in ``order`` (then by name). Weights must be > 0, demands >= 0."""
    alloc = {o: 0 for o in demands}
    rank = {o: i for i, o in enumerate(order)}
    active = sorted((o for o, d in demands.items() if d > 0), key=lambda o: (demands[o] / weights[o], o))
    left = max(0, budget)
    wsum = sum(weights[o] for o in active)
    for i, owner in enumerate(active):
        if left <= 0:
            break
        if demands[owner] <= left * weights[owner] / wsum:
            alloc[owner] = demands[owner]
            left -= demands[owner]
            wsum -= weights[owner]
            continue
        rest = active[i:]  # every remaining owner wants more than its share: split what is left by weight
        for o in rest:
            alloc[o] = int(left * weights[o] / wsum)
        spare = left - sum(alloc[o] for o in rest)
        for o in sorted(rest, key=lambda o: (rank.get(o, len(rank)), o))[:spare]:
            alloc[o] += 1  # demand > share >= floor(share), so one more never exceeds the demand
        break
    return alloc


def slot_shares(requests: Mapping[str, int], weights: Mapping[str, float], max_batch: int) -> dict[str, int]:
    """Running slots each owner may hold: ``requests`` is its running plus waiting request count."""
    return water_fill(requests, weights, max_batch)


class RecentTenants:
    """Tenants that had work within the last ``window`` steps (not thread-safe: the loop thread's)."""

    def __init__(self, window: int) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int, got {window!r}")
        self.window = window
        self._last: dict[str, int] = {}

    def note(self, owners: Iterable[str], step: int) -> int:
        """``owners`` have work at ``step``; returns how many tenants had work within the window."""
        for owner in owners:
            self._last[owner] = step
        for owner in [o for o, last in self._last.items() if step - last >= self.window]:
            del self._last[owner]
        return len(self._last)


def step_budget(budget: int, *, recent: int, contended_budget: int) -> int:
    """The step's token bound: ``budget``, or ``contended_budget`` (when > 0) while ``recent`` > 1
    tenants contend."""
    return min(budget, contended_budget) if recent > 1 and contended_budget > 0 else budget


def plan_step(tenants: Sequence[TenantDemand], *, budget: int, lean_budget: int,
              urgent_budget: int | None = None) -> StepShares:
    """Token allowances of one step (see the module docstring). ``urgent_budget`` (default ``budget``):
    what a below-share tenant's first-token prefill may take in a lean step (the uncontended budget, so
    a bounded step never cuts the victim's own chunk)."""
    order = tuple(t.owner for t in sorted(tenants, key=lambda t: (t.vtime, t.owner)))
    weights = {t.owner: t.weight for t in tenants}
    demands = {t.owner: max(0, t.tokens) for t in tenants}
    shares = water_fill(demands, weights, budget, order)
    urgent = None
    total = max(budget, urgent_budget or 0)
    if len(tenants) > 1:
        low = min(tenants, key=lambda t: (t.vtime, t.owner))
        lag = min(t.vtime for t in tenants if t is not low) - low.vtime  # in virtual time: tokens / weight
        if low.prefill_first and lag * low.weight > total:
            urgent = low
    if urgent is None:
        return StepShares(shares, budget, order)
    others = {o: d for o, d in demands.items() if o != urgent.owner}
    mine = min(demands[urgent.owner], total)
    rest = water_fill(others, weights, max(0, min(lean_budget, total - mine)), order)
    return StepShares({urgent.owner: mine, **rest}, mine + sum(rest.values()), order, True, urgent.owner)
