"""The web process never imports torch or the engine (issue 22).

A fresh process with the test settings runs ``django.setup()``, imports the ASGI application and
resolves every URL pattern's view (what a web worker holds once it serves), then reports what it
imported. The web tier talks to replicas through the worker protocol (``workers.protocol``) and the
thin, torch-free Ray wrapper (``workers.actor``: names, finds and launches actors; the engine is built
inside the actor's own process); it reads model facts through cachecore's plain-Python modules
(``layout``, ``model.config``, ``model.checkpoint``, ``model.digests``, ``routing``...). KV crosses as
bytes (``workers.protocol.KVWire``), so no tensor is ever unpickled in it.

Deliberately still lazy, at request time only, and so not covered here: ``registry.engines`` asks
vLLM's model registry and ``torch.cuda`` whether vLLM can serve a checkpoint an operator registers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Engine modules (tensors, the model, the scheduler, the replica engines): never in the web process.
ENGINE_MODULES = (
    "torch", "vllm", "transformers", "safetensors.torch",
    "cachecore.engine", "cachecore.runner", "cachecore.pages", "cachecore.device", "cachecore.scheduler",
    "cachecore.model.llama", "cachecore.model.loader", "cachecore.model.weights", "cachecore.model.hf_weights",
    "cachecore.tiers.device", "cachecore.tiers.host", "cachecore.tiers.remote",
    "workers.cache_worker", "workers.vllm_worker", "workers.kv_api", "workers.kv_wire", "workers.operations",
    "workers.revisions",
)
# The only ``workers`` modules the web tier may import: the protocol and plain-Python helpers. A new
# one must be torch-free (this test fails otherwise) and be added here on purpose.
WEB_WORKERS_MODULES = {
    "workers", "workers.protocol", "workers.actor", "workers.admission", "workers.engine_contract", "workers.stops",
    "workers.placement", "workers.replica_board",  # the replica board: start states, stdlib + Ray only
}

PROBE = r"""
import json, sys, traceback

first_import = {}


class Watch:
    # Records the stack that first imports a watched module (then lets the normal finders run).
    def find_spec(self, name, path=None, target=None):
        if name in ("torch", "vllm") and name not in first_import:
            first_import[name] = "".join(traceback.format_stack(limit=40))
        return None


sys.meta_path.insert(0, Watch())

import django

django.setup()

import controlplane.asgi  # noqa: F401,E402
from django.urls import URLPattern, URLResolver, get_resolver  # noqa: E402

views = 0


def walk(patterns):
    global views
    for p in patterns:
        if isinstance(p, URLResolver):
            walk(p.url_patterns)
        elif isinstance(p, URLPattern):
            assert callable(p.callback)
            views += 1


walk(get_resolver().url_patterns)
print(json.dumps({"modules": sorted(sys.modules), "views": views, "first_import": first_import}))
"""


def _web_process_modules() -> dict:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings.test",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")])}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_web_process_imports_neither_torch_nor_the_engine():
    seen = _web_process_modules()
    modules = set(seen["modules"])
    assert seen["views"] > 20  # the URL patterns were really resolved (admin API, /v1/, the console)
    assert "controlplane.serving.views" in modules and "controlplane.ui.views" in modules
    loaded = sorted(m for m in ENGINE_MODULES if m in modules)
    where = "\n\n".join(f"{name} first imported from:\n{stack}" for name, stack in seen["first_import"].items())
    assert not loaded, f"the web process imported engine modules {loaded}\n{where}"
    workers = sorted(m for m in modules if m == "workers" or m.startswith("workers."))
    assert set(workers) <= WEB_WORKERS_MODULES, (
        f"the web process imported workers modules beyond the protocol and its helpers: "
        f"{sorted(set(workers) - WEB_WORKERS_MODULES)}")


# ---------------------------------------------------------------------- the torch-free figures agree with torch
def test_layout_dtypes_agree_with_torch():
    import torch

    from cachecore.layout import DTYPE_BYTES, KVLayout, torch_dtype

    for name, size in DTYPE_BYTES.items():
        assert torch_dtype(name) is getattr(torch, name)
        assert torch.empty((), dtype=torch_dtype(name)).element_size() == size
        layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=name)
        assert layout.torch_dtype is getattr(torch, name) and layout.element_size == size
    assert set(DTYPE_BYTES) == {"float32", "float16", "bfloat16"}


def test_seeded_digest_still_names_the_loaded_torch_rng():
    """The recipe's torch version, now read from the distribution's metadata, is torch's own."""
    import hashlib

    import torch

    from cachecore.model.config import preset
    from cachecore.model.digests import GENERATOR_VERSION, canonical_json, seeded_digest, torch_rng_version

    assert torch_rng_version() == ".".join(torch.__version__.split(".")[:2])
    config = preset("tiny")
    recipe = {"source": "seeded", "generator": GENERATOR_VERSION,
              "torch_rng": ".".join(torch.__version__.split(".")[:2]), "config": config.canonical(),
              "model_name": "m", "revision_label": "r1", "seed": 7}
    expected = hashlib.sha256(canonical_json(recipe)).hexdigest()
    assert seeded_digest(config, model_name="m", revision_label="r1", seed=7) == expected


def test_kv_wire_round_trips_every_layout_dtype():
    import torch

    from workers.kv_wire import from_wire, retrieved_wire, to_wire

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        kv = torch.randn(2, 3, 2, 4, 1, 8).to(dtype)
        wire = to_wire(kv)
        assert wire["dtype"] == str(dtype).removeprefix("torch.") and wire["shape"] == [2, 3, 2, 4, 1, 8]
        assert isinstance(wire["data"], bytes) and len(wire["data"]) == kv.numel() * kv.element_size()
        assert torch.equal(from_wire(wire), kv)
    got = retrieved_wire(kv, torch.tensor([True, True, False]), "upload")
    assert got["hit_tokens"] == 2 and got["origin"] == "upload" and torch.equal(from_wire(got["kv"]), kv)


def test_the_actor_delegates_the_wire_calls_the_web_tier_makes():
    from controlplane.runtime.dispatch import TENANT_AFFINE
    from workers.actor import _DELEGATED, CacheWorkerActor
    from workers.cache_worker import CacheWorker

    for name in ("kv_store_wire", "kv_retrieve_wire"):
        assert name in _DELEGATED and callable(getattr(CacheWorkerActor, name))
        assert callable(getattr(CacheWorker, name)) and name in TENANT_AFFINE
