"""Expected time to first token of a request on one replica: the router's cost model.

For a prompt of ``P`` tokens whose cached prefix on replica ``r`` reaches ``hit`` (cumulative per
tier, see ``Hit``)::

    TTFT_r = queue_r + sum over tier segments s of min(len(s) / load_rate_r[tier(s)], len(s) / prefill_rate_r)
             + (P - deepest hit) / prefill_rate_r

How each term is measured (the replica reports ``Rates`` and its queue in its ``router`` stats; the
benchmark's simulation feeds the true rates of its simulated replicas):

- ``queue_r``: the replica's ``queued_prefill_tokens`` (tokens it still has to prefill for requests
  already admitted) at its prefill rate. A replica prefills one request at a time, in admission order,
  so a new request starts when that backlog is done. Decoding is taken to run beside prefill and is
  not part of the estimate (``running`` and ``decode_step_s`` are reported for the load balancing
  rules and for how long a request stays on the replica, not for its first token).
- ``load_rate_r[tier]``: tokens of KV per second the replica's loads from that tier achieved (the
  engine's per-tier bandwidth average, ``cachecore.loadcost``, divided by the layout's bytes per
  token); ``l1`` is device memory, nothing to load (infinite rate).
- ``prefill_rate_r``: prompt tokens per second of the replica's measured prefills
  (``engine.record_prefill``, long prefills only).

Each segment is loaded or recomputed, whichever is cheaper, as the engine decides it
(``cachecore.loadcost``): a slow tier is never worse than recomputing. Pure Python, no framework.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = ["TIERS", "CostModel", "Hit", "Rates", "ReplicaState"]

#: Cache tiers from fastest to slowest (device pages, host memory, the remote store).
TIERS = ("l1", "l2", "l3")

#: A request's cached prefix on one replica, in tokens, cumulative by tier: the longest contiguous
#: prefix reachable using tiers up to and including that one. ``{"l1": 64, "l2": 128, "l3": 256}``
#: means [0, 64) is in L1, [64, 128) in L2 and [128, 256) in L3. Missing tiers reach no further than
#: the tier before them; an empty mapping (or a missing replica) is no hit.
Hit = Mapping[str, int]

_DEFAULT_LOAD = MappingProxyType({"l1": math.inf, "l2": 40_000.0, "l3": 4_000.0})


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")


@dataclass(frozen=True)
class Rates:
    """A replica's measured speeds. The defaults are conservative CPU figures of the reference model.

    ``load_tokens_per_s`` maps a tier to tokens of KV loaded per second. ``l1`` is device memory,
    nothing to load: infinite unless given. Another tier left out has no measured rate and its
    segment is costed as recomputed."""

    prefill_tokens_per_s: float = 2_000.0
    load_tokens_per_s: Mapping[str, float] = field(default_factory=lambda: _DEFAULT_LOAD)
    decode_step_s: float = 0.05

    def __post_init__(self) -> None:
        _positive("prefill_tokens_per_s", self.prefill_tokens_per_s)
        _positive("decode_step_s", self.decode_step_s)
        unknown = set(self.load_tokens_per_s) - set(TIERS)
        if unknown:
            raise ValueError(f"load_tokens_per_s: unknown tier(s) {sorted(unknown)}; tiers are {TIERS}")
        for tier, rate in self.load_tokens_per_s.items():
            _positive(f"load_tokens_per_s[{tier!r}]", rate)
        rates = {"l1": math.inf, **self.load_tokens_per_s}
        object.__setattr__(self, "load_tokens_per_s", MappingProxyType(rates))


@dataclass(frozen=True)
class ReplicaState:
    """What the router knows of one replica when it routes a request.

    ``queued_prefill_tokens``: tokens the replica still has to prefill for requests it has admitted
    (their prompts less the cached prefix each found at admission; the one being prefilled counts
    what is left of it). ``running``: requests decoding. ``queued_requests``: requests admitted and
    not yet past their first token (the pending count of SGLang's rule). ``cached_tokens``: tokens the
    replica holds in its caches (SGLang's "tree size"). ``capacity_tokens``: tokens its caches can
    hold, every tier together (0: not reported)."""

    replica_id: str
    rates: Rates = field(default_factory=Rates)
    queued_prefill_tokens: int = 0
    running: int = 0
    alive: bool = True
    queued_requests: int = 0
    cached_tokens: int = 0
    capacity_tokens: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.replica_id, str) or not self.replica_id:
            raise ValueError(f"replica_id must be a non-empty string, got {self.replica_id!r}")
        for name in ("queued_prefill_tokens", "running", "queued_requests", "cached_tokens", "capacity_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")


def segments(hit: Hit, prompt_tokens: int) -> list[tuple[str, int]]:
    """The hit as (tier, tokens) segments in prefix order, clipped to ``prompt_tokens``; empty
    segments (a tier reaching no further than the one before it) are left out. Raises ``ValueError``
    for an unknown tier or a negative length."""
    unknown = set(hit) - set(TIERS)
    if unknown:
        raise ValueError(f"hit: unknown tier(s) {sorted(unknown)}; tiers are {TIERS}")
    out: list[tuple[str, int]] = []
    reached = 0
    for tier in TIERS:
        end = hit.get(tier, reached)
        if isinstance(end, bool) or not isinstance(end, int) or end < 0:
            raise ValueError(f"hit[{tier!r}] must be an int >= 0, got {end!r}")
        end = min(end, prompt_tokens)
        if end > reached:
            out.append((tier, end - reached))
            reached = end
    return out


class CostModel:
    """Estimates from a replica's reported state (module docstring). Stateless and thread-safe."""

    def queue_wait_s(self, replica: ReplicaState) -> float:
        """Seconds until the replica starts prefilling a request admitted now."""
        return replica.queued_prefill_tokens / replica.rates.prefill_tokens_per_s

    def segment_s(self, rates: Rates, tier: str, tokens: int) -> tuple[float, bool]:
        """(seconds, loaded) for ``tokens`` cached in ``tier``: the cheaper of loading them and
        recomputing them; ``loaded`` is False when recomputing is cheaper (or the tier has no rate)."""
        recompute = tokens / rates.prefill_tokens_per_s
        rate = rates.load_tokens_per_s.get(tier)
        if rate is None:
            return recompute, False
        load = tokens / rate
        return (load, True) if load <= recompute else (recompute, False)

    def prefill_s(self, rates: Rates, prompt_tokens: int, hit: Hit) -> tuple[float, int]:
        """(seconds, loaded tokens) to bring a prompt of ``prompt_tokens`` to its first token once
        its prefill starts: each hit segment loaded or recomputed, whichever is cheaper, and the rest
        prefilled. ``loaded tokens`` counts the segments that were loaded (the effective hit)."""
        if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be an int >= 0, got {prompt_tokens!r}")
        seconds, loaded, covered = 0.0, 0, 0
        for tier, tokens in segments(hit, prompt_tokens):
            t, was_loaded = self.segment_s(rates, tier, tokens)
            seconds += t
            loaded += tokens if was_loaded else 0
            covered += tokens
        return seconds + (prompt_tokens - covered) / rates.prefill_tokens_per_s, loaded

    def expected_ttft_s(self, replica: ReplicaState, prompt_tokens: int, hit: Hit) -> float:
        """Queue wait + min(load, recompute) of each hit segment + prefill of the rest."""
        return self.queue_wait_s(replica) + self.prefill_s(replica.rates, prompt_tokens, hit)[0]
