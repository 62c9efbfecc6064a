"""The console's charts: the data on a fixed grid (``timeseries.selectors.series_bucketed``: sums,
gauges, gaps), the chart data (``ui.chart_spec``: units, stable tenant colours, wire rounding, table
rows), then the dashboard's and a tenant's charts over samples of canned worker snapshots (only
``controlplane.runtime.gateway.call`` is replaced, as in test_dashboard_tiers.py): the JSON charts.js
draws, the per-chart tables (the no-JavaScript fallback), the range selector and its JSON endpoint,
offboarded tenants labelled, and the tier capacity bars and load-vs-recompute figures. The browser
test (test_browser.py) checks that uPlot draws them, hover values and the range switch."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta

import pytest
from django.template.loader import render_to_string

from controlplane.timeseries.selectors import Series, series_bucketed
from controlplane.ui.chart_spec import PALETTE, Chart, Line, tenant_color
from controlplane.ui.trend_charts import RANGES, range_choice, tenant_charts, window_step
from tests.controlplane.test_stats import canned_snapshots, install_gateway, setup_cluster
from tests.controlplane.test_timeseries import bump

T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)


# ---------------------------------------------------------------------- the grid
def _series(points: list[tuple[int, float, dict | None]]) -> Series:
    """(seconds after T0 at which the interval ends, its length, its values) per interval."""
    return Series(times=tuple(T0 + timedelta(seconds=t) for t, _, _ in points),
                  seconds=tuple(s for _, s, _ in points),
                  scopes={("total", ""): tuple(v for _, _, v in points)})


def test_buckets_sum_counter_deltas_keep_the_last_gauge_and_leave_empty_buckets_as_gaps():
    series = _series([(30, 30, {"requests": 1, "used_bytes": 10}), (60, 30, {"requests": 2, "used_bytes": 20}),
                      (90, 30, {"requests": 4, "used_bytes": 5}), (210, 30, {"requests": 8, "used_bytes": 7})])
    grid = series_bucketed(series, start=T0, width=60, count=4)
    assert [t - T0 for t in grid.times] == [timedelta(seconds=s) for s in (60, 120, 180, 240)]
    assert grid.scope("total") == ({"requests": 3, "used_bytes": 20}, {"requests": 4, "used_bytes": 5}, None,
                                   {"requests": 8, "used_bytes": 7})
    assert grid.seconds == (60, 30, 0, 30)


def test_an_interval_spanning_a_sampler_stop_is_a_gap_not_an_averaged_point():
    series = _series([(30, 30, {"requests": 1}), (3630, 3600, {"requests": 500}), (3660, 30, {"requests": 2})])
    grid = series_bucketed(series, start=T0, width=30, count=122, max_seconds=75)
    values = grid.scope("total")
    assert values[0] == {"requests": 1} and values[121] == {"requests": 2}
    assert all(v is None for v in values[1:121])  # the stop and the interval across it
    outside = series_bucketed(series, start=T0 + timedelta(hours=2), width=30, count=2)
    assert outside.scope("total") == (None, None)  # intervals outside the grid are left out


def test_ranges_keep_at_most_about_300_points_on_multiples_of_the_sample_interval(settings):
    settings.STRATA_SAMPLE_INTERVAL_SECONDS = 30
    assert [window_step(r) for r in RANGES] == [30, 90, 300]
    assert all(RANGES[r] // window_step(r) <= 300 for r in RANGES)
    assert range_choice("6h") == "6h" and range_choice("1y") == "1h" and range_choice(None) == "1h"


# ---------------------------------------------------------------------- chart data
def test_tenant_colours_are_stable_and_the_first_tenants_all_differ():
    assert len({tenant_color("t", pk) for pk in range(1, len(PALETTE) + 1)}) == len(PALETTE)
    assert tenant_color("acme", 3) == tenant_color("renamed", 3) == PALETTE[2]
    assert tenant_color("gone") == tenant_color("gone") in PALETTE  # no row: by its slug


def test_a_chart_refuses_a_line_of_the_wrong_length_and_rounds_for_the_wire():
    with pytest.raises(ValueError, match="2 values for 3"):
        Chart(id="c", title="t", hint="h", x=[1, 2, 3], lines=[Line("a", [1.0, 2.0], "#000")])
    with pytest.raises(ValueError, match="unknown unit"):
        Chart(id="c", title="t", hint="h", x=[], lines=[], unit="furlongs")
    chart = Chart(id="c", title="t", hint="h", x=[1.0, 2.0, 3.0], unit="percent",
                  lines=[Line("a", [1 / 3, None, float("nan")], "#000"), Line("b", [None, None, 0.5], "#111")])
    wire = chart.to_json()
    assert wire["series"][0]["values"] == [0.3333, None, None] and wire["x"] == [1, 2, 3]
    assert [r["cells"] for r in chart.rows()] == [["—", "50.0%"], ["33.3%", "—"]]  # newest first, gaps skipped
    # every line at the newest time with data (3), never a's older point beside b's newer one
    assert chart.latest() == [("a", "—"), ("b", "50.0%")] and not chart.empty
    assert chart.latest_at().timestamp() == 3.0
    assert Chart(id="e", title="t", hint="h", x=[1.0], lines=[Line("a", [None], "#000")]).empty


# ---------------------------------------------------------------------- dashboard and tenant charts
@pytest.fixture
def sampled(db, actor, monkeypatch):
    """Two samples 30 s apart: acme sent 400 prompt tokens (360 skipped), beta 100 (none skipped)."""
    from controlplane.timeseries.services import sample_take

    ids = setup_cluster(actor, monkeypatch)
    sample_take(now=T0)
    snaps = canned_snapshots(ids)
    bump(snaps["tiny-llama"], ids["acme"], requests=1, query_tokens=400, effective_hit_tokens=360,
         lookup_hit_tokens=380, load_success_tokens=360, saved_prefill_seconds=0.5)
    bump(snaps["tiny-llama"], ids["beta"], requests=3, query_tokens=100)
    snaps["tiny-llama"]["tiers"]["l1"].update(hit_tokens=400 + 300, evictions=5 + 4)
    install_gateway(monkeypatch, snaps)
    sample_take(now=T0 + timedelta(seconds=30))
    return ids



def _doc(html: str, script_id: str = "trends-data") -> dict:
    match = re.search(rf'<script id="{script_id}" type="application/json">(.*?)</script>', html, re.S)
    assert match, script_id
    return json.loads(match.group(1))


def _spec(doc: dict, chart_id: str) -> dict:
    return next(c for c in doc["charts"] if c["id"] == chart_id)


def _last(spec: dict, label: str) -> float | None:
    values = next(s["values"] for s in spec["series"] if s["label"] == label)
    return next((v for v in reversed(values) if v is not None), None)


def _figure(html: str, chart_id: str) -> str:
    match = re.search(rf'<figure class="chart[^"]*" id="{chart_id}" data-chart="{chart_id}">(.*?)</figure>', html, re.S)
    assert match, chart_id
    return match.group(1)


def _latest(figure: str) -> str:
    match = re.search(r'<p class="chart-latest"[^>]*>(.*?)</p>', figure, re.S)
    assert match
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", match.group(1))).strip()


def test_dashboard_charts_carry_the_counter_deltas_as_json_and_as_tables(viewer_ui, sampled):
    html = viewer_ui.get("/ui/").content.decode()
    doc = _doc(html)
    assert doc["range"] == "1h" and doc["ranges"] == ["1h", "6h", "24h"] and doc["step"] == 30
    hit = _spec(doc, "chart-hit-ratio")
    assert hit["unit"] == "percent" and hit["y_max"] == 1.0 and len(hit["x"]) == 120
    # token-weighted over the interval: acme 360/400, beta 0/100, all 360/500
    assert (_last(hit, "all tenants"), _last(hit, "acme"), _last(hit, "beta")) == (0.72, 0.9, 0.0)
    assert sum(v is not None for v in hit["series"][0]["values"]) == 1  # one interval: the rest are gaps
    colours = {s["label"]: s["color"] for s in hit["series"]}
    assert colours["acme"] == tenant_color("acme", sampled_pk("acme")) != colours["beta"]
    assert _last(_spec(doc, "chart-requests"), "requests") == pytest.approx(0.1333, abs=1e-4)  # 4 in 30 s
    tokens = _spec(doc, "chart-tokens")
    assert (_last(tokens, "presented"), _last(tokens, "prefill skipped")) == (pytest.approx(16.67, abs=0.01), 12.0)
    assert _last(_spec(doc, "chart-saved"), "saved") == 1.0
    assert _last(_spec(doc, "chart-tier-hits"), "L1 device pages") == 10.0  # 300 hit tokens / 30 s
    assert _last(_spec(doc, "chart-evictions"), "L1 device pages") == 8.0
    assert _last(_spec(doc, "chart-tier-use"), "L1 device pages") == 0.4  # 80 KiB of 200 KiB
    # the same figures without JavaScript: the latest values and each chart's table
    figure = _figure(html, "chart-hit-ratio")
    assert "all tenants 72.0%" in _latest(figure) and "acme 90.0%" in _latest(figure)
    table = re.search(r'<details class="chart-table">(.*?)</details>', figure, re.S).group(1)
    assert re.search(r"<th scope=\"row\" class=\"nowrap\">2026-12-01 12:00:30</th><td class=\"num\">72.0%</td>", table)
    assert 'aria-current="true">1h</a>' in html and 'href="?range=6h#trends"' in html
    assert "ui/charts.js" in html and "vendor/uplot/uPlot.iife.min.js" in html


def sampled_pk(slug: str) -> int:
    from controlplane.tenants.models import Tenant

    return Tenant.objects.get(slug=slug).pk


def test_the_range_selector_works_without_javascript_and_through_the_json_endpoint(viewer_ui, sampled):
    six = _doc(viewer_ui.get("/ui/?range=6h").content.decode())
    assert six["range"] == "6h" and six["step"] == 90 and len(_spec(six, "chart-hit-ratio")["x"]) == 240
    assert _last(_spec(six, "chart-hit-ratio"), "acme") == 0.9  # the interval sits in one 90 s point
    response = viewer_ui.get("/ui/charts/cluster.json?range=24h")
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    day = response.json()
    assert day["range"] == "24h" and day["step"] == 300 and len(_spec(day, "chart-requests")["x"]) == 288
    assert viewer_ui.get("/ui/charts/cluster.json?range=<script>").json()["range"] == "1h"  # never an error
    tenant = viewer_ui.get("/ui/charts/tenants/acme.json?range=1h").json()
    assert [c["id"] for c in tenant["charts"]][0] == "tenant-acme-hit-ratio"
    assert viewer_ui.get("/ui/charts/tenants/nobody.json").status_code == 404


def test_the_chart_endpoints_need_an_operator(client, sampled):
    for url in ("/ui/charts/cluster.json", "/ui/charts/tenants/acme.json"):
        response = client.get(url)
        assert response.status_code == 302 and "/ui/login/" in response["Location"]


def test_an_offboarded_tenant_keeps_its_history_labelled_and_dashed(viewer_ui, sampled):
    from controlplane.tenants.models import Tenant

    Tenant.objects.filter(slug="beta").update(status=Tenant.Status.OFFBOARDED)
    hit = _spec(_doc(viewer_ui.get("/ui/").content.decode()), "chart-hit-ratio")
    beta = next(s for s in hit["series"] if s["label"].startswith("beta"))
    acme = next(s for s in hit["series"] if s["label"].startswith("acme"))
    assert beta["label"] == "beta (offboarded)" and beta["dashed"] and not acme["dashed"]


def test_dashboard_without_samples_says_the_sampler_has_not_run(admin_ui, actor, monkeypatch):
    setup_cluster(actor, monkeypatch)
    html = admin_ui.get("/ui/").content.decode()
    figure = _figure(html, "chart-hit-ratio")
    assert "No samples in this range yet" in figure and 'class="chart-empty empty">' in figure
    assert all(v is None for c in _doc(html)["charts"] for s in c["series"] for v in s["values"])


def test_dashboard_shows_tier_capacity_by_tenant_and_load_or_recompute(viewer_ui, actor, monkeypatch):
    setup_cluster(actor, monkeypatch)
    html = viewer_ui.get("/ui/live/").content.decode()
    l1 = re.search(r'id="capacity-l1">(.*?)</div>\s*</div>', html, re.S).group(1)
    assert "80.0 KiB of 200.0 KiB used (40.0%), 120.0 KiB free" in l1
    assert "acme: 40.0 KiB" in l1 and "beta: 10.0 KiB" in l1 and "not attributed: 30.0 KiB" in l1
    assert 'style="width: 20.0%; background:' in l1  # acme's 40 KiB of 200 KiB
    decisions = re.sub(r"<[^>]+>", " ", re.search(r'id="decisions">(.*?)</dl>', html, re.S).group(1))
    assert re.search(r"Loaded\s+10\s+62.5%", decisions) and re.search(r"Recomputed\s+6\s+37.5%", decisions)
    assert "tiny-llama: cost" in decisions and "down-llama" not in decisions


def test_tenant_charts_show_one_tenant_and_render_through_the_include(sampled):
    from controlplane.ui.chart_views import chartset

    charts = tenant_charts("acme")
    assert [c.id for c in charts] == ["tenant-acme-hit-ratio", "tenant-acme-saved", "tenant-acme-requests",
                                      "tenant-acme-tokens", "tenant-acme-resident"]
    html = render_to_string("ui/_charts.html", {"chartset": chartset("t", charts, range_name="1h")})
    hit = _latest(_figure(html, "tenant-acme-hit-ratio"))
    assert "prefill skipped 90.0%" in hit and "index held 95.0%" in hit
    assert "requests 0.0333/s" in _latest(_figure(html, "tenant-acme-requests"))  # 1 request in 30 s, not beta's 3
    assert "L1 device pages 40.0 KiB" in _latest(_figure(html, "tenant-acme-resident"))
    assert "beta" not in html
    other = tenant_charts("beta")
    assert "prefill skipped 0.0%" in _latest(_figure(render_to_string("ui/_charts.html", {
        "chartset": chartset("t", other)}), "tenant-beta-hit-ratio"))
    assert all(c.empty for c in tenant_charts("nobody"))


def test_the_tenant_page_has_its_trends_and_its_cache_usage_charts(viewer_ui, sampled):
    html = viewer_ui.get("/ui/tenants/acme/?range=6h").content.decode()
    assert _doc(html)["range"] == "6h"
    usage = _doc(html, "cache-usage-charts-data")
    assert [c["id"] for c in usage["charts"]] == ["tenant-acme-cache-usage", "tenant-acme-miss-reasons"]
    assert "range" not in usage  # the ledger's 24 hours by hour: no range to pick
