"""bench.tiers' replay on a trace of the real shape: clipped prompts, each request counted exactly once."""

from __future__ import annotations

import pytest

from bench import tiers, traces


@pytest.fixture(scope="module")
def loaded():
    from cachecore.model.loader import RevisionSpec, load_model

    return load_model("replay", "tiny", RevisionSpec(label="r1", seed=3))


def _clipped_prompts(n: int, context: int) -> tuple[list[list[int]], traces.Clipping]:
    reqs = traces.generate_fast25_trace(requests=n, seed=0)
    # the same long prompt twice and a long one sharing its first 20 blocks: identical clipped prompts
    long = traces.TraceRequest(reqs[-1].timestamp, 40 * 512, 300, tuple(range(10**6, 10**6 + 40)))
    fresh = tuple(range(2 * 10**6, 2 * 10**6 + 30))
    reqs += [long, long, traces.TraceRequest(long.timestamp, 50 * 512, 300, long.hash_ids[:20] + fresh)]
    clipped, clip = traces.clip_trace(reqs, context=context, scale=16, max_output_tokens=tiers.REPLAY_OUTPUT)
    prompts = [e.tokens for e in traces.expand_trace(clipped, scale=16, max_output_tokens=tiers.REPLAY_OUTPUT)]
    return prompts, clip


def test_replay_counts_every_clipped_request_once(loaded):
    prompts, clip = _clipped_prompts(60, loaded.config.max_seq_len)
    assert clip.clipped >= 3 and max(len(p) for p in prompts) + tiers.REPLAY_OUTPUT <= loaded.config.max_seq_len
    bt = traces.BlockTrace.from_prompts(prompts, block_size=tiers.BS)
    longest = max(-(-len(p) // tiers.BS) for p in prompts) + 1
    # replay raises SystemExit unless its engine counted exactly len(prompts) requests and their tokens
    only_l1 = tiers.replay(prompts, loaded, l1_blocks=max(1, bt.unique_blocks // 8) + longest, l2_blocks=0)
    both = tiers.replay(prompts, loaded, l1_blocks=max(1, bt.unique_blocks // 8) + longest,
                        l2_blocks=bt.unique_blocks, load_policy="always_load")
    infinite = bt.infinite()
    assert 0 < only_l1["skipped"] <= both["skipped"] <= infinite.hit_tokens
    assert both["skipped"] == infinite.hit_tokens  # L2 holds the working set: every reusable block is loaded
