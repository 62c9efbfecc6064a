"""Every error under /api/ and /v1/ is JSON {"error": {"message", "type", "code"}} with a precise status."""

import json

import pytest

from tests.controlplane.helpers import JSON, assert_error, post

pytestmark = pytest.mark.django_db
URL = "/api/admin/tenants"


def test_invalid_json_body_is_400_invalid_json(admin_client):
    response = admin_client.post(URL, data="{not json", content_type=JSON)
    assert_error(response, 400, "invalid_json")


def test_wrong_types_are_422_naming_the_field(admin_client):
    error = assert_error(post(admin_client, URL, {"slug": 12, "name": "x"}), 422, "validation_error")
    assert error["param"] == "slug" and "slug" in error["message"]


def test_missing_body_is_422(admin_client):
    assert_error(admin_client.post(URL, content_type=JSON), 422)


def test_body_over_the_admin_limit_is_413_before_parsing(admin_client, settings):
    settings.STRATA_ADMIN_MAX_BODY_BYTES = 1024
    big = json.dumps({"slug": "big", "name": "x" * 5000})
    assert_error(admin_client.post(URL, data=big, content_type=JSON), 413, "request_too_large")
    assert admin_client.get(URL).json() == []
    small = post(admin_client, URL, {"slug": "small", "name": "x"})
    assert small.status_code == 201


def test_body_over_djangos_upload_limit_is_413_not_400(admin_client, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 100
    settings.STRATA_ADMIN_MAX_BODY_BYTES = 10_000
    response = admin_client.post(URL, data=json.dumps({"slug": "s", "name": "y" * 500}), content_type=JSON)
    assert_error(response, 413)


def test_unknown_paths_under_api_and_v1_are_json_404(admin_client):
    assert_error(admin_client.get("/api/admin/no-such-thing"), 404)
    assert_error(admin_client.get("/api/nothing-here"), 404)
    assert_error(admin_client.get("/v1/no-such-endpoint-xyz"), 404)


def test_wrong_method_is_json_405(admin_client):
    assert_error(admin_client.put(URL, data="{}", content_type=JSON), 405)


def test_unexpected_exception_is_json_500_without_trace(admin_client, monkeypatch):
    from controlplane.adminapi import tenants

    def boom(**kwargs):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(tenants.selectors, "tenant_list", boom)
    response = admin_client.get(URL)
    error = assert_error(response, 500, "internal_error")
    assert "secret internal detail" not in response.content.decode() and error["type"] == "server_error"


def test_non_api_paths_keep_djangos_html_404(client):
    response = client.get("/no-such-page")
    assert response.status_code == 404
    assert not response["Content-Type"].startswith("application/json")


def test_error_response_helper_shape_and_headers():
    from controlplane.common.errors import error_response

    response = error_response(429, "slow down", "rate_limit_error", "rate_limited", headers={"Retry-After": "3"})
    assert response.status_code == 429 and response["Retry-After"] == "3"
    assert json.loads(response.content) == {
        "error": {"message": "slow down", "type": "rate_limit_error", "code": "rate_limited"}}
    defaults = json.loads(error_response(404, "gone").content)["error"]
    assert defaults == {"message": "gone", "type": "not_found_error", "code": "not_found"}


def test_openapi_document_is_valid_json_listing_every_admin_path(admin_client):
    response = admin_client.get("/api/admin/openapi.json")  # operators only: see test_exposure.py
    assert response.status_code == 200
    paths = response.json()["paths"]
    for expected in [
        "/api/admin/tenants", "/api/admin/tenants/{slug}", "/api/admin/tenants/{slug}/keys",
        "/api/admin/tenants/{slug}/keys/{key_id}", "/api/admin/tenants/{slug}/grants",
        "/api/admin/tenants/{slug}/grants/{model}", "/api/admin/models", "/api/admin/models/{name}",
        "/api/admin/models/{name}/revisions", "/api/admin/audit", "/api/admin/audit/verify",
        "/api/admin/share-groups", "/api/admin/share-groups/{slug}/members",
    ]:
        assert expected in paths, expected
    assert set(paths["/api/admin/tenants/{slug}"]) >= {"get", "patch", "delete"}
    assert response.json()["components"]["securitySchemes"]["OperatorAuth"]["scheme"] == "bearer"


def test_healthz_is_up_and_readyz_checks_database_and_broker(client, admin_client, monkeypatch):
    from controlplane import runtime

    monkeypatch.setattr(runtime, "workers_ready", lambda: True)  # workers: up
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = admin_client.get("/readyz")  # the per-check detail is for operators (test_exposure.py)
    body = ready.json()
    assert ready.status_code == 200, body
    assert body["checks"]["database"]["ok"] is True and body["checks"]["broker"]["ok"] is True
    assert "workers" in body["checks"]


def test_readyz_is_503_with_retry_after_when_broker_is_down(admin_client, settings):
    settings.CELERY_BROKER_URL = "redis://127.0.0.1:1/0"
    response = admin_client.get("/readyz")
    assert response.status_code == 503 and response["Retry-After"]
    body = response.json()
    assert body["checks"]["broker"]["ok"] is False and body["checks"]["database"]["ok"] is True
    assert body["error"]["code"] == "not_ready" and "broker" in body["error"]["message"]


def test_readyz_reports_workers_from_the_runtime(admin_client, monkeypatch):
    from controlplane import runtime

    monkeypatch.setattr(runtime, "workers_ready", lambda: False)
    response = admin_client.get("/readyz")
    assert response.status_code == 503 and response.json()["checks"]["workers"]["ok"] is False
    monkeypatch.setattr(runtime, "workers_ready", lambda: {"ok": True, "workers": 2})
    response = admin_client.get("/readyz")
    assert response.status_code == 200 and response.json()["checks"]["workers"] == {"ok": True, "workers": 2}


def _drop_the_database_connection(**kwargs):
    from django.db import OperationalError

    raise OperationalError("terminating connection due to administrator command")  # pg_terminate_backend


def test_a_dropped_database_connection_is_503_with_retry_after_not_500(admin_client, monkeypatch):
    from controlplane.adminapi import tenants

    monkeypatch.setattr(tenants.selectors, "tenant_list", _drop_the_database_connection)
    response = admin_client.get(URL)
    assert_error(response, 503, "database_unavailable")
    assert response["Retry-After"] == "2" and "administrator command" not in response.content.decode()


def test_a_console_page_whose_database_dropped_is_503_not_500(monkeypatch):
    from django.contrib.auth import get_user_model
    from django.test import Client

    from controlplane.ui import tenant_views

    user = get_user_model().objects.create_superuser("ops", "ops@example.com", "pw-long-enough-1")
    client = Client()
    client.force_login(user)
    monkeypatch.setattr(tenant_views, "_list_page", lambda *a, **k: _drop_the_database_connection())
    response = client.get("/ui/tenants/")
    assert response.status_code == 503 and response["Retry-After"] == "2"
    assert "administrator command" not in response.content.decode()
