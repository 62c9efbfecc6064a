"""Shared fixtures for the whole suite (keep small; area-specific ones live in sub-conftests)."""

import base64
import os
import secrets
import tempfile
from pathlib import Path

import pytest
from django.test import Client
from hypothesis import settings as hypothesis_settings

# Cache-worker actors created by this test process expose their test hooks (poisoning free pages);
# production actors never do.
os.environ.setdefault("STRATA_TEST_HOOKS", "1")
# One master key and one L3 directory for this test session, shared by the test process, the Ray
# workers it starts and the Celery worker subprocesses (they inherit this environment).
os.environ.setdefault("STRATA_MASTER_KEY", base64.b64encode(secrets.token_bytes(32)).decode())
os.environ.setdefault("STRATA_L3_URL", Path(tempfile.mkdtemp(prefix="strata-test-l3-")).as_uri())

# CI runs the property-based tests on a fixed, derandomized set of examples so a landing never depends
# on a lucky draw; local runs keep exploring new examples (and remember failures in .hypothesis/).
hypothesis_settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    hypothesis_settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _forget_stats_samples():
    """Each test starts with no replica samples (``controlplane.runtime.samples``): deployments of
    the same name in two tests are different replicas."""
    yield
    import sys

    samples = sys.modules.get("controlplane.runtime.samples")
    if samples is not None and samples._store is not None:
        samples._store.forget()


@pytest.fixture
def actor():
    """An internal actor for calling services directly in tests."""
    from controlplane.common.actor import Actor

    return Actor.system("tests")


def _operator_client(role: str) -> Client:
    from controlplane.common.actor import Actor
    from controlplane.operators.services import operator_token_create

    _, raw = operator_token_create(actor=Actor.system("tests"), username=f"{role}-op", role=role)
    client = Client(headers={"Authorization": f"Bearer {raw}"})
    client.token = raw
    return client


@pytest.fixture
def admin_client(db) -> Client:
    """Django test client authenticated with an admin operator token (``.token`` holds it)."""
    return _operator_client("admin")


@pytest.fixture
def viewer_client(db) -> Client:
    """Django test client authenticated with a viewer operator token (``.token`` holds it)."""
    return _operator_client("viewer")


@pytest.fixture(scope="session")
def vllm_checkpoint(tmp_path_factory):
    """``(path, hf model, tokenizer)``: a random Llama checkpoint vLLM's CPU build can run (head size
    64), shared by the vLLM tests of the session (each engine start costs 15-25 s)."""
    pytest.importorskip("vllm")
    from tests.hf_checkpoints import VLLM_CPU_SHAPE, build_checkpoint

    path = tmp_path_factory.mktemp("vllm-llama")
    hf, tok = build_checkpoint("llama", path, seed=11, max_pos=2048, **VLLM_CPU_SHAPE)
    return path, hf, tok
