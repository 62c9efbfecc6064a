"""Where a tensor-parallel replica can run: pure functions over ``ray.nodes()``-shaped dicts (no Ray
import), so the control plane checks a deployment's ``tensor_parallel_size`` before it records it and
the tests run on CPU with fake node lists.

A replica with ``tensor_parallel_size = tp`` > 1 runs vLLM over ``tp`` GPUs of one node (tensor
parallelism all-reduces every layer: it stays on one node's interconnect). Its actor asks for ``tp``
GPUs (``workers.actor.placement``): one actor's resources always come from one node.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def node_gpus(node: Mapping[str, Any]) -> int:
    """Whole GPUs an alive node advertises (0 for a dead node or one without GPUs)."""
    if not node.get("Alive", node.get("alive", False)):
        return 0
    resources = node.get("Resources") or node.get("resources") or {}
    try:
        return int(float(resources.get("GPU", 0) or 0))
    except (TypeError, ValueError):
        return 0


def tensor_parallel_fit(nodes: Iterable[Mapping[str, Any]], tp: int) -> str | None:
    """None when some alive node of ``nodes`` (``ray.nodes()``: ``Alive``, ``Resources`` with ``"GPU"``)
    has at least ``tp`` GPUs, else why not, for a person: ``"tensor_parallel_size=4 needs 4 GPUs on one
    node; the largest node has 1"``. ``tp`` <= 1 always fits (one device, GPU or CPU)."""
    if tp <= 1:
        return None
    largest = max((node_gpus(n) for n in nodes), default=0)
    if largest >= tp:
        return None
    if largest == 0:
        return (f"tensor_parallel_size={tp} needs {tp} GPUs on one node; the Ray cluster has no node with "
                "a GPU")
    return f"tensor_parallel_size={tp} needs {tp} GPUs on one node; the largest node has {largest}"
