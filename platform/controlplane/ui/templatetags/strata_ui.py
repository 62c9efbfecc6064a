"""Small display filters for the operator UI templates."""

from __future__ import annotations

import json
from typing import Any

from django import template

register = template.Library()


@register.filter
def pct(ratio: Any) -> str:
    """0.4567 -> '45.7%' (a ratio in [0, 1])."""
    try:
        return f"{100.0 * float(ratio):.1f}%"
    except (TypeError, ValueError):
        return "—"


@register.filter
def num(value: Any) -> str:
    """Thousands separators for integers, two decimals for floats, a dash for None."""
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


@register.filter
def kv(mapping: Any) -> str:
    """``{"a": 1, "b": "x"}`` -> ``a=1 b=x`` (detail columns)."""
    if not mapping:
        return ""
    return " ".join(f"{k}={_short(v)}" for k, v in mapping.items())


@register.filter
def compact_json(value: Any) -> str:
    return "" if value is None else json.dumps(value, sort_keys=True, separators=(", ", ": "), default=str)


@register.filter
def short_hash(value: Any, length: int = 12) -> str:
    return str(value or "")[: int(length)]


HEX = frozenset("0123456789abcdef")


def _short(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"), default=str)
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, str) and len(value) >= 40 and set(value) <= HEX:
        return f"{value[:12]}…"  # a digest: the prefix identifies it
    return str(value)
