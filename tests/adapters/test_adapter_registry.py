"""The adapter registry over the admin API: registration checked against the base checkpoint (422s
that say what is wrong), private adapters invisible to other tenants exactly like missing models,
deletion through a job that frees the name. No replica runs here (``tests/vllm/test_adapters_http.py``
serves adapters)."""

from __future__ import annotations

import json
import os

import pytest
from django.test import Client

from tests.adapters.lora_files import build_adapter
from tests.controlplane.helpers import assert_error, audit_actions, patch, post
from tests.serving.conftest import ray_cluster  # noqa: F401  (re-exported fixture)

pytest.importorskip("vllm")
pytestmark = pytest.mark.django_db
BASE = "lora-base"


@pytest.fixture
def root(settings, tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    settings.STRATA_WEIGHTS_ROOT = base
    return base


@pytest.fixture
def deployment(actor, vllm_checkpoint, root):
    from controlplane.registry.services import model_create

    return model_create(actor=actor, name=BASE, preset="", revision={"label": "r1", "path": str(vllm_checkpoint[0])},
                        engine="vllm")


@pytest.fixture
def adapters_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("adapters")


def _tenant(actor, slug, deployment):
    from controlplane.tenants.access import grant_create
    from controlplane.tenants.services import api_key_create, tenant_create

    tenant = tenant_create(actor=actor, slug=slug, name=slug.title())
    grant_create(actor=actor, tenant=tenant, deployment=deployment)
    return tenant, Client(HTTP_AUTHORIZATION=f"Bearer {api_key_create(actor=actor, tenant=tenant)[1]}")


def _register(client, path, name="tuned", **extra):
    return post(client, f"/api/admin/models/{BASE}/adapters", {"name": name, "path": str(path), **extra})


def test_registration_answers_digest_rank_and_targets_and_lists_it(admin_client, deployment, adapters_dir,
                                                                   vllm_checkpoint):
    from cachecore.model.peft import digest

    build_adapter(adapters_dir / "a", vllm_checkpoint[1], seed=1)
    response = _register(admin_client, adapters_dir / "a")
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["name"] == "tuned" and body["model"] == BASE and body["tenant"] is None
    assert body["digest"] == digest((adapters_dir / "a").resolve()) and len(body["digest"]) == 64
    assert (body["rank"], body["target_modules"], body["dtype"]) == (8, ["q_proj", "v_proj"], "float32")
    assert audit_actions()[-1] == "adapter.create"
    listed = admin_client.get(f"/api/admin/models/{BASE}/adapters").json()
    assert [a["name"] for a in listed] == ["tuned"]
    # the name is unambiguous: a second adapter of that name, or one named like a model, is refused
    assert_error(_register(admin_client, adapters_dir / "a"), 409, "adapter_exists")
    assert_error(_register(admin_client, adapters_dir / "a", name=BASE), 409, "name_taken")


def test_a_different_file_is_a_different_digest(admin_client, deployment, adapters_dir, vllm_checkpoint):
    build_adapter(adapters_dir / "a", vllm_checkpoint[1], seed=1)
    build_adapter(adapters_dir / "b", vllm_checkpoint[1], seed=2)
    a = _register(admin_client, adapters_dir / "a", name="a").json()
    b = _register(admin_client, adapters_dir / "b", name="b").json()
    assert a["digest"] != b["digest"]


@pytest.mark.parametrize(("case", "message"), [
    ("shape", "lora_A has shape [8, 64]; the base layer needs [8, 128]"),
    ("target", "the base model has no linear layer"),
    ("not_targeted", "is not in target_modules"),
    ("rank", "rank 8 exceeds the largest rank this platform serves (4)"),
    ("dtype", "adapter tensors must share one dtype"),
    ("config", "has no adapter_config.json"),
    ("bias", "bias 'all' is not supported"),
])
def test_invalid_adapters_are_422_with_what_is_wrong(admin_client, deployment, adapters_dir, vllm_checkpoint,
                                                     settings, case, message):
    import torch
    from safetensors.torch import save_file

    hf = vllm_checkpoint[1]
    path = adapters_dir / case
    tensors = build_adapter(path, hf, seed=3, config={"bias": "all"} if case == "bias" else None)
    if case == "shape":
        name = next(n for n in tensors if n.endswith("q_proj.lora_A.weight"))
        tensors[name] = torch.zeros(8, 64)
        save_file(tensors, str(path / "adapter_model.safetensors"))
    elif case == "target":
        save_file({**tensors, "base_model.model.model.layers.0.self_attn.x_proj.lora_A.weight": torch.zeros(8, 128),
                   "base_model.model.model.layers.0.self_attn.x_proj.lora_B.weight": torch.zeros(128, 8)},
                  str(path / "adapter_model.safetensors"))
        cfg = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["q_proj", "v_proj", "x_proj"]}))
    elif case == "not_targeted":
        cfg = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["q_proj"]}))
    elif case == "rank":
        settings.STRATA_LORA_MAX_RANK = 4
    elif case == "dtype":
        save_file({k: v.to(torch.int32) for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    elif case == "config":
        (path / "adapter_config.json").unlink()
    error = assert_error(_register(admin_client, path, name=f"bad-{case.replace('_', '-')}"), 422, "invalid_adapter")
    assert message in error["message"], error["message"]
    assert not admin_client.get(f"/api/admin/models/{BASE}/adapters").json()


def test_a_symlink_out_of_the_weights_root_is_refused(admin_client, deployment, adapters_dir, vllm_checkpoint,
                                                      tmp_path_factory, settings):
    build_adapter(adapters_dir / "a", vllm_checkpoint[1], seed=1)
    settings.STRATA_WEIGHTS_ROOT = adapters_dir / "inside"
    (adapters_dir / "inside" / "a").mkdir(parents=True)
    (adapters_dir / "inside" / "a" / "adapter_config.json").write_text((adapters_dir / "a" / "adapter_config.json")
                                                                       .read_text())
    os.symlink(adapters_dir / "a" / "adapter_model.safetensors",
               adapters_dir / "inside" / "a" / "adapter_model.safetensors")
    error = assert_error(_register(admin_client, adapters_dir / "inside" / "a"), 422, "invalid_adapter")
    assert "resolves outside the weights root" in error["message"]
    error = assert_error(_register(admin_client, adapters_dir / "a"), 422, "invalid_adapter")
    assert "path must be inside" in error["message"]


def test_the_reference_engine_refuses_adapters_and_says_to_use_vllm(admin_client, actor, adapters_dir,
                                                                     vllm_checkpoint, root):
    from controlplane.registry.services import model_create

    model_create(actor=actor, name=BASE, preset="", revision={"label": "r1", "path": str(vllm_checkpoint[0])},
                 engine="strata")
    build_adapter(adapters_dir / "a", vllm_checkpoint[1], seed=1)
    error = assert_error(_register(admin_client, adapters_dir / "a"), 422, "adapters_need_vllm")
    assert "engine 'vllm'" in error["message"]


def test_with_lora_off_a_registration_says_how_to_turn_it_on(admin_client, deployment, adapters_dir,
                                                               vllm_checkpoint, settings):
    settings.STRATA_LORA_MAX_LORAS = 0  # STRATA_LORA_MAX_LORAS=0: vLLM starts without LoRA
    build_adapter(adapters_dir / "a", vllm_checkpoint[1], seed=1)
    error = assert_error(_register(admin_client, adapters_dir / "a"), 422, "adapters_disabled")
    assert "STRATA_LORA_MAX_LORAS" in error["message"]


def test_a_private_adapter_is_its_tenant_s_alone_and_a_404_like_a_missing_model_for_others(
        admin_client, actor, deployment, adapters_dir, vllm_checkpoint):
    _, acme = _tenant(actor, "acme", deployment)
    _, globex = _tenant(actor, "globex", deployment)
    assert [m["id"] for m in acme.get("/v1/models").json()["data"]] == [BASE]  # warm: the key is cached now
    build_adapter(adapters_dir / "a", vllm_checkpoint[1], seed=1)
    build_adapter(adapters_dir / "p", vllm_checkpoint[1], seed=2)
    assert _register(admin_client, adapters_dir / "a", name="public-a").status_code == 201
    assert _register(admin_client, adapters_dir / "p", name="acme-only", tenant="acme").status_code == 201
    # seen at once (the access generation moved), with the base model as its parent, as vLLM lists them
    models = {m["id"]: m for m in acme.get("/v1/models").json()["data"]}
    assert set(models) == {BASE, "public-a", "acme-only"}
    assert models["acme-only"]["parent"] == BASE and "parent" not in models[BASE]
    assert {m["id"] for m in globex.get("/v1/models").json()["data"]} == {BASE, "public-a"}
    body = {"prompt": "hello", "max_tokens": 1}
    private = post(globex, "/v1/completions", {**body, "model": "acme-only"})
    missing = post(globex, "/v1/completions", {**body, "model": "acme-onlx"})
    assert_error(private, 404, "model_not_found")
    assert private.json()["error"]["message"].replace("acme-only", "X") == \
        missing.json()["error"]["message"].replace("acme-onlx", "X")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert_error(post(globex, "/v1/chat/completions", {**chat, "model": "acme-only"}), 404, "model_not_found")
    # the KV API serves base models only: an adapter's name is a model it does not know, even its owner's
    assert_error(post(acme, "/v1/kv/lookup", {"model": "acme-only", "tokens": [1, 2, 3]}), 404, "model_not_found")
    from controlplane.adapters.selectors import usable
    from controlplane.tenants.models import Tenant

    assert usable(Tenant.objects.get(slug="acme"), "acme-only").deployment == BASE
    assert usable(Tenant.objects.get(slug="globex"), "acme-only") is None


def test_delete_is_a_job_that_stops_serving_at_once_and_frees_the_name(admin_client, actor, deployment,
                                                                        adapters_dir, vllm_checkpoint, ray_cluster):  # noqa: F811
    from controlplane.adapters.models import Adapter
    from controlplane.jobs.services import job_execute

    _, acme = _tenant(actor, "acme", deployment)
    build_adapter(adapters_dir / "a", vllm_checkpoint[1], seed=1)
    assert _register(admin_client, adapters_dir / "a").status_code == 201
    assert "tuned" in {m["id"] for m in acme.get("/v1/models").json()["data"]}
    response = admin_client.delete(f"/api/admin/models/{BASE}/adapters/tuned?reason=retired")
    assert response.status_code == 202, response.content
    job = response.json()
    assert (job["kind"], job["adapter"], job["model"]) == ("adapter_delete", "tuned", BASE)
    assert "tuned" not in {m["id"] for m in acme.get("/v1/models").json()["data"]}  # no longer served
    assert_error(post(acme, "/v1/completions", {"model": "tuned", "prompt": "x", "max_tokens": 1}), 404,
                 "model_not_found")
    assert_error(_register(admin_client, adapters_dir / "a"), 409, "adapter_exists")  # until its KV is gone
    done = job_execute(job_id=job["id"], final_attempt=True)  # no replica started: nothing held anywhere
    assert done.status == "succeeded", (done.steps, done.error)
    assert Adapter.objects.get(pk=done.adapter_id).state == "deleted"
    assert {"adapter.delete", "adapter_delete.request", "adapter_delete.complete"} <= set(audit_actions())
    assert _register(admin_client, adapters_dir / "a").status_code == 201  # a new adapter: a new scope
    assert_error(admin_client.delete(f"/api/admin/models/{BASE}/adapters/nope"), 404, "adapter_not_found")


def test_replacing_an_adapter_serves_the_new_files_in_a_new_scope_and_a_job_removes_the_old(
        admin_client, actor, deployment, adapters_dir, vllm_checkpoint, ray_cluster):  # noqa: F811
    from controlplane.adapters.models import Adapter
    from controlplane.adapters.selectors import usable
    from controlplane.jobs.services import job_execute
    from controlplane.tenants.models import Tenant

    _, acme = _tenant(actor, "acme", deployment)
    build_adapter(adapters_dir / "a", vllm_checkpoint[1], seed=1)
    build_adapter(adapters_dir / "b", vllm_checkpoint[1], seed=2)
    first = _register(admin_client, adapters_dir / "a", tenant="acme").json()
    old = usable(Tenant.objects.get(slug="acme"), "tuned")
    url = f"/api/admin/models/{BASE}/adapters/tuned"
    assert_error(admin_client.put(url, {"path": str(adapters_dir / "a")}, content_type="application/json"), 409,
                 "adapter_unchanged")
    response = admin_client.put(url, {"path": str(adapters_dir / "b"), "reason": "v2"}, content_type="application/json")
    assert response.status_code == 202, response.content
    body = response.json()
    assert body["replacement"]["name"] == "tuned" and body["replacement"]["tenant"] == "acme"
    assert body["replacement"]["digest"] != first["digest"] and body["kind"] == "adapter_delete"
    new = usable(Tenant.objects.get(slug="acme"), "tuned")  # served at once, in a scope of its own
    assert new.digest == body["replacement"]["digest"] and new.scope != old.scope
    assert [m["id"] for m in acme.get("/v1/models").json()["data"]].count("tuned") == 1
    assert [a["digest"] for a in admin_client.get(f"/api/admin/models/{BASE}/adapters").json()
            if a["state"] == "live"] == [new.digest]
    done = job_execute(job_id=body["id"], final_attempt=True)  # no replica started: nothing held anywhere
    assert done.status == "succeeded", (done.steps, done.error)
    assert Adapter.objects.get(pk=old.id).state == "deleted" and Adapter.objects.get(pk=new.id).state == "live"
    assert "adapter.replace" in audit_actions()
    assert_error(admin_client.put(f"/api/admin/models/{BASE}/adapters/nope", {"path": str(adapters_dir / "b")},
                                  content_type="application/json"), 404, "adapter_not_found")


def test_max_adapters_caps_a_tenant_s_live_private_adapters_and_public_ones_count_for_none(
        admin_client, actor, deployment, adapters_dir, vllm_checkpoint):
    _tenant(actor, "acme", deployment)
    _tenant(actor, "globex", deployment)
    assert patch(admin_client, "/api/admin/tenants/acme", {"quotas": {"max_adapters": 1}}).status_code == 200
    assert admin_client.get("/api/admin/tenants/acme").json()["quotas"]["max_adapters"] == 1
    build_adapter(adapters_dir / "a", vllm_checkpoint[1], seed=1)
    assert _register(admin_client, adapters_dir / "a", name="acme-1", tenant="acme").status_code == 201
    error = assert_error(_register(admin_client, adapters_dir / "a", name="acme-2", tenant="acme"), 409,
                         "quota_exceeded")
    assert "max_adapters" in error["message"] and "'acme'" in error["message"]
    assert audit_actions().count("adapter.create") == 1  # the refusal registered nothing
    # another tenant (no quota) and a public adapter are not acme's to count
    assert _register(admin_client, adapters_dir / "a", name="globex-1", tenant="globex").status_code == 201
    assert _register(admin_client, adapters_dir / "a", name="public-1").status_code == 201
    # a deleted adapter (its job running) no longer counts; a raised quota makes room as well
    assert admin_client.delete(f"/api/admin/models/{BASE}/adapters/acme-1").status_code == 202
    assert _register(admin_client, adapters_dir / "a", name="acme-2", tenant="acme").status_code == 201
    assert_error(_register(admin_client, adapters_dir / "a", name="acme-3", tenant="acme"), 409, "quota_exceeded")
    assert patch(admin_client, "/api/admin/tenants/acme", {"quotas": {"max_adapters": None}}).status_code == 200
    assert _register(admin_client, adapters_dir / "a", name="acme-3", tenant="acme").status_code == 201
    states = {a["name"]: a["state"] for a in admin_client.get(f"/api/admin/models/{BASE}/adapters").json()}
    assert states == {"acme-1": "deleting", "acme-2": "live", "acme-3": "live", "globex-1": "live", "public-1": "live"}
