"""``docs/architecture.md`` is a true map (issue 22, "A true map").

The convention, stated at the top of the map: every Python module under ``cachecore/``, ``workers/``,
``strata_env/`` and ``platform/controlplane/`` has exactly one entry, a Markdown list item that starts with the
module's path in backticks, spelled from its source root (its import path with ``/`` and ``.py``):

    - `cachecore/tiers/host.py`: ...
    - `controlplane/jobs/services.py`: ...      (the file platform/controlplane/jobs/services.py)

Not mapped: ``migrations/`` and ``tests/`` packages, and ``__init__.py`` files that hold nothing but
a docstring. An ``__init__.py`` with code needs its entry like any module.

These tests fail naming every module without an entry (a new module gets its line in the same
change), every entry listed twice, and every path of that form anywhere on the page (entries, walks,
diagram) that names no existing file or folder (a stale line after a move or delete). Nothing is
imported: the modules are found on disk and read with ``ast``.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAP = REPO / "docs" / "architecture.md"
# top package -> the source root that holds it
ROOTS = {"cachecore": REPO, "workers": REPO, "strata_env": REPO, "controlplane": REPO / "platform"}
SKIPPED_DIRS = {"migrations", "tests", "__pycache__"}

_TOP = "|".join(ROOTS)
# A map entry: a list item whose first text is a module path in backticks.
ENTRY = re.compile(rf"^[ \t]*[-*][ \t]+`((?:{_TOP})/[^`\s]+\.py)`", re.MULTILINE)
# Any path of the map's form anywhere on the page (a ``platform/`` prefix allowed): a module or a folder.
MENTION = re.compile(rf"(?<![\w./-])(?:platform/)?((?:{_TOP})(?:/\w+)*(?:\.py\b|/))")


def docstring_only(path: Path) -> bool:
    """An empty module, or one whose only statement is its docstring."""
    body = ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return not body


def modules() -> set[str]:
    """Every module the map must list, as its path from its source root."""
    out = set()
    for top, base in ROOTS.items():
        for path in (base / top).rglob("*.py"):
            rel = path.relative_to(base)
            if SKIPPED_DIRS.intersection(rel.parts[:-1]):
                continue
            if path.name == "__init__.py" and docstring_only(path):
                continue
            out.add(rel.as_posix())
    return out


def entries(text: str) -> list[str]:
    return ENTRY.findall(text)


def mentions(text: str) -> set[str]:
    return set(MENTION.findall(text))


def exists(mention: str) -> bool:
    """Whether a mentioned module (``....py``) or folder (``.../``) is on disk under its source root."""
    path = ROOTS[mention.split("/", 1)[0]] / mention
    return path.is_dir() if mention.endswith("/") else path.is_file()


def map_text() -> str:
    return MAP.read_text(encoding="utf-8")


def test_the_parsers_follow_the_convention():
    sample = (
        "- `cachecore/tiers/host.py`: L2\n"
        "  - `controlplane/jobs/services.py`: writes, see `workers/actor.py`\n"
        "A line that only mentions `workers/stops.py` is not an entry.\n"
        "platform/controlplane/ui/ and tests/controlplane/helpers.py; controlplane.asgi:application\n"
    )
    assert entries(sample) == ["cachecore/tiers/host.py", "controlplane/jobs/services.py"]
    assert mentions(sample) == {"cachecore/tiers/host.py", "controlplane/jobs/services.py", "workers/actor.py",
                                "workers/stops.py", "controlplane/ui/"}
    assert exists("controlplane/jobs/services.py") and exists("controlplane/ui/") and exists("cachecore/tiers/")
    assert not exists("controlplane/jobs/nothing_here.py")
    found = modules()
    assert {"cachecore/engine.py", "workers/actor.py", "controlplane/jobs/services.py",
            "cachecore/tiers/backends/__init__.py"} <= found  # an __init__ with code counts
    assert "controlplane/jobs/__init__.py" not in found  # docstring only
    assert not any("/migrations/" in m for m in found)


def test_every_module_has_an_entry():
    listed = set(entries(map_text()))
    missing = sorted(modules() - listed)
    assert not missing, (
        f"docs/architecture.md has no entry for {len(missing)} module(s); add one line each "
        "('- `<path from its source root>`: what it is for', in its package's section):\n  "
        + "\n  ".join(missing)
    )


def test_no_module_is_listed_twice():
    twice = sorted(path for path, n in Counter(entries(map_text())).items() if n > 1)
    assert not twice, f"docs/architecture.md lists these modules more than once: {twice}"


def test_every_path_on_the_map_exists():
    stale = sorted(m for m in mentions(map_text()) if not exists(m))
    assert not stale, (
        "docs/architecture.md names paths that do not exist (moved or deleted? fix or drop their lines):\n  "
        + "\n  ".join(stale)
    )
