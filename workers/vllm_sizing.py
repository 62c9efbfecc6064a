"""How big vLLM's KV cache is: a share of the GPU, or a size in bytes. One decision, no I/O, no torch.

- **CUDA, ``STRATA_L1_MB`` unset**: vLLM sizes its KV cache itself from ``gpu_memory_utilization``
  (``STRATA_GPU_MEMORY_UTILIZATION``, default 0.9): the share of each GPU this engine may use, and
  what is left of it after the weights and the activation peak it profiles becomes KV. An 80 GB GPU
  gets tens of GB of KV, not the 256 MiB default of ``STRATA_L1_MB``.
- **CUDA, ``STRATA_L1_MB`` set**: exactly that many MiB of KV (``kv_cache_memory_bytes``), raised to
  two sequences of the context length when smaller. ``gpu_memory_utilization`` is still passed:
  vLLM refuses to start unless that share of the GPU is free, whichever way the KV cache is sized.
- **CPU**: ``STRATA_L1_MB`` MiB (raised the same way), as before; no GPU share.

A rollout stages the new revision's engine beside the serving one on the replica's GPUs
(``VllmWorker.stage_revision``). Sized by share, each engine takes that share of the GPU, so two of
them fit only when the share is at most one half: :func:`kv_sizing` refuses the second engine with a
:class:`KVSizingError` that says so, instead of letting vLLM fail later on free memory. Sized in bytes
the serving engine holds only its weights and that KV, and vLLM's own check at start decides.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["KVSizing", "KVSizingError", "kv_sizing"]

FRACTION = "gpu_memory_utilization"
BYTES = "l1_mb"


class KVSizingError(ValueError):
    """The engine cannot be sized as configured (the message names the variable to change)."""


class KVSizing(NamedTuple):
    """What to pass to vLLM's engine arguments, and why.

    ``kv_cache_memory_bytes``: the KV cache's size, or ``None`` when vLLM derives it from the GPU
    share; ``gpu_memory_utilization``: the GPU share (``None`` on CPU: vLLM's default, unused there);
    ``source``: :data:`FRACTION` or :data:`BYTES`, which of the two settings decided the size."""

    kv_cache_memory_bytes: int | None
    gpu_memory_utilization: float | None
    source: str

    def engine_kwargs(self) -> dict:
        """The keyword arguments of ``AsyncEngineArgs`` this sizing sets."""
        out: dict = {"kv_cache_memory_bytes": self.kv_cache_memory_bytes}
        if self.gpu_memory_utilization is not None:
            out["gpu_memory_utilization"] = self.gpu_memory_utilization
        return out


def kv_sizing(*, device: str, l1_mb: int, l1_mb_explicit: bool, gpu_memory_utilization: float,
              min_kv_bytes: int, engines_on_gpus: int = 0) -> KVSizing:
    """The sizing of one vLLM engine (module docstring). ``device``: ``cuda`` or ``cpu``;
    ``min_kv_bytes``: two sequences of the context length (a byte size is never below it);
    ``engines_on_gpus``: engines of this replica already running on the same GPUs (1 while a rollout
    stages the next revision). Raises :class:`KVSizingError` when a share-sized engine cannot fit
    beside them."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise KVSizingError(f"STRATA_GPU_MEMORY_UTILIZATION must be in (0, 1], got {gpu_memory_utilization!r}")
    by_bytes = max(int(l1_mb) << 20, int(min_kv_bytes))
    if not str(device).startswith("cuda"):
        return KVSizing(by_bytes, None, BYTES)
    if l1_mb_explicit:
        return KVSizing(by_bytes, gpu_memory_utilization, BYTES)
    if gpu_memory_utilization * (engines_on_gpus + 1) > 1.0:
        raise KVSizingError(
            f"a rollout starts the new revision beside the serving one on the replica's GPUs, and each takes "
            f"STRATA_GPU_MEMORY_UTILIZATION={gpu_memory_utilization:g} of them ({engines_on_gpus + 1} engines "
            f"> 100%): set it to {1.0 / (engines_on_gpus + 1):g} or less, or size the KV cache with STRATA_L1_MB")
    return KVSizing(None, gpu_memory_utilization, FRACTION)
