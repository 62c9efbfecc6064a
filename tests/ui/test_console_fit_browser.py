"""The console as an operator meets it (issue 47, items 2-5), in a real browser (the machine's Chromium,
driven by Playwright) at 1,024, 1,920 and 400 px against the live server, over samples of canned
worker snapshots (no Ray or Celery; only ``gateway.call`` replaced, as in test_charts_browser.py):

- nothing is wider than its box: at 1,024 and 1,920 px neither the page nor any table's scroller
  scrolls sideways, at 400 px the page does not (a wide table scrolls inside its own box);
- the dashboard's "Latency (seconds)" shows its p99 columns whole (item 2);
- the tenant page's "Recent jobs" carries each job's blocks and bytes freed (item 3);
- the "Resident bytes" axis is as wide as its widest label, said briefly ("48 MiB") (item 4);
- a new tenant's key and grant forms come first and its charts without data are one line each, the
  tenant page offers "Flush this tenant" (typed slug), the Models page folds each model's less used
  forms and offers "Model updated — reset the cache" even without a newer revision (item 5).

Screenshots go to ``$STRATA_SCREENSHOTS`` (default /tmp/strata-screenshots), an artifact of the run."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import pytest

from tests.controlplane.test_stats import canned_snapshots, install_gateway, setup_cluster
from tests.controlplane.test_timeseries import bump
from tests.ui.conftest import require_chromium, shot

T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
WIDTHS = (1024, 1920)
LONG_MODEL = "llama-3.1-70b-instruct-awq-int4-long-context"
MIB = 1024 * 1024


@pytest.fixture
def console(transactional_db, actor, monkeypatch):
    """acme with traffic and 48 MiB resident in L1, a finished flush job of acme that freed blocks and
    bytes, latency figures of a long-named model in this process's serving metrics, a new tenant
    (newco) with no key and no model, and models with and without a newer revision."""
    from controlplane.jobs.models import FlushJob
    from controlplane.registry.models import ModelDeployment
    from controlplane.registry.services import revision_create
    from controlplane.serving import health
    from controlplane.tenants.access import grant_create
    from controlplane.tenants.models import Tenant
    from controlplane.tenants.services import api_key_create, tenant_create
    from controlplane.timeseries.services import sample_take

    ids = setup_cluster(actor, monkeypatch)
    snaps = canned_snapshots(ids)
    snaps["tiny-llama"]["bytes_per_block"] = 48 * MIB // 30  # acme's 30 L1 blocks: 48 MiB
    install_gateway(monkeypatch, snaps)
    sample_take(now=T0)
    for k in range(1, 4):
        bump(snaps["tiny-llama"], ids["acme"], requests=1, query_tokens=400, effective_hit_tokens=360,
             lookup_hit_tokens=380, load_success_tokens=360)
        install_gateway(monkeypatch, snaps)
        sample_take(now=T0 + timedelta(seconds=30 * k))
    FlushJob.objects.create(
        kind="flush", scope="tenant", tenant=Tenant.objects.get(slug="acme"), reason="customer asked",
        requested_by="alice", status="succeeded", progress_done=1, progress_total=1, verified=True,
        results={"cache-worker:tiny-llama:0": {"worker": "cache-worker:tiny-llama:0", "status": "ok",
                                               "blocks_freed": 1234, "l3_bytes": 5 * MIB}})
    for route in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
        health.LATENCY.labels(route=route, model=LONG_MODEL).observe(0.42)
        health.TTFT.labels(route=route, model=LONG_MODEL).observe(0.123)
        health.REQUESTS.labels(route=route, status="200", code="").inc()
    health.REQUESTS.labels(route="/v1/completions", status="429", code="rate_limit_requests").inc()
    acme = Tenant.objects.get(slug="acme")  # served: a key and a model
    api_key_create(actor=actor, tenant=acme)
    grant_create(actor=actor, tenant=acme, deployment=ModelDeployment.objects.get(name="tiny-llama"))
    tenant_create(actor=actor, slug="newco", name="New Co")
    revision_create(actor=actor, deployment=ModelDeployment.objects.get(name="small-llama"), label="r2", seed=3)
    return ids


FIT = """(sel) => {
    const doc = document.documentElement;
    const over = [...document.querySelectorAll(sel)].filter(e => e.offsetParent !== null)
        .filter(e => e.scrollWidth > e.clientWidth + 1)
        .map(e => (e.querySelector('table') || e).className + ' ' + e.scrollWidth + '>' + e.clientWidth);
    return {page: doc.scrollWidth, window: doc.clientWidth, over};
}"""

PAGES = ("/ui/", "/ui/tenants/acme/", "/ui/tenants/newco/", "/ui/models/", "/ui/jobs/", "/ui/tenants/", "/ui/audit/",
         "/ui/tokens/", "/ui/users/", "/ui/tenants/acme/flush/")


def _fits(page, path: str, width: int, scrollers: bool) -> None:
    sizes = page.evaluate(FIT, ".scroll")
    assert sizes["page"] <= sizes["window"] <= width, (path, sizes)  # the page never scrolls sideways
    if scrollers:
        assert sizes["over"] == [], (path, sizes)  # nor does any table's box


def _open(page, url: str) -> None:
    page.goto(url)
    page.wait_for_load_state("networkidle")


@pytest.mark.parametrize("width", (*WIDTHS, 400))
def test_no_page_is_wider_than_the_window_nor_any_table_than_its_box(chromium, live_server, console, logged_in_page,
                                                                      width):
    assert require_chromium() == chromium
    page = logged_in_page(width)
    for path in PAGES:
        _open(page, f"{live_server.url}{path}")
        shot(page, f"fit-{path.strip('/').replace('/', '-') or 'root'}-{width}")
        _fits(page, path, width, scrollers=width in WIDTHS)


@pytest.mark.parametrize("width", WIDTHS)
def test_the_dashboard_shows_every_latency_column_whole(chromium, live_server, console, logged_in_page, width):
    assert require_chromium() == chromium
    from playwright.sync_api import expect

    page = logged_in_page(width)
    _open(page, f"{live_server.url}/ui/")
    table = page.locator("table.serving-latency")
    expect(table).to_contain_text(LONG_MODEL)
    box = page.evaluate("""() => {
        const t = document.querySelector('table.serving-latency'), box = t.parentElement;
        const right = box.getBoundingClientRect().right;
        return {box: box.clientWidth, inBox: box.scrollWidth,
                ends: [...t.querySelectorAll('thead th')].map(th => th.getBoundingClientRect().right - right)};
    }""")
    assert box["inBox"] <= box["box"] and max(box["ends"]) <= 1, box  # p99 and TTFT p99 in view
    table.scroll_into_view_if_needed()
    shot(page, f"dashboard-latency-{width}", full_page=False)


@pytest.mark.parametrize("width", WIDTHS)
def test_the_tenant_page_shows_jobs_freed_figures_and_readable_byte_axes(chromium, live_server, console,
                                                                         logged_in_page, width):
    assert require_chromium() == chromium
    from playwright.sync_api import expect

    page = logged_in_page(width)
    _open(page, f"{live_server.url}/ui/tenants/acme/")
    row = page.locator("section[aria-labelledby=h-jobs] table.jobs tbody tr").first
    expect(row).to_contain_text("1,234")  # blocks freed
    expect(row).to_contain_text("5.0 MiB")  # bytes freed (L3)

    resident = page.locator("#tenant-acme-resident")
    expect(resident.locator(".chart-plot canvas")).to_be_visible()
    axis = page.evaluate("""() => {
        const plot = document.getElementById('tenant-acme-resident').strataPlot, y = plot.axes[1];
        const ctx = document.createElement('canvas').getContext('2d');
        ctx.font = '12px ' + getComputedStyle(plot.root).fontFamily;
        return {labels: y._values, size: y._size,
                widest: Math.max(...y._values.map(v => ctx.measureText(String(v)).width))};
    }""")
    assert any(re.fullmatch(r"\d+(\.\d+)? MiB", v) for v in axis["labels"]), axis
    assert "48 MiB" in axis["labels"] or any(v.endswith("MiB") for v in axis["labels"]), axis
    assert axis["widest"] + 10 <= axis["size"], axis  # the label and its tick fit the axis
    latest = resident.locator(".chart-latest")
    expect(latest).to_contain_text("48.0 MiB")
    expect(latest).to_contain_text(re.compile(r"\(at \d{4}-\d\d-\d\d \d\d:\d\d\)"))
    resident.scroll_into_view_if_needed()
    shot(page, f"tenant-resident-{width}", full_page=False)


@pytest.mark.parametrize("width", WIDTHS)
def test_a_new_tenants_next_steps_come_first_and_its_empty_charts_are_one_line(chromium, live_server, console,
                                                                               logged_in_page, width):
    assert require_chromium() == chromium
    from playwright.sync_api import expect

    page = logged_in_page(width)
    _open(page, f"{live_server.url}/ui/tenants/newco/")
    shot(page, f"tenant-new-{width}")
    key_button = page.get_by_role("button", name="Create API key")
    expect(key_button).to_be_in_viewport()  # no scrolling past charts to find it
    expect(page.get_by_role("button", name="Grant model")).to_be_visible()
    tops = page.evaluate("""() => ['#h-next', '#h-keys', '#h-charts'].map(
        s => document.querySelector(s).getBoundingClientRect().top)""")
    assert tops[0] < tops[1] < tops[2], tops
    heights = page.eval_on_selector_all("#h-charts ~ .chartset figure.chart",
                                        "els => els.map(e => e.getBoundingClientRect().height)")
    assert heights and max(heights) < 60, heights  # one line: its title and "no data"
    expect(page.locator("#h-charts ~ .chartset figure.chart").first.locator(".chart-empty")).to_be_visible()

    # acme has a key and a model: no "next steps", its keys in the grid below its charts
    _open(page, f"{live_server.url}/ui/tenants/acme/")
    expect(page.locator("#h-next")).to_have_count(0)


def test_flush_this_tenant_needs_the_typed_slug_and_queues_a_tenant_flush(chromium, live_server, console,
                                                                          logged_in_page):
    assert require_chromium() == chromium
    from playwright.sync_api import expect

    page = logged_in_page(1024)
    _open(page, f"{live_server.url}/ui/tenants/acme/")
    page.get_by_role("link", name=re.compile("Flush acme")).click()
    page.locator("input[name=confirm]").fill("acm")
    page.get_by_role("button", name="Flush acme").click()
    expect(page.locator("form.confirm-form")).to_contain_text("Type acme exactly")
    shot(page, "tenant-flush-refused")
    page.locator("input[name=confirm]").fill("acme")
    page.locator("input[name=reason]").fill("stale answers after a bad deploy")
    page.get_by_role("button", name="Flush acme").click()
    expect(page).to_have_url(re.compile(r"/ui/jobs/\d+/$"))
    expect(page.locator("main")).to_contain_text("acme")
    shot(page, "tenant-flush-job")


@pytest.mark.parametrize("width", WIDTHS)
def test_the_models_page_folds_each_models_forms_and_always_offers_the_reset(chromium, live_server, console,
                                                                             logged_in_page, width):
    assert require_chromium() == chromium
    from playwright.sync_api import expect

    page = logged_in_page(width)
    _open(page, f"{live_server.url}/ui/models/")
    shot(page, f"models-folded-{width}")
    # tiny-llama has no newer revision: the reset's place offers adding one
    tiny = page.locator("#m-tiny-llama")
    expect(tiny.locator(".model-primary")).to_contain_text("Model updated — reset the cache")
    add = tiny.locator("form[aria-label='Add a revision to tiny-llama']")
    expect(add).to_be_visible()
    # small-llama has r2: the reset itself
    small = page.locator("#m-small-llama")
    expect(small.get_by_role("button", name=re.compile("reset the cache"))).to_be_visible()
    # the rest is folded away until asked for
    expect(tiny.locator("form[aria-label='Delete tiny-llama']")).to_be_hidden()
    expect(tiny.locator("form[aria-label='Scale tiny-llama']")).to_be_hidden()
    tiny.locator("details.model-more > summary").click()
    expect(tiny.locator("form[aria-label='Delete tiny-llama']")).to_be_visible()

    # adding a revision from there turns it into the rollout
    add.locator("input[name=label]").fill("r2")
    add.locator("input[name=seed]").fill("11")
    add.get_by_role("button", name="Add revision").click()
    rollout = page.locator("form[aria-label='Roll out a revision of tiny-llama']")
    expect(rollout.locator("select[name=revision]")).to_have_value("r2")
    expect(rollout.get_by_role("button", name=re.compile("reset the cache"))).to_be_visible()
