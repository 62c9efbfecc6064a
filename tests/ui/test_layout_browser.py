"""Layout in a real browser (the machine's Chromium, driven by Playwright) against the live server,
no Ray or Celery needed: the jobs page fits a 1,000 px wide window (its table scrolls inside its own
box and wraps long cells; nothing runs off the page) and stays readable at 1,400 px, and the admin
API's docs page shows the bearer header with its placeholder. A missing Chromium skips these tests
with one line naming it, except under CI=true, where they FAIL (as tests/ui/test_browser.py).

Screenshots of each checked page go to ``$STRATA_SCREENSHOTS`` (default /tmp/strata-screenshots), an
artifact of the run, never committed."""

from __future__ import annotations

import pytest

from tests.ui.conftest import require_chromium, shot

LONG = "orders-and-invoices-for-the-northern-european-region-2024-q3-eu"  # 63 characters, a slug's most
MODEL = "llama-3.1-70b-instruct-awq-int4-long-context"


@pytest.fixture
def many_jobs(actor):
    """One job of every kind with the longest targets, reasons, requesters and figures the console
    shows: a 63-character tenant slug, a long model name and revision label, millions of blocks freed."""
    from controlplane.jobs.models import FlushJob
    from controlplane.registry.services import model_create, revision_create
    from controlplane.tenants.services import tenant_create

    tenant = tenant_create(actor=actor, slug=LONG, name="Orders and invoices")
    deployment = model_create(actor=actor, name=MODEL, preset="tiny", revision={"label": "r1", "seed": 7})
    old = deployment.revisions.get(label="r1")
    new = revision_create(actor=actor, deployment=deployment, label="2024-09-30-finetune-v2-with-long-label",
                          seed=8)
    common = dict(reason="customer asked for erasure under GDPR article 17 after the contract ended last quarter",
                  requested_by="operator-with-a-rather-long-login-name@example.com", status="succeeded",
                  progress_done=12, progress_total=12, verified=True,
                  results={f"cache-worker:{MODEL}:{i}": {"worker": f"cache-worker:{MODEL}:{i}", "status": "ok",
                                                          "blocks_freed": 1_234_567, "l3_bytes": 987_654_321_000}
                           for i in range(3)})
    rows = [dict(kind=kind, scope="tenant", tenant=tenant, key_version=12)
            for kind in ("flush", "offboard", "shred", "l3_delete", "l3_expire")]
    rows += [dict(kind="rollout", scope="model", deployment=deployment, revision=new, from_revision=old),
             dict(kind="flush", scope="revision", deployment=deployment, revision=new),
             dict(kind="flush", scope="all", status="running", progress_done=1, verified=False)]
    return [FlushJob.objects.create(**{**common, **row}) for row in rows]


def _jobs_table_box(page) -> dict:
    """Widths in the page: the document, the window, the jobs table's scrolling box and what is in it."""
    return page.evaluate("""() => {
        const doc = document.documentElement, box = document.querySelector('#jobs-live .scroll');
        const table = box.querySelector('table.jobs'), last = table.querySelector('thead th:last-child');
        return {page: doc.scrollWidth, window: doc.clientWidth, overflowX: getComputedStyle(box).overflowX,
                box: box.clientWidth, inBox: box.scrollWidth,
                lastColumnEnd: last.getBoundingClientRect().right - box.getBoundingClientRect().left};
    }""")


@pytest.mark.parametrize("width", [1000, 1400])
def test_the_jobs_table_fits_the_window(chromium, live_server, many_jobs, logged_in_page, width):
    """Nothing runs off the page, and the table fits its own scrolling box: every column, the last
    (Requested) included, is in view without scrolling; long targets and requesters wrap instead."""
    assert require_chromium() == chromium
    page = logged_in_page(width)
    page.goto(f"{live_server.url}/ui/jobs/")
    page.locator("#jobs-live table.jobs tbody tr").first.wait_for()
    shot(page, f"jobs-{width}")
    sizes = _jobs_table_box(page)
    assert sizes["page"] <= width and sizes["window"] == width, sizes
    assert sizes["overflowX"] == "auto", sizes  # a narrower window scrolls the table, not the page
    assert sizes["inBox"] <= sizes["box"] and sizes["lastColumnEnd"] <= sizes["box"] + 1, sizes
    assert page.locator("#jobs-live table.jobs tbody tr").count() == len(many_jobs)
    lines = page.eval_on_selector_all("td.requested .nowrap", "els => els.map(e => e.getClientRects().length)")
    assert set(lines) == {1}, lines  # each date and time on one line


def test_the_api_docs_page_shows_the_bearer_header_with_its_placeholder(chromium, live_server, logged_in_page):
    """Swagger UI renders the API description as Markdown: the header must keep its placeholder
    (a bare ``<operator token>`` is dropped as an unknown HTML tag, leaving "Bearer ,")."""
    assert require_chromium() == chromium
    from playwright.sync_api import expect

    page = logged_in_page(1400)
    page.goto(f"{live_server.url}/api/admin/docs")
    description = page.locator(".swagger-ui .info .description")
    expect(description).to_contain_text("Authorization: Bearer <operator token>")
    shot(page, "api-docs", full_page=False)
    assert "Bearer ," not in description.inner_text()
