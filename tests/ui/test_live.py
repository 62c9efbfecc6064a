"""The dashboard against real cache workers (a local Ray cluster): token-weighted hit ratios per
tenant and per worker, the page pool, and a deployment whose worker has not started."""

from __future__ import annotations

import re

from controlplane.ui.templatetags.strata_ui import num, pct

PROMPT = "The operator dashboard shows token-weighted hit ratios, never request counts. " * 4


def _row(html: str, header: str) -> str:
    """The <tr> whose row header is ``header``."""
    match = re.search(rf'<tr>\s*<th scope="row">{re.escape(header)}</th>(.*?)</tr>', html, re.S)
    assert match, f"no row for {header}"
    return match.group(1)


def test_dashboard_shows_hit_ratios_per_tenant_and_worker_and_a_worker_not_started(platform, admin_ui, actor):
    from controlplane.registry.services import model_create
    from controlplane.runtime.stats import cluster_stats

    model_create(actor=actor, name="tiny-idle", preset="tiny", revision={"label": "r1", "seed": 3})
    client = platform.client("acme")
    for _ in range(2):
        out = client.completions.create(model=platform.model, prompt=PROMPT, max_tokens=1, temperature=0)
    assert out.usage.prompt_tokens_details.cached_tokens > 0

    stats = cluster_stats()
    response = admin_ui.get("/ui/")
    assert response.status_code == 200
    html = response.content.decode()

    acme = next(t for t in stats["tenants"] if t["tenant"] == "acme")
    assert 0 < acme["effective_hit_ratio"] < 1
    row = _row(html, "acme")
    assert pct(acme["effective_hit_ratio"]) in row and num(acme["query_tokens"]) in row
    assert "globex" not in html  # no traffic, no row

    worker = next(w for w in stats["workers"] if w["model"] == platform.model)
    row = _row(html, platform.model)
    assert "running" in row and pct(worker["totals"]["effective_hit_ratio"]) in row
    pool = worker["pool"]
    assert pool["protected"] + pool["evictable"] + pool["free"] == pool["total"] and pool["evictable"] > 0
    for part in ("protected", "evictable", "free"):
        assert f"{num(pool[part])} {part}" in row
    assert "not started" in _row(html, "tiny-idle")
    assert "hit rate" not in html.lower()  # token-weighted ratios only

    live = admin_ui.get("/ui/live/").content.decode()
    assert "tiny-idle" in live and "<html" not in live
