"""Block index: which block serves which chain key, the chain links between indexed blocks, and the
one-walk prefix lookup (``walk``) behind ``BlockPool.hit_prefix``.

Pure bookkeeping over :class:`~cachecore.free_queue.Block` records (``block_hash``, ``token_ids``,
``tag``, ``parent``/``children``/``link``): no ref counts, free queue, owners or eviction (those are
the pool's, :mod:`cachecore.block_pool`). ``by_hash`` is the index itself (key -> block); the pool's
hot paths bind it to a local and read and write it inline.

**One walk per request** (``walk``). A request's first block is looked up by key (stored token ids
compared), each following one as its predecessor's child under the block's token bytes (the exact
bytes its key hashes, so the dict's equality compare is the token compare), so a hit block's key is
read from the block instead of hashed; only the rest of the chain is hashed (by the caller's
``keys``) and looked up key by key. Links exist only between indexed blocks (the pool's
``cache_blocks`` adds them for keys that continue their parent's chain, the walk heals missing ones,
``remove`` takes a block's links out both ways); a link is a shortcut to the block that holds the key
the chain would give, never a second key, so namespaces, salts and exact-prefix matching are the
keys' as before.
"""

from __future__ import annotations

import array
import itertools
import operator
from collections.abc import Callable, Iterable, Sequence
from functools import partial

from cachecore.free_queue import Block

__all__ = ["BlockIndex", "KeyChain"]

_is_block = partial(operator.is_not, None)  # C-level predicates and getters for whole-table walks
_token_ids = operator.attrgetter("token_ids")
_block_hash = operator.attrgetter("block_hash")

#: ``keys(blocks, parent_key)``: the chain keys of token blocks (``walk``, ``BlockPool.hit_prefix``).
KeyChain = Callable[[Sequence[bytes], "bytes | None"], list[bytes]]


class BlockIndex:
    """Key -> indexed block (``by_hash``), with each indexed block's chain links. A block is indexed
    iff its ``block_hash`` is set, and then ``by_hash[block.block_hash] is block``."""

    __slots__ = ("by_hash", "block_size")

    def __init__(self, block_size: int) -> None:
        self.by_hash: dict[bytes, Block] = {}
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.by_hash)

    def add(self, block: Block, key: bytes, token_ids: tuple[int, ...], tag: object | None) -> None:
        """Index ``block`` (not indexed) under ``key`` (not taken), holding ``token_ids``; its reuse count
        starts again."""
        self.by_hash[key] = block
        block.block_hash = key
        block.token_ids = token_ids
        block.tag = tag
        block.hits = 0

    def remove(self, block: Block) -> None:
        """Take an indexed ``block`` out: its key, tokens and tag are cleared, its links dropped both ways."""
        assert block.block_hash is not None
        del self.by_hash[block.block_hash]
        block.block_hash = None
        block.token_ids = None
        block.tag = None
        if block.parent is not None or block.children:
            self.unlink(block)

    def remove_many(self, blocks: Iterable[Block]) -> None:
        """``remove`` for each of ``blocks`` (each indexed, none twice)."""
        by_hash, unlink = self.by_hash, self.unlink
        for block in blocks:
            del by_hash[block.block_hash]
            block.block_hash = block.token_ids = block.tag = None
            if block.parent is not None or block.children:
                unlink(block)

    @staticmethod
    def link(parent: Block, child: Block, link: bytes) -> None:
        """Link indexed ``child`` under indexed ``parent`` by ``link`` (the child's token bytes)."""
        kids = parent.children
        if kids is None:
            parent.children = kids = {}
        kids[link] = child
        child.parent = parent
        child.link = link

    @staticmethod
    def unlink(block: Block) -> None:
        """Take a block leaving the index out of the chain links, both ways."""
        parent = block.parent
        if parent is not None:
            del parent.children[block.link]
            block.parent = block.link = None
        kids = block.children
        if kids:
            for child in kids.values():
                child.parent = child.link = None
        block.children = None

    def walk(self, tokens: Sequence[int], blocks: Sequence[bytes], keys: KeyChain
             ) -> tuple[list[Block], list[bytes], int]:
        """The longest prefix of a request's full blocks that the index holds with its token ids (module
        docstring). ``blocks[i]`` is block ``i``'s token bytes; ``keys(blocks[a:], parent_key)`` their
        chain keys. Returns (the prefix's blocks, the keys of every block, the collisions met: a hash
        hit whose tokens differ ends the prefix). Links what it finds past the linked part."""
        n_blocks = len(blocks)
        if not n_blocks:
            return [], [], 0
        index, bs = self.by_hash, self.block_size
        hashes = keys(blocks[:1], None)
        found: list[Block] = []
        collisions = 0
        block = index.get(hashes[0])
        if block is not None:
            if block.token_ids == tuple(tokens[:bs]):
                keep = found.append
                keep(block)
                for link in itertools.islice(blocks, 1, None):
                    kids = block.children
                    if not kids:
                        break
                    block = kids.get(link)
                    if block is None:
                        break
                    keep(block)
                if len(found) > 1:
                    hashes = list(map(_block_hash, found))
            else:
                collisions = 1
        k = len(found)
        if k < n_blocks:
            hashes += keys(blocks[max(k, 1):], hashes[-1])
        if 0 < k < n_blocks:
            collisions += self._follow_keys(found, tokens, blocks, hashes)
        return found, hashes, collisions

    def _follow_keys(self, found: list[Block], tokens: Sequence[int], blocks: Sequence[bytes],
                     hashes: Sequence[bytes]) -> int:
        """Extend ``found`` (the linked prefix) by key lookups, token ids compared, linking each block
        found to its predecessor; returns 1 if a hash hit with other tokens ended it, else 0."""
        bs, k = self.block_size, len(found)
        more = list(itertools.takewhile(_is_block, map(self.by_hash.get, itertools.islice(hashes, k, None))))
        if not more:
            return 0
        collisions = 0
        want = list(itertools.islice(zip(*[iter(tokens[k * bs :])] * bs, strict=False), len(more)))
        stored = list(map(_token_ids, more))
        if stored != want:
            n = next((i for i, (s, w) in enumerate(zip(stored, want, strict=False)) if s != w), len(want))
            if n < len(want):
                collisions = 1
            del more[n:]
        prev = found[-1]
        for block, link in zip(more, itertools.islice(blocks, k, None), strict=False):
            if block.parent is None:
                self.link(prev, block, link)
            prev = block
        found += more
        return collisions

    def check(self, blocks: Sequence[Block]) -> None:
        """Assert the index's invariants over the pool's ``blocks``: every hashed block is indexed under
        its key with ``block_size`` token ids, and the chain links join indexed blocks only, both
        ways, under the child's token bytes. ``AssertionError`` naming the first broken one."""
        index, bs = self.by_hash, self.block_size
        for block in blocks:
            assert (block.block_hash is None) == (block.token_ids is None), f"{block}: hash/tokens mismatch"
            if block.block_hash is not None:
                assert index.get(block.block_hash) is block, f"hashed {block} missing from index"
        for key, block in index.items():
            assert block.block_hash == key, f"index key {key.hex()[:8]} points at {block}"
            assert block.token_ids is not None and len(block.token_ids) == bs, f"{block}: bad token_ids"
        for block in blocks:
            if block.block_hash is None:
                assert block.parent is None and not block.children, f"unindexed {block} still linked"
                continue
            if block.parent is not None:
                assert block.parent.children.get(block.link) is block, f"{block}: parent does not link back"
                assert block.link == array.array("I", block.token_ids).tobytes(), f"{block}: link is not its tokens"
            for link, child in (block.children or {}).items():
                assert child.parent is block and child.link == link, f"{block}: child {child} not linked back"
