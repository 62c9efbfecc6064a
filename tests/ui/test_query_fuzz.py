"""Every query parameter of every console page (``/ui/...``) and admin API GET (``/api/admin/...``)
takes arbitrary text without a 5xx: hypothesis sends text, Unicode digits (``²``, ``١``), numbers
beyond any column, NULs and malformed dates to each one. The admin API's parameters come from its
OpenAPI document, the console's from a list that a second test checks against the source."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.django_db

TRICKY = ["²", "١٢", "𝟗", "9" * 40, "-1", "-" + "9" * 30, "0", "1e9", "1.5", "nan", "inf", " 7 ", "\x00", "a\x00b",
          "%00", "2026-13-45", "9999-12-31T23:59:59", "0001-01-01", "10000-01-01", "true", "[]", "{}", "'; --",
          "x" * 5000, ".", "tenant.", ""]
VALUES = st.one_of(st.sampled_from(TRICKY), st.text(max_size=60), st.integers().map(str),
                   st.from_regex(r"-?[0-9]{15,40}", fullmatch=True))

# Console GET pages and the query parameters they read (test_console_list_names_every_parsed_parameter
# keeps it complete).
CONSOLE = {
    "/ui/": ["range"],
    "/ui/charts/cluster.json": ["range"],
    "/ui/charts/tenants/acme.json": ["range"],
    "/ui/login/": ["next"],
    "/ui/live/": ["x"],
    "/ui/tenants/": ["q", "status"],
    "/ui/tenants/acme/": ["range"],
    "/ui/models/": ["x"],
    "/ui/jobs/": ["kind"],
    "/ui/jobs/live/": ["kind"],
    "/ui/jobs/{job}/": ["x"],
    "/ui/jobs/{job}/live/": ["x"],
    "/ui/tokens/": ["x"],
    "/ui/audit/": ["action", "actor", "tenant", "before", "verify"],
}
PATH_VALUES = {"slug": "acme", "name": "fuzz-model", "version": "1", "key_id": "1", "tenant": "acme", "model":
               "fuzz-model"}


@pytest.fixture
def seeded(actor):
    from controlplane.jobs.services import flush_job_request
    from controlplane.registry.services import model_create
    from controlplane.tenants.services import tenant_create

    model_create(actor=actor, name="fuzz-model", preset="tiny", revision={"label": "r1", "seed": 1})
    tenant = tenant_create(actor=actor, slug="acme", name="Acme")
    job = flush_job_request(actor=actor, scope="tenant", tenant=tenant, reason="fuzz")
    return {"job": str(job.pk), **PATH_VALUES}


def _fuzz(client, url: str, name: str) -> None:
    @settings(max_examples=25, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(value=VALUES)
    def one(value):
        resp = client.get(url, {name: value})
        assert resp.status_code < 500, (url, name, value, resp.status_code, resp.content[:300])

    one()


def _admin_queries(client, values: dict) -> list[tuple[str, str]]:
    doc = client.get("/api/admin/openapi.json").json()
    out = []
    for path, ops in doc["paths"].items():
        op = ops.get("get")
        if op is None:
            continue
        url = re.sub(r"\{(\w+)\}", lambda m: values.get(m.group(1), "1"), path)
        names = [p["name"] for p in op.get("parameters", []) if p["in"] == "query"]
        out += [(url, n) for n in names or ["x"]]
    return out


def test_no_admin_api_query_parameter_answers_5xx(admin_client, seeded, monkeypatch):
    pairs = _admin_queries(admin_client, seeded)
    assert ("/api/admin/audit", "before") in pairs and ("/api/admin/flush-jobs", "limit") in pairs
    for url, name in pairs:
        _fuzz(admin_client, url, name)


def test_no_console_query_parameter_answers_5xx(admin_ui, seeded):
    for path, names in CONSOLE.items():
        url = path.format(job=seeded["job"])
        for name in names:
            _fuzz(admin_ui, url, name)


def test_the_console_audit_page_takes_a_unicode_digit_as_a_bad_event_number(admin_ui, seeded):
    for raw in ("²", "١٢", "9" * 40, "-3"):
        resp = admin_ui.get("/ui/audit/", {"before": raw})
        assert resp.status_code == 200 and "must be an event number" in resp.content.decode()
    assert "must be an event number" not in admin_ui.get("/ui/audit/", {"before": "3"}).content.decode()


def test_console_list_names_every_parsed_parameter():
    """Every ``request.GET.get("name")`` under ui/ (and the audit filters) is fuzzed above."""
    from controlplane.ui.views import AUDIT_FILTERS

    root = Path(__file__).resolve().parents[2] / "platform" / "controlplane" / "ui"
    parsed = set(AUDIT_FILTERS)
    for source in root.glob("*.py"):
        parsed |= set(re.findall(r"request\.GET\.get\(\s*[\"'](\w+)[\"']", source.read_text()))
    fuzzed = {n for names in CONSOLE.values() for n in names}
    assert parsed <= fuzzed, parsed - fuzzed


def test_no_admin_api_path_parameter_answers_5xx(admin_client, seeded):
    """Path parameters too (an id past any column, a NUL in a name), URL-quoted."""
    doc = admin_client.get("/api/admin/openapi.json").json()
    templates = [p for p, ops in doc["paths"].items() if "get" in ops and "{" in p]
    assert "/api/admin/flush-jobs/{job_id}" in templates

    for template in templates:
        for name in re.findall(r"\{(\w+)\}", template):
            _fuzz_path(admin_client, template, name, seeded)


def _fuzz_path(client, template: str, name: str, values: dict) -> None:
    from urllib.parse import quote

    @settings(max_examples=25, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(value=VALUES.filter(bool))
    def one(value):
        url = re.sub(r"\{(\w+)\}", lambda m: quote(value, safe="") if m.group(1) == name
                     else values.get(m.group(1), "1"), template)
        resp = client.get(url)
        assert resp.status_code < 500, (url, resp.status_code, resp.content[:300])

    one()
