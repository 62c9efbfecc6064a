"""Eviction policies: the one seam every tier (L1, L2, L3) asks what to evict (``base``: the contract;
``fair_lru``: the default; ``value_aware``; ``registry``: by name)."""
