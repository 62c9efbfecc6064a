"""Inflight: the L1 blocks each owner's running requests hold, and the per-owner limits on them.

A request is refused (``InflightLimit``) when its owner already holds blocks and the request would
take it past its limit; one request alone may exceed the limit (else a long prompt could never run),
and a limit of 0 admits nothing. The default limit is half the pool.

Not separately locked: every call happens under the engine's lock.
"""

from __future__ import annotations

from cachecore.errors import InflightLimit


class Inflight:
    def __init__(self, block_size: int, default_blocks: int) -> None:
        self.block_size = block_size
        self.default_blocks = default_blocks
        self._held: dict[str, int] = {}
        self._limits: dict[str, int] = {}

    def check(self, owner: str, blocks: int) -> None:
        """Raise ``InflightLimit`` unless ``owner`` may take ``blocks`` more now."""
        held, allowed = self.held(owner), self.limit(owner)
        if (held or not allowed) and held + blocks > allowed:
            raise InflightLimit("this tenant has too many tokens in flight; retry when a request finishes")

    def add(self, owner: str, blocks: int) -> None:
        self._held[owner] = self._held.get(owner, 0) + blocks

    def remove(self, owner: str, blocks: int) -> None:
        left = self._held.get(owner, 0) - blocks
        if left > 0:
            self._held[owner] = left
        else:
            self._held.pop(owner, None)

    def held(self, owner: str) -> int:
        return self._held.get(owner, 0)

    def limit(self, owner: str) -> int:
        """Blocks ``owner``'s running requests may hold at once."""
        return self._limits.get(owner, self.default_blocks)

    def set_limit(self, owner: str, max_tokens: int | None) -> None:
        """In tokens (``None``: the default; 0: none, never the default; any other value at least one
        block)."""
        if max_tokens is None:
            self._limits.pop(owner, None)
        else:
            tokens = int(max_tokens)
            self._limits[owner] = max(1, tokens // self.block_size) if tokens > 0 else 0

    def check_integrity(self, held: dict[str, int]) -> None:
        """``held``: the blocks the running requests hold, per owner, counted from them."""
        assert held == self._held, f"in-flight blocks {self._held} != running requests {held}"
