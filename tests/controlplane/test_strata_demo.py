"""``manage.py strata_demo``: creates a usable demo once, duplicates nothing, and every secret it
prints works (and is shown only when it is created)."""

import io
import re

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.test import Client

from controlplane.operators.selectors import operator_authenticate
from controlplane.registry.models import ModelDeployment
from controlplane.tenants.models import ApiKey, Grant, Tenant
from controlplane.tenants.selectors import grant_get_deployment, tenant_authenticate

pytestmark = pytest.mark.django_db


def run_demo(*args: str) -> str:
    out = io.StringIO()
    call_command("strata_demo", "--base-url", "http://127.0.0.1:8765", *args, stdout=out)
    return out.getvalue()


def secrets_in(text: str) -> dict:
    return {
        "token": re.findall(r"st-op-[\w-]{43}", text),
        "keys": dict(re.findall(r"^  (acme|globex)\s+(sk-st-[\w-]{43})$", text, re.M)),
        "password": re.findall(r"user admin\s+password (\S+)$", text, re.M),
    }


def test_first_run_creates_everything_and_every_printed_secret_works():
    out = run_demo()
    found = secrets_in(out)

    assert set(found["keys"]) == {"acme", "globex"}
    for slug, raw in found["keys"].items():
        auth = tenant_authenticate(raw)
        assert auth is not None and auth.ok and auth.tenant.slug == slug
        assert grant_get_deployment(auth.tenant, "demo-small") is not None
    token = operator_authenticate(found["token"][0])
    assert token is not None and token.role == "admin"
    assert get_user_model().objects.get(username="admin").check_password(found["password"][0])
    assert Client(headers={"Authorization": f"Bearer {found['token'][0]}"}).get(
        "/api/admin/tenants").status_code == 200

    deployment = ModelDeployment.objects.get(name="demo-small")
    assert deployment.preset == "small" and deployment.active_revision.label == "r1"
    assert deployment.active_revision.seed == 1
    assert "base_url='http://127.0.0.1:8765/v1'" in out and found["keys"]["acme"] in out
    from controlplane.audit.models import AuditEvent

    created = list(AuditEvent.objects.filter(action="user.create", target="admin").values_list("actor", flat=True))
    assert len(created) == 1 and not created[0].startswith("system:unattributed"), created  # attributed, once


def test_second_run_duplicates_nothing_and_shows_no_secret():
    first = secrets_in(run_demo())
    second_out = run_demo()

    assert "everything already exists" in second_out
    assert secrets_in(second_out) == {"token": [], "keys": {}, "password": []}
    assert Tenant.objects.count() == 2 and ApiKey.objects.count() == 2 and Grant.objects.count() == 2
    assert ModelDeployment.objects.count() == 1 and get_user_model().objects.count() == 1
    assert tenant_authenticate(first["keys"]["acme"]).ok  # the first key still works


def test_rotate_replaces_the_demo_secrets_and_revokes_the_old_ones():
    old = secrets_in(run_demo())
    new = secrets_in(run_demo("--rotate"))

    assert set(new["keys"]) == {"acme", "globex"} and new["token"] and new["password"]
    assert tenant_authenticate(old["keys"]["acme"]).status == "revoked"
    assert tenant_authenticate(new["keys"]["acme"]).ok
    assert operator_authenticate(old["token"][0]) is None
    assert operator_authenticate(new["token"][0]) is not None
    assert ApiKey.objects.filter(revoked_at__isnull=True).count() == 2


def test_demo_tenants_may_pin_and_the_rotate_recipe_names_the_state_in_use(monkeypatch, tmp_path):
    run_demo()
    assert all(t.max_pinned_tokens and t.max_pinned_tokens >= 1136 for t in Tenant.objects.all())
    home = tmp_path / "demo home"
    monkeypatch.setenv("STRATA_HOME", str(home))
    monkeypatch.setenv("STRATA_DEMO_MODEL", "/srv/models/tiny")
    out = run_demo("--model-path", "")
    line = next(x for x in out.splitlines() if "--rotate" in x)
    assert f"STRATA_HOME='{home}' " in line and "STRATA_DEMO_MODEL=/srv/models/tiny " in line
    assert line.endswith(".venv/bin/python manage.py strata_demo --rotate")
    monkeypatch.delenv("STRATA_HOME")
    monkeypatch.delenv("STRATA_DEMO_MODEL")
    monkeypatch.delenv("DATABASE_URL", raising=False)
    line = next(x for x in run_demo().splitlines() if "--rotate" in x)
    assert line == "New keys, token and password: .venv/bin/python manage.py strata_demo --rotate"
