"""Tenant pages of the operator UI through Django's test client: the list (search, create) and a
tenant's page (quotas and cache policy, API keys shown once, grants, share groups, data keys,
offboarding). For every form: success through the services (audited with the operator's name and
source, as through the admin API), a validation error shown next to its field, a viewer refused
(403, audited)."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.django_db

OPERATOR = ("alice", "session", "127.0.0.1")


def _html(response) -> str:
    html = response.content.decode()
    assert response.status_code < 500 and "Traceback" not in html
    return html


def _audit(action: str):
    from controlplane.audit.models import AuditEvent

    return list(AuditEvent.objects.filter(action=action).order_by("seq"))


def _by_operator(action: str, count: int = 1):
    events = _audit(action)
    assert len(events) == count, (action, events)
    assert all((e.actor, e.auth_method, e.source) == OPERATOR for e in events)
    return events[-1]


def _field_errors(html: str, name: str, form: str = "id") -> list[str]:
    """The errors rendered inside the field block of ``form``'s input ``name`` (next to it); ``form``
    is the form's id prefix on the tenant page (``settings``, ``key``, ``grant``...)."""
    for block in re.findall(r'<div class="field[^"]*">(.*?)</div>', html, re.S):
        if re.search(rf'id="{re.escape(form)}_{re.escape(name)}"', block):
            return [re.sub(r"\s+", " ", e).strip() for e in re.findall(r'<small class="error"[^>]*>(.*?)</small>',
                                                                         block, re.S)]
    raise AssertionError(f"no field {name!r} on the page")


def _form_errors(html: str) -> list[str]:
    block = re.search(r'<div class="form-errors"[^>]*>(.*?)</div>', html, re.S)
    return re.findall(r'<p class="msg msg-error">(.*?)</p>', block.group(1), re.S) if block else []


def _location(response) -> str:
    assert response.status_code == 302, (response.status_code, response.content[:500])
    return response["Location"]


def _job_id(response) -> int:
    match = re.fullmatch(r"/ui/jobs/(\d+)/", _location(response))
    assert match, response["Location"]
    return int(match.group(1))


def _settings(tenant, **changes) -> dict:
    data = {"name": tenant.name, "retention_seconds": str(tenant.retention_seconds), "reason": ""}
    data.update({k: "" if v is None else str(v) for k, v in tenant.quotas.items()})
    if tenant.persist_kv:
        data["persist"] = "on"
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = str(value)
    return data


def _key_form(client, slug: str) -> dict:
    html = _html(client.get(f"/ui/tenants/{slug}/"))
    once = re.search(r'name="once" value="([^"]+)"', html).group(1)
    return {"once": once, "name": "production"}


# ---------------------------------------------------------------------- list, search, create
def test_tenant_list_searches_by_slug_or_name_and_status(admin_ui, tenant, actor):
    from controlplane.tenants.services import tenant_create, tenant_update

    other = tenant_create(actor=actor, slug="globex", name="Globex Industries")
    tenant_update(actor=actor, tenant=other, status="suspended")
    page = _html(admin_ui.get("/ui/tenants/"))
    assert 'href="/ui/tenants/acme/"' in page and 'href="/ui/tenants/globex/"' in page
    assert "Create tenant" in page and 'role="search"' in page
    by_name = _html(admin_ui.get("/ui/tenants/?q=industries"))
    assert 'href="/ui/tenants/globex/"' in by_name and 'href="/ui/tenants/acme/"' not in by_name
    assert 'value="industries"' in by_name
    by_slug = _html(admin_ui.get("/ui/tenants/?q=ACM"))
    assert 'href="/ui/tenants/acme/"' in by_slug and 'href="/ui/tenants/globex/"' not in by_slug
    suspended = _html(admin_ui.get("/ui/tenants/?status=suspended"))
    assert 'href="/ui/tenants/globex/"' in suspended and 'href="/ui/tenants/acme/"' not in suspended
    assert "No tenant matches." in _html(admin_ui.get("/ui/tenants/?q=nobody"))
    assert 'href="/ui/tenants/acme/"' in _html(admin_ui.get("/ui/tenants/?status=bogus"))  # ignored


def test_admin_creates_a_tenant_with_quotas_and_cache_policy(admin_ui):
    from controlplane.tenants.models import Tenant

    response = admin_ui.post("/ui/tenants/", {
        "slug": "initech", "name": "Initech", "requests_per_minute": "60", "tokens_per_minute": "",
        "max_cached_tokens": "100000", "max_prompt_tokens": "4096", "max_l3_bytes": "1048576",
        "max_inflight_tokens": "2048", "max_concurrent_requests": "4", "share_weight": "2",
        "retention_seconds": "3600",
    })  # persist unchecked
    assert _location(response) == "/ui/tenants/initech/"
    tenant = Tenant.objects.get(slug="initech")
    assert tenant.quotas == {"requests_per_minute": 60, "tokens_per_minute": None, "max_cached_tokens": 100000,
                             "max_prompt_tokens": 4096, "max_l3_bytes": 1048576, "max_inflight_tokens": 2048,
                             "max_concurrent_requests": 4, "share_weight": 2,
                             "max_pinned_tokens": None, "max_adapters": None}
    assert tenant.cache_policy == {"persist": False, "retention_seconds": 3600}
    assert _by_operator("tenant.create").new_value["quotas"]["requests_per_minute"] == 60
    assert _by_operator("tenant.cache_policy").new_value == {"persist": False, "retention_seconds": 3600}
    page = _html(admin_ui.get("/ui/tenants/initech/"))
    assert "Created tenant initech." in page and "Initech" in page


def test_creating_with_the_default_cache_policy_records_only_the_creation(admin_ui):
    response = admin_ui.post("/ui/tenants/", {"slug": "plain", "name": "Plain", "persist": "on",
                                              "retention_seconds": "86400"})
    assert _location(response) == "/ui/tenants/plain/"
    _by_operator("tenant.create")
    assert _audit("tenant.cache_policy") == []


@pytest.mark.parametrize(("data", "status", "field", "message"), [
    ({"slug": "Not A Slug"}, 422, "slug", "use 1-63 characters"),
    ({"slug": "-acme"}, 422, "slug", "use 1-63 characters"),
    ({"name": ""}, 422, "name", "This field is required"),
    ({"requests_per_minute": "-1"}, 422, "requests_per_minute", "greater than or equal to 0"),
    ({"max_prompt_tokens": str(2**31)}, 422, "max_prompt_tokens", "less than or equal to"),
    ({"tokens_per_minute": "lots"}, 422, "tokens_per_minute", "Enter a whole number"),
    ({"retention_seconds": "31536001"}, 422, "retention_seconds", "less than or equal to 31536000"),
    ({"retention_seconds": ""}, 422, "retention_seconds", "This field is required"),
    ({"slug": "acme"}, 409, "slug", "tenant &#x27;acme&#x27; already exists"),
])
def test_bad_new_tenants_show_the_error_next_to_the_field(admin_ui, tenant, data, status, field, message):
    from controlplane.tenants.models import Tenant

    posted = {"slug": "newco", "name": "New Co", "retention_seconds": "86400", **data}
    response = admin_ui.post("/ui/tenants/", posted)
    html = _html(response)
    assert response.status_code == status
    assert any(message in e for e in _field_errors(html, field)), _field_errors(html, field)
    assert "<details class=\"card create-tenant\" open>" in html  # the form is open with the input kept
    if posted["name"]:
        assert f'value="{posted["name"]}"' in html
    assert set(Tenant.objects.values_list("slug", flat=True)) == {"acme"}
    assert [e.target for e in _audit("tenant.create")] == ["acme"]


# ---------------------------------------------------------------------- the tenant page
def test_tenant_page_shows_everything_and_no_secrets(admin_ui, tenant, model, actor):
    from controlplane.registry.selectors import model_get
    from controlplane.tenants.access import grant_create
    from controlplane.tenants.datakeys import data_key_rotate
    from controlplane.tenants.selectors import tenant_scope_fingerprint
    from controlplane.tenants.services import api_key_create, api_key_revoke

    key, raw = api_key_create(actor=actor, tenant=tenant, name="ci")
    old, old_raw = api_key_create(actor=actor, tenant=tenant)
    api_key_revoke(actor=actor, api_key=old)
    grant_create(actor=actor, tenant=tenant, deployment=model_get(name="tiny-llama"))
    data_key_rotate(actor=actor, tenant=tenant)
    html = _html(admin_ui.get("/ui/tenants/acme/"))
    assert "Acme Corp" in html and tenant_scope_fingerprint(tenant) in html
    assert key.prefix in html and old.prefix in html and ">ci<" in html and "revoked" in html
    assert "<code>tiny-llama</code>" in html and "v1" in html and "active" in html
    assert 'name="requests_per_minute"' in html and 'value="600"' in html
    assert "key.create" in html and "grant.create" in html and "data_key.rotate" in html  # its audit events
    assert 'href="/ui/audit/?tenant=acme"' in html
    for secret in (bytes(tenant.scope_salt).hex(), raw, old_raw, key.key_hash):
        assert secret not in html
    for control in ("Save", "Create API key", "Rotate data key", "Offboard acme…", "Suspend acme",
                    f"/ui/tenants/acme/keys/{key.pk}/revoke/", "/ui/tenants/acme/data-keys/1/shred/",
                    "/ui/tenants/acme/grants/tiny-llama/remove/", "Create and join"):
        assert control in html, control
    assert f"/ui/tenants/acme/keys/{old.pk}/revoke/" not in html  # revoked: nothing to revoke


def test_tenant_page_lists_the_tenants_jobs(admin_ui, tenant, model, actor):
    from controlplane.jobs.services import flush_job_request

    mine = flush_job_request(actor=actor, scope="tenant", tenant="acme", reason="erasure request")
    other = flush_job_request(actor=actor, scope="model", model="tiny-llama", reason="refresh")
    html = _html(admin_ui.get("/ui/tenants/acme/"))
    assert f'href="/ui/jobs/{mine.pk}/"' in html and "erasure request" in html
    assert f'href="/ui/jobs/{other.pk}/"' not in html


def test_unknown_tenant_is_a_friendly_404(admin_ui):
    for url in ("/ui/tenants/nobody/", "/ui/tenants/nobody/offboard/", "/ui/tenants/nobody/keys/1/revoke/"):
        response = admin_ui.get(url)
        assert response.status_code == 404 and "not found" in _html(response), url


def test_anonymous_visitors_go_to_the_login_page(client, tenant):
    response = client.get("/ui/tenants/acme/")
    assert response.status_code == 302 and response["Location"] == "/ui/login/?next=/ui/tenants/acme/"


def test_suspend_and_reactivate_from_the_tenant_page(admin_ui, tenant):
    page = _html(admin_ui.get("/ui/tenants/acme/"))
    assert 'action="/ui/tenants/acme/status/"' in page
    admin_ui.post("/ui/tenants/acme/status/", {"status": "suspended", "reason": "unpaid"})
    tenant.refresh_from_db()
    assert tenant.status == "suspended" and _by_operator("tenant.suspend").reason == "unpaid"
    assert "Reactivate acme" in _html(admin_ui.get("/ui/tenants/acme/"))


# ---------------------------------------------------------------------- quotas and cache policy
def test_admin_edits_quotas_and_cache_policy(admin_ui, tenant):
    data = _settings(tenant, requests_per_minute="", tokens_per_minute=5000, max_l3_bytes=0, persist=None,
                     retention_seconds=600, reason="contract v2")
    assert _location(admin_ui.post("/ui/tenants/acme/settings/", data)) == "/ui/tenants/acme/"
    tenant.refresh_from_db()
    assert tenant.requests_per_minute is None and tenant.tokens_per_minute == 5000 and tenant.max_l3_bytes == 0
    assert tenant.cache_policy == {"persist": False, "retention_seconds": 600}
    quotas = _by_operator("tenant.quotas")
    assert quotas.old_value == {"requests_per_minute": 600, "tokens_per_minute": None, "max_l3_bytes": None}
    assert quotas.new_value == {"requests_per_minute": None, "tokens_per_minute": 5000, "max_l3_bytes": 0}
    assert quotas.reason == "contract v2"
    assert _by_operator("tenant.cache_policy").new_value == {"persist": False, "retention_seconds": 600}
    assert _audit("tenant.update") == []  # the name did not change
    assert "Saved the quotas and cache policy of acme." in _html(admin_ui.get("/ui/tenants/acme/"))
    assert _location(admin_ui.post("/ui/tenants/acme/settings/", _settings(tenant))) == "/ui/tenants/acme/"
    assert "Nothing changed." in _html(admin_ui.get("/ui/tenants/acme/"))
    assert len(_audit("tenant.quotas")) == 1


@pytest.mark.parametrize(("change", "field", "message"), [
    ({"name": ""}, "name", "This field is required"),
    ({"name": "x" * 201}, "name", "at most 200 characters"),
    ({"max_cached_tokens": "-5"}, "max_cached_tokens", "greater than or equal to 0"),
    ({"max_concurrent_requests": "1.5"}, "max_concurrent_requests", "Enter a whole number"),
    ({"retention_seconds": "-1"}, "retention_seconds", "greater than or equal to 0"),
    ({"reason": "r" * 1001}, "reason", "at most 1000 characters"),
])
def test_bad_settings_show_the_error_next_to_the_field(admin_ui, tenant, change, field, message):
    response = admin_ui.post("/ui/tenants/acme/settings/", _settings(tenant, **change))
    html = _html(response)
    assert response.status_code == 422
    assert any(message in e for e in _field_errors(html, field, "settings")), _field_errors(html, field, "settings")
    tenant.refresh_from_db()
    assert tenant.name == "Acme Corp" and tenant.requests_per_minute == 600
    assert _audit("tenant.quotas") == [] and _audit("tenant.update") == []


def test_a_service_refusal_is_shown_on_the_form(admin_ui, tenant, actor):
    """A change the API refuses (the tenant went offboarded meanwhile) is refused here too (409)."""
    from controlplane.tenants.services import tenant_offboard

    data = _settings(tenant, requests_per_minute=1)
    tenant_offboard(actor=actor, tenant=tenant)
    response = admin_ui.post("/ui/tenants/acme/settings/", data)
    assert response.status_code == 409 and "offboarded" in _html(response)
    tenant.refresh_from_db()
    assert tenant.requests_per_minute == 600


def test_service_errors_land_next_to_the_field_they_name(tenant):
    from controlplane.common.errors import Conflict, InvalidInput
    from controlplane.ui.tenant_forms import TenantCreateForm, TenantSettingsForm, apply_service_error

    form = TenantSettingsForm(_settings(tenant))
    assert form.is_valid()
    apply_service_error(form, InvalidInput("quota max_l3_bytes must be null (unlimited) or an integer"))
    apply_service_error(form, InvalidInput("cache_policy.retention_seconds must be an integer in [0, 1]"))
    apply_service_error(form, InvalidInput("name must be 1-200 characters"))
    apply_service_error(form, Conflict("tenant 'acme' is offboarded"))
    assert set(form.errors) == {"max_l3_bytes", "retention_seconds", "name", "__all__"}
    create = TenantCreateForm({"slug": "acme", "name": "A", "retention_seconds": "1"})
    assert create.is_valid()
    apply_service_error(create, Conflict("tenant 'acme' already exists"))
    assert list(create.errors) == ["slug"]


# ---------------------------------------------------------------------- API keys: shown once
def test_a_new_key_is_shown_once_in_the_post_response_and_never_again(admin_ui, tenant):
    from controlplane.tenants.models import ApiKey
    from controlplane.tenants.selectors import tenant_authenticate

    form = _key_form(admin_ui, "acme")
    response = admin_ui.post("/ui/tenants/acme/keys/", form)
    html = _html(response)
    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"] and "private" in response["Cache-Control"]
    raw = re.search(r'id="raw-key"[^>]*value="([^"]+)"', html).group(1)
    assert raw.startswith("sk-st-") and "shown only this once" in html
    assert '<button type="button" data-copy="raw-key">Copy</button>' in html  # copy.js copies it
    result = tenant_authenticate(raw)
    assert result is not None and result.ok and result.tenant.slug == "acme"
    key = ApiKey.objects.get(tenant=tenant)
    assert key.name == "production" and key.prefix in html
    created = _by_operator("key.create")
    assert created.target == key.prefix and raw not in str(created.new_value)
    # the key is nowhere else: not in the session, not on any page, not in a message
    assert raw not in str(dict(admin_ui.session.items()))
    for url in ("/ui/tenants/acme/", "/ui/tenants/", "/ui/audit/", f"/ui/tenants/acme/keys/{key.pk}/revoke/"):
        page = _html(admin_ui.get(url))
        assert raw not in page, url
    assert key.prefix in _html(admin_ui.get("/ui/tenants/acme/"))
    # a reload re-sends the same form: no second key, no key shown, a warning instead
    again = admin_ui.post("/ui/tenants/acme/keys/", form)
    assert _location(again) == "/ui/tenants/acme/"
    assert ApiKey.objects.filter(tenant=tenant).count() == 1 and len(_audit("key.create")) == 1
    page = _html(admin_ui.get("/ui/tenants/acme/"))
    assert "shown once and cannot be shown again" in page and raw not in page
    # a fresh form makes a second, different key
    second = _html(admin_ui.post("/ui/tenants/acme/keys/", _key_form(admin_ui, "acme")))
    assert raw not in second and ApiKey.objects.filter(tenant=tenant).count() == 2


def test_bad_key_forms_show_the_error_next_to_the_field(admin_ui, tenant, actor):
    from controlplane.tenants.models import ApiKey
    from controlplane.tenants.services import tenant_offboard

    form = {**_key_form(admin_ui, "acme"), "name": "n" * 101}
    response = admin_ui.post("/ui/tenants/acme/keys/", form)
    assert response.status_code == 422
    assert any("at most 100 characters" in e for e in _field_errors(_html(response), "name", "key"))
    missing = admin_ui.post("/ui/tenants/acme/keys/", {"name": "x"})  # no one-time form value
    assert missing.status_code == 422 and "sk-st-" not in _html(missing)
    tenant_offboard(actor=actor, tenant=tenant)
    gone = admin_ui.post("/ui/tenants/acme/keys/", {"once": "fresh"})
    assert gone.status_code == 409 and "offboarded" in _html(gone)
    assert not ApiKey.objects.exists()
    assert "Create API key" not in _html(admin_ui.get("/ui/tenants/acme/"))


def test_revoking_a_key_asks_for_confirmation_first(admin_ui, tenant, actor):
    from controlplane.tenants.selectors import tenant_authenticate
    from controlplane.tenants.services import api_key_create, tenant_create

    key, raw = api_key_create(actor=actor, tenant=tenant, name="ci")
    url = f"/ui/tenants/acme/keys/{key.pk}/revoke/"
    confirm = _html(admin_ui.get(url))
    assert f"Revoke key {key.prefix}…" in confirm and "Revoke key</button>" in confirm
    assert f'action="{url}"' in confirm and raw not in confirm
    key.refresh_from_db()
    assert key.revoked_at is None  # the GET changed nothing
    bad = admin_ui.post(url, {"reason": "r" * 1001})
    assert bad.status_code == 422 and any("at most 1000" in e for e in _field_errors(_html(bad), "reason"))
    assert _location(admin_ui.post(url, {"reason": "leaked"})) == "/ui/tenants/acme/"
    assert tenant_authenticate(raw).status == "revoked"
    assert _by_operator("key.revoke").reason == "leaked"
    assert "already revoked" in _html(admin_ui.get(url))
    other, _ = api_key_create(actor=actor, tenant=tenant_create(actor=actor, slug="other", name="Other"))
    assert admin_ui.get(f"/ui/tenants/acme/keys/{other.pk}/revoke/").status_code == 404  # not acme's key


# ---------------------------------------------------------------------- grants
def test_admin_grants_and_withdraws_a_model(admin_ui, tenant, model):
    from controlplane.tenants.selectors import grant_get_deployment

    assert '<option value="tiny-llama">' in _html(admin_ui.get("/ui/tenants/acme/"))
    unknown = admin_ui.post("/ui/tenants/acme/grants/", {"model": "nope"})
    assert unknown.status_code == 422
    assert any("Select a valid choice" in e for e in _field_errors(_html(unknown), "model", "grant"))
    assert _location(admin_ui.post("/ui/tenants/acme/grants/", {"model": "tiny-llama"})) == "/ui/tenants/acme/"
    assert grant_get_deployment(tenant, "tiny-llama") is not None
    assert _by_operator("grant.create").target == "acme:tiny-llama"
    page = _html(admin_ui.get("/ui/tenants/acme/"))
    assert "Granted model tiny-llama to acme." in page and '<option value="tiny-llama">' not in page
    unknown = admin_ui.post("/ui/tenants/acme/grants/", {"model": "nope"})
    assert "Select a valid choice" in _html(unknown) and unknown.status_code == 422  # as a message now
    assert _location(admin_ui.post("/ui/tenants/acme/grants/tiny-llama/remove/")) == "/ui/tenants/acme/"
    assert grant_get_deployment(tenant, "tiny-llama") is None
    _by_operator("grant.delete")
    again = admin_ui.post("/ui/tenants/acme/grants/tiny-llama/remove/")
    assert again.status_code == 404 and "no grant" in _html(again)


def test_a_duplicate_grant_is_refused_next_to_the_model_field(admin_ui, tenant, model, actor):
    from controlplane.registry.services import model_create
    from controlplane.tenants.access import grant_create

    model_create(actor=actor, name="other-model", preset="tiny", revision={"label": "r1", "seed": 1})
    grant_create(actor=actor, tenant=tenant, deployment=model)
    # the page offers no granted model, but a stale page may still send one: the service refuses it
    response = admin_ui.post("/ui/tenants/acme/grants/", {"model": "tiny-llama"})
    assert response.status_code == 409
    assert any("already has model" in e for e in _field_errors(_html(response), "model", "grant"))
    assert len(_audit("grant.create")) == 1


# ---------------------------------------------------------------------- share groups
def test_admin_creates_a_share_group_joins_and_leaves(admin_ui, tenant, actor):
    from controlplane.jobs.models import FlushJob
    from controlplane.tenants.models import ShareGroup
    from controlplane.tenants.services import tenant_create

    response = admin_ui.post("/ui/tenants/acme/share-group/new/", {"slug": "family", "name": "The family"})
    assert _location(response) == "/ui/tenants/acme/"
    tenant.refresh_from_db()
    assert tenant.share_group.slug == "family"
    _by_operator("share_group.create")
    _by_operator("share_group.add")
    page = _html(admin_ui.get("/ui/tenants/acme/"))
    assert "Leave family" in page and "Create and join" not in page

    sibling = tenant_create(actor=actor, slug="sibling", name="Sibling")
    assert '<option value="family">' in _html(admin_ui.get("/ui/tenants/sibling/"))
    joined = admin_ui.post("/ui/tenants/sibling/share-group/join/", {"group": "family", "reason": "same org"})
    assert _location(joined) == "/ui/tenants/sibling/"
    sibling.refresh_from_db()
    assert sibling.share_group.slug == "family"
    assert _by_operator("share_group.add", 2).reason == "same org"

    left = admin_ui.post("/ui/tenants/acme/share-group/leave/", {"reason": "split"})
    assert _location(left) == "/ui/tenants/acme/"
    tenant.refresh_from_db()
    assert tenant.share_group is None
    removed = _by_operator("share_group.remove")
    assert removed.reason == "split" and FlushJob.objects.filter(pk=removed.new_value["flush_job"]).exists()
    assert ShareGroup.objects.count() == 1
    nothing = admin_ui.post("/ui/tenants/acme/share-group/leave/", {})
    assert nothing.status_code == 404 and "in no share group" in _html(nothing)


def test_bad_share_group_forms_show_the_error_next_to_the_field(admin_ui, tenant, actor):
    from controlplane.tenants.access import share_group_create
    from controlplane.tenants.models import ShareGroup

    share_group_create(actor=actor, slug="family", name="Family")
    bad_slug = admin_ui.post("/ui/tenants/acme/share-group/new/", {"slug": "Bad Slug", "name": "x"})
    assert bad_slug.status_code == 422
    assert any("use 1-63 characters" in e for e in _field_errors(_html(bad_slug), "slug", "group"))
    taken = admin_ui.post("/ui/tenants/acme/share-group/new/", {"slug": "family", "name": "Again"})
    assert taken.status_code == 409
    assert any("already exists" in e for e in _field_errors(_html(taken), "slug", "group"))
    unknown = admin_ui.post("/ui/tenants/acme/share-group/join/", {"group": "nope"})
    assert unknown.status_code == 422
    assert any("Select a valid choice" in e for e in _field_errors(_html(unknown), "group", "join"))
    tenant.refresh_from_db()
    assert tenant.share_group is None and ShareGroup.objects.count() == 1
    assert _audit("share_group.add") == []


def test_create_and_join_is_all_or_nothing(admin_ui, tenant, actor):
    """A tenant already in a group: the new group is not left behind when joining it is refused."""
    from controlplane.tenants.access import share_group_add, share_group_create
    from controlplane.tenants.models import ShareGroup

    share_group_add(actor=actor, group=share_group_create(actor=actor, slug="family", name="F"), tenant=tenant)
    response = admin_ui.post("/ui/tenants/acme/share-group/new/", {"slug": "second", "name": "Second"})
    assert response.status_code == 409 and "already in share group" in _html(response)
    assert not ShareGroup.objects.filter(slug="second").exists()
    assert [e.target for e in _audit("share_group.create")] == ["family"]


# ---------------------------------------------------------------------- data keys
def test_admin_rotates_a_data_key(admin_ui, tenant):
    from controlplane.tenants.datakeys import data_key_list

    assert _location(admin_ui.post("/ui/tenants/acme/data-keys/rotate/", {"reason": "yearly"})) == "/ui/tenants/acme/"
    assert _location(admin_ui.post("/ui/tenants/acme/data-keys/rotate/", {})) == "/ui/tenants/acme/"
    assert [(k.version, k.state) for k in data_key_list(tenant=tenant)] == [(1, "retired"), (2, "active")]
    rotations = _audit("data_key.rotate")
    assert len(rotations) == 2 and rotations[0].reason == "yearly"
    assert all((e.actor, e.auth_method, e.source) == OPERATOR for e in rotations)
    page = _html(admin_ui.get("/ui/tenants/acme/"))
    assert "Data key v2 of acme is now active" in page and "retired" in page
    bad = admin_ui.post("/ui/tenants/acme/data-keys/rotate/", {"reason": "r" * 1001})
    assert bad.status_code == 422 and any("at most 1000" in e for e in _field_errors(_html(bad), "reason", "rotate"))


def test_shredding_a_data_key_needs_its_version_typed(admin_ui, tenant, actor):
    from controlplane.jobs.models import FlushJob
    from controlplane.tenants.datakeys import data_key_list, data_key_rotate

    data_key_rotate(actor=actor, tenant=tenant)
    data_key_rotate(actor=actor, tenant=tenant)  # v1 retired, v2 active
    url = "/ui/tenants/acme/data-keys/1/shred/"
    confirm = _html(admin_ui.get(url))
    assert "Shred data key v1" in confirm and "Type the version number to confirm" in confirm
    wrong = admin_ui.post(url, {"confirm": "2", "reason": "x"})
    assert wrong.status_code == 422
    assert any("Type 1 exactly" in e for e in _field_errors(_html(wrong), "confirm"))
    empty = admin_ui.post(url, {})
    assert empty.status_code == 422 and _field_errors(_html(empty), "confirm")
    assert not FlushJob.objects.exists() and _audit("shred.request") == []
    job = FlushJob.objects.get(pk=_job_id(admin_ui.post(url, {"confirm": " 1 ", "reason": "key exposure"})))
    assert (job.kind, job.key_version, job.tenant.slug, job.requested_by) == ("shred", 1, "acme", "alice")
    assert _by_operator("shred.request").reason == "key exposure"
    assert [(k.version, k.state) for k in data_key_list(tenant=tenant)] == [(1, "retired"), (2, "active")]
    # shredding the active version rotates first (as through the API)
    active = admin_ui.post("/ui/tenants/acme/data-keys/2/shred/", {"confirm": "2"})
    assert _job_id(active)
    assert [(k.version, k.state) for k in data_key_list(tenant=tenant)][-1] == (3, "active")
    assert admin_ui.get("/ui/tenants/acme/data-keys/9/shred/").status_code == 404


# ---------------------------------------------------------------------- offboarding
def test_offboarding_needs_the_slug_typed(admin_ui, tenant, actor):
    from controlplane.jobs.models import FlushJob
    from controlplane.tenants.selectors import tenant_authenticate
    from controlplane.tenants.services import api_key_create

    _, raw = api_key_create(actor=actor, tenant=tenant)
    confirm = _html(admin_ui.get("/ui/tenants/acme/offboard/"))
    assert "Offboard acme" in confirm and "Type the tenant&#x27;s slug to confirm" in confirm
    wrong = admin_ui.post("/ui/tenants/acme/offboard/", {"confirm": "ACME", "reason": "contract ended"})
    assert wrong.status_code == 422
    assert any("Type acme exactly" in e for e in _field_errors(_html(wrong), "confirm"))
    assert 'value="contract ended"' in _html(wrong)
    tenant.refresh_from_db()
    assert tenant.status == "active" and not FlushJob.objects.exists()
    response = admin_ui.post("/ui/tenants/acme/offboard/", {"confirm": "acme", "reason": "contract ended"})
    job = FlushJob.objects.get(pk=_job_id(response))
    assert (job.kind, job.tenant.slug, job.requested_by) == ("offboard", "acme", "alice")
    tenant.refresh_from_db()
    assert tenant.status == "offboarded" and tenant_authenticate(raw).status == "revoked"
    event = _by_operator("tenant.offboard")
    assert event.reason == "contract ended" and event.new_value["keys_revoked"] == 1
    page = _html(admin_ui.get("/ui/tenants/acme/"))
    assert "Offboarded: its keys are revoked" in page
    for control in ("Create API key", "Rotate data key", "Offboard acme…", "Save", "Suspend acme", "Grant model"):
        assert control not in page, control


# ---------------------------------------------------------------------- viewers
def test_viewer_sees_the_tenant_pages_without_any_control(viewer_ui, tenant, model, actor):
    from controlplane.tenants.datakeys import data_key_rotate
    from controlplane.tenants.services import api_key_create

    key, _ = api_key_create(actor=actor, tenant=tenant)
    data_key_rotate(actor=actor, tenant=tenant)
    for url in ("/ui/tenants/", "/ui/tenants/acme/", f"/ui/tenants/acme/keys/{key.pk}/revoke/",
                "/ui/tenants/acme/data-keys/1/shred/", "/ui/tenants/acme/offboard/"):
        response = viewer_ui.get(url)
        html = _html(response)
        assert response.status_code == 200, url
        assert 'method="post"' not in html.replace('method="post" action="/ui/logout/"', ""), url
        assert "Create tenant" not in html and "Create API key" not in html
    detail = _html(viewer_ui.get("/ui/tenants/acme/"))
    assert key.prefix in detail and "600" in detail and "v1" in detail
    assert "Revoke…" not in detail and "Shred…" not in detail and "Offboard" not in detail
    assert "may only read" in _html(viewer_ui.get("/ui/tenants/acme/offboard/"))


def test_viewer_posts_are_refused_audited_and_change_nothing(viewer_ui, tenant, model, actor):
    from controlplane.jobs.models import FlushJob
    from controlplane.tenants.access import share_group_create
    from controlplane.tenants.datakeys import data_key_rotate
    from controlplane.tenants.models import ApiKey, Grant, ShareGroup, Tenant
    from controlplane.tenants.services import api_key_create

    key, _ = api_key_create(actor=actor, tenant=tenant)
    data_key_rotate(actor=actor, tenant=tenant)
    share_group_create(actor=actor, slug="family", name="Family")
    attempts = [
        ("/ui/tenants/", {"slug": "evil", "name": "Evil", "retention_seconds": "1"}),
        ("/ui/tenants/acme/settings/", _settings(tenant, requests_per_minute=1)),
        ("/ui/tenants/acme/keys/", {"once": "x", "name": "stolen"}),
        (f"/ui/tenants/acme/keys/{key.pk}/revoke/", {}),
        ("/ui/tenants/acme/grants/", {"model": "tiny-llama"}),
        ("/ui/tenants/acme/grants/tiny-llama/remove/", {}),
        ("/ui/tenants/acme/share-group/join/", {"group": "family"}),
        ("/ui/tenants/acme/share-group/new/", {"slug": "mine", "name": "Mine"}),
        ("/ui/tenants/acme/share-group/leave/", {}),
        ("/ui/tenants/acme/data-keys/rotate/", {}),
        ("/ui/tenants/acme/data-keys/1/shred/", {"confirm": "1"}),
        ("/ui/tenants/acme/offboard/", {"confirm": "acme"}),
    ]
    for url, data in attempts:
        response = viewer_ui.post(url, data)
        assert response.status_code == 403, url
        html = _html(response)
        assert "may only read" in html and "sk-st-" not in html, url
    denied = _audit("auth.denied")
    assert [e.target for e in denied] == [f"POST {url}" for url, _ in attempts]
    assert {(e.actor, e.auth_method, e.result) for e in denied} == {("victor", "session", "denied")}
    tenant.refresh_from_db()
    assert (tenant.status, tenant.requests_per_minute, tenant.share_group_id) == ("active", 600, None)
    assert list(Tenant.objects.values_list("slug", flat=True)) == ["acme"]
    assert ApiKey.objects.count() == 1 and ApiKey.objects.get().revoked_at is None
    assert not Grant.objects.exists() and ShareGroup.objects.count() == 1 and not FlushJob.objects.exists()
    assert tenant.data_keys.count() == 1
