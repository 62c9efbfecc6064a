"""Fixtures for the vLLM engine: one in-process ``VllmWorker`` per module (starting vLLM takes 15-25 s
here) on the session's ``vllm_checkpoint`` (tests/conftest.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tests.jobs.conftest import celery_worker_factory  # noqa: E402, F401  (re-exported fixtures)
from tests.serving.conftest import asgi_url, platform, ray_cluster  # noqa: E402, F401


@pytest.fixture(scope="module")
def vllm_worker(vllm_checkpoint):
    from workers.vllm_worker import VllmWorker

    path = vllm_checkpoint[0]
    worker = VllmWorker(deployment="vllm-test", preset="", l1_mb=16,
                        revision={"label": "r1", "checkpoint_path": str(path)})
    yield worker
    worker.close()
