"""``POST /api/admin/models`` with a big checkpoint answers before its weights are hashed, and a hash
survives the web process that ran it (``controlplane.hashing``).

- A 2 GiB checkpoint (sparse files: as long to hash as a real one, nothing written) is created with
  its digest pending; the POST's time is printed (no timing assertion), and the digest that lands
  later is the one ``checkpoint_digest`` computes.
- A real web process (uvicorn, ``settings.test_worker``) hashing a checkpoint is killed (SIGKILL)
  mid-hash; a new web process takes the stale hash over from its start and completes it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.controlplane.helpers import audit_events, post
from tests.hf_checkpoints import build_checkpoint, sparse_llama_checkpoint

pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[2]


def wait_for(predicate, timeout: float = 180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def test_post_of_a_2_gib_checkpoint_answers_with_its_digest_pending(transactional_db, admin_client, tmp_path):
    from cachecore.model.hf_weights import checkpoint_digest
    from controlplane.registry.models import ModelRevision

    path = tmp_path / "big"
    total = sparse_llama_checkpoint(path, weight_bytes=2 << 30)
    t0 = time.perf_counter()
    created = post(admin_client, "/api/admin/models", {"name": "big", "revision": {"label": "r1", "path": str(path)}})
    seconds = time.perf_counter() - t0
    print(f"\nPOST /api/admin/models, {total / 2**30:.2f} GiB checkpoint ({created.json().get('engine')}): "
          f"{seconds:.3f} s")
    assert created.status_code == 201, created.content
    state = created.json()["digest_state"]
    assert created.json()["revisions"][0]["digest"] == "" and state["state"] == "hashing"
    assert state["total_bytes"] >= total
    digest = wait_for(lambda: ModelRevision.objects.get(deployment__name="big").digest)
    assert digest == checkpoint_digest(path)
    assert admin_client.get("/api/admin/models/big").json()["digest_state"] == {
        "state": "ready", "done_bytes": None, "total_bytes": None, "error": None, "message": None}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Web:
    """``uvicorn controlplane.asgi:application`` in its own process group, on the test database."""

    def __init__(self, pause: Path, log: Path) -> None:
        from tests.live_db import database_url

        self.port = _free_port()
        env = {**os.environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings.test_worker",
               "DATABASE_URL": database_url(), "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")]),
               "STRATA_TEST_DIGEST_PAUSE_FILE": str(pause), "STRATA_TEST_DIGEST_INLINE_BYTES": "0",
               "STRATA_TEST_DIGEST_STALE_SECONDS": "2"}
        env.pop("RAY_ADDRESS", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "controlplane.asgi:application", "--host", "127.0.0.1",
             "--port", str(self.port), "--lifespan", "off"],
            cwd=REPO, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(self._up, timeout=120)

    def _up(self) -> bool:
        assert self.proc.poll() is None, "the web process exited"
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", self.port)) == 0

    def client(self, token: str) -> httpx.Client:
        return httpx.Client(base_url=f"http://127.0.0.1:{self.port}/api/admin", timeout=60,
                            headers={"Authorization": f"Bearer {token}"})

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


@pytest.fixture
def webs(tmp_path):
    started: list[Web] = []
    yield lambda pause: started.append(Web(pause, tmp_path / "web.log")) or started[-1]
    for web in started:
        web.kill()


def test_a_hash_cut_by_a_killed_web_process_is_completed_by_the_next_one(transactional_db, admin_client, tmp_path,
                                                                         webs):
    from cachecore.model.hf_weights import checkpoint_digest
    from controlplane.hashing.models import WeightHash

    path = tmp_path / "ckpt"
    build_checkpoint("qwen2", path, seed=5, layers=1)
    pause = tmp_path / "pause"
    pause.touch()
    first = webs(pause)
    admin = first.client(admin_client.token)
    created = admin.post("/models", json={"name": "resumed", "engine": "strata",
                                          "revision": {"label": "r1", "path": str(path)}})
    assert created.status_code == 201, created.text
    assert created.json()["revisions"][0]["digest"] == ""
    # mid-hash: bytes done and reported, the rest held back by the pause
    wait_for(lambda: admin.get("/models/resumed").json()["digest_state"].get("done_bytes"))
    owner = WeightHash.objects.get().owner
    first.kill()
    pause.unlink()

    second = webs(pause)
    admin = second.client(admin_client.token)
    assert admin.get("/models/resumed").json()["revisions"][0]["digest"] in ("", checkpoint_digest(path))
    body = wait_for(lambda: (b := admin.get("/models/resumed").json())["digest_state"]["state"] == "ready" and b)
    assert body["revisions"][0]["digest"] == checkpoint_digest(path)
    assert not WeightHash.objects.exists()
    (landed,) = audit_events("revision.digest")
    assert landed.target == "resumed@r1"
    assert owner.split(":")[1] == str(first.proc.pid)  # the first process held it; another one finished it


def test_a_model_deleted_while_its_weights_are_hashed_lands_nothing(transactional_db, admin_client, settings,
                                                                    tmp_path):
    import threading

    from controlplane.hashing.models import WeightHash
    from controlplane.registry.models import ModelDeployment

    path = tmp_path / "ckpt"
    build_checkpoint("qwen2", path, seed=6, layers=1)
    pause = tmp_path / "pause"
    pause.touch()
    settings.STRATA_DIGEST_INLINE_BYTES = 0
    settings.STRATA_DIGEST_PAUSE_FILE = str(pause)
    created = post(admin_client, "/api/admin/models", {"name": "gone", "engine": "strata",
                                                       "revision": {"label": "r1", "path": str(path)}})
    assert created.status_code == 201 and created.json()["revisions"][0]["digest"] == ""
    revision_id = WeightHash.objects.get().pk
    hasher = next(t for t in threading.enumerate() if t.name == f"hash-revision-{revision_id}")
    ModelDeployment.objects.get(name="gone").delete()
    pause.unlink()
    hasher.join(timeout=120)
    assert not hasher.is_alive()
    assert not WeightHash.objects.exists() and audit_events("revision.digest") == []
    assert admin_client.get("/api/admin/models/gone").status_code == 404
