"""``POST /api/admin/models`` with a checkpoint answers within a second: choosing its engine reads
vLLM's model registry and torch's CUDA build from their source files instead of importing vLLM and
torch on the request thread (3.7 s and 0.9 s in a fresh web process, more on a busy machine).

Pinned by what a fresh process imports, not by a timing: the figures are printed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.controlplane.helpers import post

pytest.importorskip("vllm")
REPO = Path(__file__).resolve().parents[2]

CHOOSE = """
import sys, time
import django
django.setup()
from controlplane.registry import engines, services
t0 = time.perf_counter()
engine, info = engines.checkpoint_engine(None, lambda which: services._checkpoint(sys.argv[1], which, digest=False))
seconds = time.perf_counter() - t0
print(engine, "vllm" in sys.modules, "torch" in sys.modules, f"{seconds:.3f}")
"""


def test_vllm_architectures_read_from_source_are_the_registry_s():
    from vllm.model_executor.models import ModelRegistry

    from controlplane.registry import engines

    archs = engines.vllm_architectures_from_source()
    assert archs == frozenset(ModelRegistry.get_supported_archs())
    assert "LlamaForCausalLM" in archs and "MistralModel" in archs  # a plain key and one from a comprehension


def test_choosing_a_checkpoint_s_engine_imports_neither_vllm_nor_torch(vllm_checkpoint):
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'platform'}",
           "DJANGO_SETTINGS_MODULE": "controlplane.settings.test"}
    out = subprocess.run([sys.executable, "-c", CHOOSE, str(vllm_checkpoint[0])], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    engine, vllm_loaded, torch_loaded, seconds = out.stdout.split()[-4:]
    print(f"\nengine choice for a vLLM checkpoint in a fresh process: {float(seconds) * 1000:.0f} ms")
    assert (engine, vllm_loaded, torch_loaded) == ("vllm", "False", "False")


@pytest.mark.django_db
@pytest.mark.parametrize("engine", ["vllm", "strata"])
def test_post_models_with_a_checkpoint_on_either_engine(admin_client, vllm_checkpoint, engine):
    path = vllm_checkpoint[0]
    t0 = time.perf_counter()
    response = post(admin_client, "/api/admin/models",
                    {"name": f"fast-{engine}", "engine": engine, "revision": {"label": "r1", "path": str(path)}})
    seconds = time.perf_counter() - t0
    print(f"\nPOST /api/admin/models, {engine} checkpoint: {seconds * 1000:.0f} ms")
    assert response.status_code == 201, response.content
    assert response.json()["engine"] == engine
