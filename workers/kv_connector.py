"""Strata's KV connector for vLLM (``KVConnectorBase_V1``): vLLM's prefix cache in front, Strata's
L2 and encrypted L3 behind it, with Strata's tenant guarantees.

The replica actor (``workers.vllm_worker``) configures it (``connector_config``) and sets each
request's ``kv_transfer_params`` (``workers.kv_params.TransferParams``: the tenant, Strata's block
keys of the prompt, quotas, keys, L3 policy); a request without them is left to vLLM alone.

vLLM runs the connector twice, in two processes:

- **scheduler side** (vLLM's engine core): ``get_num_new_matched_tokens`` asks the tier service to
  stage the blocks after vLLM's own hit that L2 and L3 hold for the request (``TierService.stage``,
  over ``workers.kv_rpc``) and tells vLLM how many tokens it may skip: only what arrived and was
  verified; while a fetch is still running it answers "not yet" (vLLM serves the other requests and
  asks again next step); a service that is slow or gone is a miss. ``build_connector_meta`` tells the worker side,
  each step, which staged blocks go into which of vLLM's pages, and which full prompt blocks (and L3
  chunks) the step computes, to be saved.
- **worker side** (vLLM's worker process, which also hosts the tier service and its socket):
  ``start_load_kv`` copies the staged blocks into the pages before the forward (a block that is not
  there is reported to vLLM, which recomputes it: ``kv_load_failure_policy="recompute"``);
  ``wait_for_save`` copies the computed blocks out of the pages into L2 and queues the completed L3
  chunks, after the forward.

Fetches from L2/L3 run on the service's loader threads while vLLM goes on; the copy into vLLM's
pages is synchronous (vLLM computes the rest of the prompt in the same step); saves are
write-through. Tensor parallelism is not supported (each rank would hold a shard of every block).

The connector also carries the engine's per-step threads into vLLM's worker: the rule of Strata's own
scheduler (``cachecore.scheduler.threads``). vLLM's worker runs on ``WorkerConfig.compute_threads``
(every core but one); a step whose every request computes more than one token (prompt chunks, no
decode: nobody is streaming through it and its first tokens wait for all of it) runs on every core.
``build_connector_meta`` marks such a step (``prompt_only``) and ``handle_preemptions``, the first
call vLLM makes with a step's metadata (``execute_model``, on the thread that runs the forward, before
it builds the attention metadata: vLLM's CPU attention fixes its thread count there and checks it in
the kernel), sets that thread's threads. Not while the tier service writes L3 chunks in the
background: a forward split over every core then waits at each parallel region for the core that
write holds (on 2 cores, a warm request sent right after a cold one took 69.7 ms at p50, up to 174,
against 32.2 on one thread; the cold one's 12 MB of chunks were being sealed and fsynced).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

import strata_env
from cachecore.layout import KVLayout
from cachecore.scheduler.threads import prompt_only
from workers.kv_params import KEY, TransferParams
from workers.kv_rpc import TierClient, TierServer
from workers.kv_tiers import CHUNK_TOKENS

logger = logging.getLogger("strata.vllm.connector")

MODULE = "workers.kv_connector"
NAME = "StrataConnector"
STAGE_TIMEOUT_S = 5.0  # a lookup the service has not answered by then is a miss


def connector_config(*, endpoint: dict, worker_config: dict, layout: KVLayout, native: bool, deployment: str,
                     revision: str) -> dict:
    """``KVTransferConfig`` keyword arguments for vLLM (the actor's side)."""
    return {
        "kv_connector": NAME, "kv_connector_module_path": MODULE, "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "strata": {"endpoint": endpoint, "worker_config": worker_config, "layout": layout.canonical(),
                       "native": native, "deployment": deployment, "revision": revision},
        },
    }


@dataclass
class _Load:
    req_id: str
    first: int  # block index in the request
    block_ids: list[int]


@dataclass
class _Save:
    req_id: str
    params: TransferParams
    tokens: list[int]
    first: int
    block_ids: list[int]
    chunks: list[tuple[int, list[int]]] = field(default_factory=list)  # (chunk index, its block ids)


@dataclass
class StrataMetadata(KVConnectorMetadata):
    loads: list[_Load] = field(default_factory=list)
    saves: list[_Save] = field(default_factory=list)
    forgets: list[str] = field(default_factory=list)
    prompt_only: bool = False  # the step computes prompt chunks only: its forward runs on burst threads


@dataclass
class _Req:
    params: TransferParams
    tokens: list[int]
    stage_start: int = -1
    staged: int = 0  # blocks staged from stage_start
    pending: bool = False  # the service is still fetching (vLLM asks again next step)
    load: tuple[int, int] | None = None  # (first block, n) to load at the next step
    block_ids: list[int] = field(default_factory=list)
    saved: int = -1  # blocks [0, saved) need no save
    first_computed: int = 0  # first block this request computes itself
    chunks: int = 0  # L3 chunks handled
    outcome: dict = field(default_factory=dict)  # the last stage's answer: blocks per tier, stop
    loaded: dict = field(default_factory=dict)  # what vLLM took of it: blocks per tier


class StrataConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config.get_from_extra_config("strata", None)
        if not cfg:
            raise ValueError("StrataConnector needs its configuration (workers.kv_connector.connector_config)")
        self._cfg = cfg
        self.layout = KVLayout(**cfg["layout"])
        self.block_size = self.layout.block_size
        self.chunk_blocks = max(1, CHUNK_TOKENS // self.block_size)
        if role == KVConnectorRole.SCHEDULER:
            self._client = TierClient(cfg["endpoint"])
            self._reqs: dict[str, _Req] = {}
            self._forgets: list[str] = []
        else:
            import torch

            from workers.config import WorkerConfig
            from workers.kv_tiers import TierService

            worker_config = WorkerConfig(**cfg["worker_config"])
            self.service = TierService(worker_config, self.layout,
                                       deployment=cfg["deployment"], revision=cfg["revision"])
            # On a CPU only (elsewhere the kernels run on the device, and vLLM keeps its host threads);
            # torch's own setter: vLLM's CPU worker replaces torch.set_num_threads with a no-op.
            device = str(getattr(vllm_config.device_config, "device_type", "") or "")
            self._threads = (worker_config.step_threads(device, set_threads=torch._C.set_num_threads)
                             if device.startswith("cpu") else None)
            # Fault-injection operations only where the test suite asked for them (STRATA_TEST_HOOKS).
            self._server = TierServer(self.service, cfg["endpoint"], test_hooks=strata_env.enabled_test_hooks())
            self._codec = None
            self._load_errors: set[int] = set()

    # ================================================================== scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        p = TransferParams.from_wire(request.kv_transfer_params)
        if p is None:
            return 0, False
        bs = self.block_size
        rid = request.request_id
        st = self._reqs.get(rid)
        if st is None:
            st = self._reqs[rid] = _Req(p, list(request.prompt_token_ids or ()))
        start = num_computed_tokens // bs
        limit = (len(st.tokens) - 1) // bs  # the last prompt token is always computed (its logits)
        try:
            if start != st.stage_start:
                st.stage_start, st.staged, st.pending = start, 0, False
                if start >= limit:
                    return 0, False
                reply = self._client.call("stage", timeout=STAGE_TIMEOUT_S, connect_wait=STAGE_TIMEOUT_S,
                                          req_id=rid, p=p, tokens=st.tokens, start=start, limit=limit)
            elif st.pending:
                reply = self._client.call("stage_poll", timeout=STAGE_TIMEOUT_S, connect_wait=STAGE_TIMEOUT_S,
                                          req_id=rid)
            else:
                return st.staged * bs, False
        except Exception as exc:  # the service slow or gone: vLLM computes it
            logger.warning("Strata tier lookup failed (%s): computing the prompt", type(exc).__name__)
            st.pending = False
            return 0, False
        if not reply["done"]:
            st.pending = True
            return None, False  # not yet: vLLM schedules the others and asks again next step
        st.pending = False
        st.staged = int(reply["blocks"])
        st.outcome = {"l2": int(reply.get("l2", 0)), "l3": int(reply.get("l3", 0)), "stop": reply.get("stop")}
        return st.staged * bs, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        if num_external_tokens > 0:
            st.load = (st.stage_start, num_external_tokens // self.block_size)
            st.loaded = dict(st.outcome)
        elif st.staged:
            self._forgets.append(request.request_id)
            st.staged = 0

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        counts = scheduler_output.num_scheduled_tokens
        meta = StrataMetadata(forgets=self._forgets,
                              prompt_only=bool(counts) and prompt_only((0, n) for n in counts.values()))
        self._forgets = []
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None:
                self._step(meta, new.req_id, st, list(new.block_ids[0]), new.num_computed_tokens,
                           scheduler_output.num_scheduled_tokens.get(new.req_id, 0), replace=True)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            ids = cached.new_block_ids[i]
            self._step(meta, rid, st, list(ids[0]) if ids is not None else [], cached.num_computed_tokens[i],
                       scheduler_output.num_scheduled_tokens.get(rid, 0), replace=rid in cached.resumed_req_ids)
        for rid in scheduler_output.finished_req_ids:
            self._reqs.pop(rid, None)
        return meta

    def _step(self, meta: StrataMetadata, rid: str, st: _Req, block_ids: list[int], computed: int,
              scheduled: int, *, replace: bool) -> None:
        bs, cb = self.block_size, self.chunk_blocks
        if replace:
            st.block_ids = block_ids
            st.saved = computed // bs  # vLLM's hit and what was loaded are not saved again
            st.first_computed = st.saved
        else:
            st.block_ids.extend(block_ids)
        if st.load is not None:
            first, n = st.load
            st.load = None
            meta.loads.append(_Load(rid, first, st.block_ids[first:first + n]))
        full = min(computed + scheduled, len(st.tokens)) // bs
        full = min(full, len(st.params.hashes), len(st.block_ids))
        if full <= st.saved:
            return
        save = _Save(rid, st.params, st.tokens, st.saved, st.block_ids[st.saved:full])
        while (st.chunks + 1) * cb <= full:
            c = st.chunks
            st.chunks += 1
            if (c + 1) * cb > st.first_computed:  # a chunk this request computed (part of)
                save.chunks.append((c, st.block_ids[c * cb:(c + 1) * cb]))
        st.saved = full
        meta.saves.append(save)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Nothing is sent anywhere (``False``); the returned params reach the request's output: the
        blocks loaded from each of Strata's tiers and why a fetch stopped short (the worker's usage)."""
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        if st.staged or st.pending:
            self._forgets.append(request.request_id)
        return False, {KEY: {"loaded": st.loaded, "stop": st.outcome.get("stop")}}

    # ================================================================== worker side
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Nothing to do for preemptions (saves are synchronous); the step's threads (module docstring)."""
        if self._threads is not None and isinstance(kv_connector_metadata, StrataMetadata):
            self._threads.enter_step(kv_connector_metadata.prompt_only, self.service.writing)

    def register_kv_caches(self, kv_caches) -> None:
        from workers.kv_pages import PageCodec

        self._codec = PageCodec(kv_caches, self.layout, native=bool(self._cfg.get("native")))

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, StrataMetadata):
            return
        for rid in meta.forgets:
            self.service.forget(rid)
        for load in meta.loads:
            staged = self.service.take(load.req_id)
            n = len(load.block_ids)
            if staged is None or self._codec is None:
                self._load_errors.update(load.block_ids)
                continue
            first, kv = staged
            rows = kv[load.first - first: load.first - first + n] if load.first >= first else kv[:0]
            if len(rows) < n:  # fewer blocks than vLLM was promised: those are recomputed
                self._load_errors.update(load.block_ids[len(rows):])
            if len(rows):
                self._codec.scatter(load.block_ids[:len(rows)], rows)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._role != KVConnectorRole.WORKER:
            return set()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # saved after the forward (wait_for_save), from the registered pages

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata() or self._codec is None:
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, StrataMetadata):
            return
        for save in meta.saves:
            try:
                kv = self._codec.gather(save.block_ids)
                self.service.save(save.params, save.tokens, save.first, kv)
                for chunk, ids in save.chunks:
                    self.service.write_chunk(save.params, save.tokens, chunk, self._codec.gather(ids))
            except Exception:  # a failed save is a later miss, never a failed request
                logger.exception("Strata KV save failed")

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.WORKER:
            self._server.close()
            self.service.close()
        else:
            self._client.close()
