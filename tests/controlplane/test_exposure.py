"""What anonymous callers may learn: /readyz says only ok / not ok (details for operators), and the
admin API's OpenAPI document and docs page are for operators only (token or staff session)."""

import pytest
from django.test import Client

from tests.controlplane.helpers import assert_error

pytestmark = pytest.mark.django_db
OPENAPI = "/api/admin/openapi.json"
DOCS = "/api/admin/docs"
PASSWORD = "correct horse battery staple"


@pytest.fixture
def workers_up(monkeypatch):
    from controlplane import runtime

    monkeypatch.setattr(runtime, "workers_ready", lambda: {"ok": True, "workers": 3})


@pytest.fixture
def broker_down(settings):
    settings.CELERY_BROKER_URL = "redis://127.0.0.1:1/0"


@pytest.fixture
def staff_session(django_user_model) -> Client:
    client = Client()
    client.force_login(django_user_model.objects.create_user("stella", "s@example.com", PASSWORD, is_staff=True))
    return client


@pytest.fixture
def plain_session(django_user_model) -> Client:
    client = Client()
    client.force_login(django_user_model.objects.create_user("paul", "p@example.com", PASSWORD))
    return client


def bad_token_client() -> Client:
    return Client(headers={"Authorization": "Bearer st-op-not-a-real-token"})


# ------------------------------------------------------------------ /readyz
def test_readyz_tells_anonymous_callers_only_ok(client, workers_up):
    response = client.get("/readyz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_readyz_tells_anonymous_callers_only_not_ok_with_retry_after(client, broker_down, workers_up):
    response = client.get("/readyz")
    error = assert_error(response, 503, "not_ready")
    assert response["Retry-After"] == "5"
    assert set(response.json()) == {"status", "error"} and response.json()["status"] == "unavailable"
    assert "broker" not in error["message"]  # which dependency failed is an operator's detail


@pytest.mark.parametrize("caller", ["admin_client", "viewer_client", "staff_session"])
def test_readyz_shows_operators_the_per_check_detail(request, caller, workers_up):
    response = request.getfixturevalue(caller).get("/readyz")
    body = response.json()
    assert response.status_code == 200, body
    assert body["status"] == "ok"
    assert body["checks"]["database"]["ok"] is True and body["checks"]["broker"]["ok"] is True
    assert body["checks"]["workers"] == {"ok": True, "workers": 3}


def test_readyz_names_the_failing_check_to_operators(admin_client, broker_down, workers_up):
    response = admin_client.get("/readyz")
    error = assert_error(response, 503, "not_ready")
    assert response["Retry-After"] == "5" and "broker" in error["message"]
    assert response.json()["checks"]["broker"]["ok"] is False


@pytest.mark.parametrize("caller", ["bad_token", "plain_session"])
def test_readyz_treats_bad_tokens_and_non_staff_sessions_as_anonymous(request, caller, broker_down, workers_up):
    client = bad_token_client() if caller == "bad_token" else request.getfixturevalue(caller)
    response = client.get("/readyz")
    assert response.status_code == 503 and set(response.json()) == {"status", "error"}


def test_readyz_answers_vary_by_credentials_and_are_not_cached(client, workers_up):
    response = client.get("/readyz")
    assert {"Authorization", "Cookie"} <= {v.strip() for v in response["Vary"].split(",")}
    assert response["Cache-Control"] == "no-store"


# ------------------------------------------------------------------ OpenAPI document and docs page
@pytest.mark.parametrize("caller", ["anonymous", "bad_token", "plain_session"])
def test_openapi_document_is_401_json_without_operator_credentials(request, client, caller):
    who = {"anonymous": client, "bad_token": bad_token_client()}.get(caller) or request.getfixturevalue(caller)
    response = who.get(OPENAPI)
    assert_error(response, 401)
    assert response["WWW-Authenticate"] == "Bearer"
    assert b"paths" not in response.content


@pytest.mark.parametrize("caller", ["admin_client", "viewer_client", "staff_session"])
def test_openapi_document_is_served_to_operators(request, caller):
    response = request.getfixturevalue(caller).get(OPENAPI)
    assert response.status_code == 200
    assert "/api/admin/tenants" in response.json()["paths"]


def test_docs_page_sends_an_anonymous_browser_to_the_login_page(client):
    response = client.get(DOCS)
    assert response.status_code == 302
    assert response["Location"] == f"/ui/login/?next={DOCS}"
    assert b"swagger" not in response.content.lower()


def test_docs_page_is_401_json_for_a_bad_token_or_a_non_staff_session(plain_session):
    assert_error(bad_token_client().get(DOCS), 401)
    response = plain_session.get(DOCS)
    assert response.status_code in (302, 401) and b"swagger" not in response.content.lower()


@pytest.mark.parametrize("caller", ["admin_client", "staff_session"])
def test_docs_page_is_served_to_operators_from_local_assets(request, caller):
    client = request.getfixturevalue(caller)
    response = client.get(DOCS)
    assert response.status_code == 200
    page = response.content.decode()
    assert "swagger-ui-bundle.js" in page and "/static/ninja/" in page
    assert "cdn" not in page.lower()  # no third-party script on an operator page
    assert client.get("/static/ninja/swagger-ui-bundle.js").status_code == 200


def test_the_docs_show_the_bearer_header_with_a_placeholder(admin_client):
    """The docs page renders the description as Markdown, where a bare ``<operator token>`` is an
    unknown HTML tag that is dropped ("Authorization: Bearer ,"): it must sit in a code span."""
    description = admin_client.get(OPENAPI).json()["info"]["description"]
    assert "`Authorization: Bearer <operator token>`" in description
    outside_code = "".join(description.split("`")[::2])
    assert "<" not in outside_code and "Bearer ," not in description


def test_the_docs_list_each_operation_once_under_one_tag(admin_client):
    doc = admin_client.get(OPENAPI).json()
    ops = [(path, method, op.get("tags", [])) for path, item in doc["paths"].items() for method, op in item.items()]
    assert all(len(tags) == 1 for _, _, tags in ops), [o for o in ops if len(o[2]) != 1]
    data_keys = [o for o in ops if "/data-keys" in o[0]]
    assert data_keys and {o[2][0] for o in data_keys} == {"data keys"}
    ids = [op["operationId"] for item in doc["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids))
