"""The tenant page's "Cache usage" section: the ledger's last 24 hours as charts (tokens by tier,
miss reasons) with a table of the same figures, the CSV download through the admin API, and the
tenant's live named caches with a Delete button for admins (POST, CSRF, audited)."""

from __future__ import annotations

import html
import json
import re
from datetime import timedelta

import pytest
from django.utils import timezone

pytestmark = pytest.mark.django_db


def _usage(prompt: int, l1: int = 0, l2: int = 0, l3: int = 0, write: int = 0) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": 3, "total_tokens": prompt + 3,
            "prompt_tokens_details": {"cached_tokens": l1 + l2 + l3, "cache_write_tokens": write,
                                      "cached_tokens_by_tier": {"l1": l1, "l2": l2, "l3": l3}}}


def _cache(tenant, model, **fields):
    from controlplane.caches.models import NamedCache

    values = {"revision": "r1", "tokens": 64, "pinned_tokens": 48, "tiers": {"l2": 48, "l3": 64},
              "expires_at": timezone.now() + timedelta(hours=2), "display_name": "System prompt"}
    values.update(fields)
    return NamedCache.objects.create(tenant=tenant, deployment=model, **values)


def _section(page: str) -> str:
    match = re.search(r'<section aria-labelledby="h-cache-usage".*?</section>', page, re.S)
    assert match, "no Cache usage section"
    return match.group(0)


@pytest.fixture
def recorded(tenant, model):
    from controlplane.ledger.services import ledger_record

    now = timezone.now()
    ledger_record(tenant_id=tenant.pk, model=model.name, usage=_usage(500, l1=200, l2=64, l3=32, write=128),
                  misses={"evicted": 80, "no_prior_request": 16}, at=now)
    ledger_record(tenant_id=tenant.pk, model=model.name, usage=_usage(300, l1=100), misses={"expired": 40},
                  at=now - timedelta(hours=3))
    ledger_record(tenant_id=tenant.pk, model=model.name, usage=_usage(999_999), at=now - timedelta(days=3))  # outside
    return _cache(tenant, model)


def test_the_tenant_page_charts_the_last_24_hours_of_the_ledger(admin_ui, recorded):
    response = admin_ui.get("/ui/tenants/acme/")
    assert response.status_code == 200
    section = _section(response.content.decode())
    assert "<h2 id=\"h-cache-usage\">Cache usage</h2>" in section
    assert 'id="tenant-acme-cache-usage"' in section and 'id="tenant-acme-miss-reasons"' in section
    doc = json.loads(re.search(r'<script id="cache-usage-charts-data" type="application/json">(.*?)</script>',
                               section, re.S).group(1))
    labels = [s["label"] for chart in doc["charts"] for s in chart["series"]]
    for series in ("presented", "read from L1", "read from L2", "read from L3", "written", "evicted", "expired",
                   "no prior request"):
        assert series in labels, series
    assert "flushed" not in labels  # only the reasons that lost tokens are charted
    presented = next(s for s in doc["charts"][0]["series"] if s["label"] == "presented")
    assert sum(presented["values"]) == 800 and len(presented["values"]) == 25  # 24 h + the current one; idle: 0
    assert "2 requests, 800 prompt tokens presented, 396 read from the cache, 128 written" in " ".join(section.split())
    assert "999,999" not in section
    # The table fallback: one row per hour with usage, newest first.
    rows = re.findall(r'<tr>\s*<th scope="row" class="nowrap">(.*?)</th>\s*<td class="num">(\d+)</td>'
                      r'<td class="num">([\d,]+)</td>', section)
    assert [r[2] for r in rows] == ["500", "300"]


def test_the_csv_link_downloads_the_tenant_ledger_with_the_session(admin_ui, recorded):
    section = _section(admin_ui.get("/ui/tenants/acme/").content.decode())
    href = html.unescape(re.search(r'<a href="([^"]+)" download>Download CSV</a>', section).group(1))
    assert href.startswith("/api/admin/tenants/acme/ledger?format=csv&since=")
    response = admin_ui.get(href)
    assert response.status_code == 200 and response["Content-Disposition"].startswith("attachment;")
    lines = response.content.decode().splitlines()
    assert lines[0].startswith("tenant,model,hour,") and len(lines) == 3  # header + the two hours


def test_an_empty_ledger_says_so(viewer_ui, tenant):
    section = _section(viewer_ui.get("/ui/tenants/acme/").content.decode())
    assert "No usage in the last 24 hours." in section and "No live named caches." in section
    assert "No usage in the last 24 hours." in section  # the empty charts' text


def test_live_named_caches_are_listed_with_a_delete_button_for_admins(admin_ui, viewer_ui, tenant, model, recorded):
    _cache(tenant, model, display_name="Gone", deleted_at=timezone.now())
    _cache(tenant, model, display_name="Old", expires_at=timezone.now() - timedelta(minutes=1))
    section = _section(admin_ui.get("/ui/tenants/acme/").content.decode())
    assert recorded.public_id in section and "System prompt" in section and "L2 48 · L3 64" in section
    assert "Gone" not in section and "Old" not in section
    action = f'action="/ui/tenants/acme/caches/{recorded.public_id}/delete/"'
    assert action in section and "csrfmiddlewaretoken" in section
    viewer_section = _section(viewer_ui.get("/ui/tenants/acme/").content.decode())
    assert recorded.public_id in viewer_section and action not in viewer_section


def _drops_everywhere(monkeypatch) -> None:
    """The replicas' side of a delete (Ray actors) answers as one running replica would."""
    from controlplane.caches import workers

    monkeypatch.setattr(workers, "drop_everywhere",
                        lambda cache: {"ok": True, "tiers": {"l1": 0, "l2": 3, "l3": 4}, "bytes": 4096, "replicas": 1})


def test_an_admin_deletes_a_named_cache_from_the_console(admin_ui, monkeypatch, recorded):
    from controlplane.audit.models import AuditEvent

    _drops_everywhere(monkeypatch)
    response = admin_ui.post(f"/ui/tenants/acme/caches/{recorded.public_id}/delete/")
    assert response.status_code == 302 and response["Location"] == "/ui/tenants/acme/"
    recorded.refresh_from_db()
    assert recorded.deleted_at is not None and recorded.token_ids == []
    event = AuditEvent.objects.get(action="cache.delete")
    assert (event.actor, event.auth_method, event.target) == ("alice", "session", recorded.public_id)
    assert recorded.public_id not in _section(admin_ui.get("/ui/tenants/acme/").content.decode())
    assert admin_ui.post(f"/ui/tenants/acme/caches/{recorded.public_id}/delete/").status_code == 404  # already gone


def test_a_viewer_cannot_delete_and_another_tenants_cache_is_a_404(viewer_ui, admin_ui, actor, monkeypatch, model,
                                                                   recorded):
    from controlplane.tenants.services import tenant_create

    _drops_everywhere(monkeypatch)
    assert viewer_ui.post(f"/ui/tenants/acme/caches/{recorded.public_id}/delete/").status_code == 403
    other = tenant_create(actor=actor, slug="other", name="Other")
    assert admin_ui.post(f"/ui/tenants/other/caches/{recorded.public_id}/delete/").status_code == 404
    recorded.refresh_from_db()
    assert recorded.deleted_at is None and other.pk != recorded.tenant_id
