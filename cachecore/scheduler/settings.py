"""The scheduler's settings, validated when built (``ValueError`` naming the setting)."""

from __future__ import annotations

from dataclasses import dataclass

from cachecore.scheduler.queue import QUEUE_POLICIES


@dataclass(frozen=True)
class SchedulerSettings:
    """``token_budget``: tokens one step computes at most (it must exceed ``max_batch``: every step keeps
    room for a prefill chunk beside the decode tokens); ``max_batch``: requests running at once;
    ``age_steps``: steps after which a waiting request goes before every other; ``policy``: order within
    a tenant (``queue.QUEUE_POLICIES``); ``quantum``: tokens of head start a tenant that was idle gets;
    ``lean_budget``: tokens all other tenants share in a step carrying the first token of a tenant below
    its share; ``contended_budget``: tokens per step while two or more tenants had work within
    ``contended_window`` steps (0: no bound; otherwise it must exceed ``max_batch``); ``anticipate_ms``: how
    long the loop may hold the next step for a tenant below its share that just finished a request
    (``anticipate.py``; 0: never, at most 1000)."""

    token_budget: int = 512
    max_batch: int = 32
    age_steps: int = 64
    policy: str = "cache_aware"
    quantum: int = 1024
    lean_budget: int = 8
    contended_budget: int = 64
    contended_window: int = 8
    anticipate_ms: int = 40

    def __post_init__(self) -> None:
        for name in ("max_batch", "age_steps", "token_budget", "lean_budget", "contended_window"):
            value, low = getattr(self, name), 0 if name == "lean_budget" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if self.token_budget <= self.max_batch:
            raise ValueError(f"token_budget ({self.token_budget}) must exceed max_batch ({self.max_batch}): every "
                             "step keeps room for a prefill chunk beside the decode tokens")
        cb = self.contended_budget
        if isinstance(cb, bool) or not isinstance(cb, int) or not (cb == 0 or cb > self.max_batch):
            raise ValueError(f"contended_budget must be 0 (no bound) or exceed max_batch ({self.max_batch}), "
                             f"got {cb!r}")
        am = self.anticipate_ms
        if isinstance(am, bool) or not isinstance(am, int) or not 0 <= am <= 1000:
            raise ValueError(f"anticipate_ms must be an int from 0 to 1000, got {am!r}")
        if self.policy not in QUEUE_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(QUEUE_POLICIES)}, got {self.policy!r}")
