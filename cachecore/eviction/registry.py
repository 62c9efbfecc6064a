"""The eviction policies by name: what ``EngineConfig.eviction_policy`` (and ``BlockPool`` /
``RemoteStore``'s ``eviction_policy``) choose from. A new policy is one module in this package and one
line here."""

from __future__ import annotations

from cachecore.eviction.base import EvictionPolicy
from cachecore.eviction.fair_lru import FairLRU
from cachecore.eviction.value_aware import ValueAware

__all__ = ["DEFAULT_EVICTION_POLICY", "EVICTION_POLICIES", "make_policy"]

#: name -> policy class (each store gets its own instance: a policy holds that store's state).
EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    FairLRU.name: FairLRU,
    ValueAware.name: ValueAware,
}

DEFAULT_EVICTION_POLICY = FairLRU.name


def make_policy(name: str = DEFAULT_EVICTION_POLICY) -> EvictionPolicy:
    """A fresh policy of the registered ``name``; ``ValueError`` naming the registered ones otherwise."""
    cls = EVICTION_POLICIES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"eviction_policy must be one of {', '.join(EVICTION_POLICIES)}, got {name!r}")
    return cls()
