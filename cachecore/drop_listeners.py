"""Drop listeners: how a block pool announces the hashes it drops, and when an operation is over.

Every hash the pool drops is announced first to each callable in ``listeners`` as
``listener(block, reason)`` with ``reason`` one of ``"evicted"`` (reused by ``allocate``), ``"capped"``
(its owner's cap) or ``"flushed"`` (``drop_where``), while the block still holds its hash, tokens, tag
and bytes, so write-back, metrics and KV events are pushed, never polled. A listener must not call
back into the pool. After each operation that announced drops (an allocation's evictions, a flush, one
owner's cap trim), each callable in ``batch_listeners`` is called once with no arguments (``done``),
so a listener can batch per operation; inside a ``with`` block on this object (``pool.batch()``) they
are called once, at the end of the outermost one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from cachecore.free_queue import Block

__all__ = ["DropListeners"]


class DropListeners:
    """The pool's ``listeners`` and ``batch_listeners``, and the batch nesting depth (module docstring).
    Also the context manager ``BlockPool.batch()`` returns (nestable)."""

    __slots__ = ("listeners", "batch_listeners", "_depth")

    def __init__(self) -> None:
        self.listeners: list[Callable[[Block, str], None]] = []
        self.batch_listeners: list[Callable[[], None]] = []
        self._depth = 0

    def announce(self, block: Block, reason: str) -> None:
        """``block``'s hash is about to be dropped for ``reason``."""
        for listener in self.listeners:
            listener(block, reason)

    def announce_many(self, blocks: Iterable[Block], reason: str) -> None:
        """``announce`` for each of ``blocks``, in order."""
        listeners = self.listeners
        if listeners:
            for block in blocks:
                for listener in listeners:
                    listener(block, reason)

    def done(self) -> None:
        """An operation that announced drops is over: ``batch_listeners`` now, or at the end of the
        outermost ``with`` block."""
        if not self._depth:
            for listener in self.batch_listeners:
                listener()

    @property
    def in_batch(self) -> bool:
        """Inside a ``with`` block: ``batch_listeners`` wait for its end."""
        return self._depth > 0

    def __enter__(self) -> None:
        self._depth += 1

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        self.done()
