"""Property-based test of the two-tier system (L1 device pages over an L2 host pool).

Random admit / load / compute / commit / release / flush sequences from two tenants over prompts
that share prefixes. Every block's bytes are a function of its chain hash, so after every step the
test can check that each cached block, in either tier, and each block a running request reads holds
exactly its own bytes; that both stores' integrity checks hold; that a block a request writes is held
by that request alone and indexed nowhere (never overwritten while another reads it); and that each
L1's fair share holds against the other tenant.
"""

from __future__ import annotations

import secrets

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cachecore.config import EngineConfig
from cachecore.engine import CacheEngine
from cachecore.errors import InflightLimit, OutOfBlocks
from cachecore.layout import KVLayout
from cachecore.namespace import Namespace

BS = 4
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, block_size=BS, dtype="float32")
NS = Namespace.build(scope_salt=secrets.token_bytes(32), model_id="prop", weight_digest="w", tokenizer_digest="t",
                     layout=LAYOUT.canonical(), rope={"theta": 10000.0})
BASES = [[1] * 8, [2] * 8]
PROMPTS = [base + tail for base in BASES for tail in ([3, 3, 3, 3, 5], [4, 4, 4, 4, 6, 6, 6, 6, 7], [9])]


def _value(key: bytes) -> float:
    return float(int.from_bytes(key[:2], "little") % 997 + 1)


def _page(key: bytes) -> torch.Tensor:
    return torch.full((1, *LAYOUT.page_shape), _value(key))


class TwoTiers(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.engine = CacheEngine(LAYOUT, num_blocks=7, device="cpu",
                                  config=EngineConfig(l2_blocks=6, load_deadline_s=5.0))
        self.running: list = []

    @rule(prompt=st.sampled_from(PROMPTS), owner=st.sampled_from(["a", "b"]))
    def admit(self, prompt, owner) -> None:
        pool = self.engine.pool
        before = {o: pool.usage(o) for o in ("a", "b")}
        share = pool.num_blocks // len({o for o, n in before.items() if n} | {owner})
        last_resorts = pool.stats.protected_evictions
        try:
            seq = self.engine.admit(NS, prompt, owner=owner)
        except (OutOfBlocks, InflightLimit):
            return
        other = "b" if owner == "a" else "a"  # fair share in L1: never pushed below it by the other
        if pool.stats.protected_evictions == last_resorts:  # (but by the counted last resort)
            assert pool.usage(other) >= min(before[other], share), (before, share)
        self.engine.finish_loads(seq)
        self.running.append(seq)

    @rule(prompt=st.sampled_from(PROMPTS), owner=st.sampled_from(["a", "b"]))
    def serve(self, prompt, owner) -> None:
        """A whole request at once: admit, load, compute, commit, release."""
        before = len(self.running)
        self.admit(prompt, owner)
        if len(self.running) > before:
            seq = self.running.pop()
            self._compute(seq)
            self.engine.release(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def compute_and_commit(self, data) -> None:
        self._compute(data.draw(st.sampled_from(self.running)))

    def _compute(self, seq) -> None:
        start = seq.num_computed // BS
        for i in range(start, len(seq.tokens) // BS):
            self.engine.l1.write([seq.blocks[i]], _page(seq.hashes[i]))
        self.engine.mark_computed(seq, len(seq.tokens))
        self.engine.commit(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def release(self, data) -> None:
        seq = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        self.engine.release(seq)

    @rule(owner=st.sampled_from(["a", "b"]))
    def flush(self, owner) -> None:
        self.engine.flush(lambda t: t.owner == owner)
        assert self.engine.count_cached(lambda t: t.owner == owner) == 0

    @invariant()
    def stores_hold_exactly_their_own_bytes(self) -> None:
        engine = self.engine
        engine.check_integrity()
        for block in engine.pool.blocks:
            if block.block_hash is not None:
                got = engine.l1.read([block])
                assert torch.equal(got, _page(block.block_hash)), f"L1 {block} holds foreign bytes"
        l2 = engine.l2
        for key, block in list(l2.pool._index.items()):
            assert torch.equal(l2.data[block.block_id : block.block_id + 1], _page(key)), "L2 foreign bytes"

    @invariant()
    def written_blocks_are_exclusive_and_read_blocks_are_exact(self) -> None:
        owners_of: dict[int, int] = {}
        for seq in self.running:
            for i, block in enumerate(seq.blocks):
                if i < seq.num_registered or i * BS < seq.num_cached_tokens:
                    # read-only prefix (hit or promoted): exact bytes
                    if i < len(seq.hashes) and i * BS < seq.num_computed:
                        assert torch.equal(self.engine.l1.read([block]), _page(seq.hashes[i]))
                elif i * BS >= seq.num_computed:
                    owners_of[block.block_id] = owners_of.get(block.block_id, 0) + 1
                    assert block.block_hash is None and block.ref_cnt == 1, f"{block} written while shared"
        assert all(n == 1 for n in owners_of.values())

    @invariant()
    def l2_holds_only_unheld_blocks_within_capacity(self) -> None:
        pool = self.engine.l2.pool
        assert pool.num_in_use == 0 and sum(pool.usage(o) for o in pool.owners()) <= pool.num_blocks


TestTwoTiers = TwoTiers.TestCase
TestTwoTiers.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
