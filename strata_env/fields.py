"""Typed readers of one environment variable each: the only parsing of environment values in Strata.

Every reader takes the mapping to read (``os.environ`` or another process's environment, e.g. the
launcher's children's) and a variable name, and returns a typed value or raises :class:`EnvError`
naming the variable. Unset and empty mean "the default" for every reader but :func:`boolean`
(where an empty value is an explicit "off", as it always was for the control plane's switches).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping

TRUE = frozenset({"1", "true", "yes", "on"})
FALSE = frozenset({"0", "false", "no", "off", ""})


class EnvError(ValueError):
    """An environment variable is set to a value that cannot be used; the message names it."""


def boolean(src: Mapping[str, str], name: str, default: bool) -> bool:
    """1/0, true/false, yes/no, on/off (any case); anything else is an error. Unset: ``default``."""
    raw = src.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise EnvError(f"{name} must be a boolean (1/0, true/false), got {raw!r}")


def flag(src: Mapping[str, str], name: str) -> bool:
    """A process switch that a launcher sets for one child: on for 1/true/yes/on (any case), off for
    anything else, never an error (what ``STRATA_SAMPLER``, ``STRATA_WARM_REPLICAS`` and
    ``STRATA_DEMO`` always meant)."""
    return (src.get(name) or "").strip().lower() in TRUE


def integer(src: Mapping[str, str], name: str, default: int, *, minimum: int | None = None,
            maximum: int | None = None) -> int:
    """A base-10 integer, optionally bounded (inclusive). Unset or blank: ``default`` (not checked)."""
    raw = src.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise EnvError(f"{name} must be an integer, got {raw!r}") from None
    if minimum is not None and value < minimum:
        raise EnvError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise EnvError(f"{name} must be at most {maximum}, got {value}")
    return value


def number(src: Mapping[str, str], name: str, default: float) -> float:
    """A float. Unset or blank: ``default``."""
    raw = src.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise EnvError(f"{name} must be a number, got {raw!r}") from None


def fraction(src: Mapping[str, str], name: str, default: float) -> float:
    """A number in (0, 1] (a share of something, e.g. of a GPU's memory). Unset or blank: ``default``."""
    value = number(src, name, default)
    if not 0.0 < value <= 1.0:  # also refuses nan and inf
        raise EnvError(f"{name} must be a fraction greater than 0 and at most 1, got {src.get(name)!r}")
    return value


def given(src: Mapping[str, str], name: str) -> bool:
    """Whether the variable is set to something (blank counts as unset, as every reader here treats it)."""
    return bool((src.get(name) or "").strip())


def items(src: Mapping[str, str], name: str, default: tuple[str, ...] = ()) -> tuple[str, ...]:
    """A comma-separated list, each item stripped, empty items dropped. Unset: ``default``."""
    raw = src.get(name)
    if raw is None:
        return default
    return tuple(item.strip() for item in raw.split(",") if item.strip())


def networks(src: Mapping[str, str], name: str) -> tuple[str, ...]:
    """Comma-separated IP addresses or CIDR networks, each checked (a typo must not silently trust
    nobody, or everybody); returned normalised (``10.0.0.1`` -> ``10.0.0.1/32``)."""
    out = []
    for item in items(src, name):
        try:
            out.append(str(ipaddress.ip_network(item, strict=False)))
        except ValueError:
            raise EnvError(f"{name} must list IP addresses or CIDR networks, got {item!r}") from None
    return tuple(out)


def string(src: Mapping[str, str], name: str) -> str | None:
    """The value as it is (secrets, URLs, paths: never altered), ``None`` when unset or empty."""
    raw = src.get(name)
    return raw if raw else None


def word(src: Mapping[str, str], name: str, default: str | None = None) -> str | None:
    """The value stripped of surrounding blanks; ``default`` when unset or blank (names of policies,
    devices, addresses)."""
    return (src.get(name) or "").strip() or default
