"""One quota registry (issue 22): every quota of ``controlplane.tenants.quotas.QUOTAS`` reaches the admin
API's schema (OpenAPI, with its help text), the console's forms, the services' validation (its bounds
refused with the same message by the service and the admin API, and by the console's form), the audit,
and, for a worker-enforced quota, every worker message that carries it. A quota added to the registry
alone shows up in all of them (the builders are generic): adding one touches the registry, its column's
migration and the code that enforces it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from controlplane.tenants import quotas
from controlplane.tenants.quotas import QUOTAS, QuotaSpec
from tests.controlplane.helpers import assert_error, audit_events, patch

REPO = Path(__file__).resolve().parents[2]
URL = "/api/admin/tenants"
IDS = [s.name for s in QUOTAS]


def _schema_bounds(spec: QuotaSpec) -> tuple[int | float, int | float | None]:
    """What the admin API's schema states: a refused 0 is left to the service (it says why)."""
    return (0 if spec.zero_hint else spec.minimum), spec.maximum


def _bad_values(spec: QuotaSpec) -> list:
    """Just below the range (0 for a quota that refuses it), -1, and just above it."""
    low = sorted({spec.minimum - 1, -1})
    return [*low, spec.upper + 1] if spec.upper is not None else low


def _valid(spec: QuotaSpec, index: int) -> int | float:
    """A distinct in-range value per quota, so a value found in a worker message is that quota's own."""
    value = min(spec.minimum + 3 + index, spec.upper) if spec.upper is not None else spec.minimum + 3 + index
    return spec.value_type(value)


def test_the_registry_is_well_formed_and_matches_the_tenant_columns():
    from controlplane.tenants.models import Tenant, quota_column
    from workers.admission import tenant_concurrency

    assert quotas.names() == tuple(IDS) and len(set(IDS)) == len(IDS)
    for spec in QUOTAS:
        column = Tenant._meta.get_field(spec.name)
        assert column.null and column.blank and not column.has_default(), spec.name
        assert type(column) is type(quota_column(spec)), spec.name
    assert list(Tenant().quotas) == list(IDS)
    assert all(s.default is None for s in QUOTAS if s.unlimited)  # a null limit is no number
    assert quotas.get("max_concurrent_requests").default == tenant_concurrency(None)  # the worker's own default
    with pytest.raises(ValueError, match="refuses 0"):
        QuotaSpec(name="x", label="X", hint="", help="", unit="", enforced="web", enforced_in=("a",), zero_hint="!")
    with pytest.raises(ValueError, match="worker"):
        QuotaSpec(name="x", label="X", hint="", help="", unit="", enforced="worker", enforced_in=("a",))
    with pytest.raises(ValueError, match="fit"):
        QuotaSpec(name="x", label="X", hint="", help="", unit="", enforced="web", enforced_in=("a",), bits=16,
                  maximum=2**20)


@pytest.mark.parametrize("spec", QUOTAS, ids=IDS)
def test_each_quota_names_modules_that_enforce_it(spec):
    """``enforced_in`` points at real code that reads the quota (by its name, or its worker field)."""
    for path in spec.enforced_in:
        file = REPO / ("platform/" + path if path.startswith("controlplane/") else path)
        assert file.is_file(), (spec.name, path)
        assert (spec.sent_as or spec.name) in file.read_text(), (spec.name, path)


# ---------------------------------------------------------------------- admin API schema
def test_every_quota_is_in_the_admin_api_schema_with_its_type_bounds_and_help_text(admin_client):
    doc = admin_client.get("/api/admin/openapi.json").json()["components"]["schemas"]
    quotas_in, quotas_out = doc["QuotasIn"], doc["QuotasOut"]
    assert list(quotas_in["properties"]) == IDS and list(quotas_out["properties"]) == IDS
    assert quotas_in["additionalProperties"] is False and sorted(quotas_out["required"]) == sorted(IDS)
    for spec in QUOTAS:
        for prop in (quotas_in["properties"][spec.name], quotas_out["properties"][spec.name]):
            assert prop["description"] == spec.help and prop["x-unit"] == spec.unit
            typed, null = prop["anyOf"]
            assert typed["type"] == ("integer" if spec.value_type is int else "number") and null == {"type": "null"}
        low, high = _schema_bounds(spec)
        typed = quotas_in["properties"][spec.name]["anyOf"][0]
        assert typed["minimum"] == low and typed.get("maximum") == high, spec.name


# ---------------------------------------------------------------------- console
def test_every_quota_is_a_console_form_field_with_its_label_hint_and_range():
    from controlplane.ui.tenant_forms import TenantCreateForm, TenantSettingsForm

    create, settings = TenantCreateForm(), TenantSettingsForm()
    assert list(create.fields) == ["slug", "name", *IDS, "persist", "retention_seconds"]
    assert list(settings.fields) == ["name", *IDS, "persist", "retention_seconds", "reason"]
    for spec in QUOTAS:
        field = settings.fields[spec.name]
        assert (field.label, field.help_text, field.required) == (spec.label, spec.hint, False)
        assert (field.min_value, field.max_value) == (spec.minimum, spec.upper)


# ---------------------------------------------------------------------- validation: service, API, console
@pytest.mark.django_db
@pytest.mark.parametrize("spec", QUOTAS, ids=IDS)
def test_each_quotas_bounds_are_refused_alike_by_the_service_the_admin_api_and_the_console(admin_client, tenant,
                                                                                           spec):
    from controlplane.common.errors import InvalidInput
    from controlplane.tenants.models import Tenant
    from controlplane.ui.tenant_forms import TenantSettingsForm

    low, high = _schema_bounds(spec)
    for bad in _bad_values(spec):
        message = spec.refusal(bad)
        assert message and message.startswith(f"quota {spec.name} must be null ({spec.null_means}) or ")
        with pytest.raises(InvalidInput) as refused:
            quotas.clean({spec.name: bad})
        assert refused.value.message == message and refused.value.status == 422
        error = assert_error(patch(admin_client, f"{URL}/acme", {"quotas": {spec.name: bad}}), 422)
        if low <= bad and (high is None or bad <= high):  # the schema lets it through: the service's words
            assert (error["code"], error["message"]) == ("invalid_input", message)
        if bad == 0 and spec.zero_hint:
            assert spec.zero_hint in message
        form = TenantSettingsForm(data={"name": "Acme Corp", "retention_seconds": "86400", spec.name: str(bad)})
        assert not form.is_valid() and spec.name in form.errors, (spec.name, bad)
        if bad == 0 and spec.zero_hint:
            assert spec.zero_hint.strip(" ()") in " ".join(form.errors[spec.name])
    assert getattr(Tenant.objects.get(slug="acme"), spec.name) is None  # nothing refused was stored


@pytest.mark.django_db
def test_every_quota_round_trips_through_the_admin_api_and_its_audit(admin_client, tenant):
    from controlplane.tenants.models import Tenant

    values = {s.name: _valid(s, i) for i, s in enumerate(QUOTAS)}
    body = patch(admin_client, f"{URL}/acme", {"quotas": values}).json()
    assert body["quotas"] == values and Tenant.objects.get(slug="acme").quotas == values
    assert audit_events("tenant.quotas")[-1].new_value == values
    patch(admin_client, f"{URL}/acme", {"quotas": dict.fromkeys(IDS)})
    event = audit_events("tenant.quotas")[-1]
    assert event.old_value == values
    assert event.new_value == {**dict.fromkeys(IDS), "effective": {
        s.name: s.null_means for s in QUOTAS if not s.unlimited}}


# ---------------------------------------------------------------------- the worker requests
@pytest.fixture
def limited(db, actor, tenant, model):
    """``tenant`` with a distinct value for every quota, granted ``model``; ``(tenant, values, key)``."""
    from controlplane.tenants.access import grant_create
    from controlplane.tenants.services import api_key_create, tenant_update

    values = {s.name: _valid(s, i) for i, s in enumerate(QUOTAS)}
    values["requests_per_minute"] = values["tokens_per_minute"] = 10**6  # never in the way here
    values["max_prompt_tokens"] = 1000
    tenant = tenant_update(actor=actor, tenant=tenant, quotas=values)
    grant_create(actor=actor, tenant=tenant, deployment=model)
    return tenant, values, api_key_create(actor=actor, tenant=tenant)[1]


def _request(path: str, key: str, body: dict):
    from django.test import RequestFactory

    return RequestFactory().post(path, data=json.dumps(body), content_type="application/json",
                                 headers={"Authorization": f"Bearer {key}"})


def _messages(limited, model) -> dict[str, dict]:
    from controlplane.caches.workers import cache_request
    from controlplane.serving.context import _prepare, _prepare_kv
    from controlplane.serving.schemas import CompletionRequest, KVRequest

    tenant, _, key = limited
    completion = _prepare(_request("/v1/completions", key, {"model": model.name, "prompt": "hi", "max_tokens": 1}),
                          CompletionRequest).worker_req
    kv = _prepare_kv(_request("/v1/kv/lookup", key, {"model": model.name, "tokens": [1, 2, 3]}), KVRequest)[2]
    cache = cache_request(SimpleNamespace(tenant=tenant, token_ids=[1, 2, 3], cache_salt=None, adapter_id=None))
    return {"completion": completion, "kv": kv, "cache": cache}


@pytest.mark.django_db
def test_each_worker_quota_rides_in_every_worker_message_that_carries_it_and_no_web_quota_does(limited, model):
    from workers.protocol import WorkerRequest

    fields = {f.name for f in dataclasses.fields(WorkerRequest)}
    _, values, _ = limited
    messages = _messages(limited, model)
    assert set(messages) == set(quotas.WORKER_MESSAGES)
    for spec in QUOTAS:
        if spec.enforced == "web":
            assert spec.sent_as is None and spec.name not in fields
            assert all(spec.name not in m for m in messages.values()), spec.name
            continue
        assert spec.sent_as in fields, f"WorkerRequest has no field {spec.sent_as} for quota {spec.name}"
        for name, message in messages.items():
            expected = values[spec.name] if name in spec.worker_messages else None
            assert message.get(spec.sent_as) == expected, (spec.name, name)
    for name in ("completion", "cache"):  # the worker reads them back
        WorkerRequest.from_dict(messages[name])


def test_the_worker_messages_carry_the_quotas_they_always_did():
    """The contract with the workers, pinned: which quotas each message carries, under which field."""
    carried = {m: {s.name: s.sent_as for s in QUOTAS if m in s.worker_messages} for m in quotas.WORKER_MESSAGES}
    cache = {"max_cached_tokens": "max_cached_tokens", "max_l3_bytes": "max_l3_bytes", "share_weight": "share_weight"}
    assert carried["cache"] == cache
    assert carried["kv"] == {**cache, "max_concurrent_requests": "max_concurrent_requests"}
    assert carried["completion"] == {**carried["kv"], "max_inflight_tokens": "max_inflight_tokens"}


# ---------------------------------------------------------------------- adding a quota
EXTRA = (
    QuotaSpec(name="max_widgets", label="Widgets", hint="per worker; blank = 2", help="widgets per worker (null = 2)",
              unit="widgets", bits=32, minimum=1, default=2, null_means="the default, 2 per worker",
              null_display="worker default", zero_hint=" (0 would stop every widget)", enforced="worker",
              enforced_in=("workers/widgets.py",), worker_messages=frozenset({"completion", "kv"}),
              worker_field="widgets"),
    QuotaSpec(name="burst_ratio", label="Burst ratio", short="burst", hint="blank = unlimited",
              help="how far a burst may exceed the rate (null = unlimited)", unit="ratio", value_type=float,
              minimum=1, maximum=10, enforced="web", enforced_in=("controlplane/serving/ratelimit.py",)),
)


@pytest.fixture
def extended(monkeypatch):
    """The registry with two more quotas, and no other change anywhere."""
    monkeypatch.setattr(quotas, "QUOTAS", (*QUOTAS, *EXTRA))
    return quotas.QUOTAS


def test_a_quota_added_to_the_registry_alone_is_validated_and_audited(extended):
    from controlplane.common.errors import InvalidInput

    assert quotas.names()[-2:] == ("max_widgets", "burst_ratio")
    assert quotas.clean({"max_widgets": 5, "burst_ratio": 2.5}) == {"max_widgets": 5, "burst_ratio": 2.5}
    assert quotas.clean({"burst_ratio": 3}) == {"burst_ratio": 3}  # a float quota takes an integer
    with pytest.raises(InvalidInput, match=r"quota max_widgets must be null \(the default, 2 per worker\) or an "
                                           r"integer in \[1, 2147483647\] \(0 would stop every widget\)"):
        quotas.clean({"max_widgets": 0})
    with pytest.raises(InvalidInput, match=r"burst_ratio must be null \(unlimited\) or a number in \[1, 10\]"):
        quotas.clean({"burst_ratio": 10.5})
    with pytest.raises(InvalidInput, match="known: .*max_pinned_tokens, max_adapters, max_widgets, burst_ratio"):
        quotas.clean({"max_gadgets": 1})
    assert quotas.audited({"max_widgets": None, "burst_ratio": None}) == {
        "max_widgets": None, "burst_ratio": None, "effective": {"max_widgets": "the default, 2 per worker"}}


def test_a_quota_added_to_the_registry_alone_is_in_the_admin_schema(extended):
    from pydantic import ValidationError

    from controlplane.adminapi.schemas import quota_schemas

    quotas_in, quotas_out = quota_schemas(extended)
    schema = quotas_in.model_json_schema()["properties"]
    assert list(schema)[-2:] == ["max_widgets", "burst_ratio"]
    assert schema["max_widgets"]["description"] == "widgets per worker (null = 2)"
    assert schema["max_widgets"]["anyOf"][0] == {"type": "integer", "minimum": 0}  # 0: the service says why
    assert schema["burst_ratio"]["anyOf"][0] == {"type": "number", "minimum": 1, "maximum": 10}
    assert quotas_in.model_validate({"max_widgets": 3, "burst_ratio": 1.5}).model_dump(exclude_unset=True) == {
        "max_widgets": 3, "burst_ratio": 1.5}
    for bad in ({"burst_ratio": 11.0}, {"max_widgets": "3"}, {"max_widgets": -1}, {"max_gadgets": 1}):
        with pytest.raises(ValidationError):
            quotas_in.model_validate(bad)
    assert "burst_ratio" in quotas_out.model_json_schema()["required"]


def test_a_quota_added_to_the_registry_alone_is_on_the_console_and_in_the_worker_request(extended):
    from django.db import models

    from controlplane.tenants.models import quota_column
    from controlplane.ui.present import quota_list
    from controlplane.ui.tenant_forms import TenantSettingsForm

    form = TenantSettingsForm(data={"name": "Acme", "retention_seconds": "0", "max_widgets": "4",
                                    "burst_ratio": "2.5"})
    assert list(form.fields)[-5:] == ["max_widgets", "burst_ratio", "persist", "retention_seconds", "reason"]
    assert form.fields["burst_ratio"].label == "Burst ratio" and form.is_valid(), form.errors
    assert form.quotas()["max_widgets"] == 4 and form.quotas()["burst_ratio"] == 2.5
    refused = TenantSettingsForm(data={"name": "Acme", "retention_seconds": "0", "max_widgets": "0"})
    assert not refused.is_valid() and "0 would stop every widget" in refused.errors["max_widgets"][0]

    shown = {q["name"]: q for q in quota_list({"max_widgets": None, "burst_ratio": 1.5})}
    assert (shown["max_widgets"]["null"], shown["max_widgets"]["limit"]) == ("worker default", False)
    assert (shown["burst_ratio"]["short"], shown["burst_ratio"]["limit"]) == ("burst", True)

    tenant = SimpleNamespace(**{s.name: None for s in QUOTAS}, max_widgets=7, burst_ratio=2.0)
    assert quotas.worker_values(tenant, "kv")["widgets"] == 7 and "burst_ratio" not in quotas.worker_values(
        tenant, "completion")
    assert "widgets" not in quotas.worker_values(tenant, "cache")
    assert isinstance(quota_column(EXTRA[0]), models.PositiveIntegerField)  # its migration: makemigrations
    assert isinstance(quota_column(EXTRA[1]), models.FloatField)
