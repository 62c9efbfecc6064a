"""vLLM's own engine figures for one revision: KV cache usage, waiting and running requests,
preemptions, as vLLM's scheduler reports them to its stat loggers.

:class:`EngineFigures` is the plain holder (thread-safe: vLLM's output handler records, the replica's
``stats`` reads); :meth:`EngineFigures.stat_logger` is the per-engine factory handed to
``AsyncLLM.from_engine_args(stat_loggers=[...])``. ``vllm`` is imported only when the factory is
called (inside vLLM), so this module imports without vLLM.

``snapshot()`` -> ``{"kv_cache_usage": 0..1, "waiting": n, "running": n, "preemptions": total,
"reported": bool}``: the gauges are the last scheduler report (summed over engines of a data-parallel
group, the usage averaged), ``preemptions`` counts since this revision's engine started, and
``reported`` is False until the first report (the gauges then read 0).
"""

from __future__ import annotations

import threading


class EngineFigures:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_engine: dict[int, tuple[float, int, int]] = {}  # engine index -> (usage, waiting, running)
        self._preemptions = 0

    def record(self, *, engine: int, kv_cache_usage: float | None, waiting: int | None, running: int | None,
               preempted: int) -> None:
        with self._lock:
            if kv_cache_usage is not None:
                self._by_engine[engine] = (float(kv_cache_usage), int(waiting or 0), int(running or 0))
            self._preemptions += max(0, int(preempted))

    def snapshot(self) -> dict:
        with self._lock:
            rows = list(self._by_engine.values())
            preemptions = self._preemptions
        return {"kv_cache_usage": round(sum(r[0] for r in rows) / len(rows), 6) if rows else 0.0,
                "waiting": sum(r[1] for r in rows), "running": sum(r[2] for r in rows),
                "preemptions": preemptions, "reported": bool(rows)}

    def stat_logger(self, vllm_config, engine_index: int = 0):
        """vLLM's per-engine stat logger factory: a ``StatLoggerBase`` that records into this holder."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        figures = self

        class _Recorder(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0) -> None:
                self.engine_index = engine_index

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
                figures.record(
                    engine=engine_idx,
                    kv_cache_usage=getattr(scheduler_stats, "kv_cache_usage", None) if scheduler_stats else None,
                    waiting=getattr(scheduler_stats, "num_waiting_reqs", 0) if scheduler_stats else None,
                    running=getattr(scheduler_stats, "num_running_reqs", 0) if scheduler_stats else None,
                    preempted=getattr(iteration_stats, "num_preempted_reqs", 0) if iteration_stats else 0)

            def log_engine_initialized(self) -> None:
                pass

        return _Recorder(vllm_config, engine_index)
