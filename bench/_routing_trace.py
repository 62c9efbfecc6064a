"""A Mooncake-format trace made ready for the routing simulation (``bench.routing``).

Each request becomes a ``SimRequest`` in the simulation's units: full-scale tokens, one cache block
per 512-token hash block (``traces.HASH_BLOCK_TOKENS``), a block keyed by its whole prefix (its chain:
the previous block's key and its own hash id, as the engine's hash chain keys it). Only full blocks
are cached; at most ``(input_length - 1) // 512`` of them may hit (the last prompt token is always
recomputed), as in ``traces.BlockTrace``, whose infinite-cache bound is computed on the same keys.

Tenants and sessions are not in the format, so they are derived from it, the same way for every
policy:

- **tenant**: a digest of the request's first hash id, modulo ``tenants``. Requests sharing a prefix
  share its first block, hence a tenant (a prefix is never shared across tenants, whose hash chains
  differ by their scope). The tenant only drives fair-share eviction.
- **session**: a request continues the session of the latest earlier request whose whole prompt (all
  hash ids, the partial last block included) is a prefix of its own: turn k+1 of a chat extends turn
  k. That is what the gateway's stickiness key (the request's ``user``, or a digest of the chat's first
  turn) identifies; otherwise the request starts a session of its own.

**Arrival rate.** Timestamps (ms) are shifted to start at 0 and scaled by one factor so that the
trace's prompt tokens, prefilled with no cache at all, would keep ``load`` of the replicas'
aggregate prefill capacity busy over the trace's span: ``sum(input_length) = load * replicas *
prefill_tokens_per_s * span``. Cache hits lower the work actually done, so no policy is pushed past
saturation by the choice of rate alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from bench.traces import HASH_BLOCK_TOKENS, BlockTrace, TraceRequest

__all__ = ["SimRequest", "SimTrace", "prepare"]


@dataclass(frozen=True)
class SimRequest:
    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    keys: tuple[int, ...]  # chain keys of the full blocks, in prefix order
    usable: int  # how many of ``keys`` may hit
    tenant: int
    session: str


@dataclass(frozen=True)
class SimTrace:
    requests: list[SimRequest]
    unique_blocks: int  # the working set: distinct full blocks
    infinite_hit: float  # token-weighted infinite-cache hit bound
    time_scale: float  # simulated seconds per trace second
    span_s: float  # simulated seconds from the first arrival to the last
    offered_load: float  # no-cache prompt tokens / (replicas x prefill rate x span)
    sessions: int


def _tenant(first_id: int, tenants: int) -> int:
    digest = hashlib.blake2b(first_id.to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % tenants


def prepare(
    trace: Sequence[TraceRequest], *, replicas: int, prefill_tokens_per_s: float, load: float = 0.75,
    tenants: int = 4,
) -> SimTrace:
    """The trace as ``SimRequest``s at the arrival rate of ``load`` (module docstring). Raises
    ``ValueError`` for an empty trace or non-positive arguments."""
    if not trace:
        raise ValueError("an empty trace")
    if replicas < 1 or tenants < 1 or not prefill_tokens_per_s > 0 or not load > 0:
        raise ValueError("replicas, tenants, prefill_tokens_per_s and load must be > 0")
    B = HASH_BLOCK_TOKENS
    block_keys: dict[tuple[int, int], int] = {}  # (parent key, hash id) -> key, full blocks
    prefix_keys: dict[tuple[int, int], int] = {}  # the same over every block, partial ones included
    session_of: dict[int, str] = {}  # prefix key of a request's whole prompt -> its session
    t0 = trace[0].timestamp
    span_ms = trace[-1].timestamp - t0
    tokens = sum(r.input_length for r in trace)
    span_s = tokens / (load * replicas * prefill_tokens_per_s)
    scale = span_s / (span_ms / 1000.0) if span_ms > 0 else 1.0
    out: list[SimRequest] = []
    chains, usable_all = [], []
    n_sessions = 0
    for i, req in enumerate(trace):
        tenant = _tenant(req.hash_ids[0], tenants)
        parent, keys = -1 - tenant, []
        for h in req.hash_ids[: req.input_length // B]:
            parent = block_keys.setdefault((parent, h), len(block_keys))
            keys.append(parent)
        parent, prefixes = -1 - tenant, []
        for h in req.hash_ids:
            parent = prefix_keys.setdefault((parent, h), len(prefix_keys))
            prefixes.append(parent)
        session = next((session_of[k] for k in reversed(prefixes) if k in session_of), None)
        if session is None:
            session = f"s{n_sessions}"
            n_sessions += 1
        session_of[prefixes[-1]] = session
        usable = min(len(keys), (req.input_length - 1) // B)
        chains.append(keys)
        usable_all.append(usable)
        arrival = (req.timestamp - t0) / 1000.0 * scale
        out.append(SimRequest(i, arrival, req.input_length, req.output_length, tuple(keys), usable, tenant, session))
    bt = BlockTrace(chains, usable_all, tokens, B)
    span = out[-1].arrival_s
    offered = tokens / (replicas * prefill_tokens_per_s * span) if span > 0 else float("inf")
    return SimTrace(out, bt.unique_blocks, bt.infinite().ratio, scale, span, offered, n_sessions)
