"""The ``router`` section of a worker's ``stats()``/``info()``: what a router needs to estimate a
request's time to first token on this replica (``cachecore.routing.cost``), all measured here.

- ``queued_prefill_tokens``: prompt tokens admitted by the engine and not computed yet (each running
  request's prompt length less the tokens whose KV is in its pages: its cached prefix counts as done);
  ``queued_requests``: those requests; ``running``: requests past their prefill (decoding).
- ``rates.prefill_tokens_per_s``: the inverse of the engine's measured prefill cost per token
  (``engine.record_prefill``, moving average of prefills of at least 128 computed tokens).
- ``rates.load_tokens_per_s``: per tier, the engine's measured load bandwidth (bytes/s of the loads
  that tier served, ``cachecore.loadcost``) over the layout's bytes per token; ``l1`` is
  ``L1_TOKENS_PER_S`` (device pages: nothing to load; a finite stand-in for infinite so the figures
  stay valid JSON).
- ``rates.decode_step_s``: moving average of the gap between consecutive tokens of a request on this
  worker (one decode step, its wait for the model included).
- ``cached_tokens``: tokens held in L1 and L2; ``capacity_tokens``: tokens L1 and L2 can hold.

A vLLM replica reports the same section (``VllmWorker._router``): L1 is vLLM's device cache (the
blocks vLLM allocated; what it holds as the worker records it, ``workers.vllm_blocks``), L2 Strata's
tier service under the KV connector (its size; what it holds as its KV events say).

Before the first measurement of a figure it is the documented default below and ``measured`` says
so: prefill ``DEFAULT_PREFILL_TOKENS_PER_S``, loads the cost model's priors (``loadcost.PRIORS``),
decode ``DEFAULT_DECODE_STEP_S``.
"""

from __future__ import annotations

import threading

from cachecore.loadcost import PRIORS

DEFAULT_PREFILL_TOKENS_PER_S = 2_000.0  # the cost model's conservative CPU figure (routing.cost.Rates)
DEFAULT_DECODE_STEP_S = 0.05
L1_TOKENS_PER_S = 1e12
_ALPHA = 0.2


class DecodeClock:
    """Moving average of decode step seconds, fed by the worker's token stream. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value: float | None = None
        self.samples = 0

    def observe(self, seconds: float) -> None:
        if seconds <= 0:
            return
        with self._lock:
            self.value = seconds if self.value is None else (1 - _ALPHA) * self.value + _ALPHA * seconds
            self.samples += 1


def router_section(engine, decode: DecodeClock) -> dict:
    """Plain data (module docstring) from ``engine`` (a ``CacheEngine``) and the worker's decode clock."""
    queued = waiting = running = 0
    for seq in engine.running():
        left = seq.prompt_len - seq.num_computed
        if left > 0:
            queued += left
            waiting += 1
        else:
            running += 1
    cost = engine.cost.snapshot()
    per_token = cost["prefill_seconds_per_token"]
    bandwidth = cost["bandwidth_bytes_per_s"]
    bytes_per_token = engine.layout.bytes_per_block / engine.block_size
    tiers = ["l2"] if engine.l2 is not None else []
    if engine.l3 is not None:
        tiers.append("l3")
    load = {"l1": L1_TOKENS_PER_S, **{t: (bandwidth.get(t) or PRIORS[t][0]) / bytes_per_token for t in tiers}}
    cached = engine.pool.num_cached + (engine.l2.pool.num_cached if engine.l2 is not None else 0)
    capacity = engine.pool.num_blocks + (engine.l2.pool.num_blocks if engine.l2 is not None else 0)
    return {
        "queued_prefill_tokens": queued,
        "queued_requests": waiting,
        "running": running,
        "cached_tokens": cached * engine.block_size,
        "capacity_tokens": capacity * engine.block_size,
        "rates": {
            "prefill_tokens_per_s": 1.0 / per_token if per_token else DEFAULT_PREFILL_TOKENS_PER_S,
            "load_tokens_per_s": load,
            "decode_step_s": decode.value if decode.value is not None else DEFAULT_DECODE_STEP_S,
        },
        "measured": {"prefill": bool(per_token), "decode": decode.value is not None,
                     **{t: bool(bandwidth.get(t)) for t in tiers}},
    }
