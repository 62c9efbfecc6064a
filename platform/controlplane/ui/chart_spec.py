"""What a console chart is, as data: :class:`Chart` (x values and :class:`Line` series, with units),
turned into the JSON that ``frontend/static/ui/charts.js`` draws with uPlot and into the rows of
the table each chart carries for readers of numbers (and for browsers without JavaScript).

Colours are stable: a tenant keeps its colour on every chart and page and across time
(:func:`tenant_color`, by the tenant's row id, so the first tenants never share one); other lines
take fixed colours by their position. Values are rounded to four significant digits for the wire.
``None`` is "no data" and is drawn as a gap, never as a drop to zero.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.utils import timezone

from controlplane.ui.present import human_bytes

# 12 colours that stay apart for the common kinds of colour blindness (Tableau 10 plus two).
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#b07aa1", "#edc948", "#9c755f",
           "#ff9da7", "#17becf", "#8c564b", "#bcbd22")
TOTAL_COLOR = "#1c2430"  # "all tenants"
REST_COLOR = "#9aa5b1"  # "N other tenants", "not attributed"

UNITS = ("percent", "count", "bytes", "seconds")


def tenant_color(slug: str, row_id: int | None = None) -> str:
    """A tenant's colour everywhere: by its row id when known (tenants 1..12 all differ), else by a
    hash of its slug (a tenant whose row is gone)."""
    if row_id is not None:
        return PALETTE[(row_id - 1) % len(PALETTE)]
    digest = hashlib.blake2b(slug.encode(), digest_size=2).digest()
    return PALETTE[int.from_bytes(digest, "big") % len(PALETTE)]


def position_color(index: int) -> str:
    return PALETTE[index % len(PALETTE)]


# ---------------------------------------------------------------------- value formats (the table's)
def si(value: float) -> str:
    """12_300 -> '12.3k' (k, M, G); small values keep three significant digits."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.3g}" if value else "0"


def formatter(unit: str, suffix: str = "") -> Callable[[float], str]:
    """The text of one value in ``unit`` (the same rules as charts.js's axis and hover)."""
    if unit == "percent":
        return lambda v: f"{100 * v:.1f}%"
    if unit == "bytes":
        return lambda v: human_bytes(int(v))
    if unit == "seconds":
        return lambda v: f"{v:.2f} s{suffix}"
    return lambda v: f"{si(v)}{suffix}"


def _wire(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    if value == 0:
        return 0.0
    return float(f"{value:.4g}")


# ---------------------------------------------------------------------- charts
@dataclass(frozen=True)
class Line:
    """One series over the chart's x values (``values[k]`` at ``x[k]``; None: no data there)."""

    label: str
    values: Sequence[float | None]
    color: str
    dashed: bool = False  # e.g. an offboarded tenant's line

    def __post_init__(self) -> None:  # a NaN or an infinity is no data, not a point
        object.__setattr__(self, "values", tuple(
            None if v is None or not math.isfinite(v) else float(v) for v in self.values))


@dataclass(frozen=True)
class Chart:
    id: str
    title: str
    hint: str
    x: Sequence[float]  # epoch seconds
    lines: Sequence[Line]
    unit: str = "count"
    suffix: str = ""  # after a count or seconds: "/s", "/min"
    y_max: float | None = None  # a fixed top (1.0 for ratios); else fitted to the data
    empty_text: str = "No data in this range yet."
    notes: Sequence[str] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise ValueError(f"unknown unit {self.unit!r}")
        for line in self.lines:
            if len(line.values) != len(self.x):
                raise ValueError(f"line {line.label!r} has {len(line.values)} values for {len(self.x)} x values")

    @property
    def empty(self) -> bool:
        return not any(v is not None for line in self.lines for v in line.values)

    def _latest_index(self) -> int | None:
        """The newest x where any line has data (None: no data at all)."""
        return next((k for k in range(len(self.x) - 1, -1, -1)
                     if any(line.values[k] is not None for line in self.lines)), None)

    def latest(self) -> list[tuple[str, str]]:
        """Each line's value at one time, the newest that has data (``latest_at``), as text (— for a
        line without data then): never one line's newest point beside another's older one."""
        fmt = formatter(self.unit, self.suffix)
        k = self._latest_index()
        return [(line.label, "—" if k is None or line.values[k] is None else fmt(line.values[k]))
                for line in self.lines]

    def latest_at(self) -> datetime | None:
        """The time ``latest`` shows."""
        k = self._latest_index()
        return None if k is None else datetime.fromtimestamp(self.x[k], tz=timezone.get_current_timezone())

    def rows(self) -> list[dict[str, Any]]:
        """Table rows, newest first, for the x values where any line has data."""
        fmt = formatter(self.unit, self.suffix)
        rows = []
        for k in range(len(self.x) - 1, -1, -1):
            cells = [line.values[k] for line in self.lines]
            if all(v is None for v in cells):
                continue
            at = datetime.fromtimestamp(self.x[k], tz=timezone.get_current_timezone())
            rows.append({"at": at, "cells": ["—" if v is None else fmt(v) for v in cells]})
        return rows

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "title": self.title, "hint": self.hint, "unit": self.unit, "suffix": self.suffix,
            "y_max": self.y_max, "empty_text": self.empty_text, "x": [int(x) for x in self.x],
            "series": [{"label": line.label, "color": line.color, "dashed": line.dashed,
                        "values": [_wire(v) for v in line.values]} for line in self.lines],
        }


def charts_json(charts: Iterable[Chart], **extra: Any) -> dict[str, Any]:
    """The JSON document of a page's charts (``extra``: the range, its choices, the step)."""
    return {**extra, "charts": [c.to_json() for c in charts]}
