"""bench.traces: Mooncake-format reader/writer, generator, expansion, and the hit-ratio bounds."""

from __future__ import annotations

import json
import random
from functools import cache

import pytest

from bench import traces
from bench.traces import (
    BlockTrace,
    TraceFormatError,
    TraceRequest,
    belady_bound,
    block_token_ids,
    clip_trace,
    expand_request,
    expand_trace,
    generate_fast25_trace,
    generate_trace,
    infinite_cache_bound,
    parse_trace,
    read_trace,
    session_sizes,
    write_trace,
)

SMALL = dict(sessions=6, system_prompts=2, turns=(1, 4), one_offs=4, seed=3)


# ---------------------------------------------------------------------- reader / writer / generator
def test_round_trip_generator_file_reader(tmp_path):
    reqs = generate_trace(**SMALL)
    path = tmp_path / "t.jsonl"
    assert write_trace(path, reqs) == len(reqs)
    lines = path.read_text().splitlines()
    assert len(lines) == len(reqs)
    first = json.loads(lines[0])
    assert list(first) == ["timestamp", "input_length", "output_length", "hash_ids"]
    assert read_trace(path) == reqs
    assert not (tmp_path / "t.jsonl.tmp").exists()


def test_generator_is_deterministic_and_sized_by_arguments():
    assert generate_trace(**SMALL) == generate_trace(**SMALL)
    assert generate_trace(**SMALL) != generate_trace(**{**SMALL, "seed": 4})
    reqs = generate_trace(sessions=5, system_prompts=1, turns=(3, 3), one_offs=7, seed=0)
    assert len(reqs) == 5 * 3 + 7


def test_generator_shape():
    reqs = generate_trace(sessions=20, system_prompts=3, turns=(2, 4), one_offs=10, seed=1)
    ts = [r.timestamp for r in reqs]
    assert ts == sorted(ts)
    for r in reqs:
        assert len(r.hash_ids) == -(-r.input_length // 512)
    # Ids are numbered in order of first appearance.
    seen: list[int] = []
    for r in reqs:
        for h in r.hash_ids:
            if h not in seen:
                seen.append(h)
    assert seen == list(range(len(seen)))
    # Multi-turn: many requests extend an earlier request's hash ids; system prompts are shared.
    ids = [r.hash_ids for r in reqs]
    extends = sum(1 for i, a in enumerate(ids) if any(len(b) < len(a) and a[: len(b)] == b for b in ids[:i]))
    assert extends >= 20
    firsts = {a[0] for a in ids}
    assert len(firsts) < len(reqs) / 2  # many requests open with the same block


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "missing field(s) hash_ids"),
        ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [0]}', "timestamp"),
        ('{"timestamp": true, "input_length": 10, "output_length": 1, "hash_ids": [0]}', "timestamp"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "input_length"),
        ('{"timestamp": 0, "input_length": "10", "output_length": 1, "hash_ids": [0]}', "input_length"),
        ('{"timestamp": 0, "input_length": 10, "output_length": -2, "hash_ids": [0]}', "output_length"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": 5}', "hash_ids must be a list"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1.5]}', "hash_ids[0]"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [false]}', "hash_ids[0]"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0]}', "needs ceil(600/512) = 2"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0, 1]}', "= 1 hash_ids, got 2"),
    ],
)
def test_reader_rejects_bad_lines_with_line_number(line, message):
    good = '{"timestamp": 0, "input_length": 512, "output_length": 3, "hash_ids": [7]}'
    with pytest.raises(TraceFormatError) as err:
        parse_trace([good, line], source="f.jsonl")
    assert "f.jsonl:2" in str(err.value)
    assert message in str(err.value)


def test_reader_rules_for_order_blank_lines_extra_keys_and_empty():
    ok = parse_trace([
        '{"timestamp": 5, "input_length": 513, "output_length": 0, "hash_ids": [0, 1], "session_id": "x"}',
        "",
        '{"timestamp": 5.5, "input_length": 1, "output_length": 2, "hash_ids": [0]}',
    ])
    assert ok == [TraceRequest(5, 513, 0, (0, 1)), TraceRequest(5.5, 1, 2, (0,))]
    with pytest.raises(TraceFormatError, match="earlier than the previous"):
        parse_trace([
            '{"timestamp": 9, "input_length": 1, "output_length": 0, "hash_ids": [0]}',
            '{"timestamp": 3, "input_length": 1, "output_length": 0, "hash_ids": [0]}',
        ])
    with pytest.raises(TraceFormatError, match="no request"):
        parse_trace(["", "  "])


def test_generator_rejects_bad_arguments():
    with pytest.raises(ValueError, match="sessions"):
        generate_trace(sessions=-1)
    with pytest.raises(ValueError, match="turns"):
        generate_trace(turns=(3, 2))
    with pytest.raises(ValueError, match="at least one"):
        generate_trace(sessions=0, one_offs=0)


# ---------------------------------------------------------------------- the FAST'25 shape
@cache
def _fast25(requests: int = traces.FAST25_REQUESTS, seed: int = 0) -> tuple[TraceRequest, ...]:
    return tuple(generate_fast25_trace(requests=requests, seed=seed))


def test_fast25_shape_matches_the_public_conversation_trace(tmp_path):
    reqs = list(_fast25())
    assert len(reqs) == 12_031
    lengths = sorted(r.input_length for r in reqs)
    median = lengths[len(lengths) // 2]
    assert 6_200 <= median <= 7_600  # the public trace: 6,909
    assert 100_000 <= lengths[-1] <= 126_000  # the public trace: 126,195
    assert lengths[0] >= 891
    assert 9_000 <= sum(lengths) / len(lengths) <= 15_000  # the public trace: 12,035
    outs = [r.output_length for r in reqs]
    assert max(outs) <= 2_000 and min(outs) >= 1
    sessions = session_sizes(reqs)
    assert sum(sessions) == len(reqs)
    assert sum(n == 1 for n in sessions) / len(sessions) >= 0.99  # almost every session a single request
    assert max(sessions) >= 2  # and a few follow-up turns
    assert all(r.hash_ids[0] == 0 for r in reqs)  # one shared system block
    # Shared prefixes: a good part of the requests reuse more than the system block of an earlier one.
    seen: set[tuple[int, ...]] = set()
    reusing = 0
    for r in reqs:
        reusing += r.hash_ids[:2] in seen
        seen.update(r.hash_ids[:k] for k in range(1, len(r.hash_ids) + 1))
    assert 0.25 <= reusing / len(reqs) <= 0.5  # the public trace: 39%
    # A valid trace, in arrival order, ids numbered in order of first appearance, about an hour long.
    path = tmp_path / "fast25.jsonl"
    write_trace(path, reqs)
    assert read_trace(path) == reqs
    first_seen: dict[int, None] = {}
    for r in reqs:
        first_seen.update(dict.fromkeys(r.hash_ids))
    assert list(first_seen) == list(range(len(first_seen)))
    assert 3_000_000 <= reqs[-1].timestamp <= 4_200_000


def test_fast25_generator_is_deterministic_and_sized():
    assert _fast25(200) == tuple(generate_fast25_trace(requests=200))
    assert _fast25(200) != _fast25(200, seed=1)
    assert len(_fast25(17)) == 17
    for bad in ({"requests": 0}, {"min_input": 10_000, "median_input": 5_000}, {"reuse_share": 1.5},
                {"reuse_recency": 0}, {"output_median": 3_000}):
        with pytest.raises(ValueError):
            generate_fast25_trace(**bad)


def test_fast25_bounds_on_the_whole_trace():
    summary = traces.summarize(list(_fast25()), scale=16, context=1024, max_output_tokens=16)
    assert summary["requests"] == 12_031
    assert 0.2 <= summary["infinite_hit"] <= 0.55  # the public trace's hash-level bound: 37%
    assert summary["clipped_requests"] > 0 and 0 < summary["clipped_token_share"] < 1


def test_session_sizes():
    a = TraceRequest(0, 1100, 10, (0, 1, 2))
    turn2 = TraceRequest(1, 2000, 10, (0, 1, 2, 3))  # extends all of a: a's next turn
    other = TraceRequest(2, 1100, 10, (0, 1, 4))  # shares a prefix only: a session of its own
    dup = TraceRequest(3, 1100, 10, (0, 1, 2))  # the same prompt again: not a next turn
    turn3 = TraceRequest(4, 2600, 10, (0, 1, 2, 3, 5, 6))
    assert session_sizes([a, turn2, other, dup, turn3]) == [3, 1, 1]
    assert session_sizes([TraceRequest(0, 5, 1, (0,)), TraceRequest(1, 600, 1, (0, 1))]) == [1, 1]


# ---------------------------------------------------------------------- clipping
def test_clipping_keeps_whole_leading_blocks_and_shared_prefixes():
    long_a = TraceRequest(0, 40 * 512 - 100, 900, tuple(range(40)))
    long_b = TraceRequest(1, 60 * 512, 900, tuple(range(35)) + tuple(range(100, 125)))  # shares 35 blocks
    short = TraceRequest(2, 3 * 512 - 7, 900, (500, 501, 502))  # fits: left as it is
    tight = TraceRequest(3, 31 * 512 + 1, 32, tuple(range(300, 332)))  # 993 + 2 output: fits exactly
    no_out = TraceRequest(4, 33 * 512, 0, tuple(range(400, 433)))  # 1,056 + 0 output: 32 blocks fit
    reqs = [long_a, long_b, short, tight, no_out]
    clipped, clip = clip_trace(reqs, context=1024, scale=16, max_output_tokens=16)
    # (1024 - 16) // 32 = 31 whole hash blocks at scale 1/16
    assert clipped[0] == TraceRequest(0, 31 * 512, 900, tuple(range(31)))
    assert clipped[1] == TraceRequest(1, 31 * 512, 900, tuple(range(31)))
    assert clipped[2] is short and clipped[3] is tight
    assert clipped[4] == TraceRequest(4, 32 * 512, 0, tuple(range(400, 432)))
    assert (clip.requests, clip.clipped, clip.max_blocks) == (5, 3, 32)
    assert clip.input_tokens == sum(r.input_length for r in reqs)
    assert clip.dropped_tokens == (9 * 512 - 100) + 29 * 512 + 512
    assert clip.token_share == pytest.approx(clip.dropped_tokens / clip.input_tokens)
    # Still a valid trace, and every expanded prompt fits the context beside its (capped) output.
    assert parse_trace(r.to_json() for r in clipped) == clipped
    expanded = expand_trace(clipped, scale=16, max_output_tokens=16)
    for ex in expanded:
        assert len(ex.tokens) + ex.output_length <= 1024
    # The shared prefix stays shared: both long prompts clip to the same 31 whole blocks.
    assert expanded[0].tokens == expanded[1].tokens == expand_request(long_a, scale=16)[: 31 * 32]
    bt = BlockTrace.from_prompts([ex.tokens for ex in expanded])
    assert bt.infinite().hit_tokens == (31 * 32 - 1) // 16 * 16  # the second hits all but the last block


def test_clipping_keeps_common_prefixes_on_generated_traces():
    reqs = list(_fast25(400))
    clipped, clip = clip_trace(reqs, context=1024, scale=16, max_output_tokens=16)
    assert clip.clipped == sum(-(-r.input_length // 16) + min(-(-r.output_length // 16), 16) > 1024 for r in reqs) > 0
    for before, after in zip(reqs, clipped, strict=True):
        assert before.hash_ids[: len(after.hash_ids)] == after.hash_ids
        assert len(after.hash_ids) == -(-after.input_length // 512)
    rng = random.Random(0)
    for _ in range(300):
        (a, ca), (b, cb) = rng.sample(list(zip(reqs, clipped, strict=True)), 2)
        common = next((i for i, (x, y) in enumerate(zip(a.hash_ids, b.hash_ids)) if x != y),
                      min(len(a.hash_ids), len(b.hash_ids)))
        kept = next((i for i, (x, y) in enumerate(zip(ca.hash_ids, cb.hash_ids)) if x != y),
                    min(len(ca.hash_ids), len(cb.hash_ids)))
        assert kept == min(common, len(ca.hash_ids), len(cb.hash_ids))


def test_clipping_rejects_a_context_without_room_for_a_block():
    r = TraceRequest(0, 4 * 512, 900, (0, 1, 2, 3))  # output: 57 tokens at 1/16, capped at 16
    with pytest.raises(ValueError, match="no room for one hash block"):
        clip_trace([r], context=40, scale=16, max_output_tokens=16)  # 24 tokens left, a block is 32
    assert clip_trace([r], context=48, scale=16, max_output_tokens=16)[1].clipped == 1
    for bad in ({"context": 0}, {"context": 1024, "scale": 3}, {"context": 1024, "max_output_tokens": -1}):
        with pytest.raises(ValueError):
            clip_trace([r], **bad)


# ---------------------------------------------------------------------- expansion
def _common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_block_tokens_are_deterministic_prefix_stable_and_in_vocab():
    a = block_token_ids(42, 32)
    assert a == block_token_ids(42, 32)
    assert block_token_ids(42, 20) == a[:20]
    assert block_token_ids(42, 100)[:32] == a
    assert a != block_token_ids(43, 32)
    assert all(0 <= t < 256 for t in block_token_ids(1, 512))
    assert all(0 <= t < 7 for t in block_token_ids(1, 64, vocab=7))


@pytest.mark.parametrize("scale", [1, 4, 16])
def test_expansion_shares_exactly_the_shared_hash_prefix(scale):
    per = 512 // scale
    a = TraceRequest(0, 3 * 512, 0, (1, 2, 3))
    b = TraceRequest(0, 3 * 512, 0, (1, 2, 9))
    c = TraceRequest(0, 2 * 512 + 100, 0, (1, 2, 3))  # partial last block of the same id
    d = TraceRequest(0, 3 * 512, 0, (5, 2, 3))
    ta, tb, tc, td = (expand_request(r, scale=scale) for r in (a, b, c, d))
    assert len(ta) == 3 * per and len(tc) == -(-(2 * 512 + 100) // scale)
    assert _common_prefix(ta, tb) == 2 * per  # shared up to the differing id, and no further (random tokens)
    assert tc == ta[: len(tc)]  # the partial block is a prefix of the full one
    assert _common_prefix(ta, td) < per  # different first id: unrelated tokens


def test_expansion_on_generated_trace_matches_hash_ids():
    reqs = generate_trace(**SMALL)
    scale = 16
    per = 512 // scale
    exp = expand_trace(reqs, scale=scale)
    for x, ex in zip(reqs, exp, strict=True):
        assert len(ex.tokens) == -(-x.input_length // scale)
        assert ex.output_length == -(-x.output_length // scale)
    rng = random.Random(0)
    pairs = [(rng.randrange(len(reqs)), rng.randrange(len(reqs))) for _ in range(200)]
    for i, j in pairs:
        a, b = reqs[i], reqs[j]
        ta, tb = exp[i].tokens, exp[j].tokens
        shared_ids = _common_prefix(a.hash_ids, b.hash_ids)
        common = _common_prefix(ta, tb)
        if shared_ids == min(len(a.hash_ids), len(b.hash_ids)):
            assert common == min(len(ta), len(tb))  # one prompt is a prefix of the other
        else:
            assert shared_ids * per <= common < shared_ids * per + per
            assert common // per == shared_ids


def test_expansion_clipping_and_scale_checks():
    r = TraceRequest(0, 20 * 512, 900, tuple(range(20)))
    full = expand_request(r, scale=16)
    clipped = expand_request(r, scale=16, max_input_tokens=100)
    assert clipped == full[:100]
    (ex,) = expand_trace([r], scale=16, max_input_tokens=1008, max_output_tokens=16)
    assert len(ex.tokens) == 20 * 32 and ex.output_length == 16
    (ex0,) = expand_trace([TraceRequest(0, 1, 0, (0,))], scale=16)
    assert ex0.output_length == 0 and len(ex0.tokens) == 1
    for bad in (0, 3, 1024, 2.0):
        with pytest.raises(ValueError, match="scale"):
            expand_request(r, scale=bad)
    with pytest.raises(ValueError, match="max_input_tokens"):
        expand_request(r, max_input_tokens=0)


# ---------------------------------------------------------------------- bounds
def _blocks(*names, bs=2):
    """Prompt whose blocks are given by letters: each letter -> a block of `bs` equal tokens."""
    return [ord(ch) for name in names for ch in name for _ in range(bs)]


def test_hand_computed_example():
    bs = 2
    # Blocks as letters; each prompt has one extra token so that every full block is usable.
    A, B, C, D = "A", "B", "C", "D"
    prompts = [
        _blocks(A, B, C) + [0],  # 7 tokens, all miss
        _blocks(A, B, D) + [0],  # hits A B (4 tokens)
        _blocks(A, B, C) + [0],  # hits A B C (6) with infinite cache
        _blocks(D) + [0],  # D alone is a different chain from A B D: miss
        _blocks(A, B, D) + [0],  # hits A B D (6) with infinite cache
    ]
    bt = BlockTrace.from_prompts(prompts, block_size=bs)
    assert bt.query_tokens == 7 * 4 + 3
    assert bt.unique_blocks == 5  # A, AB, ABC, ABD, D
    inf = bt.infinite()
    assert inf.hit_tokens == 4 + 6 + 6
    assert inf.ratio == pytest.approx(16 / 31)
    # Capacity 3: after request 1 (A, AB, ABC cached), request 2 needs A, AB (hit) and inserts ABD:
    # evict farthest next use among {A, AB, ABC, ABD}: A, AB next at request 3, ABC at request 3 too but
    # later in it, ABD at request 5 -> ABD bypassed. Request 3 hits A B C (6). Request 4 (D): D is never
    # used again: bypassed. Request 5: A B hit, ABD missing -> 4. Total 4 + 6 + 4 = 14.
    assert bt.belady(3).hit_tokens == 14
    # Capacity 4: ABD fits too: 4 + 6 + 6 = 16 == infinite. Capacity 2: A, AB only: 4 + 4 + 4 = 12.
    assert bt.belady(4).hit_tokens == 16
    assert bt.belady(2).hit_tokens == 12
    assert bt.belady(1).hit_tokens == 2 + 2 + 2
    assert bt.belady(0).hit_tokens == 0


def test_last_token_rule_and_partial_blocks():
    bs = 4
    p = list(range(8))
    # Second request equals the first: 2 full blocks cached, but its last token is recomputed -> 1 block.
    assert infinite_cache_bound([p, p], block_size=bs).hit_tokens == 4
    # One more token: both blocks usable.
    assert infinite_cache_bound([p, p + [99]], block_size=bs).hit_tokens == 8
    # A partial block is never cached: the 3-token tail of the first prompt gives nothing.
    assert infinite_cache_bound([p + [1, 2, 3], p + [1, 2, 3, 4, 5]], block_size=bs).hit_tokens == 8
    assert BlockTrace.from_prompts([p, p], block_size=bs, recompute_last=False).infinite().hit_tokens == 8


def test_hits_are_prefix_contiguous():
    bs = 2
    # Second prompt shares block B only at a different position (different chain): no hit; third shares
    # the first block then diverges, then repeats C at the same position but after a different prefix.
    prompts = [_blocks("A", "B", "C") + [0], _blocks("X", "B", "C") + [0], _blocks("A", "Y", "C") + [0]]
    assert infinite_cache_bound(prompts, block_size=bs).hit_tokens == 2


def _random_prompts(seed, n=60):
    rng = random.Random(seed)
    roots = [[rng.randrange(5) for _ in range(rng.randrange(4, 40))] for _ in range(4)]
    prompts = []
    for _ in range(n):
        base = rng.choice(roots + prompts[-5:]) if prompts else rng.choice(roots)
        cut = rng.randrange(0, len(base) + 1)
        prompts.append(base[:cut] + [rng.randrange(5) for _ in range(rng.randrange(1, 12))])
    return prompts


@pytest.mark.parametrize("seed", range(8))
def test_belady_properties_on_random_traces(seed):
    prompts = _random_prompts(seed)
    bs = [1, 2, 4][seed % 3]
    bt = BlockTrace.from_prompts(prompts, block_size=bs)
    inf = bt.infinite().hit_tokens
    previous = -1
    for cap in range(0, bt.unique_blocks + 3):
        got = bt.belady(cap).hit_tokens
        assert got <= inf
        assert got >= previous, f"Belady not monotone at capacity {cap}"
        assert got % bs == 0
        previous = got
    assert bt.belady(bt.unique_blocks).hit_tokens == inf
    assert bt.belady(10**9).hit_tokens == inf


@pytest.mark.parametrize("seed", range(4))
def test_belady_beats_lru_on_random_traces(seed):
    """Sanity of the optimum: never below a plain prefix-contiguous LRU cache of the same capacity."""
    prompts = _random_prompts(100 + seed)
    bt = BlockTrace.from_prompts(prompts, block_size=2)
    for cap in (1, 3, 8, 20):
        assert bt.belady(cap).hit_tokens >= _lru_hits(bt, cap)


def _lru_hits(bt, cap):
    return bt.lru(cap).hit_tokens


def test_lru_reference_policy():
    bs = 2
    prompts = [_blocks("A", "B", "C") + [0], _blocks("X") + [0], _blocks("A", "B", "D") + [0]]
    bt = BlockTrace.from_prompts(prompts, block_size=bs)
    # After request 1 the LRU order is ABC, AB, A (deepest evicted first); X pushes out ABC at capacity 3.
    assert bt.lru(3).hit_tokens == 4
    assert bt.lru(2).hit_tokens == 2  # X pushes out ABC and AB: only A is left
    assert bt.lru(100).hit_tokens == bt.infinite().hit_tokens == 4


def test_generated_trace_bounds_end_to_end():
    reqs = generate_trace(**SMALL)
    prompts = [e.tokens for e in expand_trace(reqs, scale=16, max_input_tokens=1008)]
    inf = infinite_cache_bound(prompts)
    assert 0.2 < inf.ratio < 1.0  # system prompts and multi-turn reuse make a real bound
    bt = BlockTrace.from_prompts(prompts)
    eighth = belady_bound(prompts, max(1, bt.unique_blocks // 8))
    assert 0 < eighth.hit_tokens <= inf.hit_tokens


def test_bounds_reject_bad_arguments():
    with pytest.raises(ValueError, match="capacity_blocks"):
        BlockTrace.from_prompts([[1, 2]]).belady(-1)
    with pytest.raises(ValueError, match="block_size"):
        BlockTrace.from_prompts([[1, 2]], block_size=0)


def test_cli_writes_trace_and_prints_summary(tmp_path, capsys):
    out = tmp_path / "trace.jsonl"
    traces.main(["--out", str(out), "--sessions", "5", "--one-offs", "2", "--seed", "1"])
    printed = capsys.readouterr().out
    assert read_trace(out)
    assert "infinite-cache hit" in printed
    result = printed.strip().splitlines()[-1]
    assert result.startswith("RESULT requests=")
    assert "infinite_hit=" in result and "unique_blocks=" in result
    traces.main(["--trace", str(out)])
    assert capsys.readouterr().out.strip().splitlines()[-1] == result


def test_cli_reports_bad_trace(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    with pytest.raises(SystemExit) as exit_info:
        traces.main(["--trace", str(bad)])
    assert exit_info.value.code == 2
    assert "bad.jsonl:1: missing field(s)" in capsys.readouterr().err


def _exhaustive_optimum(bt, cap):
    """Best prefix-contiguous hit blocks over every policy that caches a block only when its request
    reads it (insert or not on a miss; evict any cached block when over capacity)."""
    accesses = [(r, i, key) for r, chain in enumerate(bt.chains) for i, key in enumerate(chain)]

    @cache
    def best(t, cached, run):
        if t == len(accesses):
            return 0
        r, i, key = accesses[t]
        if i == 0:
            run = True
        nxt_run_start = t + 1 < len(accesses) and accesses[t + 1][1] == 0
        if key in cached:
            gain = 1 if run and i < bt.usable[r] else 0
            return gain + best(t + 1, cached, run or nxt_run_start)
        options = [best(t + 1, cached, nxt_run_start)]  # do not cache it
        grown = cached | {key}
        if len(grown) <= cap:
            options.append(best(t + 1, grown, nxt_run_start))
        else:
            options += [best(t + 1, grown - {victim}, nxt_run_start) for victim in cached]
        return max(options)

    return best(0, frozenset(), True) * bt.block_size


@pytest.mark.parametrize("seed", range(12))
def test_belady_equals_exhaustive_optimum_on_tiny_traces(seed):
    rng = random.Random(seed)
    prompts = []
    for _ in range(rng.randrange(3, 6)):
        base = rng.choice(prompts) if prompts and rng.random() < 0.7 else []
        cut = rng.randrange(0, len(base) + 1)
        prompts.append(base[:cut] + [rng.randrange(3) for _ in range(rng.randrange(1, 5))])
    bt = BlockTrace.from_prompts(prompts, block_size=1)
    for cap in range(0, 5):
        assert bt.belady(cap).hit_tokens == _exhaustive_optimum(bt, cap), (prompts, cap)
