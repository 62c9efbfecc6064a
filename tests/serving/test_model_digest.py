"""A checkpoint's weights digest computed in the background (``controlplane.hashing``), over real HTTP
through uvicorn to a real Ray worker: ``POST /api/admin/models`` answers 201 with the digest pending
while the hasher is paused (the test hook ``STRATA_DIGEST_PAUSE_FILE``: no timing involved), tenants
get 503 ``model_starting`` with Retry-After and no replica starts meanwhile, a rollout to a pending
revision is 409; once the digest lands the model serves, its cached output equal to the uncached one
and to transformers'. A checkpoint whose weights change while they are hashed ends ``failed`` with
its reason and is never served."""

from __future__ import annotations

import secrets
import time

import httpx
import pytest
import torch

from tests.hf_checkpoints import build_checkpoint

pytest.importorskip("transformers")

PROMPT = "The quick brown fox jumps over the lazy dog. A cache keeps the attention keys and values of prompts. "


def wait_for(predicate, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("digest-ckpt")
    hf, tok = build_checkpoint("llama", path, seed=31, max_pos=512)
    return path, hf, tok


@pytest.fixture
def paused(settings, tmp_path):
    """Every weight hash of this process goes to the background and waits while the returned file exists."""
    pause = tmp_path / "pause-hashing"
    pause.touch()
    settings.STRATA_DIGEST_INLINE_BYTES = 0
    settings.STRATA_DIGEST_PAUSE_FILE = str(pause)
    yield pause
    pause.unlink(missing_ok=True)


@pytest.fixture
def admin(asgi_url, transactional_db, admin_client):
    return httpx.Client(base_url=f"{asgi_url}/api/admin", timeout=60,
                        headers={"Authorization": f"Bearer {admin_client.token}"})


def _tenant_key(actor, name: str) -> str:
    from controlplane.registry.models import ModelDeployment
    from controlplane.tenants.access import grant_create
    from controlplane.tenants.services import api_key_create, tenant_create

    tenant = tenant_create(actor=actor, slug=f"t-{secrets.token_hex(3)}", name="Digest Tenant")
    grant_create(actor=actor, tenant=tenant, deployment=ModelDeployment.objects.get(name=name))
    return api_key_create(actor=actor, tenant=tenant)[1]


def _complete(asgi_url: str, key: str, name: str) -> httpx.Response:
    return httpx.post(f"{asgi_url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=300,
                      json={"model": name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})


def _state(admin: httpx.Client, name: str) -> dict:
    return admin.get(f"/models/{name}").json()["digest_state"]


@pytest.fixture
def cleanup():
    names: list[str] = []
    yield names
    import ray

    from workers import actor as worker_actor

    for name in names:
        handle = worker_actor.find(name)
        if handle is not None:
            ray.kill(handle)


def test_post_answers_before_the_digest_and_the_model_serves_once_it_lands(
        asgi_url, admin, actor, checkpoint, paused, cleanup):
    from cachecore.model.hf_weights import checkpoint_digest
    from tests.controlplane.helpers import audit_events
    from workers import actor as worker_actor

    path, hf, tok = checkpoint
    name = f"digest-{secrets.token_hex(3)}"
    cleanup.append(name)
    created = admin.post("/models", json={"name": name, "engine": "strata",
                                          "revision": {"label": "r1", "path": str(path)}})
    assert created.status_code == 201, created.text
    (revision,) = created.json()["revisions"]
    assert revision["digest"] == "" and revision["digest_state"]["state"] == "hashing"
    assert revision["digest_state"]["total_bytes"] > 0
    assert created.json()["digest_state"]["state"] == "hashing"
    detail = admin.get(f"/models/{name}").json()
    assert detail["digest_state"]["message"].startswith("hashing weights (")

    key = _tenant_key(actor, name)
    held = _complete(asgi_url, key, name)
    assert held.status_code == 503, held.text
    assert held.json()["error"]["code"] == "model_starting" and int(held.headers["Retry-After"]) >= 1
    assert worker_actor.find(name) is None  # nothing was started, so no namespace was formed from ""
    from controlplane.registry.models import ModelDeployment
    from controlplane.runtime import gateway, warm

    spec = gateway.spec_for(ModelDeployment.objects.select_related("active_revision").get(name=name))
    assert spec.unservable[0] == "model_starting"
    assert warm.start_replicas(spec) == 0 and gateway.apply_scale(spec, wait=True) is None  # scaling refused
    assert worker_actor.find(name) is None

    staged = admin.post(f"/models/{name}/revisions", json={"label": "r2", "path": str(path)})
    assert staged.status_code == 201 and staged.json()["digest"] == ""
    refused = admin.post(f"/models/{name}/rollout", json={"revision": "r2"})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "revision_not_ready"

    paused.unlink()  # the hasher goes on
    wait_for(lambda: _state(admin, name)["state"] == "ready")
    wait_for(lambda: admin.get(f"/models/{name}").json()["revisions"][1]["digest"])
    digests = {r["label"]: r["digest"] for r in admin.get(f"/models/{name}").json()["revisions"]}
    assert digests["r1"] == checkpoint_digest(path.resolve())
    assert sorted(e.target for e in audit_events("revision.digest")) == [f"{name}@r1", f"{name}@r2"]

    ids = tok(PROMPT)["input_ids"]
    with torch.no_grad():
        expected = tok.decode(hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):],
                              skip_special_tokens=True)
    first = _complete(asgi_url, key, name)
    second = _complete(asgi_url, key, name)
    assert first.status_code == second.status_code == 200, first.text
    assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"] == expected

    accepted = admin.post(f"/models/{name}/rollout", json={"revision": "r2"})
    assert accepted.status_code == 202, accepted.text  # the same request once r2's digest is known


@pytest.mark.parametrize("change", ["rewritten", "deleted"])
def test_weights_changed_while_hashed_end_failed_and_never_serve(
        asgi_url, admin, actor, checkpoint, paused, tmp_path, change):
    import shutil

    from tests.controlplane.helpers import audit_events
    from workers import actor as worker_actor

    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint[0], path)
    name = f"changing-{secrets.token_hex(3)}"
    created = admin.post("/models", json={"name": name, "engine": "strata",
                                          "revision": {"label": "r1", "path": str(path)}})
    assert created.status_code == 201 and created.json()["revisions"][0]["digest"] == ""
    weights = path / "model.safetensors"
    if change == "rewritten":
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF  # same size, other bytes: the modification time tells
        time.sleep(0.01)
        weights.write_bytes(bytes(data))
    else:
        weights.unlink()
    paused.unlink()
    state = wait_for(lambda: (s := _state(admin, name))["state"] == "failed" and s)
    assert "model.safetensors" in state["error"] and ("changed" in state["error"] or "gone" in state["error"])
    assert state["message"].startswith("hashing weights failed")
    assert admin.get(f"/models/{name}").json()["revisions"][0]["digest"] == ""
    assert [e.target for e in audit_events("revision.digest_failed")] == [f"{name}@r1"]

    held = _complete(asgi_url, _tenant_key(actor, name), name)
    assert held.status_code == 503, held.text
    if change == "rewritten":  # (a deleted file is already refused when the model's facts are read)
        assert held.json()["error"]["code"] == "model_failed" and "model.safetensors" in held.text
    assert worker_actor.find(name) is None
