"""One model revision served by vLLM: its async engine, its tokenizer and the cache-key facts Strata
derives for it.

``VllmRevision.start`` builds vLLM's ``AsyncLLM`` (engine core in a process of its own, as vLLM
always runs it) on the revision's Hugging Face checkpoint directory, on the event loop that will
drive it (``workers.async_loop``). Its KV cache is sized by ``workers.vllm_sizing``: on CUDA a
share of each GPU (``STRATA_GPU_MEMORY_UTILIZATION``) unless ``STRATA_L1_MB`` is set; on CPU, and on
CUDA when it is set, ``STRATA_L1_MB`` (``kv_cache_memory_bytes``), raised to hold two sequences of
the context length when that is smaller, so a tiny budget never stops it from starting.
``num_blocks`` is estimated before the start (from that budget; sized by share, from those two
sequences, the least vLLM starts with) and is the number of blocks vLLM allocated after it (what the
replica reports as its device cache's capacity); ``kv_cache_bytes`` follows it when sized by share.

The namespace (``namespace``) binds what a cache key must: the deployment, the weight digest
(recorded by the control plane, checked here against the files), the tokenizer and chat template
(the digest the web tier's ``JinjaChatTemplate`` has), the KV layout (vLLM's block size, layers, KV
heads, head size, dtype) and the tensor parallel size. ``cache_salt`` turns a request's scope into
vLLM's ``cache_salt``: a keyed hash of that namespace (so of the tenant's secret scope salt), the
scope's flush generation, this process's epoch and the client's ``cache_salt`` (which only narrows).
vLLM folds it into the hash of every block of the request, so its prefix cache never shares across
scopes, revisions or flushes.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import strata_env
from cachecore.layout import KVLayout
from cachecore.model.checkpoint import inspect_checkpoint
from cachecore.model.hf_config import CheckpointError, weights_root
from cachecore.model.peft import is_moe
from cachecore.namespace import Namespace, canonical_encode
from cachecore.routing.hashes import namespace_fields
from workers.vllm_engine_figures import EngineFigures
from workers.vllm_sizing import KVSizing, kv_sizing

MAX_CPU_LORAS = 16  # adapters vLLM keeps loaded in host memory (LRU) beyond the max_loras of one batch
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank values
CPU_BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32
GPU_BLOCK_SIZE = 16
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class CheckpointFacts:
    """What Strata reads from a checkpoint's ``config.json`` for any architecture vLLM serves
    (``cachecore.model.checkpoint.inspect_checkpoint(..., engine="vllm")``, as the web tier reads it)."""

    architecture: str
    vocab_size: int
    max_seq_len: int
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str

    @classmethod
    def of(cls, config) -> CheckpointFacts:
        m = config.model
        return cls(architecture=config.architecture, vocab_size=m.vocab_size, max_seq_len=m.max_seq_len,
                   layers=m.n_layers, kv_heads=m.n_kv_heads, head_dim=m.head_dim, dtype=config.checkpoint_dtype)


def lora_settings(requested: dict | None, architecture: str, config: dict) -> dict | None:
    """vLLM's LoRA arguments for a revision whose spec asks for them (``{"max_loras", "max_lora_rank"}``
    from the control plane's settings; ``max_lora_rank`` rounded up to a rank vLLM takes), or None when
    it does not ask, vLLM serves no LoRA for ``architecture``, or the model is a mixture of experts
    (``config``: its ``config.json``; vLLM's LoRA of fused experts needs kernels its CPU build lacks)."""
    if not requested or int(requested.get("max_loras") or 0) < 1:
        return None
    if is_moe(config):
        return None
    try:
        from vllm.model_executor.models import ModelRegistry
        from vllm.model_executor.models.interfaces import supports_lora

        model_cls = ModelRegistry._try_load_model_cls(architecture)
        if model_cls is None or not supports_lora(model_cls):
            return None
    except Exception:  # an architecture vLLM cannot inspect here: serve it without adapters
        return None
    rank = int(requested.get("max_lora_rank") or 16)
    return {"max_loras": int(requested["max_loras"]),
            "max_lora_rank": next((r for r in VLLM_LORA_RANKS if r >= rank), VLLM_LORA_RANKS[-1])}


@dataclass
class VllmRevision:
    label: str
    root: Path
    facts: CheckpointFacts
    weight_digest: str
    tokenizer_digest: str
    block_size: int
    dtype: str
    tensor_parallel_size: int
    kv_cache_bytes: int
    sizing: KVSizing | None = None  # what engine_args passes for the KV cache (workers.vllm_sizing)
    block_bytes: int = 0  # KV bytes of one block on one GPU
    tokenizer: object = None  # cachecore.model.hf_tokenizer.HFTokenizer: the web tier's, special tokens skipped
    engine: object = None  # vllm.v1.engine.async_llm.AsyncLLM, once started
    num_blocks: int = 0
    epoch: bytes = field(default_factory=lambda: secrets.token_bytes(16))
    device: str = "cpu"
    tiers: object = None  # workers.kv_rpc.TierClient to this engine's tier service (None: no connector)
    tier_events: object = None  # a second client, for the KV events (never queued behind a slow job call)
    connector: dict | None = None  # KVTransferConfig arguments (workers.kv_connector.connector_config)
    lora: dict | None = None  # {"max_loras", "max_lora_rank"}: vLLM's LoRA on (None: the engine serves no adapter)
    figures: EngineFigures = field(default_factory=EngineFigures)  # vLLM's scheduler figures, as reported

    @classmethod
    def prepare(cls, deployment: str, revision: dict, *, device: str, l1_mb: int, dtype: str | None,
                tensor_parallel_size: int = 1, weights_root_dir: str | None = None, l1_mb_explicit: bool = True,
                gpu_memory_utilization: float = 0.9, engines_on_gpus: int = 0) -> VllmRevision:
        """Check the checkpoint (it must be a directory whose bytes match the recorded digest) and
        work out the engine's settings; nothing is started. ``l1_mb_explicit``,
        ``gpu_memory_utilization`` and ``engines_on_gpus``: see ``workers.vllm_sizing.kv_sizing``
        (which raises ``KVSizingError`` here when the engine cannot be sized); by default ``l1_mb``
        sizes the KV cache on every device (the benchmarks' engines); ``VllmWorker`` passes its config's."""
        path = revision.get("checkpoint_path")
        if not path:
            raise CheckpointError("the vllm engine serves Hugging Face checkpoint directories only "
                                  "(a revision with a 'path'); seeded presets run on the strata engine")
        with weights_root(weights_root_dir):  # no file of it may lead outside the root
            info = inspect_checkpoint(path, engine="vllm")
        root, digest = Path(info.path), info.digest
        if revision.get("digest") and revision["digest"] != digest:
            raise CheckpointError(f"checkpoint {root} changed since revision {revision['label']!r} was recorded "
                                  "(its digest differs); add a new revision for new weights")
        facts = CheckpointFacts.of(info.config)
        if dtype is None:
            dtype = "float32" if device == "cpu" else ("bfloat16" if facts.dtype == "float32" else facts.dtype)
        block = CPU_BLOCK_SIZE if device == "cpu" else GPU_BLOCK_SIZE
        per_token = 2 * max(1, facts.layers) * max(1, facts.kv_heads) * max(1, facts.head_dim) \
            * _DTYPE_BYTES.get(dtype, 4) // max(1, tensor_parallel_size)
        least = 2 * facts.max_seq_len * per_token + (4 << 20)
        sizing = kv_sizing(device=device, l1_mb=l1_mb, l1_mb_explicit=l1_mb_explicit,
                           gpu_memory_utilization=gpu_memory_utilization, min_kv_bytes=least,
                           engines_on_gpus=engines_on_gpus)
        kv_bytes = sizing.kv_cache_memory_bytes or least  # sized by share: an estimate until vLLM reports
        block_bytes = max(1, per_token * block)
        return cls(label=str(revision["label"]), root=root, facts=facts, weight_digest=digest, tokenizer=info.tokenizer,
                   tokenizer_digest=info.chat.digest, block_size=block, dtype=dtype,
                   tensor_parallel_size=int(tensor_parallel_size), kv_cache_bytes=kv_bytes, sizing=sizing,
                   block_bytes=block_bytes, num_blocks=kv_bytes // block_bytes, device=device,
                   lora=lora_settings(revision.get("lora"), facts.architecture,
                                      getattr(info.config, "raw", None) or {}))

    def kv_layout(self) -> KVLayout:
        """Strata's block layout of this engine's KV (what its L2 and L3 blocks hold)."""
        return KVLayout(num_layers=self.facts.layers, num_kv_heads=self.facts.kv_heads, head_dim=self.facts.head_dim,
                        block_size=self.block_size, dtype=self.dtype)

    @property
    def pages(self) -> str:
        """What the bytes of this engine's blocks are (``workers.kv_pages.page_format``)."""
        from workers.kv_pages import page_format

        return page_format(self.device, self.dtype, self.block_size, self.facts.head_dim)

    @property
    def native_pages(self) -> bool:
        from workers.kv_pages import CANONICAL

        return self.pages != CANONICAL

    def attach_tiers(self, deployment: str, worker_config: dict) -> None:
        """Serve this engine with Strata's KV connector (before ``start``): its tier service (L2, L3)
        will live in vLLM's worker process, reached over a fresh private socket."""
        from workers.kv_connector import connector_config
        from workers.kv_rpc import TierClient, new_endpoint

        endpoint = new_endpoint()
        self.connector = connector_config(endpoint=endpoint, worker_config=worker_config, layout=self.kv_layout(),
                                          native=self.native_pages, deployment=deployment, revision=self.label)
        self.tiers = TierClient(endpoint)
        self.tier_events = TierClient(endpoint)

    def engine_args(self, *, max_num_seqs: int, device: str):
        from vllm.config import KVTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs

        return AsyncEngineArgs(
            kv_transfer_config=KVTransferConfig(**self.connector) if self.connector else None,
            model=str(self.root), tokenizer=str(self.root), dtype=self.dtype, seed=0,
            enable_prefix_caching=True, block_size=self.block_size,
            **({"enable_lora": True, "max_loras": self.lora["max_loras"], "max_lora_rank": self.lora["max_lora_rank"],
                "max_cpu_loras": max(self.lora["max_loras"], MAX_CPU_LORAS)} if self.lora else {}),
            **(self.sizing.engine_kwargs() if self.sizing else {"kv_cache_memory_bytes": self.kv_cache_bytes}),
            max_model_len=self.facts.max_seq_len, max_num_seqs=max_num_seqs,
            tensor_parallel_size=self.tensor_parallel_size,
            # the actor holds the node's GPUs (Ray set CUDA_VISIBLE_DEVICES to them): vLLM's own worker
            # processes use them; its Ray backend would ask the cluster for GPUs this actor already holds
            distributed_executor_backend="mp" if self.tensor_parallel_size > 1 else None,
            enforce_eager=device == "cpu" or strata_env.vllm_eager(),
            disable_log_stats=True,
        )

    async def start(self, *, max_num_seqs: int, device: str) -> None:
        """Start vLLM on the running event loop (its output handler lives there)."""
        from vllm.v1.engine.async_llm import AsyncLLM

        # vLLM's scheduler reports to its stat loggers: ours keeps its figures (KV usage, queues, preemptions)
        self.engine = AsyncLLM.from_engine_args(self.engine_args(max_num_seqs=max_num_seqs, device=device),
                                                stat_loggers=[self.figures.stat_logger])
        # the blocks vLLM allocated: its engine core reports them to the client at start-up (its ready
        # response, into the client's ``cache_config``); the estimate from the KV budget stands without it
        self.num_blocks = int(self.engine.vllm_config.cache_config.num_gpu_blocks or self.num_blocks)
        if self.sizing is not None and self.sizing.kv_cache_memory_bytes is None:  # vLLM chose the size
            self.kv_cache_bytes = self.num_blocks * self.block_bytes

    def shutdown(self) -> None:
        for client in (self.tiers, self.tier_events):
            if client is not None:
                client.close()
        if self.engine is not None:
            try:
                self.engine.shutdown()
            finally:
                self.engine = None
        if self.connector is not None:  # the socket's private directory
            endpoint = self.connector["kv_connector_extra_config"]["strata"]["endpoint"]
            shutil.rmtree(os.path.dirname(endpoint["socket"]), ignore_errors=True)

    # -------------------------------------------------------------- cache keys
    def layout(self) -> dict:
        return {"engine": "vllm", "dtype": self.dtype, "block_size": self.block_size, "n_layers": self.facts.layers,
                "n_kv_heads": self.facts.kv_heads, "head_dim": self.facts.head_dim,
                "pages": self.pages}

    def namespace(self, deployment: str, scope_salt: bytes, *, origin: str = "model", lora_id: str = "") -> Namespace:
        """``lora_id``: the scope of the request's LoRA adapter (``""``: the base model)."""
        return Namespace.build(scope_salt=bytes(scope_salt), model_id=deployment, weight_digest=self.weight_digest,
                               tokenizer_digest=self.tokenizer_digest, layout=self.layout(), rope={},
                               lora_id=lora_id, tp_size=self.tensor_parallel_size, origin=origin)

    def namespace_fields(self, deployment: str) -> dict:
        """The router's fields (every namespace field but the salt, plus vLLM's block size)."""
        return namespace_fields(self.namespace(deployment, bytes(32)), self.block_size)

    def cache_salt(self, ns: Namespace, *, generation: int, request_salt: bytes) -> str:
        """vLLM's ``cache_salt`` for one request (module docstring). Hex: vLLM hashes it as a string."""
        h = hashlib.blake2b(canonical_encode("strata.vllm.cache_salt", self.epoch, int(generation), request_salt),
                            key=ns.digest, digest_size=32)
        return h.hexdigest()
