"""vLLM's KV cache size (workers/vllm_sizing.py), decided without a GPU: on CUDA a share of each GPU
(``STRATA_GPU_MEMORY_UTILIZATION``, default 0.9) unless ``STRATA_L1_MB`` is set, then exactly that;
on CPU ``STRATA_L1_MB`` as before. The variable is typed and checked in strata_env (0 < x <= 1); a
rollout's second engine is refused with a clear message when two shares cannot fit; and the revision
hands vLLM's ``AsyncEngineArgs`` what the decision says (with vLLM's CPU build installed, its real
argument class on a real checkpoint, prepared for ``cuda``: nothing is started)."""

from __future__ import annotations

import dataclasses

import pytest

import strata_env
from workers.config import WorkerConfig
from workers.vllm_sizing import BYTES, FRACTION, KVSizing, KVSizingError, kv_sizing

MiB = 1 << 20
LEAST = 40 * MiB  # two sequences of the context length


def sizing(device: str, *, l1_mb: int = 256, explicit: bool = False, share: float = 0.9, engines: int = 0) -> KVSizing:
    return kv_sizing(device=device, l1_mb=l1_mb, l1_mb_explicit=explicit, gpu_memory_utilization=share,
                     min_kv_bytes=LEAST, engines_on_gpus=engines)


# ---------------------------------------------------------------------------------------- the decision
def test_on_cuda_the_gpu_share_sizes_the_kv_cache_unless_l1_mb_is_set():
    assert sizing("cuda") == KVSizing(None, 0.9, FRACTION)
    assert sizing("cuda:1", share=0.6) == KVSizing(None, 0.6, FRACTION)
    # set: exactly that size; the share still goes to vLLM (it refuses to start unless that much is free)
    assert sizing("cuda", l1_mb=8192, explicit=True) == KVSizing(8192 * MiB, 0.9, BYTES)
    assert sizing("cuda", l1_mb=256, explicit=True) == KVSizing(256 * MiB, 0.9, BYTES)  # the default value, set


def test_on_cpu_l1_mb_sizes_it_as_before_set_or_not_and_no_gpu_share_is_passed():
    assert sizing("cpu") == KVSizing(256 * MiB, None, BYTES)
    assert sizing("cpu", l1_mb=1024, explicit=True) == KVSizing(1024 * MiB, None, BYTES)
    assert sizing("cpu").engine_kwargs() == {"kv_cache_memory_bytes": 256 * MiB}


def test_a_byte_size_is_raised_to_two_sequences_of_the_context_and_a_share_is_not():
    assert sizing("cpu", l1_mb=1).kv_cache_memory_bytes == LEAST
    assert sizing("cuda", l1_mb=1, explicit=True).kv_cache_memory_bytes == LEAST
    assert sizing("cuda", l1_mb=1).kv_cache_memory_bytes is None  # vLLM checks the context fits itself


def test_engine_kwargs_are_what_vllm_receives():
    assert sizing("cuda").engine_kwargs() == {"kv_cache_memory_bytes": None, "gpu_memory_utilization": 0.9}
    assert sizing("cuda", l1_mb=512, explicit=True).engine_kwargs() == {"kv_cache_memory_bytes": 512 * MiB,
                                                                       "gpu_memory_utilization": 0.9}


def test_a_rollout_s_second_engine_fits_beside_the_first_only_when_two_shares_do():
    with pytest.raises(KVSizingError, match=r"STRATA_GPU_MEMORY_UTILIZATION=0\.9 .*set it to 0\.5 or less"):
        sizing("cuda", engines=1)
    assert sizing("cuda", share=0.5, engines=1) == KVSizing(None, 0.5, FRACTION)
    assert sizing("cuda", share=0.45, engines=1) == KVSizing(None, 0.45, FRACTION)
    # sized in bytes the serving engine holds only its weights and that KV: vLLM's own check decides
    assert sizing("cuda", l1_mb=512, explicit=True, engines=1) == KVSizing(512 * MiB, 0.9, BYTES)
    assert sizing("cpu", engines=1) == KVSizing(256 * MiB, None, BYTES)  # CPU: no GPU share at all


@pytest.mark.parametrize("share", [0.0, -0.1, 1.01, float("nan")])
def test_a_share_outside_0_to_1_is_refused_by_the_decision_too(share):
    with pytest.raises(KVSizingError, match="STRATA_GPU_MEMORY_UTILIZATION"):
        sizing("cuda", share=share)


# ---------------------------------------------------------------------------------------- the environment
def test_the_share_is_read_typed_and_checked_in_strata_env():
    assert strata_env.load_worker({}).gpu_memory_utilization == 0.9
    assert strata_env.load_worker({"STRATA_GPU_MEMORY_UTILIZATION": "0.45"}).gpu_memory_utilization == 0.45
    assert strata_env.load_worker({"STRATA_GPU_MEMORY_UTILIZATION": "1"}).gpu_memory_utilization == 1.0
    assert strata_env.load_worker({"STRATA_GPU_MEMORY_UTILIZATION": " "}).gpu_memory_utilization == 0.9
    for bad in ("0", "1.5", "-0.2", "nan", "inf"):
        with pytest.raises(strata_env.EnvError, match="STRATA_GPU_MEMORY_UTILIZATION must be a fraction"):
            strata_env.load_worker({"STRATA_GPU_MEMORY_UTILIZATION": bad})
    with pytest.raises(strata_env.EnvError, match="STRATA_GPU_MEMORY_UTILIZATION must be a number"):
        strata_env.load_worker({"STRATA_GPU_MEMORY_UTILIZATION": "90%"})


def test_l1_mb_counts_as_set_only_when_it_has_a_value():
    assert not strata_env.load_worker({}).l1_mb_explicit
    assert not strata_env.load_worker({"STRATA_L1_MB": ""}).l1_mb_explicit
    assert strata_env.load_worker({"STRATA_L1_MB": "256"}).l1_mb_explicit  # the default's value, but set
    cfg = WorkerConfig.from_env({"STRATA_L1_MB": "4096", "STRATA_GPU_MEMORY_UTILIZATION": "0.8"})
    assert (cfg.l1_mb, cfg.l1_mb_explicit, cfg.gpu_memory_utilization) == (4096, True, 0.8)
    cfg = WorkerConfig.from_env({})
    assert (cfg.l1_mb, cfg.l1_mb_explicit, cfg.gpu_memory_utilization) == (256, False, 0.9)
    # the KV connector rebuilds the config from a dict in vLLM's worker process: the fields survive
    assert WorkerConfig(**dataclasses.asdict(cfg)) == cfg


# ---------------------------------------------------------------------------------------- into vLLM
def test_the_revision_gives_vllm_s_engine_arguments_what_the_decision_says(vllm_checkpoint):
    """A real checkpoint prepared for ``cuda`` (only arithmetic: nothing runs on a GPU) and turned
    into vLLM's own ``AsyncEngineArgs``; the same checkpoint for ``cpu`` keeps today's arguments."""
    from workers.vllm_revision import VllmRevision

    path = vllm_checkpoint[0]
    revision = {"label": "r1", "checkpoint_path": str(path)}

    def args(device: str, **kw):
        rev = VllmRevision.prepare("sizing", revision, device=device, l1_mb=256, dtype=None, **kw)
        return rev, rev.engine_args(max_num_seqs=4, device=device)

    rev, ea = args("cuda", l1_mb_explicit=False, gpu_memory_utilization=0.9)
    assert (ea.kv_cache_memory_bytes, ea.gpu_memory_utilization) == (None, 0.9)
    assert rev.num_blocks > 0 and rev.kv_cache_bytes == rev.num_blocks * rev.block_bytes  # the estimate
    rev, ea = args("cuda", l1_mb_explicit=True, gpu_memory_utilization=0.7)
    assert (ea.kv_cache_memory_bytes, ea.gpu_memory_utilization) == (256 * MiB, 0.7)
    rev, ea = args("cpu", l1_mb_explicit=False, gpu_memory_utilization=0.5)
    default = type(ea)().gpu_memory_utilization  # vLLM's own default: Strata passes no share on CPU
    assert (ea.kv_cache_memory_bytes, ea.gpu_memory_utilization) == (256 * MiB, default)
    with pytest.raises(KVSizingError):
        args("cuda", l1_mb_explicit=False, gpu_memory_utilization=0.9, engines_on_gpus=1)
