"""A deployment's replica count through /api/admin/models and the console's model page: validated
(1..16, 422 otherwise), audited, and applied to the cluster only once committed (the gateway's
``apply_scale`` is replaced here: the real one starts and drains Ray actors)."""

import pytest

from tests.controlplane.helpers import assert_error, audit_events, patch, post

pytestmark = pytest.mark.django_db
URL = "/api/admin/models"


@pytest.fixture(autouse=True)
def own_head_log(settings, tmp_path):
    """These tests run on-commit callbacks inside a test transaction that is then rolled back: the
    audit head they append must not land in the suite's head log (a later verify would find the
    database's chain behind it, as after a truncation)."""
    settings.STRATA_AUDIT_HEAD_LOG = str(tmp_path / "audit-head.log")


@pytest.fixture
def scaled(monkeypatch):
    """Record the specs ``apply_scale`` is called with instead of touching Ray."""
    from controlplane.runtime import gateway

    calls = []
    monkeypatch.setattr(gateway, "apply_scale", lambda spec, **kw: calls.append(spec))
    return calls


def test_create_takes_replicas_and_reports_them(admin_client, scaled, django_capture_on_commit_callbacks):
    body = {"name": "m2", "preset": "tiny", "revision": {"label": "v1", "seed": 3}, "replicas": 3}
    with django_capture_on_commit_callbacks(execute=True):
        response = post(admin_client, URL, body)
    assert response.status_code == 201 and response.json()["replicas"] == 3
    assert [(s.deployment, s.replicas) for s in scaled] == [("m2", 3)]
    with django_capture_on_commit_callbacks(execute=True):
        default = post(admin_client, URL, {"name": "m1", "preset": "tiny", "revision": {"label": "v1", "seed": 3}})
    assert default.json()["replicas"] == 1 and len(scaled) == 1  # the default needs no scaling


@pytest.mark.parametrize("replicas", [17, -1, "two", 2.5, None, True])  # 0 stops: test_model_stop_start
def test_replica_counts_outside_0_to_16_are_422_and_change_nothing(admin_client, model, scaled, replicas):
    assert_error(patch(admin_client, f"{URL}/tiny-llama", {"replicas": replicas}), 422)
    assert_error(post(admin_client, URL, {"name": "m3", "preset": "tiny", "revision": {"label": "v1", "seed": 1},
                                          "replicas": replicas}), 422)
    assert admin_client.get(f"{URL}/tiny-llama").json()["replicas"] == 1
    assert admin_client.get(f"{URL}/m3").status_code == 404
    assert scaled == [] and audit_events("model.scale") == []


def test_patch_scales_audits_and_applies_after_commit(admin_client, model, scaled,
                                                      django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = patch(admin_client, f"{URL}/tiny-llama", {"replicas": 4, "reason": "more traffic"})
        assert scaled == []  # nothing touches the cluster before the transaction commits
    assert response.status_code == 200 and response.json()["replicas"] == 4
    for callback in callbacks:
        callback()
    assert [(s.deployment, s.replicas, s.revision["label"]) for s in scaled] == [("tiny-llama", 4, "r1")]
    (event,) = audit_events("model.scale")
    assert (event.old_value, event.new_value, event.reason) == ({"replicas": 1}, {"replicas": 4}, "more traffic")
    with django_capture_on_commit_callbacks(execute=True):
        again = patch(admin_client, f"{URL}/tiny-llama", {"replicas": 4})
    assert again.status_code == 200 and len(audit_events("model.scale")) == 1 and len(scaled) == 1


def test_viewers_cannot_scale_and_unknown_models_are_404(viewer_client, admin_client, model, scaled):
    assert patch(viewer_client, f"{URL}/tiny-llama", {"replicas": 2}).status_code == 403
    assert_error(patch(admin_client, f"{URL}/nope", {"replicas": 2}), 404)
    assert_error(patch(admin_client, f"{URL}/tiny-llama", {"replicas": 2, "extra": 1}), 422)
    assert scaled == [] and admin_client.get(f"{URL}/tiny-llama").json()["replicas"] == 1


def test_the_model_page_shows_and_changes_the_replica_count(client, model, scaled, django_capture_on_commit_callbacks):
    from django.contrib.auth import get_user_model

    admin = get_user_model().objects.create_superuser("root", "root@example.com", "pw-long-enough-123")
    client.force_login(admin)
    page = client.get("/ui/models/").content.decode()
    assert "1 replica<" in page and 'name="replicas"' in page
    bad = client.post("/ui/models/tiny-llama/replicas/", {"replicas": "17"})
    assert bad.status_code == 422 and scaled == []
    with django_capture_on_commit_callbacks(execute=True):
        ok = client.post("/ui/models/tiny-llama/replicas/", {"replicas": "2", "reason": "load"})
    assert ok.status_code == 302 and [s.replicas for s in scaled] == [2]
    assert "2 replicas<" in client.get("/ui/models/").content.decode()
