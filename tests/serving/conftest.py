"""Fixtures for end-to-end serving tests: a real local Ray cluster, the ASGI app under a real uvicorn
server (in a thread of this process, against the test database), tenants, keys and a tiny model."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from workers.config import apply_ray_env

    if not ray.is_initialized():
        apply_ray_env()  # replicas at the normal priority, as `make run` starts them
        ray.init(num_cpus=2, namespace="strata", include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    yield ray.get_runtime_context().gcs_address


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def asgi_url(ray_cluster, django_db_setup, django_db_blocker):
    import uvicorn

    port = _free_port()
    config = uvicorn.Config("controlplane.asgi:application", host="127.0.0.1", port=port, log_level="warning",
                            lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@dataclass
class Platform:
    url: str
    model: str
    keys: dict[str, str]
    tenants: dict
    deployment: object
    engine: str = "strata"
    block_size: int = 16  # the engine's cache block (vLLM's CPU build: 32)

    def client(self, tenant: str):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.keys[tenant], max_retries=0, timeout=120)


MODEL = "tiny-serve"


def _platform(asgi_url, actor, deployment, *, engine: str = "strata", block_size: int = 16) -> Platform:
    from controlplane.tenants.access import grant_create
    from controlplane.tenants.services import api_key_create, tenant_create

    tenants, keys = {}, {}
    for slug in ("acme", "globex", "initech"):
        tenant = tenant_create(actor=actor, slug=slug, name=slug.title())
        grant_create(actor=actor, tenant=tenant, deployment=deployment)
        tenants[slug] = tenant
        keys[slug] = api_key_create(actor=actor, tenant=tenant)[1]
    return Platform(url=asgi_url, model=deployment.name, keys=keys, tenants=tenants, deployment=deployment,
                    engine=engine, block_size=block_size)


@pytest.fixture
def platform(asgi_url, transactional_db, actor):
    from controlplane.registry.services import model_create

    deployment = model_create(actor=actor, name=MODEL, preset="tiny", revision={"label": "r1", "seed": 5})
    return _platform(asgi_url, actor, deployment)


VLLM_MODEL = "tiny-serve-vllm"


@pytest.fixture(params=["strata", "vllm"])
def engine_platform(request, asgi_url, transactional_db, actor):
    """The serving platform on each engine: the tiny preset on Strata's engine, and a random Llama
    checkpoint on vLLM (its replica actor keeps running between tests: one engine start per session).
    The suites that take this fixture run unchanged against both."""
    from controlplane.registry.services import model_create

    if request.param == "strata":
        deployment = model_create(actor=actor, name=MODEL, preset="tiny", revision={"label": "r1", "seed": 5})
        return _platform(asgi_url, actor, deployment)
    path = request.getfixturevalue("vllm_checkpoint")[0]
    deployment = model_create(actor=actor, name=VLLM_MODEL, preset="", revision={"label": "r1", "path": str(path)},
                              engine="vllm")
    return _platform(asgi_url, actor, deployment, engine="vllm", block_size=32)
