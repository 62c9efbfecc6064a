"""The console's tokens page: each token's expiry and last use listed, an expiry chosen at
creation, an expired token shown as such, and a revoke that needs its confirmation step."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

pytestmark = pytest.mark.django_db


def _html(response) -> str:
    html = response.content.decode()
    assert response.status_code < 500 and "Traceback" not in html
    return html


def _row(html: str, prefix: str) -> str:
    start = html.index(f"{prefix}…</code></th>")
    return html[start:html.index("</tr>", start)]


def test_the_tokens_page_lists_expiry_and_last_use(viewer_ui, actor):
    from controlplane.operators.models import OperatorToken
    from controlplane.operators.services import operator_token_create

    token, raw = operator_token_create(actor=actor, username="ci-bot", role="viewer", expires_days=30)
    html = _html(viewer_ui.get("/ui/tokens/"))
    assert "<th scope=\"col\">Expires</th>" in html and "<th scope=\"col\">Last used</th>" in html
    row = _row(html, token.prefix)
    assert token.expires_at.strftime("%Y-%m-%d %H:%M") in row and "never" in row and "live" in row
    assert Client(headers={"Authorization": f"Bearer {raw}"}).get("/api/admin/models").status_code == 200
    used = OperatorToken.objects.get(pk=token.pk).last_used
    assert used is not None
    row = _row(_html(viewer_ui.get("/ui/tokens/")), token.prefix)
    assert used.strftime("%Y-%m-%d %H:%M") in row and "never" not in row
    OperatorToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() - timedelta(minutes=1))
    row = _row(_html(viewer_ui.get("/ui/tokens/")), token.prefix)
    assert "expired" in row and "live" not in row


def test_an_admin_sets_the_expiry_when_creating_a_token(admin_ui, settings):
    from controlplane.operators.models import OperatorToken

    settings.STRATA_OPERATOR_TOKEN_DAYS = 90
    page = _html(admin_ui.get("/ui/tokens/"))
    assert re.search(r'name="expires_days"[^>]*value="90"', page)
    nonce = re.search(r'name="nonce" value="([^"]+)"', page)[1]
    bad = admin_ui.post("/ui/tokens/", {"username": "ci", "role": "viewer", "expires_days": "0", "nonce": nonce})
    assert bad.status_code == 422 and not OperatorToken.objects.exists()
    nonce = re.search(r'name="nonce" value="([^"]+)"', _html(bad))[1]
    made = admin_ui.post("/ui/tokens/", {"username": "ci", "role": "viewer", "expires_days": "5", "nonce": nonce})
    assert made.status_code == 200
    token = OperatorToken.objects.get()
    assert timezone.now() + timedelta(days=4) < token.expires_at < timezone.now() + timedelta(days=5, minutes=1)


def test_a_token_revoked_in_the_console_is_401_token_revoked(admin_ui, actor):
    from controlplane.operators.services import operator_token_create

    token, raw = operator_token_create(actor=actor, username="old-bot", role="admin")
    bearer = Client(headers={"Authorization": f"Bearer {raw}"})
    assert bearer.get("/api/admin/models").status_code == 200
    assert admin_ui.post(f"/ui/tokens/{token.pk}/revoke/", {}).status_code == 422  # no confirmation
    assert bearer.get("/api/admin/models").status_code == 200
    confirm = _html(admin_ui.get(f"/ui/tokens/{token.pk}/revoke/"))
    assert 'name="confirm" value="yes"' in confirm
    assert admin_ui.post(f"/ui/tokens/{token.pk}/revoke/", {"confirm": "yes"}).status_code == 302
    refused = bearer.get("/api/admin/models")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "token_revoked"
    row = _row(_html(admin_ui.get("/ui/tokens/")), token.prefix)
    assert "revoked" in row and "Revoke…" not in row
