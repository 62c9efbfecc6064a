"""Load versus recompute: a decision from measured costs, not an assumption.

Per tier, the load time of ``n`` bytes is estimated as ``n / bandwidth``, the bandwidth being a
moving average of what the loads that tier actually served achieved end to end (its latency
included), plus a small fixed prior latency; the recompute time of ``t`` tokens as ``t`` times the
model's measured prefill cost per token on this device (from prefills long enough to measure it).
``should_load`` compares the two for the prefix a lower tier holds. Both costs grow linearly with
the prefix, so the answer is the whole prefix or none of it. Until the model's prefill rate is known,
the estimate cannot favour recompute and the prefix is loaded.

Fixed policies for comparison: ``always_load`` and ``always_recompute``. Thread-safe (the engine's
loader threads decide for L3 once they know what it holds).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

MIN_PREFILL_SAMPLE_TOKENS = 128
# Priors until a tier has served loads: a host-memory copy (~4 GB/s, 50 us) and a remote store.
PRIORS = {"l2": (4e9, 50e-6), "l3": (200e6, 2e-3)}


@dataclass
class _Ema:
    value: float | None = None

    def add(self, x: float, alpha: float = 0.2) -> None:
        self.value = x if self.value is None else (1 - alpha) * self.value + alpha * x


class LoadCost:
    def __init__(self, policy: str = "cost") -> None:
        self.policy = policy
        self._bandwidth: dict[str, _Ema] = {}
        self._sec_per_token = _Ema()
        self.decisions = {"load": 0, "recompute": 0}
        self._lock = threading.Lock()

    def observe_load(self, tier: str, *, nbytes: int, seconds: float, blocks: int) -> None:
        if blocks <= 0 or seconds <= 0:
            return
        with self._lock:
            self._bandwidth.setdefault(tier, _Ema()).add(nbytes / seconds)

    def observe_prefill(self, *, tokens: int, seconds: float) -> None:
        if tokens >= MIN_PREFILL_SAMPLE_TOKENS and seconds > 0:
            with self._lock:
                self._sec_per_token.add(seconds / tokens)

    def set_prefill_rate(self, tokens_per_s: float) -> None:
        """The model's prefill rate as measured elsewhere (a vLLM replica's actor): recompute cost."""
        if tokens_per_s > 0:
            with self._lock:
                self._sec_per_token.value = 1.0 / tokens_per_s

    def estimate_load(self, tier: str, nbytes: int) -> float:
        bw_prior, lat_prior = PRIORS.get(tier, PRIORS["l3"])
        bw = self._bandwidth.get(tier, _Ema(bw_prior)).value or bw_prior
        return lat_prior + nbytes / bw

    def estimate_recompute(self, tokens: int) -> float | None:
        rate = self._sec_per_token.value
        return None if rate is None else rate * tokens

    def should_load(self, tier: str, *, nbytes: int, tokens: int) -> bool:
        if self.policy == "always_load":
            load = True
        elif self.policy == "always_recompute":
            load = False
        else:
            with self._lock:
                recompute = self.estimate_recompute(tokens)
                load = recompute is None or self.estimate_load(tier, nbytes) < recompute
        with self._lock:
            self.decisions["load" if load else "recompute"] += 1
        return load

    def snapshot(self) -> dict:
        return {
            "policy": self.policy,
            "decisions": dict(self.decisions),
            "prefill_seconds_per_token": self._sec_per_token.value,
            "bandwidth_bytes_per_s": {t: e.value for t, e in self._bandwidth.items()},
        }
