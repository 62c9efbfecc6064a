"""The operator dashboard's tier table, token layers and per-tenant resident bytes, rendered
server-side from canned worker snapshots (only ``controlplane.runtime.gateway.call`` is replaced;
see tests/controlplane/test_stats.py for the snapshots and the sums they imply)."""

from __future__ import annotations

import re

import pytest

from tests.controlplane.test_stats import install_gateway, setup_cluster

pytestmark = pytest.mark.django_db


def _text(html: str) -> str:
    """Visible text with tags dropped and whitespace collapsed."""
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html)).strip()


def _row(html: str, row_id: str) -> str:
    match = re.search(rf'<tr id="{row_id}">(.*?)</tr>', html, re.S)
    assert match, row_id
    return _text(match.group(1))


def _tenant_row(html: str, slug: str) -> str:
    section = html[html.index('id="h-tenants"'):]
    match = re.search(rf'<th scope="row">{slug}</th>(.*?)</tr>', section, re.S)
    assert match, slug
    return match.group(1)


@pytest.mark.parametrize("url", ["/ui/", "/ui/live/"])
def test_dashboard_shows_each_tier_summed_over_workers(viewer_ui, actor, monkeypatch, url):
    setup_cluster(actor, monkeypatch)
    response = viewer_ui.get(url)
    assert response.status_code == 200
    html = response.content.decode()
    l1 = _row(html, "tier-l1")
    assert l1.startswith("L1 device pages")
    assert "80.0 KiB / 200.0 KiB (60 / 150 blocks)" in l1
    assert "656 in 12 loads" in l1 and "57.0 KiB" in l1  # hit tokens; bytes out 58,368
    assert "3.0 ms 4.0 ms" in l1  # p50, p99: the slowest worker's
    assert "3 / 0 / 3" in l1 and "0 / 0" in l1  # failures / corrupt / fallbacks; promotions / demotions
    l2 = _row(html, "tier-l2")
    assert "8.0 KiB / 400.0 KiB (8 / 400 blocks)" in l2
    assert "112 in 4 loads" in l2 and "8.0 KiB 7.0 KiB" in l2  # bytes in, bytes out
    assert "2.0 ms 10.0 ms" in l2 and "0 / 1 / 1" in l2 and "7 / 8" in l2


def test_dashboard_shows_resident_bytes_per_tenant_and_tier(admin_ui, actor, monkeypatch):
    setup_cluster(actor, monkeypatch)
    html = admin_ui.get("/ui/").content.decode()
    assert "Resident L1" in html and "Resident L2" in html
    acme = _tenant_row(html, "acme")
    assert '<td class="num" data-tier="l1">40.0 KiB</td>' in acme  # 30 x 1 KiB + 5 x 2 KiB
    assert '<td class="num" data-tier="l2">8.0 KiB</td>' in acme
    beta = _tenant_row(html, "beta")
    assert '<td class="num" data-tier="l1">10.0 KiB</td>' in beta
    assert '<td class="num" data-tier="l2">0 B</td>' in beta


def test_dashboard_shows_the_token_layers_apart(admin_ui, actor, monkeypatch):
    setup_cluster(actor, monkeypatch)
    text = _text(admin_ui.get("/ui/live/").content.decode())
    assert "Hit ratio (all workers) 51.2%" in text  # 768 / 1,500: the headline stays token-weighted
    assert "Index held (lookup hit) 928 61.9%" in text
    assert "Bytes arrived (load success) 784 52.3%" in text
    assert "Prefill skipped (effective hit) 768 51.2%" in text
    assert "Requests served: 7" in text
    assert "did not answer" in text  # down-llama: listed, fails nothing


def test_dashboard_without_workers_says_so(admin_ui, monkeypatch):
    install_gateway(monkeypatch, {})
    response = admin_ui.get("/ui/")
    assert response.status_code == 200
    assert "No tier figures yet" in response.content.decode()
