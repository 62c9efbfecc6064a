"""The Ray actor: a thin, named, detached wrapper around a replica's engine — :class:`CacheWorker`
(Strata's reference engine) or :class:`workers.vllm_worker.VllmWorker` (vLLM), chosen by the
deployment's ``engine``; both keep ``workers.engine_contract.ServingEngine``.

``import ray`` happens only inside the functions that need it, so this module (and the plain class)
import without Ray; the engines only inside ``build_worker``, which runs in the actor's own process,
so the web tier (which names, finds and launches actors) imports neither torch nor the engine.

The actor is made remote at the call site (``launch``); where it runs is ``placement``: one GPU each
when the cluster has GPUs; otherwise one unit of the custom resource ``strata_worker`` when some node
advertises it (worker nodes join with ``ray start --address ... --resources '{"strata_worker": 8}'``,
so cache workers stay off the web/Celery head node), and anywhere (the head, the single-machine
``make run``) when none does. A deployment's replicas are spread over the nodes
(``scheduling_strategy="SPREAD"``). A vLLM replica with ``tensor_parallel_size`` tp > 1 asks for tp
GPUs: one actor's resources always come from one node, and vLLM spreads the model over the GPUs Ray
gave it (``CUDA_VISIBLE_DEVICES``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

import strata_env
from workers import replica_board
from workers.admission import MAX_CONCURRENCY
from workers.engine_contract import ServingEngine

NAMESPACE = "strata"
WORKER_RESOURCE = "strata_worker"  # the custom resource worker nodes advertise


def actor_name(deployment: str, replica: int = 0) -> str:
    return f"cache-worker:{deployment}:{replica}"


def build_worker(*, engine: str = "strata", tensor_parallel_size: int = 1, **kwargs):
    """The replica's engine: ``CacheWorker`` or ``VllmWorker``, imported only here (in the actor's
    process: the engines need torch, which the processes that merely address actors never load)."""
    if engine == "vllm":
        from workers.vllm_worker import VllmWorker

        return VllmWorker(tensor_parallel_size=tensor_parallel_size, **kwargs)
    if engine != "strata":
        raise ValueError(f"unknown engine {engine!r}; known: strata, vllm")
    if tensor_parallel_size != 1:
        raise ValueError("the strata engine runs on one device: tensor_parallel_size must be 1")
    from workers.cache_worker import CacheWorker

    return CacheWorker(**kwargs)


START_PHASES = {"strata": "loading weights", "vllm": "starting the vLLM engine (loading weights, profiling memory)"}


class CacheWorkerActor:
    """Delegates every call to one replica engine (``build_worker``). ``stream`` is a Ray streaming
    generator. While it builds its engine it reports its phase to the replica board
    (``workers.replica_board``), then ``ready``, or ``failed`` with the error (and re-raises: the
    actor dies, as any actor whose constructor fails)."""

    def __init__(self, *, start_delay_s: float = 0.0, **kwargs) -> None:
        name = actor_name(kwargs.get("deployment", "?"), int(kwargs.get("replica", 0)))
        try:
            if start_delay_s and kwargs.get("test_hooks"):  # test hook: a replica slow to start
                replica_board.report(name, "starting", phase="test hook: a slow start")
                time.sleep(float(start_delay_s))
            replica_board.report(name, "starting", phase=START_PHASES.get(kwargs.get("engine", "strata")))
            self.worker = build_worker(**kwargs)
        except BaseException as exc:
            replica_board.report(name, "failed", error=f"{type(exc).__name__}: {exc}")
            raise
        replica_board.report(name, "ready")

    def shutdown(self, timeout: float = 30.0) -> dict:
        """Stop the engine before the actor is killed: its ``close`` (a vLLM engine-core process
        exits), then any process this actor started that is still alive after ``timeout`` is killed,
        so that nothing outlives the replica (a killed actor's children are not always reaped).
        Returns ``{"children", "killed"}``: the processes found, those that had to be killed."""
        from workers import proc_table

        children = proc_table.descendants(os.getpid())
        close = getattr(self.worker, "close", None)
        if close is not None:
            close()
        deadline = time.monotonic() + timeout
        while any(proc_table.alive(pid, start) for pid, start in children.items()) and time.monotonic() < deadline:
            time.sleep(0.1)
        killed = []
        for pid, start in children.items():
            if proc_table.alive(pid, start):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
        return {"children": sorted(children), "killed": killed}

    def stream(self, req: dict) -> Iterator[dict]:
        yield from self.worker.stream(req)


_DELEGATED = (
    "info", "ping", "stats", "collect", "kv_layout", "kv_lookup", "kv_store", "kv_retrieve",
    "kv_store_wire", "kv_retrieve_wire", "flush",
    "probe", "stage_revision", "switch_revision", "check_integrity", "poison_free_blocks", "cancel",
    "drop_data_key", "kv_events", "kv_snapshot", "cancel_tenant", "drain_writes",
    "prewarm", "cache_pin", "cache_drop", "cache_resident",
)


def _delegate(name: str):
    def method(self, *args, **kwargs):
        return getattr(self.worker, name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = getattr(getattr(ServingEngine, name, None), "__doc__", None) or f"The engine's ``{name}``."
    return method


for _name in _DELEGATED:
    setattr(CacheWorkerActor, _name, _delegate(_name))


def placement(cluster_resources: dict, tensor_parallel_size: int = 1) -> dict:
    """Ray actor options placing one cache worker, from ``ray.cluster_resources()`` (see the module
    docstring): ``num_gpus`` (``tensor_parallel_size`` of them on GPU clusters) and, on CPU clusters
    with worker nodes, ``resources``."""
    if cluster_resources.get("GPU", 0) >= 1:
        return {"num_gpus": max(1, int(tensor_parallel_size)), "scheduling_strategy": "SPREAD"}
    if cluster_resources.get(WORKER_RESOURCE, 0) >= 1:
        return {"num_gpus": 0, "resources": {WORKER_RESOURCE: 1}, "scheduling_strategy": "SPREAD"}
    return {"num_gpus": 0, "scheduling_strategy": "SPREAD"}


def launch(deployment: str, preset: str, revision: dict, *, replica: int = 0, engine: str = "strata",
           tensor_parallel_size: int = 1, **worker_kwargs):
    """Return the named actor for (deployment, replica), creating it (detached) if it does not exist."""
    import ray

    worker_kwargs.update(engine=engine, tensor_parallel_size=tensor_parallel_size)  # build_worker's choice

    # Test hooks (poisoning free pages) exist only where the test suite asks for them.
    worker_kwargs.setdefault("test_hooks", strata_env.enabled_test_hooks())
    remote_cls = ray.remote(CacheWorkerActor)
    return remote_cls.options(
        name=actor_name(deployment, replica),
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        **placement(ray.cluster_resources(), tensor_parallel_size),
        max_concurrency=MAX_CONCURRENCY,
    ).remote(deployment=deployment, preset=preset, revision=revision, replica=replica, **worker_kwargs)


def find(deployment: str, replica: int = 0):
    """The named actor handle, or None if it does not exist."""
    import ray

    try:
        return ray.get_actor(actor_name(deployment, replica), namespace=NAMESPACE)
    except ValueError:
        return None
