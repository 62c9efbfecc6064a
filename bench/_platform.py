"""A throwaway Strata platform for benchmarks that drive it end to end, outside pytest.

    with throwaway_platform(preset="tiny", tenants=4) as p:
        httpx.post(f"{p.url}/v1/completions", headers=p.headers(0), json={...})
        handle = p.actor()                          # the deployment's Ray actor (what the server calls)
        req = p.worker_request(0, {...})            # the exact worker request the server would build

    with throwaway_platform(preset=None, tenants=4) as p:   # no deployment yet: add checkpoints yourself
        dep = p.add_model("m", revision={"label": "r1", "path": str(ckpt)}, engine="vllm")
        ...                                         # p.model is now "m"; every tenant is granted it
        p.stop_model(dep)                           # its replica stopped (a vLLM engine shut down first)

What it sets up, in this process: a temporary ``STRATA_HOME`` (SQLite database, secret key, Ray's
session files), ``DJANGO_SETTINGS_MODULE=controlplane.settings.local``, ``django.setup()`` and the
migrations, a local Ray head (``address="local"``: never joins another engineer's cluster), one model
deployment with its worker actor already started (none with ``preset=None``; ``Platform.add_model``
adds deployments, ``Platform.stop_model`` stops one's replica), ``tenants`` tenants each with an API
key and a grant, and uvicorn serving ``controlplane.asgi:application`` in a thread on a free port.
Leaving the block stops the server, shuts Ray down (the detached actor dies with the local head) and
removes the temporary directory.

``DATABASE_URL``, ``REDIS_URL``, ``CELERY_BROKER_URL`` and ``RAY_ADDRESS`` are removed from this
process's environment first, so a benchmark never writes into a real database or cluster. Django can
be set up once per process, so there is at most one platform per process.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
SOURCE_ROOT = REPO_ROOT / "platform"  # a source root, never a package
SERVER_ENV = ("DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "RAY_ADDRESS")
_used = False


@dataclass
class Platform:
    url: str
    model: str
    preset: str
    home: Path
    deployment: Any
    tenants: list[Any]
    keys: list[str]
    server: Any = field(repr=False)
    block_size: int = 16

    def add_model(self, name: str, *, revision: dict, engine: str | None = None, preset: str = "",
                  start_timeout: float = 900.0):
        """Create deployment ``name`` (``registry.services.model_create``: a checkpoint revision
        ``{"label", "path"}`` with ``preset=""``, or a preset with ``{"label", "seed"}``) on ``engine``,
        grant it to every tenant, start its worker (waits for the weights or the vLLM engine) and make
        it this platform's ``model`` / ``deployment`` / ``block_size``. Returns the deployment."""
        import ray

        from controlplane.common.actor import Actor
        from controlplane.common.errors import Unavailable
        from controlplane.registry.services import model_create
        from controlplane.runtime import gateway
        from controlplane.tenants.access import grant_create
        from workers.actor import find

        actor = Actor.system("bench")
        deployment = model_create(actor=actor, name=name, preset=preset, revision=revision, engine=engine)
        for tenant in self.tenants:
            grant_create(actor=actor, tenant=tenant, deployment=deployment)
        deadline = time.monotonic() + start_timeout
        while True:  # the gateway waits CREATE_TIMEOUT_S per try; a vLLM engine may take longer on a busy CPU
            try:
                handle = gateway.get_worker(gateway.spec_for(deployment))
                break
            except Unavailable:
                if time.monotonic() > deadline or find(name) is None:  # gone: it failed, not slow
                    raise
                time.sleep(1)
        info = ray.get(handle.info.remote())
        self.model, self.preset, self.deployment = name, preset, deployment
        self.block_size = int(info["layout"]["block_size"])
        return deployment

    def stop_model(self, deployment, *, timeout: float = 60.0) -> None:
        """Stop ``deployment``'s replica actors so they use no CPU or memory while something else is
        measured: a vLLM replica's engine is shut down in the actor first (``VllmWorker.close``: its
        engine-core process exits), then the actor is killed; any process the actor had started that
        is still alive after ``timeout`` is killed by its pid. The gateway forgets the deployment."""
        import psutil
        import ray

        from controlplane.runtime import gateway
        from workers.actor import find

        gateway.forget(deployment.name)
        for replica in range(max(1, int(deployment.replicas))):
            handle = find(deployment.name, replica)
            if handle is None:
                continue
            children: list = []
            try:
                pid = ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
                children = psutil.Process(pid).children(recursive=True)
                ray.get(handle.__ray_call__.remote(lambda self: getattr(self.worker, "close", lambda: None)()),
                        timeout=timeout)
            except Exception as exc:  # best effort: the actor is killed below anyway
                print(f"[platform] stopping {deployment.name}:{replica}: {exc!r}", file=sys.stderr, flush=True)
            ray.kill(handle, no_restart=True)
            _, alive = psutil.wait_procs(children, timeout=timeout)
            for proc in alive:
                with contextlib.suppress(psutil.Error):
                    proc.kill()

    def headers(self, tenant: int) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}

    def spec(self):
        from controlplane.runtime import gateway

        return gateway.spec_for(self.deployment)

    def actor(self):
        """The deployment's Ray actor handle, the same one the server's gateway uses."""
        from controlplane.runtime import gateway

        return gateway.get_worker(self.spec())

    def worker_request(self, tenant: int, body: dict) -> dict:
        """The worker request the serving API builds for ``body`` sent with tenant ``tenant``'s key:
        ``controlplane.serving.context`` itself runs on a synthetic request (auth, grant, scope salt,
        quotas), so a direct actor call gets exactly what the HTTP path would hand the worker."""
        from django.test import RequestFactory

        from controlplane.serving import context
        from controlplane.serving.schemas import CompletionRequest

        request = RequestFactory().post("/v1/completions", data=json.dumps(body), content_type="application/json",
                                        headers=self.headers(tenant))
        return context._prepare(request, CompletionRequest).worker_req


def _prepare_env(home: Path, log_level: str) -> None:
    for name in SERVER_ENV:
        os.environ.pop(name, None)
    os.environ["STRATA_HOME"] = str(home)
    os.environ["DJANGO_SETTINGS_MODULE"] = "controlplane.settings.local"
    os.environ.setdefault("STRATA_LOG_LEVEL", log_level)
    if str(SOURCE_ROOT) not in sys.path:
        sys.path.insert(1, str(SOURCE_ROOT))


def _listening_socket() -> socket.socket:
    """A bound socket on a free port, handed to uvicorn (no window for another process to take it)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextmanager
def throwaway_platform(
    *,
    preset: str | None = "tiny",
    tenants: int = 2,
    model: str = "bench-model",
    seed: int = 7,
    ray_cpus: int = 2,
    log_level: str = "WARNING",
    quiet: bool = False,
) -> Iterator[Platform]:
    global _used
    if _used:
        raise RuntimeError("one throwaway platform per process (Django is set up once)")
    _used = True
    home = Path(tempfile.mkdtemp(prefix="strata-bench-"))
    _prepare_env(home, log_level)
    server = thread = sock = None
    ray_started = False
    t0 = time.perf_counter()

    def say(msg: str) -> None:
        if not quiet:
            print(f"[platform {time.perf_counter() - t0:5.1f}s] {msg}", file=sys.stderr, flush=True)

    try:
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0, interactive=False)
        say(f"database migrated under {home}")

        import ray

        from workers.config import apply_ray_env

        apply_ray_env()  # replicas at the normal priority, as `make run` starts them
        ray.init(address="local", num_cpus=ray_cpus, namespace="strata", include_dashboard=False,
                 log_to_driver=False, configure_logging=False, _temp_dir=str(home / "ray"))
        ray_started = True
        say("local Ray started")

        from controlplane.common.actor import Actor
        from controlplane.registry.services import model_create
        from controlplane.runtime import gateway
        from controlplane.tenants.access import grant_create
        from controlplane.tenants.services import api_key_create, tenant_create

        actor = Actor.system("bench")
        deployment = None
        if preset is not None:
            deployment = model_create(actor=actor, name=model, preset=preset,
                                      revision={"label": "r1", "seed": seed})
        made, keys = [], []
        for i in range(tenants):
            tenant = tenant_create(actor=actor, slug=f"bench-{i}-{secrets.token_hex(3)}", name=f"Bench tenant {i}")
            if deployment is not None:
                grant_create(actor=actor, tenant=tenant, deployment=deployment)
            made.append(tenant)
            keys.append(api_key_create(actor=actor, tenant=tenant)[1])
        block_size = 16
        if deployment is not None:
            handle = gateway.get_worker(gateway.spec_for(deployment))  # starts the actor, waits for its weights
            info = ray.get(handle.info.remote())
            block_size = int(info["layout"]["block_size"])
            say(f"model {model!r} ({preset}) on {info['device']}, {tenants} tenants")
        else:
            say(f"{tenants} tenants, no model yet (Platform.add_model)")

        import uvicorn

        from controlplane.asgi import application

        sock = _listening_socket()
        port = sock.getsockname()[1]
        config = uvicorn.Config(application, host="127.0.0.1", port=port, log_level=log_level.lower(),
                                lifespan="off", access_log=False)
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        say(f"serving on http://127.0.0.1:{port}")
        yield Platform(url=f"http://127.0.0.1:{port}", model=model if deployment is not None else "",
                       preset=preset or "", home=home, deployment=deployment, tenants=made, keys=keys,
                       server=server, block_size=block_size)
    finally:
        if server is not None:
            server.should_exit = True
            if thread is not None:
                thread.join(timeout=10)
        if sock is not None:
            sock.close()
        if ray_started:
            import ray

            ray.shutdown()
        try:
            from django.db import connections

            connections.close_all()
        except Exception:  # best effort: Django may not have been set up
            pass
        shutil.rmtree(home, ignore_errors=True)
        say("platform stopped, temporary directory removed")
