"""Server-rendered SVG charts (``controlplane.ui.charts``): the renderer on its own (valid SVG,
points scaled into the plot, gaps, empty series, escaping, ticks), then the dashboard and the tenant
charts over samples of canned worker snapshots (only ``controlplane.runtime.gateway.call`` is
replaced, as in test_dashboard_tiers.py), with the tier capacity bars and load-vs-recompute figures."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from datetime import UTC, datetime, timedelta

import pytest
from django.template.loader import render_to_string

from controlplane.ui.charts import EMPTY_TEXT, Line, line_chart, tenant_charts, time_ticks, value_ticks
from tests.controlplane.test_stats import canned_snapshots, install_gateway, setup_cluster
from tests.controlplane.test_timeseries import bump

SVG = "{http://www.w3.org/2000/svg}"
T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)


def _svg(markup: str) -> ET.Element:
    root = ET.fromstring(markup)  # raises on anything that is not well-formed XML
    assert root.tag == f"{SVG}svg"
    return root


def _points(element: ET.Element) -> list[tuple[float, float]]:
    return [tuple(map(float, pair.split(","))) for pair in element.get("points").split()]


def _plot_box(root: ET.Element) -> tuple[float, float, float, float]:
    """(left, right, top, bottom) of the plot: the x axis line and the outermost grid lines."""
    grid = root.find(f"{SVG}g[@class='chart-grid']")
    ys = [float(line.get("y1")) for line in grid]
    first = grid[0]
    return float(first.get("x1")), float(first.get("x2")), min(ys), max(ys)


# ---------------------------------------------------------------------- the renderer
def test_points_are_scaled_into_the_plot_area():
    root = _svg(line_chart([Line("a", [(0, 0.0), (50, 5.0), (100, 10.0)])], x_range=(0, 100), y_range=(0, 10)))
    left, right, top, bottom = _plot_box(root)
    (polyline,) = root.iter(f"{SVG}polyline")
    assert polyline.get("data-series") == "a"
    (x0, y0), (x1, y1), (x2, y2) = _points(polyline)
    assert (x0, y0) == (left, bottom) and (x2, y2) == (right, top)
    assert x1 == pytest.approx((left + right) / 2, abs=0.1) and y1 == pytest.approx((top + bottom) / 2, abs=0.1)


def test_the_y_axis_fits_the_data_to_nice_ticks_unless_fixed():
    root = _svg(line_chart([Line("a", [(0, 3.0), (1, 87.0)])], x_range=(0, 1)))
    labels = [t.text for t in root.find(f"{SVG}g[@class='chart-axis']").iter(f"{SVG}text")]
    assert labels[:5] == ["0", "25", "50", "75", "100"]  # 0 .. 87 on a nice step: 0 .. 100 by 25
    assert value_ticks(0, 0.93, target=5) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert value_ticks(0, 0) == [0, 0.25, 0.5, 0.75, 1.0]  # a flat zero line still has an axis
    assert value_ticks(0, 1, target=4) != value_ticks(0, 1, target=10)


def test_time_ticks_fall_on_round_minutes_inside_the_window():
    start = T0.timestamp() + 17
    ticks = time_ticks(start, start + 3600)
    assert len(ticks) == 6 and all(t % 600 == 0 for t in ticks)  # every 10 minutes
    assert start <= ticks[0] and ticks[-1] <= start + 3600


def test_a_missing_value_breaks_the_line_and_a_lone_point_is_marked():
    root = _svg(line_chart([Line("a", [(0, 1.0), (1, 2.0), (2, None), (3, 2.0), (4, None), (5, 1.0), (6, 1.5)])],
                           x_range=(0, 6)))
    polylines = list(root.iter(f"{SVG}polyline"))
    assert [len(_points(p)) for p in polylines] == [2, 2]
    (circle,) = root.iter(f"{SVG}circle")  # the point at x=3 has no neighbour to join
    assert circle.get("data-series") == "a"


def test_points_outside_the_window_are_dropped():
    root = _svg(line_chart([Line("a", [(-10, 9.0), (0, 1.0), (10, 2.0)])], x_range=(0, 10)))
    (polyline,) = root.iter(f"{SVG}polyline")
    assert len(_points(polyline)) == 2


def test_an_empty_series_draws_the_axes_and_says_there_is_nothing_yet():
    for lines in ([], [Line("a", [])], [Line("a", [(0, None), (1, None)])]):
        markup = line_chart(lines, x_range=(0, 3600), label="Requests")
        root = _svg(markup)
        assert EMPTY_TEXT in markup and not list(root.iter(f"{SVG}polyline"))
        assert root.find(f"{SVG}title").text == "Requests"
    assert EMPTY_TEXT not in line_chart([Line("a", [(0, 0.0)])], x_range=(0, 1))


def test_labels_are_escaped_and_every_line_has_a_legend_entry():
    markup = line_chart([Line("<script>alert(1)</script>", [(0, 1.0), (1, 2.0)]), Line("b & c", [(0, 2.0)])],
                        x_range=(0, 1), label='a "quoted" <title>')
    assert "<script>" not in markup
    root = _svg(markup)
    legend = [t.text for t in root.find(f"{SVG}g[@class='chart-legend']").iter(f"{SVG}text")]
    assert legend == ["<script>alert(1)</script>", "b & c"]
    colours = [r.get("fill") for r in root.find(f"{SVG}g[@class='chart-legend']").iter(f"{SVG}rect")]
    assert len(set(colours)) == 2
    assert root.get("aria-label") == 'a "quoted" <title>'


def test_a_long_legend_wraps_and_the_chart_grows_to_hold_it():
    short = _svg(line_chart([Line("a", [(0, 1.0)])], x_range=(0, 1)))
    many = _svg(line_chart([Line(f"tenant-number-{i}", [(0, 1.0)]) for i in range(10)], x_range=(0, 1)))
    height = lambda root: float(root.get("viewBox").split()[3])  # noqa: E731
    rows = {float(r.get("y")) for r in many.find(f"{SVG}g[@class='chart-legend']").iter(f"{SVG}rect")}
    assert len(rows) > 1 and height(many) > height(short)


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


def _figure(html: str, chart_id: str) -> str:
    match = re.search(rf'<figure class="chart[^"]*" id="{chart_id}">(.*?)</figure>', html, re.S)
    assert match, chart_id
    return match.group(1)


def _latest(figure: str) -> str:
    match = re.search(r'<p class="chart-latest">(.*?)</p>', figure, re.S)
    assert match
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", match.group(1))).strip()


@pytest.mark.parametrize("url", ["/ui/", "/ui/live/"])
def test_dashboard_charts_the_last_hour_from_counter_deltas(viewer_ui, sampled, url):
    html = viewer_ui.get(url).content.decode()
    hit = _figure(html, "chart-hit-ratio")
    _svg(hit[hit.index("<svg"):hit.index("</svg>") + 6])
    assert 'data-series="acme"' in hit and 'data-series="beta"' in hit and 'data-series="all tenants"' in hit
    # token-weighted over the interval: acme 360/400, beta 0/100, all 360/500
    assert "all tenants 72.0%" in _latest(hit) and "acme 90.0%" in _latest(hit) and "beta 0.0%" in _latest(hit)
    assert "requests 0.133/s" in _latest(_figure(html, "chart-requests"))  # 4 requests in 30 s
    assert "presented 16.7/s · prefill skipped 12/s" in _latest(_figure(html, "chart-tokens"))
    assert "saved 1.00 s/min" in _latest(_figure(html, "chart-saved"))
    assert "L1 device pages 10/s" in _latest(_figure(html, "chart-tier-hits"))  # 300 hit tokens / 30 s
    assert "L1 device pages 8/min" in _latest(_figure(html, "chart-evictions"))
    assert "L1 device pages 40.0%" in _latest(_figure(html, "chart-tier-use"))  # 80 KiB of 200 KiB
    assert "loaded 0/min" in _latest(_figure(html, "chart-decisions"))
    assert "No samples yet" not in html


def test_dashboard_without_samples_says_the_sampler_has_not_run(admin_ui, actor, monkeypatch):
    setup_cluster(actor, monkeypatch)
    html = admin_ui.get("/ui/").content.decode()
    assert "No samples yet" in html and EMPTY_TEXT in _figure(html, "chart-hit-ratio")
    assert "<polyline" not in html


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
    charts = tenant_charts("acme")
    assert [c["id"] for c in charts] == ["tenant-acme-hit-ratio", "tenant-acme-saved", "tenant-acme-requests",
                                         "tenant-acme-tokens", "tenant-acme-resident"]
    html = render_to_string("ui/_charts.html", {"charts": charts})
    hit = _latest(_figure(html, "tenant-acme-hit-ratio"))
    assert "prefill skipped 90.0%" in hit and "index held 95.0%" in hit
    assert "requests 0.0333/s" in _latest(_figure(html, "tenant-acme-requests"))  # 1 request in 30 s, not beta's 3
    assert "L1 device pages 40.0 KiB" in _latest(_figure(html, "tenant-acme-resident"))
    assert "beta" not in html
    other = tenant_charts("beta")
    assert "prefill skipped 0.0%" in _latest(_figure(render_to_string("ui/_charts.html", {"charts": other}),
                                                      "tenant-beta-hit-ratio"))
    assert all(c["empty"] for c in tenant_charts("nobody"))


def test_a_bytes_axis_ticks_on_round_binary_units():
    from controlplane.ui.charts import byte_unit
    from controlplane.ui.present import human_bytes

    values = [(0, 40 * 1024.0), (1, 8 * 1024.0)]
    assert byte_unit([40 * 1024, 8 * 1024]) == 1024 and byte_unit([]) == 1 and byte_unit([3 * 2**30]) == 2**30
    root = _svg(line_chart([Line("l1", values)], x_range=(0, 1), y_format=human_bytes, y_unit=1024))
    labels = [t.text for t in root.find(f"{SVG}g[@class='chart-axis']").iter(f"{SVG}text")][:4]
    assert labels == ["0 B", "10.0 KiB", "20.0 KiB", "30.0 KiB"]
