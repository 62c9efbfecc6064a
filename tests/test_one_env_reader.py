"""One reader of the environment (issue 22): ``strata_env``.

- No module of ``cachecore/``, ``workers/``, ``platform/controlplane/`` (nor ``manage.py``) reads
  ``os.environ`` / ``os.getenv`` for a ``STRATA_`` variable or a conventional one (``DATABASE_URL``,
  ``REDIS_URL``, ``CELERY_BROKER_URL``, ``RAY_ADDRESS``, ``PORT``), nor takes the whole environment,
  except the few places in :data:`ALLOWED` (each with its reason). Found with ``ast``: calls
  (``get``, ``setdefault``, ``pop``, ``getenv``), subscripts, ``in`` tests, with the name a literal or
  a module-level string constant; a name it cannot tell counts as a read.
- ``strata_env`` imports the standard library only (the web tier, the workers, cachecore and the
  launcher all import it).
- The three views (control plane, worker, launcher; plus ``manage.py``) agree on ``STRATA_HOME``, the
  master key file and the key itself for a relative ``STRATA_HOME``, whatever the working directory.
- A bad value is one :class:`strata_env.EnvError` naming the variable, in every view and through
  the objects built from them.
"""

from __future__ import annotations

import ast
import base64
import importlib.util
import os
import sys
from pathlib import Path

import pytest

import strata_env

REPO = Path(__file__).resolve().parents[1]
SCANNED = (REPO / "cachecore", REPO / "workers", REPO / "platform" / "controlplane")
EXTRA_FILES = (REPO / "manage.py",)
CONVENTIONAL = {"DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "RAY_ADDRESS", "PORT"}
WHOLE = "<the whole environment>"
UNKNOWN = "<a name that is not a literal>"

# (file from the repository root, enclosing function or "<module>") -> why it may touch os.environ.
ALLOWED = {
    ("workers/launcher.py", "Launcher._child_env"):
        "copies the environment into its children's (they read it with strata_env); reads no variable",
    ("workers/config.py", "apply_ray_env"): "writes Ray's RAY_worker_niceness into an environment; reads none",
    ("platform/controlplane/settings/test.py", "<module>"):
        "STRATA_TEST_CELERY_QUEUE: a knob of the test suite's own settings, never of a deployment",
    ("platform/controlplane/settings/test_worker.py", "<module>"):
        "STRATA_TEST_*: the job test hooks of the integration tests' Celery worker (settings for tests only)",
}


# ------------------------------------------------------------------------------------------- scanner
def _in_scope(name: str) -> bool:
    return name in (WHOLE, UNKNOWN) or name.startswith("STRATA_") or name in CONVENTIONAL


class _Reads(ast.NodeVisitor):
    """``[(function, variable, line)]``: every read of the process environment in one module."""

    def __init__(self, tree: ast.Module) -> None:
        self.found: list[tuple[str, str, int]] = []
        self.scope: list[str] = []
        self.parents: dict[ast.AST, ast.AST] = {}
        for parent in ast.walk(tree):
            for child in ast.iter_child_nodes(parent):
                self.parents[child] = parent
        self.os_names = {"os"}
        self.environ_names: set[str] = set()
        self.getenv_names: set[str] = set()
        self.constants: dict[str, str] = {}
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                    and isinstance(node.value.value, str):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        self.constants[target.id] = node.value.value
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                self.os_names |= {a.asname or a.name for a in node.names if a.name == "os"}
            elif isinstance(node, ast.ImportFrom) and node.module == "os":
                self.environ_names |= {a.asname or a.name for a in node.names if a.name == "environ"}
                self.getenv_names |= {a.asname or a.name for a in node.names if a.name == "getenv"}

    def _where(self) -> str:
        return ".".join(self.scope) or "<module>"

    def _name(self, node: ast.AST | None) -> str:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name) and node.id in self.constants:
            return self.constants[node.id]
        return UNKNOWN

    def _is_environ(self, node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
                and node.value.id in self.os_names) or (isinstance(node, ast.Name) and node.id in self.environ_names)

    def _is_getenv(self, node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "getenv" and isinstance(node.value, ast.Name)
                and node.value.id in self.os_names) or (isinstance(node, ast.Name) and node.id in self.getenv_names)

    def _scoped(self, node):
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Call(self, node: ast.Call) -> None:
        if self._is_getenv(node.func):
            self.found.append((self._where(), self._name(node.args[0] if node.args else None), node.lineno))
        self.generic_visit(node)

    def generic_visit(self, node: ast.AST) -> None:
        if self._is_environ(node):
            self._classify(node)
        super().generic_visit(node)

    def _classify(self, node: ast.AST) -> None:
        parent = self.parents.get(node)
        read: str | None = WHOLE
        if isinstance(parent, ast.Attribute) and isinstance(self.parents.get(parent), ast.Call) \
                and self.parents[parent].func is parent:
            call = self.parents[parent]
            if parent.attr in {"get", "setdefault", "pop", "__getitem__", "__contains__"}:
                read = self._name(call.args[0] if call.args else None)
        elif isinstance(parent, ast.Subscript) and parent.value is node:
            read = self._name(parent.slice) if isinstance(parent.ctx, ast.Load) else None  # a write
        elif isinstance(parent, ast.Compare) and node in parent.comparators:
            read = self._name(parent.left)
        if read is not None:
            self.found.append((self._where(), read, node.lineno))


def _env_reads(source: str) -> list[tuple[str, str, int]]:
    """``[(function, variable, line)]`` for the module ``source``: every environment read in scope."""
    tree = ast.parse(source)
    visitor = _Reads(tree)
    visitor.visit(tree)
    return [r for r in visitor.found if _in_scope(r[1])]


def scanned_files() -> list[Path]:
    files = [p for root in SCANNED for p in sorted(root.rglob("*.py"))
             if not {"migrations", "tests", "__pycache__"} & set(p.relative_to(REPO).parts)]
    return [*files, *EXTRA_FILES]


def all_reads() -> dict[tuple[str, str], list[tuple[str, int]]]:
    out: dict[tuple[str, str], list[tuple[str, int]]] = {}
    for path in scanned_files():
        rel = path.relative_to(REPO).as_posix()
        for where, name, line in _env_reads(path.read_text(encoding="utf-8")):
            out.setdefault((rel, where), []).append((name, line))
    return out


def test_the_scanner_sees_every_form_of_a_read():
    source = '''
import os
from os import environ as ENV, getenv
FLAG = "STRATA_X"
a = os.environ.get("STRATA_A")
b = os.environ["DATABASE_URL"]
c = "PORT" in os.environ
d = os.getenv("REDIS_URL")
e = getenv(FLAG)
f = ENV.get("STRATA_F", "")
g = dict(os.environ)
def h(name):
    return os.environ.get(name)
os.environ["STRATA_WRITTEN"] = "1"
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "x")
i = os.environ.get("HOME")
'''
    found = {(where, name) for where, name, _ in _env_reads(source)}
    assert found == {("<module>", "STRATA_A"), ("<module>", "DATABASE_URL"), ("<module>", "PORT"),
                     ("<module>", "REDIS_URL"), ("<module>", "STRATA_X"), ("<module>", "STRATA_F"),
                     ("<module>", WHOLE), ("h", UNKNOWN)}


def test_no_module_reads_the_environment_but_strata_env():
    reads = all_reads()
    offenders = {key: found for key, found in reads.items() if key not in ALLOWED}
    assert not offenders, "read the environment through strata_env (or add a reasoned ALLOWED entry): " + "; ".join(
        f"{path} {where}: " + ", ".join(f"{name} (line {line})" for name, line in found)
        for (path, where), found in sorted(offenders.items()))
    stale = set(ALLOWED) - set(reads)
    assert not stale, f"ALLOWED entries that no longer touch the environment (remove them): {sorted(stale)}"


def test_strata_env_imports_the_standard_library_only():
    package = REPO / "strata_env"
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            for module in modules:
                top = module.split(".")[0]
                assert top in sys.stdlib_module_names or top in {"strata_env", "__future__"}, \
                    f"{path.name} imports {module}: strata_env must stay stdlib-only"


# ------------------------------------------------------------------------------------------- agreement
def _manage_home() -> Path:
    spec = importlib.util.spec_from_file_location("strata_manage_py", REPO / "manage.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._home()


@pytest.mark.parametrize("cwd", ["tmp", "/", "repo"])
def test_the_views_agree_on_a_relative_home_and_the_master_key_whatever_the_cwd(tmp_path, monkeypatch, cwd):
    from controlplane.common import masterkey as cp_masterkey
    from workers.config import WorkerConfig
    from workers.config import master_key as worker_master_key
    from workers.launcher import Config

    home = tmp_path / "state"
    relative = os.path.relpath(home, REPO)  # relative to the repository: "../../tmp/.../state"
    assert not Path(relative).is_absolute()
    for name in ("STRATA_MASTER_KEY", "STRATA_MASTER_KEY_FILE", "STRATA_L3_URL", "PORT", "STRATA_RAY_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("STRATA_HOME", relative)
    monkeypatch.chdir({"tmp": tmp_path, "/": "/", "repo": REPO}[cwd])

    control, worker, launcher = strata_env.load(), strata_env.load_worker(), strata_env.load_launcher()
    homes = {control.home, worker.home, launcher.home, Config.from_env([]).home, _manage_home(), strata_env.home()}
    assert {p.resolve() for p in homes} == {home.resolve()} and all(p.is_absolute() for p in homes)
    key_file = REPO / relative / "master.key"  # spelled as every view spells it (absolute, unresolved)
    assert key_file.resolve() == (home / "master.key").resolve()
    cfg = WorkerConfig.from_env()
    assert control.master_key_file == worker.master_key_file == Path(cfg.master_key_file) == key_file
    assert cp_masterkey.resolve(control) == strata_env.masterkey.resolve(worker) == ("default", key_file)
    assert cfg.l3_url == (REPO / relative / "l3").as_uri()

    assert worker_master_key(cfg) is None  # not created yet: the worker waits, never creates
    created = cp_masterkey.load_master_key(control)  # the control plane creates it (0600)
    assert worker_master_key(cfg) == created == strata_env.masterkey.read(worker)

    # A relative STRATA_MASTER_KEY_FILE is relative to the repository too, in every view.
    monkeypatch.setenv("STRATA_MASTER_KEY_FILE", os.path.join(relative, "master.key"))
    control, worker = strata_env.load(), strata_env.load_worker()
    assert control.master_key_file == worker.master_key_file == Path(WorkerConfig.from_env().master_key_file) \
        == key_file
    assert cp_masterkey.ensure_master_key(control) == {"STRATA_MASTER_KEY_FILE": str(key_file)}
    assert worker_master_key(WorkerConfig.from_env()) == created


def test_the_worker_reads_the_key_as_the_control_plane_does(tmp_path, monkeypatch):
    from workers.config import WorkerConfig
    from workers.config import master_key as worker_master_key

    key = os.urandom(32)
    for name in ("STRATA_MASTER_KEY", "STRATA_MASTER_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("STRATA_HOME", str(tmp_path))
    monkeypatch.setenv("STRATA_MASTER_KEY", base64.b64encode(key).decode())
    assert worker_master_key(WorkerConfig()) == key
    monkeypatch.setenv("STRATA_MASTER_KEY", "not base64!")
    with pytest.raises(strata_env.EnvError, match="STRATA_MASTER_KEY is not valid base64"):
        worker_master_key(WorkerConfig())
    monkeypatch.setenv("STRATA_MASTER_KEY", base64.b64encode(key).decode())
    monkeypatch.setenv("STRATA_MASTER_KEY_FILE", str(tmp_path / "k"))
    with pytest.raises(strata_env.MasterKeyError, match="only one"):
        worker_master_key(WorkerConfig())
    monkeypatch.delenv("STRATA_MASTER_KEY")
    (tmp_path / "k").write_bytes(key)
    (tmp_path / "k").chmod(0o644)
    with pytest.raises(strata_env.MasterKeyError, match="chmod 600"):
        worker_master_key(WorkerConfig(master_key_file=str(tmp_path / "k")))
    (tmp_path / "k").chmod(0o600)
    assert worker_master_key(WorkerConfig(master_key_file=str(tmp_path / "k"))) == key


# ------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(("load", "name", "value", "says"), [
    (strata_env.load, "STRATA_HSTS_SECONDS", "a year", "must be an integer, got 'a year'"),
    (strata_env.load, "STRATA_DEBUG", "maybe", "must be a boolean"),
    (strata_env.load, "STRATA_TRUSTED_PROXIES", "10.0.0.300", "must list IP addresses or CIDR networks"),
    (strata_env.load, "STRATA_WEB_BODY_TIMEOUT_S", "soon", "must be a number, got 'soon'"),
    (strata_env.load_worker, "STRATA_L1_MB", "0", "must be >= 1, got 0"),
    (strata_env.load_worker, "STRATA_L2_MB", "-1", "must be >= 0, got -1"),
    (strata_env.load_worker, "STRATA_ANTICIPATE_MS", "1001", "must be at most 1000, got 1001"),
    (strata_env.load_worker, "STRATA_TOKEN_BUDGET", "lots", "must be an integer, got 'lots'"),
    (strata_env.load_launcher, "PORT", "http", "must be an integer, got 'http'"),
    (strata_env.load_launcher, "STRATA_RAY_PORT", "x", "must be an integer, got 'x'"),
])
def test_a_bad_value_is_one_env_error_naming_the_variable(load, name, value, says):
    with pytest.raises(strata_env.EnvError) as caught:
        load({name: value})
    assert type(caught.value) is strata_env.EnvError
    assert str(caught.value).startswith(f"{name} {says}")


def test_the_objects_built_from_the_views_raise_the_same_error(monkeypatch, capsys):
    from controlplane import env as envmod
    from controlplane.common.masterkey import MasterKeyError
    from workers.config import WorkerConfig, WorkerConfigError
    from workers.launcher import Config

    assert envmod.EnvError is WorkerConfigError is strata_env.EnvError
    assert issubclass(MasterKeyError, strata_env.EnvError) and issubclass(MasterKeyError, RuntimeError)
    monkeypatch.setenv("STRATA_MAX_BATCH", "many")
    with pytest.raises(strata_env.EnvError, match="STRATA_MAX_BATCH must be an integer"):
        WorkerConfig.from_env()
    monkeypatch.setenv("STRATA_MAX_BATCH", "600")  # the checks across variables: the same error class
    with pytest.raises(strata_env.EnvError, match="STRATA_TOKEN_BUDGET .* must exceed STRATA_MAX_BATCH"):
        WorkerConfig.from_env()
    monkeypatch.delenv("STRATA_MAX_BATCH")
    monkeypatch.setenv("PORT", "eighty")
    with pytest.raises(SystemExit):
        Config.from_env([])
    assert "PORT must be an integer, got 'eighty'" in capsys.readouterr().err
