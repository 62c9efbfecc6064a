// The console's line charts, drawn with uPlot (npm's uplot, through frontend/package-lock.json).
// Each [data-charts] container names the JSON script that ui/_charts.html rendered (chart_spec.py's
// shape: x in epoch seconds, series with label, colour, dashed and values, null = no data). Values
// show in the legend as the pointer moves (hover); null values are gaps, and a point with no
// neighbour is drawn as a dot. A trend set (data-charts-src) switches its range in place (the
// range links reload the page without JavaScript) and refreshes every data-refresh ms. Without the
// library the tables stay the figures and the page says why.
(function () {
  "use strict";

  var HEIGHT = 220;

  function si(v) {
    var a = Math.abs(v);
    var units = [["G", 1e9], ["M", 1e6], ["k", 1e3]];
    for (var i = 0; i < units.length; i++) {
      if (a >= units[i][1]) {
        return +(v / units[i][1]).toPrecision(3) + units[i][0];
      }
    }
    return v ? String(+v.toPrecision(3)) : "0";
  }

  function bytes(v) {
    var units = ["B", "KiB", "MiB", "GiB", "TiB"];
    var i = 0;
    while (Math.abs(v) >= 1024 && i < units.length - 1) {
      v /= 1024;
      i++;
    }
    return (i ? v.toFixed(1) : String(Math.round(v))) + " " + units[i];
  }

  function formatter(spec) {
    var suffix = spec.suffix || "";
    if (spec.unit === "percent") {
      return function (v) { return (100 * v).toFixed(1) + "%"; };
    }
    if (spec.unit === "bytes") {
      return bytes;
    }
    if (spec.unit === "seconds") {
      return function (v) { return v.toFixed(2) + " s" + suffix; };
    }
    return function (v) { return si(v) + suffix; };
  }

  // A bytes tick as short as it can be said: "48 MiB", "1.5 KiB".
  function bytesTick(v) {
    var units = ["B", "KiB", "MiB", "GiB", "TiB"];
    var i = 0;
    while (Math.abs(v) >= 1024 && i < units.length - 1) {
      v /= 1024;
      i++;
    }
    return +v.toPrecision(3) + " " + units[i];
  }

  function axisFormatter(spec) {
    if (spec.unit === "percent") {
      return function (v) { return Math.round(100 * v) + "%"; };
    }
    if (spec.unit === "bytes") {
      return bytesTick;
    }
    return si;
  }

  // The y axis as wide as its widest label (plus its ticks and gap), so no label is clipped on the left.
  var measurer = null;

  function axisSize(u, values, axisIdx) {
    var axis = u.axes[axisIdx];
    if (!values || !values.length) {
      return 40;
    }
    measurer = measurer || document.createElement("canvas").getContext("2d");
    var font = Array.isArray(axis.font) ? axis.font[0].replace(/(\d+)px/, (axis.font[2] || 12) + "px") : "12px sans-serif";
    measurer.font = font;
    var widest = 0;
    values.forEach(function (t) { widest = Math.max(widest, measurer.measureText(String(t)).width); });
    var ticks = axis.ticks && axis.ticks.show !== false ? axis.ticks.size || 10 : 0;
    return Math.ceil(widest + ticks + (axis.gap || 5) + 8);
  }

  function pad(n) {
    return (n < 10 ? "0" : "") + n;
  }

  function timeText(epoch) {
    var d = new Date(epoch * 1000);
    return d.getFullYear() + "-" + pad(d.getMonth() + 1) + "-" + pad(d.getDate()) + " " +
      pad(d.getHours()) + ":" + pad(d.getMinutes()) + ":" + pad(d.getSeconds());
  }

  // Indices of values with no non-null neighbour: a line cannot show them, a dot can.
  function isolated(values) {
    var out = [];
    for (var i = 0; i < values.length; i++) {
      if (values[i] !== null && (i === 0 || values[i - 1] === null) &&
          (i === values.length - 1 || values[i + 1] === null)) {
        out.push(i);
      }
    }
    return out;
  }

  function options(spec, width) {
    var fmt = formatter(spec);
    var series = [{ label: "Time", value: function (u, ts) { return ts == null ? "—" : timeText(ts); } }];
    spec.series.forEach(function (s) {
      var lone = isolated(s.values);
      series.push({
        label: s.label,
        stroke: s.color,
        width: 2,
        dash: s.dashed ? [6, 4] : undefined,
        spanGaps: false,
        value: function (u, v) { return v == null ? "—" : fmt(v); },
        points: { show: lone.length > 0, size: 6, fill: s.color, filter: function () { return lone; } },
      });
    });
    var top = spec.y_max;
    return {
      width: width,
      height: HEIGHT,
      series: series,
      legend: { live: true },
      cursor: { points: { size: 7 } },
      scales: {
        x: { time: true },
        y: {
          range: function (u, lo, hi) {
            if (top != null) {
              return [0, top];
            }
            return [Math.min(0, lo || 0), hi > 0 ? hi * 1.1 : 1];
          },
        },
      },
      axes: [{}, {
        size: axisSize,
        incrs: spec.unit === "bytes" ? BYTE_INCRS : undefined,
        values: function (u, ticks) { return ticks.map(axisFormatter(spec)); },
      }],
    };
  }

  // A bytes axis ticks on round binary units (256 KiB, 1 MiB, 2 MiB...), not on 1.9 MiB.
  var BYTE_INCRS = (function () {
    var out = [];
    for (var k = 0; k < 5; k++) {
      [1, 2, 4, 8, 16, 32, 64, 128, 256, 512].forEach(function (m) { out.push(m * Math.pow(1024, k)); });
    }
    return out;
  })();

  function data(spec) {
    return [spec.x].concat(spec.series.map(function (s) { return s.values; }));
  }

  function signature(spec) {
    return spec.series.map(function (s) { return s.label + "|" + s.color + "|" + s.dashed; }).join(";");
  }

  function text(el, value) {
    if (el) {
      el.textContent = value;
    }
  }

  function latest(figure, spec) {
    var p = figure.querySelector(".chart-latest");
    if (!p) {
      return;
    }
    var fmt = formatter(spec);
    // every line at one time, the newest where any has data: never one line's newest point beside
    // another's older one
    var at = -1;
    for (var k = spec.x.length - 1; k >= 0 && at < 0; k--) {
      if (spec.series.some(function (s) { return s.values[k] !== null; })) {
        at = k;
      }
    }
    var parts = spec.series.map(function (s) {
      var v = at < 0 ? null : s.values[at];
      return s.label + " " + (v === null || v === undefined ? "—" : fmt(v));
    });
    text(p, "Latest: " + parts.join(" · ") + (at < 0 ? "" : " (at " + timeText(spec.x[at]).slice(0, 16) + ")"));
  }

  function table(figure, spec) {
    var tbl = figure.querySelector(".chart-table table");
    if (!tbl) {
      return;
    }
    var fmt = formatter(spec);
    var head = "<tr><th scope=\"col\">Time</th>";
    var body = "";
    var esc = function (s) {
      return String(s).replace(/[&<>"]/g, function (c) {
        return { "&": "&amp;", "<": "&lt;", ">": "&gt;", "\"": "&quot;" }[c];
      });
    };
    spec.series.forEach(function (s) { head += "<th scope=\"col\" class=\"num\">" + esc(s.label) + "</th>"; });
    for (var k = spec.x.length - 1; k >= 0; k--) {
      var cells = spec.series.map(function (s) { return s.values[k]; });
      if (cells.every(function (v) { return v === null; })) {
        continue;
      }
      body += "<tr><th scope=\"row\" class=\"nowrap\">" + timeText(spec.x[k]) + "</th>" + cells.map(function (v) {
        return "<td class=\"num\">" + (v === null ? "—" : esc(fmt(v))) + "</td>";
      }).join("") + "</tr>";
    }
    if (!body) {
      body = "<tr><td colspan=\"" + (spec.series.length + 1) + "\" class=\"muted\">" + esc(spec.empty_text) + "</td></tr>";
    }
    tbl.innerHTML = "<thead>" + head + "</tr></thead><tbody>" + body + "</tbody>";
  }

  function ChartSet(container, doc) {
    this.container = container;
    this.plots = {}; // chart id -> {plot, signature}
    this.doc = doc;
  }

  ChartSet.prototype.draw = function (doc) {
    var self = this;
    self.doc = doc;
    doc.charts.forEach(function (spec) {
      var figure = self.container.querySelector("[data-chart=\"" + spec.id + "\"]");
      if (!figure) {
        return;
      }
      var holder = figure.querySelector(".chart-plot");
      var empty = spec.series.every(function (s) { return s.values.every(function (v) { return v === null; }); });
      figure.classList.toggle("chart-is-empty", empty);
      var emptyText = figure.querySelector(".chart-empty");
      if (emptyText) {
        emptyText.hidden = !empty;
        text(emptyText, spec.empty_text);
        emptyText.title = spec.empty_text; // a collapsed chart shows one line of it
      }
      var latestP = figure.querySelector(".chart-latest");
      if (latestP) {
        latestP.hidden = empty;
      }
      latest(figure, spec);
      table(figure, spec);
      var known = self.plots[spec.id];
      var sig = signature(spec);
      if (known && known.signature === sig) {
        known.plot.setData(data(spec));
        if (!empty && holder.clientWidth > 0 && Math.abs(known.plot.width - holder.clientWidth) > 2) {
          known.plot.setSize({ width: Math.max(240, holder.clientWidth), height: HEIGHT }); // shown again: its box's width
        }
        return;
      }
      if (known) {
        known.plot.destroy();
      }
      var width = Math.max(240, holder.clientWidth || figure.clientWidth || 480);
      self.plots[spec.id] = { plot: new window.uPlot(options(spec, width), data(spec), holder), signature: sig };
      figure.strataPlot = self.plots[spec.id].plot; // for the browser tests: its axes as drawn
    });
    var range = doc.range;
    if (range) {
      self.container.setAttribute("data-range", range);
      var links = self.container.querySelectorAll(".range a[data-range]");
      for (var i = 0; i < links.length; i++) {
        if (links[i].getAttribute("data-range") === range) {
          links[i].setAttribute("aria-current", "true");
        } else {
          links[i].removeAttribute("aria-current");
        }
      }
      text(self.container.querySelector(".range-step"), "one point per " + (doc.step >= 60 ? doc.step / 60 + " min" : doc.step + " s"));
    }
    self.container.setAttribute("data-drawn", String(Date.now()));
  };

  ChartSet.prototype.resize = function () {
    var self = this;
    Object.keys(self.plots).forEach(function (id) {
      var holder = self.plots[id].plot.root.parentNode;
      var width = Math.max(240, holder.clientWidth);
      self.plots[id].plot.setSize({ width: width, height: HEIGHT });
    });
  };

  ChartSet.prototype.load = function (range) {
    var self = this;
    var src = self.container.getAttribute("data-charts-src");
    if (!src) {
      return Promise.resolve();
    }
    var url = src + "?range=" + encodeURIComponent(range || self.doc.range || "");
    return fetch(url, { credentials: "same-origin", cache: "no-store", headers: { Accept: "application/json" } })
      .then(function (response) {
        if (response.redirected) { // the session expired: the login page came back
          window.location.reload();
          return null;
        }
        if (!response.ok) {
          throw new Error("HTTP " + response.status);
        }
        return response.json();
      })
      .then(function (doc) {
        if (doc) {
          self.draw(doc);
        }
      });
  };

  function start() {
    var containers = document.querySelectorAll("[data-charts]");
    for (var i = 0; i < containers.length; i++) {
      setup(containers[i]);
    }
  }

  function setup(container) {
    var script = document.getElementById(container.getAttribute("data-charts"));
    if (!script) {
      return;
    }
    if (!window.uPlot) {
      var note = container.querySelector(".chart-nolib");
      if (note) {
        note.hidden = false;
      }
      var tables = container.querySelectorAll(".chart-table");
      for (var t = 0; t < tables.length; t++) {
        tables[t].open = true;
      }
      return;
    }
    var set = new ChartSet(container, JSON.parse(script.textContent));
    container.classList.add("charts-drawn");
    set.draw(set.doc);
    window.addEventListener("resize", function () { set.resize(); });

    container.addEventListener("click", function (event) {
      var link = event.target.closest && event.target.closest(".range a[data-range]");
      if (!link || !container.getAttribute("data-charts-src")) {
        return;
      }
      event.preventDefault();
      var range = link.getAttribute("data-range");
      set.load(range).then(function () {
        var url = new URL(window.location.href);
        url.searchParams.set("range", range);
        window.history.replaceState(null, "", url.pathname + url.search + url.hash);
      }).catch(function () {
        window.location.href = link.href; // the page itself renders any range
      });
    });

    var every = parseInt(container.getAttribute("data-refresh") || "0", 10);
    if (every > 0 && container.getAttribute("data-charts-src")) {
      var tick = function () {
        if (!document.body.contains(container)) {
          return;
        }
        set.load().then(function () { window.setTimeout(tick, every); },
          function () { window.setTimeout(tick, Math.min(every * 2, 120000)); });
      };
      window.setTimeout(tick, every);
    }
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
