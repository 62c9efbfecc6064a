"""Request traces in the public Mooncake FAST'25 format, and the hit-ratio bounds of a trace.

**Format** (one JSON object per line, as in kvcache-ai/Mooncake ``FAST25-release/traces``)::

    {"timestamp": 0, "input_length": 6755, "output_length": 500, "hash_ids": [0, 1, 2, ..., 13]}

``timestamp``: arrival in ms since the start (non-decreasing down the file); ``input_length`` and
``output_length``: tokens; ``hash_ids``: ids of the prompt's 512-token blocks in order, the last one
possibly partial, so ``len(hash_ids) == ceil(input_length / 512)``; equal ids mean equal token blocks.
Other keys (some tools add ``session_id``) are ignored. ``read_trace`` rejects anything else with a
``TraceFormatError`` naming the file, line and field; nothing is half-read.

**Generator** (``generate_trace``): the default trace of ``bench.tiers``, deterministic from its seed.
Shared system prompts (a few, each reused by many sessions); multi-turn sessions whose turn k+1 is
turn k's hash ids extended by the previous answer (``output_length`` tokens) and a new user message;
one-off requests made of fresh ids only (the noise that pollutes a cache). Ids are renumbered in
order of first appearance, as in Mooncake's files. A turn's last block is usually partial and keeps
its id when the next turn fills it: expansion makes the partial block a prefix of the full one.

**Real shape** (``generate_fast25_trace``, ``--shape fast25``): a trace shaped like the public
FAST'25 ``conversation_trace.jsonl`` (12,031 requests over about an hour; every prompt opens with the
same 512-token block; input lengths from 891 to 126,195 tokens, median 6,909, mean 12,035; outputs
median 350, at most 2,000; 99.9% of sessions a single request; about 39% of the requests reuse a
longer prefix of an earlier one, most of their own length, for an infinite-cache hit ratio near 37%).
Every request opens with one shared system block. With probability ``reuse_share`` a request reuses
60-100% of the hash blocks of an earlier request (never all of them), about ``reuse_recency`` requests
back (exponentially distributed: reuse is mostly recent, so LRU at an eighth of the working set gets
most of the bound, as on the public trace), and adds a tail of its own of 5-50% of that (reused
prefixes get reused again: a few tens of times, most never);
else its length is drawn from a log-normal split at ``median_input`` (a wider spread below the median
than above, floored at ``min_input`` plus a little, redrawn above ``max_input``; the default median is
below the target's as reuse favours the longer prompts) and its other ids are fresh. With
probability ``multi_turn_share`` a request opens a session whose next turn (arriving 30 s to 3 min
later) extends it by its answer and a new message. Arrivals are a Poisson process of
``requests / duration_ms``. Deterministic from the seed; ``session_sizes`` finds the sessions of any
trace again (a request whose ids extend all of an earlier request's).

**Clipping** (``clip_trace``), the first step of a replay on a model with a short context: a request
fits when its scaled prompt ``ceil(input_length / scale)`` plus its scaled output
``min(ceil(output_length / scale), max_output_tokens)`` is at most ``context``. A request that does not
fit keeps its leading whole hash blocks, as many as fit: ``(context - output) // (512 // scale)`` of
them, and ``input_length`` becomes that many times 512 (``output_length`` is left as is; its cap applies
at expansion). The clipped trace is still a valid trace; a kept prefix of ids is a prefix of the
original, so two requests still share exactly their common prefix of ids up to the shorter kept
length (shared prefixes stay shared), and whole blocks keep it a trace in the format (every kept id
stands for its full 512 tokens, ``input_length`` matches the ids). ``Clipping`` counts what it did:
requests clipped and prompt tokens dropped (trace scale), of all. A context that cannot hold one
hash block beside the output raises ``ValueError``.

**Expansion** (``expand_request`` / ``expand_trace``): each hash id becomes ``512 // scale``
deterministic token ids (BLAKE2b in counter mode keyed by the id, so the same id always gives the
same tokens, in any process or order); a prompt is the concatenation of its blocks cut to
``ceil(input_length / scale)`` tokens. ``scale`` must divide 512, so every length scales by exactly
1/scale and a prompt keeps its number of hash blocks. Requests that share a prefix of hash ids share
exactly that token prefix (a shared partial last block included, up to the shorter length), and
only that: distinct ids give unrelated random tokens. Clipping at expansion, token by token:
``max_input_tokens`` keeps only the first ``max_input_tokens`` tokens of each scaled prompt (a prefix
of a shared prefix is still shared, so reuse survives clipping; the clipped tail is simply never
asked for), and ``max_output_tokens`` caps the scaled ``ceil(output_length / scale)`` (an output of 0
stays 0). A replay clips with ``clip_trace`` first (whole blocks, counted; above) and expands with
``max_output_tokens`` only: for the ``tiny`` model (context 1,024) e.g. ``scale=16``,
``max_output_tokens=16``. Token ids lie in ``0..vocab-1``; the default ``vocab=256`` keeps them
byte tokens of the reference tokenizer (never a special token).

**Bounds** (``BlockTrace``, at the engine's block granularity, default 16 expanded tokens). A block is
keyed by its whole prefix (its chain: the previous block's key and its own tokens), as the engine's
hash chain keys it, so two blocks share a key iff their full prefixes are equal. Requests are served
one at a time in trace order; only full blocks of the prompt are ever cached (after the request,
all of them, like ``commit``); output tokens are never cached (a replay generates its own, which the
trace's next turn does not contain). Like the engine, a request's hit is its longest *contiguous*
prefix of cached blocks, and at most ``(len(prompt) - 1) // block_size`` blocks (the last prompt token
is always recomputed). Ratios are token-weighted: hit blocks x block size over all prompt tokens.

- ``infinite()``: the infinite-cache bound: a block is a hit iff it (hence its whole chain) was seen
  in an earlier request.
- ``belady(capacity_blocks)``: Belady's MIN at a capacity counted in cached blocks. The reference
  string is every full prompt block of every request, in order; a block's priority is the time of
  its next access that could count as a hit (inside some later request's usable prefix); a missed
  block is inserted and, when the cache is over capacity, the block whose next such access is
  farthest in the future is evicted (possibly the one just inserted: bypass); blocks never usable
  again are not inserted (or are dropped once their last usable access is past). Because a block's
  descendants are always used after it (a request reaching block i reads blocks 0..i-1 just before),
  they are always evicted before it: the cached set stays prefix-closed, so the contiguous-prefix
  hits equal MIN's plain block hits, which MIN maximises for this reference string
  (tests/test_traces.py checks it against an exhaustive search of every insert/evict choice on small
  traces). Simplifications: sequential requests (no concurrency, so no capacity is held by running
  requests: the engine needs room for those on top of ``capacity_blocks``); a block may only be
  cached while its request is served (no prefetch of unseen blocks); ties cannot occur (access times
  are unique) except among blocks never usable again, which are evicted first. ``belady(c)`` is
  non-decreasing in ``c`` (MIN is a stack algorithm: the cache at ``c`` is a subset of the cache at
  ``c + 1`` at every step), ``<= infinite()``, and equal to it once ``c`` reaches ``unique_blocks``.
- ``lru(capacity_blocks)``: not a bound but a reference online policy on the same blocks (LRU,
  prefix-contiguous hits, each request's blocks refreshed deepest first as the engine frees them).

CLI: write a generated trace and print its summary, or summarise an existing one (clipped with
``clip_trace`` to ``--context`` tokens, the tiny model's 1,024 by default, and ``--max-output-tokens``)::

    .venv/bin/python -m bench.traces --out trace.jsonl [--sessions N] [--seed S] [--scale 16] ...
    .venv/bin/python -m bench.traces --out trace.jsonl --shape fast25 [--requests 12031] [--seed S] ...
    .venv/bin/python -m bench.traces --trace trace.jsonl [--scale 16] [--context 1024] ...
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import math
import os
import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "HASH_BLOCK_TOKENS",
    "BlockTrace",
    "Bound",
    "Clipping",
    "SHAPES",
    "ExpandedRequest",
    "TraceFormatError",
    "TraceRequest",
    "belady_bound",
    "block_token_ids",
    "clip_trace",
    "expand_request",
    "expand_trace",
    "generate_fast25_trace",
    "generate_trace",
    "infinite_cache_bound",
    "parse_trace",
    "read_trace",
    "session_sizes",
    "summarize",
    "write_trace",
]

#: Tokens per hash id in the Mooncake format.
HASH_BLOCK_TOKENS = 512
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
_EXPAND_KEY = b"strata/bench.traces/v1"


class TraceFormatError(ValueError):
    """A trace line that is not a valid Mooncake request (the message names file, line and field)."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace, in the file's units (full-scale tokens, 512-token hash blocks)."""

    timestamp: int | float  # ms since the start
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def to_json(self) -> str:
        return json.dumps(
            {
                "timestamp": self.timestamp,
                "input_length": self.input_length,
                "output_length": self.output_length,
                "hash_ids": list(self.hash_ids),
            }
        )


# ---------------------------------------------------------------------- reader / writer
def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_request(obj: object, where: str) -> TraceRequest:
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [f for f in _FIELDS if f not in obj]
    if missing:
        raise TraceFormatError(f"{where}: missing field(s) {', '.join(missing)}")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0:
        raise TraceFormatError(f"{where}: timestamp must be a finite number of ms >= 0, got {ts!r}")
    n_in, n_out, ids = obj["input_length"], obj["output_length"], obj["hash_ids"]
    if not _is_int(n_in) or n_in < 1:
        raise TraceFormatError(f"{where}: input_length must be an int >= 1, got {n_in!r}")
    if not _is_int(n_out) or n_out < 0:
        raise TraceFormatError(f"{where}: output_length must be an int >= 0, got {n_out!r}")
    if not isinstance(ids, list):
        raise TraceFormatError(f"{where}: hash_ids must be a list of ints, got {type(ids).__name__}")
    for i, h in enumerate(ids):
        if not _is_int(h) or h < 0:
            raise TraceFormatError(f"{where}: hash_ids[{i}] must be an int >= 0, got {h!r}")
    expect = -(-n_in // HASH_BLOCK_TOKENS)
    if len(ids) != expect:
        raise TraceFormatError(
            f"{where}: input_length {n_in} needs ceil({n_in}/{HASH_BLOCK_TOKENS}) = {expect} hash_ids, "
            f"got {len(ids)}"
        )
    return TraceRequest(ts, n_in, n_out, tuple(ids))


def parse_trace(lines: Iterable[str], source: str = "<trace>") -> list[TraceRequest]:
    """Parse trace lines (blank lines skipped). Raises ``TraceFormatError`` ("source:line: why") for
    invalid JSON, a missing or mistyped field, ``len(hash_ids) != ceil(input_length / 512)``, a
    timestamp earlier than the previous line's, or a trace with no request at all."""
    out: list[TraceRequest] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
        req = _check_request(obj, where)
        if out and req.timestamp < out[-1].timestamp:
            raise TraceFormatError(
                f"{where}: timestamp {req.timestamp} is earlier than the previous request's "
                f"({out[-1].timestamp}); a trace is in arrival order"
            )
        out.append(req)
    if not out:
        raise TraceFormatError(f"{source}: no request in the trace")
    return out


def read_trace(path: str | os.PathLike[str]) -> list[TraceRequest]:
    """Read a Mooncake trace file; see ``parse_trace`` for what is rejected (``OSError`` if unreadable)."""
    with open(path, encoding="utf-8") as fh:
        return parse_trace(fh, source=str(path))


def write_trace(path: str | os.PathLike[str], requests: Iterable[TraceRequest]) -> int:
    """Write ``requests`` one JSON object a line (written to a temporary name, then renamed).
    Returns the number of requests written."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    with open(tmp, "w", encoding="utf-8") as fh:
        for req in requests:
            fh.write(req.to_json() + "\n")
            n += 1
    os.replace(tmp, path)
    return n


# ---------------------------------------------------------------------- generator
def generate_trace(
    *,
    sessions: int = 32,
    system_prompts: int = 4,
    turns: tuple[int, int] = (2, 5),
    one_offs: int = 16,
    system_blocks: tuple[int, int] = (4, 8),
    user_tokens: tuple[int, int] = (128, 1536),
    output_tokens: tuple[int, int] = (64, 512),
    one_off_blocks: tuple[int, int] = (2, 12),
    think_ms: tuple[int, int] = (2_000, 30_000),
    duration_ms: int = 300_000,
    seed: int = 0,
) -> list[TraceRequest]:
    """A synthetic trace in arrival order, deterministic from the arguments (ranges are inclusive).

    Each session picks one of ``system_prompts`` shared system prompts (``system_blocks`` full hash
    blocks each) and runs ``turns`` turns: turn 1 is the system prompt plus a user message of
    ``user_tokens`` tokens; turn k+1 is turn k's prompt plus its answer (``output_tokens``) plus a new
    user message, so its hash ids extend turn k's. Sessions start uniformly in ``[0, duration_ms)``,
    turns follow each other after ``think_ms``. ``one_offs`` requests of ``one_off_blocks`` blocks of
    fresh ids arrive uniformly in ``[0, duration_ms)``. Raises ``ValueError`` for a negative count or
    an empty/negative range."""
    for name, value in (("sessions", sessions), ("system_prompts", system_prompts), ("one_offs", one_offs)):
        if not _is_int(value) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if sessions and system_prompts < 1:
        raise ValueError("sessions need at least one system prompt")
    if sessions + one_offs == 0:
        raise ValueError("a trace needs at least one session or one-off request")
    ranges = {
        "turns": (turns, 1),
        "system_blocks": (system_blocks, 0),
        "user_tokens": (user_tokens, 1),
        "output_tokens": (output_tokens, 0),
        "one_off_blocks": (one_off_blocks, 1),
        "think_ms": (think_ms, 0),
    }
    for name, ((lo, hi), least) in ranges.items():
        if not (_is_int(lo) and _is_int(hi)) or lo < least or hi < lo:
            raise ValueError(f"{name} must be a (min, max) pair of ints with {least} <= min <= max, got {(lo, hi)}")
    if not _is_int(duration_ms) or duration_ms < 1:
        raise ValueError(f"duration_ms must be an int >= 1, got {duration_ms!r}")

    rng = random.Random(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    B = HASH_BLOCK_TOKENS
    prompts = [fresh(rng.randint(*system_blocks)) for _ in range(system_prompts)]
    events: list[tuple[int, int, TraceRequest]] = []  # (timestamp, generation order, request)
    for _ in range(sessions):
        system = prompts[rng.randrange(system_prompts)]
        ids = list(system)
        length = len(system) * B
        t = rng.randrange(duration_ms)
        for turn in range(rng.randint(*turns)):
            if turn:
                t += rng.randint(*think_ms)
            length += rng.randint(*user_tokens)
            ids += fresh(-(-length // B) - len(ids))
            out = rng.randint(*output_tokens)
            events.append((t, len(events), TraceRequest(t, length, out, tuple(ids))))
            length += out  # the answer is part of the next turn's prompt
    for _ in range(one_offs):
        n = rng.randint(*one_off_blocks)
        length = (n - 1) * B + rng.randint(1, B)
        t = rng.randrange(duration_ms)
        events.append((t, len(events), TraceRequest(t, length, rng.randint(*output_tokens), tuple(fresh(n)))))
    events.sort(key=lambda e: (e[0], e[1]))
    # Renumber ids in order of first appearance, as Mooncake's files are.
    renumber: dict[int, int] = {}
    out_reqs = []
    for t, _, req in events:
        ids = tuple(renumber.setdefault(h, len(renumber)) for h in req.hash_ids)
        out_reqs.append(TraceRequest(t, req.input_length, req.output_length, ids))
    return out_reqs


#: Generated shapes: ``sessions`` (``generate_trace``: shared system prompts, multi-turn sessions,
#: one-offs) and ``fast25`` (``generate_fast25_trace``: the public conversation trace's shape).
SHAPES = ("sessions", "fast25")
#: Requests of the public FAST'25 conversation trace (``generate_fast25_trace``'s default).
FAST25_REQUESTS = 12_031


def generate_fast25_trace(
    *,
    requests: int = FAST25_REQUESTS,
    median_input: int = 6_200,
    min_input: int = 891,
    max_input: int = 126_000,
    spread: tuple[float, float] = (1.55, 1.1),
    reuse_share: float = 0.42,
    reuse_recency: int = 1_000,
    multi_turn_share: float = 0.001,
    output_median: int = 350,
    max_output: int = 2_000,
    duration_ms: int | None = None,
    seed: int = 0,
) -> list[TraceRequest]:
    """A trace of ``requests`` requests shaped like the FAST'25 conversation trace (module docstring),
    in arrival order, deterministic from the arguments. ``median_input``: the median of the prompts
    that reuse nothing (the whole trace's comes out near 6.9K); ``spread``: the log-normal's sigma below
    and above it; ``reuse_recency``: the mean distance, in requests, back to a reused request;
    ``duration_ms`` defaults to 294 ms a request (the public trace's hour). Raises ``ValueError`` for a
    count below 1, lengths out of order, a share outside [0, 1] or a recency below 1."""
    if not _is_int(requests) or requests < 1:
        raise ValueError(f"requests must be an int >= 1, got {requests!r}")
    if not all(_is_int(v) for v in (median_input, min_input, max_input)) or not (
        1 <= min_input <= median_input <= max_input
    ):
        raise ValueError(
            f"need ints 1 <= min_input <= median_input <= max_input, got {min_input}, {median_input}, {max_input}"
        )
    if not (_is_int(output_median) and _is_int(max_output)) or not 1 <= output_median <= max_output:
        raise ValueError(f"need ints 1 <= output_median <= max_output, got {output_median}, {max_output}")
    if not _is_int(reuse_recency) or reuse_recency < 1:
        raise ValueError(f"reuse_recency must be an int >= 1, got {reuse_recency!r}")
    for name, share in (("reuse_share", reuse_share), ("multi_turn_share", multi_turn_share)):
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"{name} must lie in [0, 1], got {share!r}")
    if len(spread) != 2 or not all(s >= 0 for s in spread):
        raise ValueError(f"spread must be two sigmas >= 0, got {spread!r}")
    if duration_ms is None:
        duration_ms = max(1, 294 * requests)
    if not _is_int(duration_ms) or duration_ms < 1:
        raise ValueError(f"duration_ms must be an int >= 1, got {duration_ms!r}")

    rng = random.Random(seed)
    B = HASH_BLOCK_TOKENS
    next_id = 1  # id 0: the system block every prompt opens with

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    def input_length() -> int:
        while True:
            z = rng.gauss(0.0, 1.0)
            n = round(median_input * math.exp(z * spread[0 if z < 0 else 1]))
            if n <= max_input:
                break
        if n < min_input:  # the floor: a system prompt and a short question
            n = min(max_input, min_input + int(rng.expovariate(1 / 40)))
        return max(n, 1)

    def output_length() -> int:
        return max(1, min(max_output, round(rng.gauss(output_median, output_median / 2))))

    rate = requests / duration_ms
    t = 0.0
    follow_ups: list[tuple[float, int, tuple[int, ...], int]] = []  # (due ms, order, ids, length so far)
    made: list[TraceRequest] = []
    for _ in range(requests):
        t += rng.expovariate(rate)
        ts = int(t)
        if follow_ups and follow_ups[0][0] <= t:
            _, _, prev, length = heapq.heappop(follow_ups)  # a session's next turn
            length = min(max_input, length + input_length() // 8)
            ids = list(prev) + fresh(max(0, -(-length // B) - len(prev)))
            ids = ids[: -(-length // B)]
        else:
            src: tuple[int, ...] = ()
            if made and rng.random() < reuse_share:
                back = int(rng.expovariate(1 / reuse_recency))
                src = made[-1 - back if back < len(made) else rng.randrange(len(made))].hash_ids
            if len(src) >= 3:
                # most of the source's prefix (never all of it: that would be the source's next turn),
                # then a tail of its own: the shared part is most of the new prompt
                k = min(len(src) - 1, max(2, round(rng.uniform(0.6, 1.0) * len(src))))
                length = min(max_input, k * B + max(1, round(k * B * rng.uniform(0.05, 0.5))))
                ids = list(src[:k]) + fresh(-(-length // B) - k)
            else:
                length = input_length()
                ids = [0] + fresh(-(-length // B) - 1)
        out = output_length()
        req = TraceRequest(ts, length, out, tuple(ids))
        made.append(req)
        if rng.random() < multi_turn_share:
            due = t + rng.uniform(30_000, 180_000)
            heapq.heappush(follow_ups, (due, len(made), req.hash_ids, length + out))
    # Renumber ids in order of first appearance, as Mooncake's files are.
    renumber: dict[int, int] = {}
    return [
        TraceRequest(r.timestamp, r.input_length, r.output_length,
                     tuple(renumber.setdefault(h, len(renumber)) for h in r.hash_ids))
        for r in made
    ]


def session_sizes(requests: Sequence[TraceRequest]) -> list[int]:
    """Requests per session, sessions in order of their first request: a request continues the
    session of the latest earlier request of at least two hash ids whose ids are all a prefix of its
    own (a next turn: the previous prompt, its answer, a new message); else it opens a session."""
    keys: dict[tuple[int, int], int] = {}  # (parent prefix key, id) -> prefix key
    ends: dict[int, int] = {}  # prefix key -> session of the latest request whose ids end there
    sizes: list[int] = []
    for req in requests:
        session, key, chain = None, -1, []
        for h in req.hash_ids:
            key = keys.setdefault((key, h), len(keys))
            chain.append(key)
        for k in reversed(chain[1:-1] if len(chain) > 2 else []):
            if k in ends:
                session = ends[k]
                break
        if session is None:
            session = len(sizes)
            sizes.append(0)
        sizes[session] += 1
        if len(chain) >= 2:
            ends[chain[-1]] = session
    return sizes


# ---------------------------------------------------------------------- clipping
@dataclass(frozen=True)
class Clipping:
    """What ``clip_trace`` did: ``clipped`` of ``requests`` requests lost ``dropped_tokens`` of the
    trace's ``input_tokens`` prompt tokens (trace scale); kept prompts hold at most ``max_blocks``
    hash blocks."""

    requests: int
    clipped: int
    input_tokens: int
    dropped_tokens: int
    max_blocks: int

    @property
    def token_share(self) -> float:
        """Share of the trace's prompt tokens dropped."""
        return self.dropped_tokens / self.input_tokens if self.input_tokens else 0.0


def clip_trace(
    requests: Sequence[TraceRequest],
    *,
    context: int,
    scale: int = 1,
    max_output_tokens: int | None = None,
) -> tuple[list[TraceRequest], Clipping]:
    """Every request fitted to a model of ``context`` tokens at ``scale`` (the module docstring's
    rule: leading whole hash blocks, as many as fit beside the scaled, capped output) and what was
    dropped. Requests that fit are returned as they are. Raises ``ValueError`` for a bad scale,
    context or output cap, or a context with no room for one hash block beside an output."""
    _check_scale(scale)
    if not _is_int(context) or context < 1:
        raise ValueError(f"context must be an int >= 1, got {context!r}")
    if max_output_tokens is not None and (not _is_int(max_output_tokens) or max_output_tokens < 0):
        raise ValueError(f"max_output_tokens must be an int >= 0 or None, got {max_output_tokens!r}")
    per_block = HASH_BLOCK_TOKENS // scale
    out: list[TraceRequest] = []
    clipped = dropped = total = 0
    for req in requests:
        total += req.input_length
        n_out = -(-req.output_length // scale)
        if max_output_tokens is not None:
            n_out = min(n_out, max_output_tokens)
        if -(-req.input_length // scale) + n_out <= context:
            out.append(req)
            continue
        keep = (context - n_out) // per_block
        if keep < 1:
            raise ValueError(
                f"a context of {context} tokens has no room for one hash block ({per_block} tokens at scale "
                f"1/{scale}) beside an output of {n_out}: use a larger scale or a smaller output cap"
            )
        length = keep * HASH_BLOCK_TOKENS
        clipped += 1
        dropped += req.input_length - length
        out.append(TraceRequest(req.timestamp, length, req.output_length, req.hash_ids[:keep]))
    longest = max((len(r.hash_ids) for r in out), default=0)
    return out, Clipping(len(out), clipped, total, dropped, longest)


# ---------------------------------------------------------------------- expansion
@dataclass(frozen=True)
class ExpandedRequest:
    """A trace request at replay scale: prompt token ids and the (scaled, clipped) output length."""

    timestamp: int | float  # ms, as in the trace (not scaled)
    tokens: list[int]
    output_length: int
    hash_ids: tuple[int, ...]


def _check_scale(scale: int) -> None:
    if not _is_int(scale) or scale < 1 or HASH_BLOCK_TOKENS % scale:
        raise ValueError(f"scale must be an int dividing {HASH_BLOCK_TOKENS} (1, 2, 4, ..., 512), got {scale!r}")


def block_token_ids(hash_id: int, n: int, *, vocab: int = 256) -> list[int]:
    """The first ``n`` token ids (each in ``0..vocab-1``) of hash block ``hash_id``. Pure and
    deterministic: BLAKE2b-512 of (id, counter) under a fixed key, 4 bytes per token. ``n`` tokens
    are a prefix of ``n + 1`` tokens, so a partial block is a prefix of the full one."""
    if not _is_int(hash_id) or hash_id < 0:
        raise ValueError(f"hash_id must be an int >= 0, got {hash_id!r}")
    if not _is_int(vocab) or not 1 <= vocab <= 2**32:
        raise ValueError(f"vocab must be an int in 1..2**32, got {vocab!r}")
    out: list[int] = []
    counter = 0
    while len(out) < n:
        digest = hashlib.blake2b(
            hash_id.to_bytes(8, "little") + counter.to_bytes(8, "little"), key=_EXPAND_KEY, digest_size=64
        ).digest()
        out.extend(int.from_bytes(digest[i : i + 4], "little") % vocab for i in range(0, 64, 4))
        counter += 1
    return out[:n]


def expand_request(
    req: TraceRequest,
    *,
    scale: int = 1,
    max_input_tokens: int | None = None,
    vocab: int = 256,
    _cache: dict[int, list[int]] | None = None,
) -> list[int]:
    """The prompt token ids of ``req`` at ``scale`` (see the module docstring): its hash blocks'
    ``512 // scale`` tokens each, cut to ``ceil(input_length / scale)`` and then to
    ``max_input_tokens``. Raises ``ValueError`` for a scale that does not divide 512 or
    ``max_input_tokens < 1``."""
    _check_scale(scale)
    if max_input_tokens is not None and (not _is_int(max_input_tokens) or max_input_tokens < 1):
        raise ValueError(f"max_input_tokens must be an int >= 1 or None, got {max_input_tokens!r}")
    per_block = HASH_BLOCK_TOKENS // scale
    n = -(-req.input_length // scale)
    if max_input_tokens is not None:
        n = min(n, max_input_tokens)
    cache = {} if _cache is None else _cache
    tokens: list[int] = []
    for h in req.hash_ids[: -(-n // per_block)]:
        block = cache.get(h)
        if block is None:
            block = cache[h] = block_token_ids(h, per_block, vocab=vocab)
        tokens += block
    return tokens[:n]


def expand_trace(
    requests: Sequence[TraceRequest],
    *,
    scale: int = 1,
    max_input_tokens: int | None = None,
    max_output_tokens: int | None = None,
    vocab: int = 256,
) -> list[ExpandedRequest]:
    """Every request expanded (``expand_request``); output lengths become ``ceil(output_length / scale)``
    capped at ``max_output_tokens``."""
    if max_output_tokens is not None and (not _is_int(max_output_tokens) or max_output_tokens < 0):
        raise ValueError(f"max_output_tokens must be an int >= 0 or None, got {max_output_tokens!r}")
    cache: dict[int, list[int]] = {}
    out = []
    for req in requests:
        tokens = expand_request(req, scale=scale, max_input_tokens=max_input_tokens, vocab=vocab, _cache=cache)
        n_out = -(-req.output_length // scale)
        if max_output_tokens is not None:
            n_out = min(n_out, max_output_tokens)
        out.append(ExpandedRequest(req.timestamp, tokens, n_out, req.hash_ids))
    return out


# ---------------------------------------------------------------------- bounds
@dataclass(frozen=True)
class Bound:
    """Token-weighted hit ratio of a bound: ``hit_tokens / query_tokens``."""

    hit_tokens: int
    query_tokens: int

    @property
    def ratio(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class BlockTrace:
    """A trace as chain-keyed full blocks, ready for the bounds (see the module docstring).

    ``chains[r]``: the block keys (small ints, equal iff the whole prefix up to and including that
    block is equal) of request ``r``'s full blocks; ``usable[r]``: how many of them may hit
    (``(len(prompt) - 1) // block_size``, or all full blocks with ``recompute_last=False``)."""

    def __init__(self, chains: list[list[int]], usable: list[int], query_tokens: int, block_size: int) -> None:
        self.chains = chains
        self.usable = usable
        self.query_tokens = query_tokens
        self.block_size = block_size
        self.unique_blocks = len({k for chain in chains for k in chain})

    @classmethod
    def from_prompts(
        cls, prompts: Iterable[Sequence[int]], *, block_size: int = 16, recompute_last: bool = True
    ) -> BlockTrace:
        if not _is_int(block_size) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        keys: dict[tuple[int, tuple[int, ...]], int] = {}
        chains, usable, query = [], [], 0
        for prompt in prompts:
            prompt = list(prompt)
            query += len(prompt)
            chain, parent = [], -1
            for start in range(0, len(prompt) - block_size + 1, block_size):
                parent = keys.setdefault((parent, tuple(prompt[start : start + block_size])), len(keys))
                chain.append(parent)
            chains.append(chain)
            usable.append(min(len(chain), (len(prompt) - 1) // block_size) if recompute_last else len(chain))
        return cls(chains, usable, query, block_size)

    def infinite(self) -> Bound:
        """The infinite-cache bound: the longest prefix of blocks seen in earlier requests."""
        seen: set[int] = set()
        hit = 0
        for chain, usable in zip(self.chains, self.usable, strict=True):
            n = 0
            while n < usable and chain[n] in seen:
                n += 1
            hit += n
            seen.update(chain)
        return Bound(hit * self.block_size, self.query_tokens)

    def belady(self, capacity_blocks: int) -> Bound:
        """Belady's MIN at ``capacity_blocks`` cached blocks (module docstring). O(A log A) for A
        block accesses. Raises ``ValueError`` for a negative capacity."""
        if not _is_int(capacity_blocks) or capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be an int >= 0, got {capacity_blocks!r}")
        never = math.inf
        # next_use[r][i]: time (a global access index) of the next access to chains[r][i] after this one
        # that could count as a hit; access times are unique, so priorities never tie.
        next_use: list[list[float]] = [[] for _ in self.chains]
        upcoming: dict[int, float] = {}
        t = sum(len(c) for c in self.chains)
        for r in range(len(self.chains) - 1, -1, -1):
            chain, usable = self.chains[r], self.usable[r]
            row = [never] * len(chain)
            for i in range(len(chain) - 1, -1, -1):
                t -= 1
                key = chain[i]
                row[i] = upcoming.get(key, never)
                if i < usable:
                    upcoming[key] = t
            next_use[r] = row
        cached: dict[int, float] = {}  # key -> its current priority (next counted use)
        heap: list[tuple[float, int]] = []  # (-priority, key), lazily invalidated
        hit = 0
        for r, chain in enumerate(self.chains):
            usable = self.usable[r]
            run = True
            for i, key in enumerate(chain):
                nxt = next_use[r][i]
                if key in cached:
                    if run and i < usable:
                        hit += 1
                    if nxt == never:
                        del cached[key]  # never useful again: drop it now (an eviction MIN would make first)
                    else:
                        cached[key] = nxt
                        heapq.heappush(heap, (-nxt, key))
                    continue
                run = False
                if nxt == never or capacity_blocks == 0:
                    continue  # bypass
                cached[key] = nxt
                heapq.heappush(heap, (-nxt, key))
                while len(cached) > capacity_blocks:
                    prio, victim = heapq.heappop(heap)
                    if cached.get(victim) == -prio:
                        del cached[victim]
        return Bound(hit * self.block_size, self.query_tokens)


    def lru(self, capacity_blocks: int) -> Bound:
        """A reference online policy, not a bound: prefix-contiguous hits under LRU at
        ``capacity_blocks`` cached blocks, each request's blocks refreshed deepest first (as the
        engine frees them), so a shared prefix outlives the tails that hang off it."""
        if not _is_int(capacity_blocks) or capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be an int >= 0, got {capacity_blocks!r}")
        lru: OrderedDict[int, None] = OrderedDict()
        hit = 0
        for chain, usable in zip(self.chains, self.usable, strict=True):
            n = 0
            while n < usable and chain[n] in lru:
                n += 1
            hit += n
            for key in reversed(chain):
                lru[key] = None
                lru.move_to_end(key)
            while len(lru) > capacity_blocks:
                lru.popitem(last=False)
        return Bound(hit * self.block_size, self.query_tokens)


def infinite_cache_bound(prompts: Iterable[Sequence[int]], *, block_size: int = 16) -> Bound:
    """``BlockTrace.from_prompts(prompts, block_size=block_size).infinite()``."""
    return BlockTrace.from_prompts(prompts, block_size=block_size).infinite()


def belady_bound(prompts: Iterable[Sequence[int]], capacity_blocks: int, *, block_size: int = 16) -> Bound:
    """``BlockTrace.from_prompts(prompts, block_size=block_size).belady(capacity_blocks)``."""
    return BlockTrace.from_prompts(prompts, block_size=block_size).belady(capacity_blocks)


# ---------------------------------------------------------------------- summary / CLI
def summarize(
    requests: Sequence[TraceRequest],
    *,
    scale: int = 1,
    context: int | None = None,
    max_output_tokens: int | None = None,
    max_input_tokens: int | None = None,
    block_size: int = 16,
    capacity_fracs: Sequence[float] = (),
) -> dict[str, float]:
    """Figures of a trace: requests, sessions and the share of single-request ones, full-scale input
    tokens (median, max), unique hash ids; with a ``context``, what ``clip_trace`` dropped to fit it
    (requests clipped, share of prompt tokens); expanded prompt tokens (clipped to ``max_input_tokens``
    too when given), unique blocks of ``block_size`` expanded tokens, the infinite-cache bound and,
    for each fraction ``f`` of ``capacity_fracs``, Belady and LRU at ``max(1, round(f * unique_blocks))``
    blocks."""
    sessions = session_sizes(requests)
    lengths = sorted(r.input_length for r in requests)
    out: dict[str, float] = {
        "requests": len(requests),
        "sessions": len(sessions),
        "single_request_sessions": sum(n == 1 for n in sessions) / len(sessions) if sessions else 0.0,
        "input_tokens": sum(lengths),
        "median_input": lengths[len(lengths) // 2] if lengths else 0,
        "max_input": lengths[-1] if lengths else 0,
        "unique_hash_ids": len({h for r in requests for h in r.hash_ids}),
    }
    if context is not None:
        requests, clip = clip_trace(requests, context=context, scale=scale, max_output_tokens=max_output_tokens)
        out["clipped_requests"] = clip.clipped
        out["clipped_token_share"] = clip.token_share
    expanded = expand_trace(requests, scale=scale, max_input_tokens=max_input_tokens)
    bt = BlockTrace.from_prompts((e.tokens for e in expanded), block_size=block_size)
    out["expanded_tokens"] = bt.query_tokens
    out["unique_blocks"] = bt.unique_blocks
    out["infinite_hit"] = bt.infinite().ratio
    for frac in capacity_fracs:
        cap = max(1, round(frac * bt.unique_blocks))
        out[f"belady_{frac:g}_blocks"] = cap
        out[f"belady_{frac:g}_hit"] = bt.belady(cap).ratio
        out[f"lru_{frac:g}_hit"] = bt.lru(cap).ratio
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write a synthetic Mooncake-format trace and print its summary")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--out", help="write a generated trace to this file")
    src.add_argument("--trace", help="summarise this existing trace instead of generating one")
    ap.add_argument("--shape", choices=SHAPES, default="sessions",
                    help="generated shape: sessions (generate_trace, the options below) or fast25 (the public "
                         "conversation trace's shape, generate_fast25_trace)")
    ap.add_argument("--requests", type=int, default=FAST25_REQUESTS,
                    help=f"requests of a fast25 trace (default {FAST25_REQUESTS:,}, the public trace's)")
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--system-prompts", type=int, default=4)
    ap.add_argument("--min-turns", type=int, default=2)
    ap.add_argument("--max-turns", type=int, default=5)
    ap.add_argument("--one-offs", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=int, default=16, help="lengths divided by this for the summary (divides 512)")
    ap.add_argument("--context", type=int, default=1024,
                    help="requests clipped (clip_trace) to this model context for the summary (default: the "
                         "tiny model's 1,024)")
    ap.add_argument("--max-output-tokens", type=int, default=16,
                    help="scaled outputs capped at this when fitting the context (default 16)")
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args(argv)

    try:
        if args.out:
            if args.shape == "fast25":
                reqs = generate_fast25_trace(requests=args.requests, seed=args.seed)
            else:
                reqs = generate_trace(
                    sessions=args.sessions,
                    system_prompts=args.system_prompts,
                    turns=(args.min_turns, args.max_turns),
                    one_offs=args.one_offs,
                    seed=args.seed,
                )
            write_trace(args.out, reqs)
            path = args.out
        else:
            path = args.trace
            reqs = read_trace(path)
        summary = summarize(
            reqs, scale=args.scale, context=args.context, max_output_tokens=args.max_output_tokens,
            block_size=args.block_size, capacity_fracs=(0.125, 0.5),
        )
    except (TraceFormatError, ValueError, OSError) as exc:
        ap.exit(2, f"bench.traces: {exc}\n")

    print(f"trace {path}: scale 1/{args.scale}, clipped to a context of {args.context} tokens "
          f"({args.max_output_tokens} of them output), block size {args.block_size}")
    header = f"{'figure':<36} {'value':>12}"
    print(header)
    print("-" * len(header))
    rows = [
        ("requests", f"{summary['requests']:d}"),
        ("sessions (single-request share)", f"{summary['sessions']:d} ({summary['single_request_sessions']:.1%})"),
        ("input tokens (trace scale)", f"{summary['input_tokens']:d}"),
        ("median / max input (trace scale)", f"{summary['median_input']:d} / {summary['max_input']:d}"),
        ("unique hash ids (512-token blocks)", f"{summary['unique_hash_ids']:d}"),
        ("clipped requests (tokens dropped)",
         f"{summary['clipped_requests']:d} ({summary['clipped_token_share']:.1%})"),
        ("prompt tokens (expanded)", f"{summary['expanded_tokens']:d}"),
        ("unique blocks (expanded)", f"{summary['unique_blocks']:d}"),
        ("infinite-cache hit", f"{summary['infinite_hit']:.1%}"),
    ]
    for frac in (0.125, 0.5):
        cap = summary[f"belady_{frac:g}_blocks"]
        rows.append((f"belady hit @ {cap:d} blocks ({frac:g})", f"{summary[f'belady_{frac:g}_hit']:.1%}"))
        rows.append((f"lru hit @ {cap:d} blocks ({frac:g})", f"{summary[f'lru_{frac:g}_hit']:.1%}"))
    for name, value in rows:
        print(f"{name:<36} {value:>12}")
    print("RESULT " + " ".join(
        f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()
    ))


if __name__ == "__main__":
    main()
