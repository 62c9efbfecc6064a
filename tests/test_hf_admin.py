"""Checkpoint directories through /api/admin/models: created with a ``path`` and no preset (the
architecture from config.json), revisions that keep the KV layout, and 422s that say what is wrong."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.controlplane.helpers import assert_error, audit_actions, post
from tests.hf_checkpoints import build_checkpoint

pytest.importorskip("transformers")
pytestmark = pytest.mark.django_db
URL = "/api/admin/models"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("admin-ckpt")
    build_checkpoint("qwen2", root / "a", seed=1, layers=1)
    build_checkpoint("qwen2", root / "b", seed=2, layers=1)  # same layout, other weights
    build_checkpoint("qwen2", root / "deeper", seed=3, layers=2)  # another KV layout
    return root


def _create(client, path, name="qwen", label="r1", **extra):
    return post(client, URL, {"name": name, "revision": {"label": label, "path": str(path)}, **extra})


def test_checkpoint_model_takes_its_architecture_and_digest_from_the_directory(admin_client, dirs):
    from cachecore.model.hf_weights import checkpoint_digest

    response = _create(admin_client, dirs / "a")
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["preset"], body["architecture"], body["tokenizer"]) == ("", "qwen2", "hf")
    (revision,) = body["revisions"]
    assert revision["source"] == "checkpoint" and revision["path"] == str((dirs / "a").resolve())
    assert revision["digest"] == checkpoint_digest((dirs / "a").resolve())
    assert audit_actions()[-1] == "model.create"


def test_workers_get_the_recorded_digest_and_refuse_a_checkpoint_changed_since(admin_client, dirs, tmp_path):
    from cachecore.model.hf_config import CheckpointError
    from cachecore.model.loader import RevisionSpec, load_model
    from controlplane.registry.models import ModelDeployment
    from controlplane.runtime.gateway import spec_for

    shutil.copytree(dirs / "a", tmp_path / "c")
    assert _create(admin_client, tmp_path / "c", name="changing").status_code == 201
    spec = spec_for(ModelDeployment.objects.get(name="changing"))
    assert spec.revision["digest"] == ModelDeployment.objects.get(name="changing").active_revision.digest
    loaded = load_model("changing", "", RevisionSpec.from_dict(spec.revision), device="cpu")
    assert loaded.weight_digest == spec.revision["digest"]
    shutil.copy(dirs / "b" / "model.safetensors", tmp_path / "c" / "model.safetensors")  # weights swapped on disk
    with pytest.raises(CheckpointError, match="changed since revision"):
        load_model("changing", "", RevisionSpec.from_dict(spec.revision), device="cpu")


def test_revision_with_the_same_layout_is_added_and_another_layout_is_422(admin_client, dirs):
    assert _create(admin_client, dirs / "a").status_code == 201
    added = post(admin_client, f"{URL}/qwen/revisions", {"label": "r2", "path": str(dirs / "b")})
    assert added.status_code == 201, added.content
    assert added.json()["active"] is False and added.json()["path"] == str((dirs / "b").resolve())
    first = admin_client.get(f"{URL}/qwen").json()["revisions"][0]
    assert added.json()["digest"] != first["digest"]
    error = assert_error(post(admin_client, f"{URL}/qwen/revisions", {"label": "r3", "path": str(dirs / "deeper")}),
                         422, "invalid_checkpoint")
    assert "KV layout" in error["message"]
    assert [r["label"] for r in admin_client.get(f"{URL}/qwen").json()["revisions"]] == ["r1", "r2"]


def test_unsupported_architecture_is_422_naming_the_supported_ones(admin_client, dirs, tmp_path):
    path = tmp_path / "gpt2"
    shutil.copytree(dirs / "a", path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    # engine strata: on CUDA the default would hand GPT-2 to vLLM, which serves it
    error = assert_error(_create(admin_client, path, engine="strata"), 422, "invalid_checkpoint")
    assert "GPT2LMHeadModel" in error["message"] and "Qwen3ForCausalLM" in error["message"]
    assert admin_client.get(URL).json() == []


def test_missing_directory_is_422(admin_client, tmp_path):
    error = assert_error(_create(admin_client, tmp_path / "missing"), 422, "invalid_checkpoint")
    assert "not a directory" in error["message"]
    assert_error(_create(admin_client, tmp_path), 422, "invalid_checkpoint")  # no config.json


def test_preset_and_path_exclude_each_other(admin_client, dirs):
    assert_error(_create(admin_client, dirs / "a", preset="tiny"), 422)
    assert_error(post(admin_client, URL, {"name": "x", "revision": {"label": "r1", "seed": 1}}), 422)  # no preset
    assert_error(post(admin_client, URL, {"name": "x", "revision": {"label": "r1", "seed": 1,
                                                                   "path": str(dirs / "a")}}), 422)
    assert admin_client.get(URL).json() == []


def test_sources_do_not_mix_within_a_deployment(admin_client, dirs):
    # a preset model takes no checkpoint, a checkpoint model takes no seed
    assert post(admin_client, URL, {"name": "tiny-llama", "preset": "tiny",
                                    "revision": {"label": "r1", "seed": 7}}).status_code == 201
    assert_error(post(admin_client, f"{URL}/tiny-llama/revisions", {"label": "r9", "path": str(dirs / "a")}),
                 422, "invalid_revision_source")
    assert _create(admin_client, dirs / "a").status_code == 201
    assert_error(post(admin_client, f"{URL}/qwen/revisions", {"label": "r9", "seed": 4}), 422,
                 "invalid_revision_source")


def test_checkpoint_outside_the_weights_root_is_422(admin_client, dirs, settings, tmp_path):
    settings.STRATA_WEIGHTS_ROOT = tmp_path
    assert_error(_create(admin_client, dirs / "a"), 422, "invalid_checkpoint")
    inside = tmp_path / "inside"
    shutil.copytree(dirs / "a", inside)
    assert _create(admin_client, inside).status_code == 201


def test_strata_demo_serves_the_checkpoint_named_by_strata_demo_model(dirs, monkeypatch):
    import io

    from django.core.management import call_command

    from controlplane.registry.models import ModelDeployment
    from controlplane.tenants.models import Grant

    monkeypatch.setenv("STRATA_DEMO_MODEL", str(dirs / "a"))
    out = io.StringIO()
    call_command("strata_demo", stdout=out)
    deployment = ModelDeployment.objects.get(name="demo-hf")
    assert deployment.active_revision.checkpoint_path == str((dirs / "a").resolve())
    assert deployment.architecture == "qwen2" and deployment.preset == ""
    assert set(Grant.objects.filter(deployment=deployment).values_list("tenant__slug", flat=True)) == {
        "acme", "globex"}
    assert not ModelDeployment.objects.filter(name="demo-small").exists()
    assert "model='demo-hf'" in out.getvalue() and "checkpoint" in out.getvalue()


def test_console_creates_a_checkpoint_model_and_shows_its_directory(dirs, django_user_model):
    from django.test import Client

    from controlplane.registry.models import ModelDeployment

    client = Client()
    client.force_login(django_user_model.objects.create_superuser("alice", "alice@example.com", "pw-123456789"))
    response = client.post("/ui/models/", {"name": "console-qwen", "preset": "", "label": "r1",
                                           "path": str(dirs / "a")})
    assert response.status_code == 302, response.content[:500]
    deployment = ModelDeployment.objects.get(name="console-qwen")
    assert deployment.active_revision.checkpoint_path == str((dirs / "a").resolve())
    page = client.get("/ui/models/").content.decode()
    assert str((dirs / "a").resolve()) in page and "qwen2 · checkpoint" in page
    bad = client.post("/ui/models/", {"name": "other", "preset": "", "label": "r1", "path": "/nowhere"})
    assert bad.status_code == 422 and "not a directory" in bad.content.decode()
    both = client.post("/ui/models/console-qwen/revisions/", {"label": "r2", "seed": "1", "path": str(dirs / "b")})
    assert both.status_code == 422 and "only one of" in both.content.decode()
    assert not ModelDeployment.objects.filter(name="other").exists()


def test_web_tokenizer_and_template_follow_the_active_revision(dirs, tmp_path, actor):
    from controlplane.registry import services
    from controlplane.registry.models import ModelDeployment
    from controlplane.serving.model_facts import model_facts

    deployment = services.model_create(actor=actor, name="facts", preset="", revision={"label": "r1",
                                                                                         "path": str(dirs / "a")})
    first = model_facts(deployment)
    assert first is model_facts(deployment)  # cached for the revision
    assert first.max_seq_len == 512 and first.vocab_size == first.tokenizer.vocab_size
    edited = tmp_path / "edited"
    shutil.copytree(dirs / "a", edited)
    template = edited / "chat_template.jinja"
    template.write_text(template.read_text().replace("<|im_start|>assistant\n", "<|im_start|>assistant\n\n"))
    revision = services.revision_create(actor=actor, deployment=deployment, label="r2", path=str(edited))
    services.model_activate_revision(actor=actor, deployment=deployment, revision=revision)
    second = model_facts(ModelDeployment.objects.get(name="facts"))
    assert revision.digest == deployment.revisions.get(label="r1").digest  # same weights
    assert second.chat.digest != first.chat.digest
    messages = [{"role": "user", "content": "Hello world!"}]
    assert second.chat.render(messages) != first.chat.render(messages)
