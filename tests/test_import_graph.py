"""No import cycles between the project's own modules (issue 22: "No cycles, no upward imports").

The graph is built from the source with ``ast`` (nothing is imported), over every module of
``cachecore``, ``workers`` and ``controlplane`` (``platform/controlplane``; migrations included).

What counts as an edge ``a -> b`` (module ``a`` makes module ``b`` execute):

- every ``import`` / ``from ... import`` statement anywhere in ``a``: at module level AND inside
  function and class bodies (an import hidden in a function is still a dependency; that is how
  the cycles this test was written against hid), ``try`` blocks included. Only imports under
  ``if TYPE_CHECKING:`` are skipped: they never run.
- string imports, which run an import just the same: ``importlib.import_module("x")``,
  ``controlplane.common.hooks.optional_attr("x", ...)`` and ``django``'s ``import_string("x.attr")``
  with a literal module name.
- ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``.

Not edges: Celery task names (``send_task("strata.run_job")``, ``signature(...)``): a message to
another process, resolved there by the task registry, which is exactly how services enqueue work
without importing their tasks. Nor the implicit import of a module's parent packages: a submodule
that runs while its package's ``__init__`` imports it is the ordinary package pattern, not a cycle.
An explicit ``from pkg import Name`` from a submodule of ``pkg`` IS an edge to ``pkg`` (its
``__init__``), and a cycle through it is reported like any other.

A cycle is a path ``a -> b -> ... -> a`` between distinct modules; each strongly connected component
of the graph is reported with the shortest cycle through each of its modules and the edges
(file:line) they use.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# (package name, directory holding it)
ROOTS = (("cachecore", REPO), ("workers", REPO), ("controlplane", REPO / "platform"))
STRING_IMPORTERS = {"import_module", "optional_attr", "import_string"}


def project_modules() -> dict[str, Path]:
    """Every module of the project: dotted name -> file (a package is its ``__init__.py``)."""
    out: dict[str, Path] = {}
    for package, base in ROOTS:
        for path in sorted((base / package).rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST):
    """``ast.walk`` that skips the bodies of ``if TYPE_CHECKING:`` (their ``else`` runs)."""
    todo = [node]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def _string_import(node: ast.Call) -> str | None:
    func = node.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    if name not in STRING_IMPORTERS or not node.args:
        return None
    first = node.args[0]
    if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
        return None
    return first.value.rpartition(".")[0] if name == "import_string" else first.value


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module ``name`` denotes (its longest existing prefix), or None if not ours."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """``[(imported project module, line)]`` for one module (see the module docstring)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: list[tuple[str, int]] = []
    for node in _walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if sub in modules else base)
        elif isinstance(node, ast.Call):
            name = _string_import(node)
            if name:
                targets = [name]
        for target in targets:
            resolved = _resolve(target, modules)
            if resolved and resolved != module:
                found.append((resolved, node.lineno))
    return found


def import_graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], int]]:
    """``(edges: module -> imported modules, line of the first such import per edge)``."""
    modules = project_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    where: dict[tuple[str, str], int] = {}
    for name, path in modules.items():
        for target, line in imports_of(name, path, modules):
            graph[name].add(target)
            where.setdefault((name, target), line)
    return graph, where


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's SCCs with more than one module (iterative: the graph has hundreds of nodes)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out)


def shortest_cycle(graph: dict[str, set[str]], component: list[str], start: str | None = None) -> list[str]:
    """A shortest cycle through ``start`` (default: the first module of ``component``): ``[a, ..., a]``."""
    start, members = start or component[0], set(component)
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph[node] & members):
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if child not in parent:
                parent[child] = node
                queue.append(child)
    raise AssertionError(f"no cycle through {start}")  # not reachable for an SCC


def component_cycles(graph: dict[str, set[str]], component: list[str]) -> list[list[str]]:
    """The distinct shortest cycles through each module of ``component``, each from its first module."""
    cycles: dict[tuple[str, ...], list[str]] = {}
    for start in component:
        ring = shortest_cycle(graph, component, start)[:-1]
        first = ring.index(min(ring))
        ring = ring[first:] + ring[:first]
        cycles.setdefault(tuple(ring), [*ring, ring[0]])
    return sorted(cycles.values())


def describe_cycles(graph: dict[str, set[str]], where: dict[tuple[str, str], int]) -> list[str]:
    modules = project_modules()
    report = []
    for component in strongly_connected(graph):
        lines = [f"cycle group of {len(component)} modules: {', '.join(component)}"]
        for cycle in component_cycles(graph, component):
            lines.append("  " + " -> ".join(cycle))
            lines += [f"    {a} -> {b}  ({modules[a].relative_to(REPO)}:{where[a, b]})"
                      for a, b in zip(cycle, cycle[1:])]
        report.append("\n".join(lines))
    return report


# ---------------------------------------------------------------------- the builder itself
def test_graph_sees_hidden_and_string_imports(tmp_path):
    modules = {"pkg": tmp_path / "pkg/__init__.py", "pkg.a": tmp_path / "pkg/a.py", "pkg.b": tmp_path / "pkg/b.py",
               "pkg.c": tmp_path / "pkg/c.py", "pkg.d": tmp_path / "pkg/d.py"}
    source = (
        "from typing import TYPE_CHECKING\n"
        "import os\n"
        "from pkg import b\n"
        "from . import c as renamed\n"
        "if TYPE_CHECKING:\n"
        "    from pkg.d import Thing\n"
        "def f():\n"
        "    from pkg.d import helper\n"
        "    optional_attr('pkg.c', 'x')\n"
        "    current_app.send_task('pkg.d.task')\n"
        "    from pkg import Name\n"
    )
    path = tmp_path / "a.py"
    path.write_text(source)
    assert sorted(imports_of("pkg.a", path, modules)) == [("pkg", 11), ("pkg.b", 3), ("pkg.c", 4), ("pkg.c", 9),
                                                          ("pkg.d", 8)]
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    assert shortest_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    graph = {"a": {"b", "c"}, "b": {"a"}, "c": {"a"}, "d": set()}
    assert component_cycles(graph, ["a", "b", "c"]) == [["a", "b", "a"], ["a", "c", "a"]]


def test_graph_covers_the_project():
    graph, _ = import_graph()
    assert {"cachecore.engine", "workers.protocol", "controlplane.jobs.services", "controlplane.jobs.tasks",
            "controlplane.tenants.datakeys", "controlplane.runtime.stats"} <= graph.keys()
    # the tasks run the services (the allowed direction)
    assert "controlplane.jobs.services" in graph["controlplane.jobs.tasks"]


# ---------------------------------------------------------------------- the rule
def test_no_import_cycles():
    graph, where = import_graph()
    cycles = describe_cycles(graph, where)
    assert not cycles, "import cycles between project modules:\n" + "\n".join(cycles)


def test_only_celery_imports_the_tasks():
    """Services (and the reaper) enqueue Celery tasks by name (``jobs.services.job_send``); the tasks
    module is imported by Celery's autodiscovery only, so it can import the services freely."""
    graph, where = import_graph()
    offenders = [f"{name} (line {where[name, target]})" for name, targets in graph.items() for target in targets
                 if target.endswith(".tasks")]
    assert not offenders, f"modules importing Celery task modules: {offenders}"
