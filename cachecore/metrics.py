"""Token-weighted cache metrics, per tenant and model, with bounded label sets.

The headline is token-weighted (``effective_hit_tokens / query_tokens``), never a request-level hit
rate: one 8K-token hit and one 16-token miss are not "50%". Everything here is plain Python data so
a snapshot crosses process boundaries (Ray, HTTP) without torch.

Thread-safety: callers (the engine) hold their own lock; this class does no locking.
"""

from __future__ import annotations

import bisect
import random
from collections import defaultdict
from dataclasses import asdict, dataclass, field

# Hit-length histogram bucket upper bounds, in tokens (the last bucket is open-ended).
HIT_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384)
MAX_TENANT_LABELS = 1000  # beyond this, tenants are folded into "other" (bounded label sets)
RESERVOIR = 2048  # latency samples kept per tier for p50/p99
MIN_COST_SAMPLE_TOKENS = 128  # prefills shorter than this do not update the per-token cost estimate


@dataclass
class UsageCounters:
    """Per (tenant, model) token counters."""

    requests: int = 0
    query_tokens: int = 0  # prompt tokens presented to the cache
    lookup_hit_tokens: int = 0  # tokens whose blocks the index said it holds
    load_success_tokens: int = 0  # tokens whose bytes actually arrived
    effective_hit_tokens: int = 0  # prefill actually skipped
    stored_tokens: int = 0
    hit_histogram: list[int] = field(default_factory=lambda: [0] * (len(HIT_BUCKETS) + 1))
    saved_prefill_seconds: float = 0.0
    prefill_seconds: float = 0.0


@dataclass
class TierCounters:
    """Per tier (l1, l2, l3) counters."""

    hits: int = 0
    hit_tokens: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    failures: int = 0
    corrupt_loads: int = 0
    late_loads: int = 0  # arrived after the deadline (the request had recomputed)
    fallbacks_to_recompute: int = 0
    promotions: int = 0  # blocks copied up from this tier into L1
    demotions: int = 0  # blocks written down into this tier
    skipped_writes: int = 0  # writes dropped because the tier's writer was too far behind
    load_seconds: float = 0.0
    _latencies: list[float] = field(default_factory=list, repr=False)
    _seen: int = 0

    def observe_latency(self, seconds: float, rng: random.Random) -> None:
        # Reservoir sampling keeps p50/p99 estimates bounded in memory.
        self._seen += 1
        if len(self._latencies) < RESERVOIR:
            self._latencies.append(seconds)
        else:
            j = rng.randrange(self._seen)
            if j < RESERVOIR:
                self._latencies[j] = seconds

    def percentiles(self) -> dict[str, float | None]:
        if not self._latencies:
            return {"p50": None, "p99": None}
        data = sorted(self._latencies)
        return {
            "p50": data[int(0.50 * (len(data) - 1))],
            "p99": data[int(0.99 * (len(data) - 1))],
        }


class CacheMetrics:
    """Collects counters; ``snapshot()`` returns them as plain dicts."""

    def __init__(self) -> None:
        self._usage: dict[tuple[str, str], UsageCounters] = defaultdict(UsageCounters)
        self._tiers: dict[str, TierCounters] = defaultdict(TierCounters)
        self._tenants: set[str] = set()
        self._rng = random.Random(0)
        self.promotions = 0
        self.flushed_blocks = 0
        self._sec_per_token: dict[str, float] = {}

    def _label(self, tenant: str) -> str:
        if tenant in self._tenants:
            return tenant
        if len(self._tenants) >= MAX_TENANT_LABELS:
            return "other"
        self._tenants.add(tenant)
        return tenant

    def usage(self, tenant: str, model: str) -> UsageCounters:
        return self._usage[(self._label(tenant), model)]

    def tier(self, name: str) -> TierCounters:
        return self._tiers[name]

    def tier_row(self, name: str) -> dict:
        """The snapshot row of one tier (what ``snapshot()["tiers"][name]`` holds)."""
        t = self._tiers[name]
        row = {k: v for k, v in asdict(t).items() if not k.startswith("_")}
        row.update(load_latency=t.percentiles())
        return row

    def record_query(
        self,
        *,
        tenant: str,
        model: str,
        query_tokens: int,
        lookup_hit_tokens: int,
        load_success_tokens: int,
        effective_hit_tokens: int,
    ) -> None:
        u = self.usage(tenant, model)
        u.requests += 1
        u.query_tokens += query_tokens
        u.lookup_hit_tokens += lookup_hit_tokens
        u.load_success_tokens += load_success_tokens
        u.effective_hit_tokens += effective_hit_tokens
        u.hit_histogram[bisect.bisect_left(HIT_BUCKETS, effective_hit_tokens)] += 1

    def record_prefill(self, *, tenant: str, model: str, seconds: float, computed: int, skipped: int) -> None:
        """Record a prefill's time. Saved time = skipped tokens x the model's per-token prefill cost,
        learned (moving average) from prefills long enough to measure it: a short tail after a long
        hit costs more per token (it attends over the whole prefix) and would overstate savings."""
        u = self.usage(tenant, model)
        u.prefill_seconds += seconds
        if computed >= MIN_COST_SAMPLE_TOKENS:
            rate = seconds / computed
            old = self._sec_per_token.get(model)
            self._sec_per_token[model] = rate if old is None else 0.8 * old + 0.2 * rate
        if skipped > 0 and model in self._sec_per_token:
            u.saved_prefill_seconds += self._sec_per_token[model] * skipped

    def observe_load(self, tier: str, *, tokens: int, nbytes: int, seconds: float) -> None:
        t = self._tiers[tier]
        t.hits += 1
        t.hit_tokens += tokens
        t.bytes_out += nbytes
        t.load_seconds += seconds
        t.observe_latency(seconds, self._rng)

    def snapshot(self, pool_gauges: dict[str, int] | None = None) -> dict:
        usage = []
        totals = UsageCounters()
        for (tenant, model), u in sorted(self._usage.items()):
            row = asdict(u)
            row.update(tenant=tenant, model=model, effective_hit_ratio=_ratio(u.effective_hit_tokens, u.query_tokens))
            usage.append(row)
            for name in ("requests", "query_tokens", "lookup_hit_tokens", "load_success_tokens",
                         "effective_hit_tokens", "stored_tokens"):
                setattr(totals, name, getattr(totals, name) + getattr(u, name))
            totals.saved_prefill_seconds += u.saved_prefill_seconds
            totals.prefill_seconds += u.prefill_seconds
        tiers = {name: self.tier_row(name) for name in sorted(self._tiers)}
        total = asdict(totals)
        total.pop("hit_histogram")
        total["effective_hit_ratio"] = _ratio(totals.effective_hit_tokens, totals.query_tokens)
        return {
            "totals": total,
            "usage": usage,
            "tiers": tiers,
            "pool": dict(pool_gauges or {}),
            "promotions": self.promotions,
            "flushed_blocks": self.flushed_blocks,
            "hit_buckets": list(HIT_BUCKETS),
        }


def _ratio(a: int, b: int) -> float:
    return round(a / b, 4) if b else 0.0
