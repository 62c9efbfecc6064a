"""The storage-tier contract, the same at L1 (device pages), L2 (host memory) and L3 (remote store).

Metadata hit and bytes delivered are different things: ``lookup`` answers from the index only,
``retrieve`` says with its mask which tokens really arrived. A failed, late or corrupt load is a miss
for that block and every block after it, never wrong bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

import torch

from cachecore.namespace import Namespace


class Retrieved(NamedTuple):
    """``kv``: ``[n_blocks, *page_shape]`` for the contiguous prefix that arrived; ``mask``: one bool per
    token of the query, True for the tokens whose KV is in ``kv`` (always a prefix of the query)."""

    kv: torch.Tensor
    mask: torch.Tensor


class Tier(ABC):
    """One storage tier. Only full blocks are ever stored or returned."""

    name: str

    @abstractmethod
    def lookup(self, ns: Namespace, tokens: Sequence[int], *, request_salt: bytes = b"") -> int:
        """Length in tokens of the contiguous cached prefix of ``tokens`` (a multiple of the block size).
        Never mutates eviction order or contents."""

    @abstractmethod
    def store(
        self, ns: Namespace, tokens: Sequence[int], kv: torch.Tensor, *, owner: str, request_salt: bytes = b""
    ) -> int:
        """Store the KV of the full blocks of ``tokens`` (``kv``: ``[n_blocks, *page_shape]``). Blocks
        already present are recognised and not stored twice. Returns the number of blocks newly stored."""

    @abstractmethod
    def retrieve(self, ns: Namespace, tokens: Sequence[int], *, request_salt: bytes = b"") -> Retrieved:
        """Copy out the KV of the longest cached prefix of ``tokens``; see :class:`Retrieved`."""
