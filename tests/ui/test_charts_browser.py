"""The console's charts and rollout safety in a real browser (the machine's Chromium, driven by
Playwright) at 1,000 and 1,400 px, against the live server over samples of canned worker snapshots
(no Ray or Celery): uPlot draws every chart from the page's JSON, hovering shows the values at the
pointer, the range selector switches to 6 h in place (URL and the selected link follow), an
offboarded tenant is labelled, and nothing runs off the page. On the Models page the primary "Model
updated — reset the cache" form offers only revisions newer than the active one with the newest
selected, and a rollback with a wrongly typed name is refused and changes nothing.

Screenshots go to ``$STRATA_SCREENSHOTS`` (default /tmp/strata-screenshots), an artifact of the run."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest

from tests.controlplane.test_stats import canned_snapshots, install_gateway, setup_cluster
from tests.controlplane.test_timeseries import bump
from tests.ui.conftest import require_chromium, shot

T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
WIDTHS = (1000, 1400)


@pytest.fixture
def sampled_cluster(transactional_db, actor, monkeypatch):
    """Five samples 30 s apart: acme's and beta's traffic in each interval; beta then offboarded."""
    from controlplane.tenants.models import Tenant
    from controlplane.timeseries.services import sample_take

    ids = setup_cluster(actor, monkeypatch)
    snaps = canned_snapshots(ids)
    install_gateway(monkeypatch, snaps)
    sample_take(now=T0)
    for k in range(1, 5):
        bump(snaps["tiny-llama"], ids["acme"], requests=1, query_tokens=400, effective_hit_tokens=360,
             lookup_hit_tokens=380, load_success_tokens=360)
        bump(snaps["tiny-llama"], ids["beta"], requests=2, query_tokens=100, effective_hit_tokens=25 * k)
        install_gateway(monkeypatch, snaps)
        sample_take(now=T0 + timedelta(seconds=30 * k))
    Tenant.objects.filter(slug="beta").update(status=Tenant.Status.OFFBOARDED)
    return ids


@pytest.fixture
def rollout_model(transactional_db, actor):
    """A deployment on r2 with an older r1 and newer r3 and r4 (nothing started)."""
    from controlplane.registry.models import ModelRevision
    from controlplane.registry.services import model_create, revision_create

    deployment = model_create(actor=actor, name="tiny-rollout", preset="tiny", revision={"label": "r1", "seed": 1})
    for label, seed in (("r2", 2), ("r3", 3), ("r4", 4)):
        revision_create(actor=actor, deployment=deployment, label=label, seed=seed)
    deployment.active_revision = ModelRevision.objects.get(deployment=deployment, label="r2")
    deployment.save(update_fields=["active_revision"])
    return deployment


def _no_overflow(page) -> None:
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= page.viewport_size["width"], f"page is {width} px wide"


@pytest.mark.parametrize("width", WIDTHS)
def test_charts_draw_show_values_on_hover_and_switch_range(chromium, live_server, sampled_cluster, logged_in_page,
                                                            width):
    assert require_chromium() == chromium
    from playwright.sync_api import expect

    page = logged_in_page(width)
    page.goto(f"{live_server.url}/ui/")
    trends = page.locator("#trends")
    expect(trends).to_have_class(re.compile(r"\bcharts-drawn\b"))
    hit = page.locator("#chart-hit-ratio")
    expect(hit.locator(".chart-plot canvas")).to_be_visible()
    expect(hit.locator(".chart-nolib")).to_have_count(0)
    legend = hit.locator(".u-legend")
    expect(legend).to_contain_text("beta (offboarded)")
    expect(legend).to_contain_text("all tenants")
    _no_overflow(page)

    # Hover the newest point (the right edge of the plot): the legend shows the values there.
    over = hit.locator(".u-over")
    box = over.bounding_box()
    page.mouse.move(box["x"] + box["width"] - 1, box["y"] + box["height"] / 2)
    acme = hit.locator(".u-legend tr.u-series", has_text="acme")
    expect(acme.locator(".u-value")).to_have_text("90.0%")
    expect(hit.locator(".u-legend tr.u-series", has_text="beta").locator(".u-value")).to_have_text("100.0%")
    shot(page, f"dashboard-charts-{width}")

    # The range selector: in place, and the address follows.
    trends.get_by_role("link", name="6h").click()
    expect(trends).to_have_attribute("data-range", "6h")
    expect(page).to_have_url(re.compile(r"[?&]range=6h"))
    expect(trends.get_by_role("link", name="6h")).to_have_attribute("aria-current", "true")
    expect(trends.locator(".range-step")).to_have_text("one point per 1.5 min")
    expect(hit.locator(".chart-plot canvas")).to_be_visible()
    hit.locator("details.chart-table summary").click()
    # the newest 90 s point holds the last three intervals: (3*360 + 50+75+100) / (3*400 + 3*100)
    expect(hit.locator(".chart-table tbody tr").first).to_contain_text("87.0%")
    _no_overflow(page)
    shot(page, f"dashboard-charts-6h-{width}")

    page.goto(f"{live_server.url}/ui/tenants/acme/")
    expect(page.locator("#trends")).to_have_class(re.compile(r"\bcharts-drawn\b"))
    expect(page.locator("#tenant-acme-hit-ratio .chart-plot canvas")).to_be_visible()
    # no ledger rows here: the cache usage charts are one line each, "no usage" (issue 47), until data comes
    expect(page.locator("#cache-usage-charts figure.chart-is-empty .chart-empty").first).to_be_visible()
    expect(page.locator("#cache-usage-charts .chart-plot canvas").first).to_be_hidden()
    _no_overflow(page)
    shot(page, f"tenant-charts-{width}")


@pytest.mark.parametrize("width", WIDTHS)
def test_rollout_offers_only_newer_revisions_and_a_rollback_needs_the_typed_name(chromium, live_server, rollout_model,
                                                                                logged_in_page, width):
    assert require_chromium() == chromium
    from playwright.sync_api import expect

    page = logged_in_page(width)
    page.goto(f"{live_server.url}/ui/models/")
    rollout = page.locator("form[aria-label='Roll out a revision of tiny-rollout']")
    options = rollout.locator("select[name=revision] option")
    expect(options).to_have_text([re.compile(r"^r4\b"), re.compile(r"^r3\b")])  # newer than r2 only, newest first
    expect(rollout.locator("select[name=revision]")).to_have_value("r4")
    expect(rollout.get_by_role("button", name=re.compile("reset the cache", re.I))).to_be_visible()
    rollback = page.locator("form[aria-label='Roll back tiny-rollout to an older revision']")
    expect(rollback).to_be_hidden()  # folded under "More for tiny-rollout"
    page.locator("#m-tiny-rollout details.model-more > summary").click()
    expect(rollback.locator("[name=revision]")).to_have_value("r1")
    _no_overflow(page)
    shot(page, f"models-rollout-{width}")

    rollback.locator("input[name=confirm]").fill("tiny-rollout-typo")
    rollback.get_by_role("button", name="Roll back").click()
    expect(page.locator("[role=alert]").first).to_contain_text(re.compile("name", re.I))
    shot(page, f"models-rollback-refused-{width}")
    page.goto(f"{live_server.url}/ui/models/")
    expect(page.locator("form[aria-label='Roll out a revision of tiny-rollout'] select[name=revision]")
           ).to_have_value("r4")  # still on r2: nothing was rolled back
