"""Model deployments and revisions through /api/admin/models."""

import hashlib

import pytest

from tests.controlplane.helpers import assert_error, audit_actions, post

pytestmark = pytest.mark.django_db
URL = "/api/admin/models"


def seeded(name, label, seed, preset="tiny"):
    from cachecore.model.config import preset as preset_config
    from cachecore.model.weights import seeded_digest

    return seeded_digest(preset_config(preset), model_name=name, revision_label=label, seed=seed)


def test_create_seeded_model_201_with_active_revision_and_cachecore_digest(admin_client):
    response = post(admin_client, URL, {"name": "m1", "preset": "tiny", "revision": {"label": "v1", "seed": 3}})
    assert response.status_code == 201
    body = response.json()
    assert body["active_revision"] == "v1" and body["architecture"] == "llama"
    (revision,) = body["revisions"]
    assert revision["active"] and revision["source"] == "seed" and revision["seed"] == 3
    assert revision["digest"] == seeded("m1", "v1", 3)
    assert [m["name"] for m in admin_client.get(URL).json()] == ["m1"]
    assert audit_actions()[-1] == "model.create"


def test_digest_changes_with_seed_label_and_model_name(admin_client):
    assert seeded("m", "v1", 1) != seeded("m", "v1", 2)
    assert seeded("m", "v1", 1) != seeded("m", "v2", 1)
    assert seeded("m", "v1", 1) != seeded("n", "v1", 1)
    assert seeded("m", "v1", 1) == seeded("m", "v1", 1)


def test_new_revision_is_added_inactive_with_its_own_digest(admin_client, model):
    response = post(admin_client, f"{URL}/tiny-llama/revisions", {"label": "r2", "seed": 8})
    assert response.status_code == 201
    body = response.json()
    assert body["label"] == "r2" and body["active"] is False
    assert body["digest"] == seeded("tiny-llama", "r2", 8) != seeded("tiny-llama", "r1", 7)
    detail = admin_client.get(f"{URL}/tiny-llama").json()
    assert detail["active_revision"] == "r1" and [r["label"] for r in detail["revisions"]] == ["r1", "r2"]
    assert audit_actions()[-1] == "revision.create"


def test_file_revision_digest_is_sha256_of_the_file(admin_client, model, tmp_path):
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"\x00not-really-safetensors" * 1000)
    response = post(admin_client, f"{URL}/tiny-llama/revisions", {"label": "file1", "weights_path": str(weights)})
    assert response.status_code == 201
    body = response.json()
    assert body["digest"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert body["source"] == "file" and body["seed"] is None


def test_missing_weights_file_is_422(admin_client, model, tmp_path):
    response = post(admin_client, f"{URL}/tiny-llama/revisions", {"label": "x", "weights_path": str(tmp_path / "no")})
    assert_error(response, 422, "invalid_weights_path")


def test_weights_outside_the_configured_root_are_refused(admin_client, model, tmp_path, settings):
    inside, outside = tmp_path / "root", tmp_path / "elsewhere.bin"
    inside.mkdir()
    outside.write_bytes(b"x")
    settings.STRATA_WEIGHTS_ROOT = inside.resolve()
    response = post(admin_client, f"{URL}/tiny-llama/revisions", {"label": "x", "weights_path": str(outside)})
    assert_error(response, 422, "invalid_weights_path")
    (inside / "ok.bin").write_bytes(b"y")
    ok = post(admin_client, f"{URL}/tiny-llama/revisions", {"label": "y", "weights_path": str(inside / "ok.bin")})
    assert ok.status_code == 201


def test_unknown_preset_is_422_and_creates_nothing(admin_client):
    response = post(admin_client, URL, {"name": "m1", "preset": "huge", "revision": {"label": "v1", "seed": 1}})
    assert_error(response, 422, "unknown_preset")
    assert admin_client.get(URL).json() == []


@pytest.mark.parametrize("revision", [
    {"label": "v1"},
    {"label": "v1", "seed": 1, "weights_path": "/x"},
    {"label": "v1", "seed": "1"},
    {"label": "v1", "seed": -1},
    {"label": "bad label", "seed": 1},
])
def test_revision_needs_exactly_one_valid_weights_source(admin_client, revision):
    assert_error(post(admin_client, URL, {"name": "m1", "preset": "tiny", "revision": revision}), 422)
    assert admin_client.get(URL).json() == []


def test_duplicate_model_name_and_revision_label_are_409(admin_client, model):
    dup = post(admin_client, URL, {"name": "tiny-llama", "preset": "tiny", "revision": {"label": "a", "seed": 1}})
    assert_error(dup, 409)
    assert_error(post(admin_client, f"{URL}/tiny-llama/revisions", {"label": "r1", "seed": 9}), 409)


def test_unknown_model_is_404(admin_client):
    assert_error(admin_client.get(f"{URL}/nope"), 404, "model_not_found")
    assert_error(post(admin_client, f"{URL}/nope/revisions", {"label": "r", "seed": 1}), 404)


def test_activate_revision_switches_atomically_and_audits(model, actor):
    from controlplane.registry.selectors import model_get, revision_get
    from controlplane.registry.services import model_activate_revision, revision_create

    revision_create(actor=actor, deployment=model, label="r2", seed=9)
    model_activate_revision(actor=actor, deployment=model, revision=revision_get(deployment=model, label="r2"))
    assert model_get(name="tiny-llama").active_revision.label == "r2"
    assert audit_actions()[-1] == "model.activate"
    model_activate_revision(actor=actor, deployment=model, revision=revision_get(deployment=model, label="r2"))
    assert audit_actions().count("model.activate") == 1
