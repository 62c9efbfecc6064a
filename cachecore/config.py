"""Typed configuration of the engine, validated when built. Environment variables are not read here:
the worker reads them in one place (``workers/config.py``) and builds this."""

from __future__ import annotations

from dataclasses import dataclass

from cachecore.eviction.registry import DEFAULT_EVICTION_POLICY, EVICTION_POLICIES

WRITE_POLICIES = ("write_back", "write_through", "selective")
LOAD_POLICIES = ("cost", "always_load", "always_recompute")


@dataclass(frozen=True)
class EngineConfig:
    """``l2_blocks``: blocks in the host-memory tier (0 disables L2). ``write_policy``: how blocks reach
    L2 (``write_back`` on eviction from L1, the default; ``write_through`` after commit, off the request's
    path; ``selective``: write back only blocks reused at least ``selective_min_hits`` times).
    ``load_policy``: ``cost`` (load a lower-tier prefix only when its estimated load time beats
    recomputing it), or the two fixed baselines. ``load_deadline_s``: a load not done by then is a miss.
    ``pin_memory``: pin the L2 pool (None: when CUDA is present). ``eviction_policy``: which cached
    blocks every tier of the engine gives up first (L1, L2 and the L3 store it is given), a name of
    :data:`cachecore.eviction.registry.EVICTION_POLICIES` (``fair_lru``, the default, or
    ``value_aware``); fair sharing between tenants holds under each."""

    l2_blocks: int = 0
    write_policy: str = "write_back"
    selective_min_hits: int = 2
    load_policy: str = "cost"
    load_deadline_s: float = 0.5
    pin_memory: bool | None = None
    eviction_policy: str = DEFAULT_EVICTION_POLICY

    def __post_init__(self) -> None:
        if isinstance(self.l2_blocks, bool) or not isinstance(self.l2_blocks, int) or self.l2_blocks < 0:
            raise ValueError(f"l2_blocks must be an int >= 0, got {self.l2_blocks!r}")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {', '.join(WRITE_POLICIES)}, got {self.write_policy!r}")
        if self.load_policy not in LOAD_POLICIES:
            raise ValueError(f"load_policy must be one of {', '.join(LOAD_POLICIES)}, got {self.load_policy!r}")
        if not isinstance(self.eviction_policy, str) or self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be one of {', '.join(EVICTION_POLICIES)}, "
                             f"got {self.eviction_policy!r}")
        if not isinstance(self.selective_min_hits, int) or self.selective_min_hits < 1:
            raise ValueError(f"selective_min_hits must be an int >= 1, got {self.selective_min_hits!r}")
        if not self.load_deadline_s > 0:
            raise ValueError(f"load_deadline_s must be > 0, got {self.load_deadline_s!r}")
