"""One KV page's bookkeeping record and the free queue threaded through those records.

Split from ``block_pool.py`` (which owns ref counts and drives the index, eviction order, caps); these
two are the data structures only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

__all__ = ["Block", "FreeBlockQueue"]


class Block:
    """One KV page's bookkeeping. ``token_ids`` is set iff ``block_hash`` is (the block is indexed).

    ``owner`` is the allocating owner while held and the caching owner while cached; ``None`` for a
    plain free block. ``freed_at`` orders cached free blocks across owners (least recently freed
    first). ``prev_free``/``next_free`` link the block into the free queue (``None`` when it is not
    in it: the pool queues plain free blocks only). ``parent``/``children``/``link``: the index's
    chain links (``BlockPool.hit_prefix``): an indexed block's ``children`` maps a following block's
    token bytes (its ``link``) to that block.
    """

    __slots__ = (
        "block_id", "ref_cnt", "block_hash", "token_ids", "owner", "tag", "hits", "freed_at", "prev_free", "next_free",
        "parent", "children", "link",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.owner: str | None = None
        self.tag: object | None = None  # what the cached block belongs to (set with the hash, cleared with it)
        self.hits = 0  # times a request reused it from the index (selective write policies read it)
        self.freed_at = 0  # pool-wide free order of a cached free block: smaller = less recently used
        self.prev_free: Block | None = None
        self.next_free: Block | None = None
        self.parent: Block | None = None
        self.children: dict[bytes, Block] | None = None
        self.link: bytes | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"Block(id={self.block_id}, ref={self.ref_cnt}, hash={h}, owner={self.owner!r})"


class FreeBlockQueue:
    """Doubly linked list threaded through ``Block.prev_free``/``next_free``, with two sentinels.

    ``popleft``, ``remove``, ``append`` and ``appendleft`` are O(1) and allocate nothing; their
    ``_many`` forms are O(blocks) in one call (a request's table at once). The queue
    does not check membership: removing a block that is not in it, or adding one that is, corrupts it
    (``BlockPool.check_integrity`` would catch it).
    """

    def __init__(self, blocks: Iterable[Block] = ()) -> None:
        self._head = Block(-1)
        self._tail = Block(-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free

    def __iter__(self) -> Iterator[Block]:
        """Walk head to tail (LRU first)."""
        node = self._head.next_free
        while node is not self._tail and node is not None:
            yield node
            node = node.next_free

    def popleft(self) -> Block:
        """Remove and return the head (next to be reused). Raises ``IndexError`` when empty."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("pop from an empty FreeBlockQueue")
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        """Unlink ``block`` from anywhere in the queue."""
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def remove_many(self, blocks: Iterable[Block]) -> int:
        """Unlink every block of ``blocks`` (each in the queue, none twice); returns how many."""
        n = 0
        for block in blocks:
            prev, nxt = block.prev_free, block.next_free
            prev.next_free = nxt
            nxt.prev_free = prev
            block.prev_free = block.next_free = None
            n += 1
        self.num_free -= n
        return n

    def popleft_many(self, n: int) -> list[Block]:
        """Remove and return the ``n`` blocks at the head, in queue order. Raises ``IndexError``
        (changing nothing) when fewer are queued."""
        if n > self.num_free:
            raise IndexError(f"pop of {n} blocks from a FreeBlockQueue of {self.num_free}")
        out = []
        keep = out.append
        block = self._head.next_free
        for _ in range(n):
            keep(block)
            block.prev_free, block = None, block.next_free
        for taken in out:
            taken.next_free = None
        self._head.next_free = block
        block.prev_free = self._head
        self.num_free -= n
        return out

    def append_many(self, blocks: Iterable[Block]) -> None:
        """Add ``blocks`` at the tail in order (the last one reused last)."""
        tail = self._tail
        prev = tail.prev_free
        n = 0
        for block in blocks:
            block.prev_free = prev
            prev.next_free = block
            prev = block
            n += 1
        prev.next_free = tail
        tail.prev_free = prev
        self.num_free += n

    def append(self, block: Block) -> None:
        """Add at the tail (reused last)."""
        self._link(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: Block) -> None:
        """Add at the head (reused first)."""
        self._link(block, self._head, self._head.next_free)

    def _link(self, block: Block, prev: Block | None, nxt: Block | None) -> None:
        assert prev is not None and nxt is not None
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free += 1

    def check(self, blocks: Sequence[Block]) -> list[Block]:
        """Assert the queue's links (both ways, sentinels at the ends, no cycle, no repeat, only blocks
        of ``blocks``, where ``blocks[i].block_id == i``) and ``num_free``; returns the queued blocks,
        head to tail. ``AssertionError`` naming the first broken one."""
        head, tail, total = self._head, self._tail, len(blocks)
        assert head.prev_free is None and tail.next_free is None, "sentinels linked outward"
        walked: list[Block] = []
        seen: set[int] = set()
        prev = head
        node = head.next_free
        while node is not tail:
            assert node is not None, "free queue broken: ran off the end before the tail sentinel"
            assert node.prev_free is prev, f"free queue back link of {node} does not point at {prev}"
            assert node.block_id not in seen, f"{node} appears twice in the free queue"
            assert len(seen) <= total, "free queue longer than the pool (cycle?)"
            assert blocks[node.block_id] is node, f"free queue holds foreign block {node}"
            seen.add(node.block_id)
            walked.append(node)
            prev, node = node, node.next_free
        assert tail.prev_free is prev, "tail sentinel back link is stale"
        assert len(walked) == self.num_free, f"free queue walk {len(walked)} != num_free {self.num_free}"
        return walked
