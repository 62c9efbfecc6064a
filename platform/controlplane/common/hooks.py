"""Optional integration points: modules other parts of the platform add later.

The control plane calls into ``controlplane.jobs`` / ``controlplane.runtime`` / ``controlplane.serving``
only through these helpers, so it works (and its tests pass) before those modules exist. A module
that exists but fails to import raises as usual: only absence is tolerated.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.util import find_spec
from typing import Any


def module_exists(name: str) -> bool:
    """True when ``name`` can be imported (its parent packages exist and it is found)."""
    try:
        return find_spec(name) is not None
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (name == missing or name.startswith(missing + ".")):
            return False
        raise


def optional_attr(module: str, attr: str) -> Callable[..., Any] | None:
    """``module.attr`` when the module exists and defines it, else ``None``."""
    if not module_exists(module):
        return None
    return getattr(importlib.import_module(module), attr, None)
