"""Settings: environment split, DB/broker selection, secret key handling, check --deploy."""

import json
import os
import secrets
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PRINT_SETTINGS = (
    "import json, django; from django.conf import settings; django.setup(); "
    "db = settings.DATABASES['default']; "
    "print(json.dumps({'engine': db['ENGINE'], 'name': str(db['NAME']), 'broker': settings.CELERY_BROKER_URL, "
    "'debug': settings.DEBUG, 'key_len': len(settings.SECRET_KEY)}))"
)


def run_django(env_overrides, *args, settings_module="controlplane.settings.local", umask=-1):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("STRATA_") and k not in ("DATABASE_URL", "CELERY_BROKER_URL", "REDIS_URL")}
    env.update({"DJANGO_SETTINGS_MODULE": settings_module, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'platform'}"})
    env.update(env_overrides)
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                          umask=umask)


def test_check_deploy_passes_with_production_settings(tmp_path):
    proc = run_django(
        {"STRATA_HOME": str(tmp_path), "STRATA_SECRET_KEY": secrets.token_urlsafe(50),
         "STRATA_ALLOWED_HOSTS": "strata.example.com"},
        "manage.py", "check", "--deploy", "--fail-level", "WARNING", "--settings", "controlplane.settings.production",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no issues" in proc.stdout


def test_production_refuses_to_start_without_allowed_hosts(tmp_path):
    proc = run_django({"STRATA_HOME": str(tmp_path)}, "manage.py", "check",
                      settings_module="controlplane.settings.production")
    assert proc.returncode != 0 and "STRATA_ALLOWED_HOSTS" in proc.stderr


def test_defaults_are_sqlite_and_embedded_broker_under_strata_home(tmp_path):
    proc = run_django({"STRATA_HOME": str(tmp_path)}, "-c", PRINT_SETTINGS)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["engine"] == "django.db.backends.sqlite3" and got["name"] == str(tmp_path / "db.sqlite3")
    assert got["broker"] == f"sqla+sqlite:///{tmp_path / 'broker.sqlite3'}"
    assert got["debug"] is False


def test_database_url_and_broker_url_switch_to_real_servers(tmp_path):
    proc = run_django({"STRATA_HOME": str(tmp_path), "DATABASE_URL": "postgres://u@db.example:5432/strata",
                       "CELERY_BROKER_URL": "redis://cache.example:6379/0"}, "-c", PRINT_SETTINGS)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["engine"] == "django.db.backends.postgresql" and got["name"] == "strata"
    assert got["broker"] == "redis://cache.example:6379/0"


def test_sqlite_by_url_gets_the_same_locking_options_as_the_default(tmp_path):
    import dataclasses

    from controlplane import env
    from controlplane.settings.base import SQLITE_OPTIONS, database_config

    base = dataclasses.replace(env.load(), home=tmp_path, database_url=None)
    default = database_config(base)
    by_url = database_config(dataclasses.replace(base, database_url=f"sqlite:///{tmp_path / 'w.sqlite3'}"))
    assert default["OPTIONS"] == by_url["OPTIONS"] == SQLITE_OPTIONS
    assert by_url["NAME"] == str(tmp_path / "w.sqlite3")
    postgres = database_config(dataclasses.replace(base, database_url="postgres://u@h:5432/db"))
    assert "transaction_mode" not in postgres.get("OPTIONS", {})
    # ASGI runs each request's sync code in a new thread: a pool, not per-thread persistent connections
    assert postgres["CONN_MAX_AGE"] == 0 and postgres["OPTIONS"]["pool"]["max_size"] >= 1


def test_generated_secret_key_lives_in_strata_home_private_and_stable(tmp_path):
    first = run_django({"STRATA_HOME": str(tmp_path)}, "-c", PRINT_SETTINGS)
    second = run_django({"STRATA_HOME": str(tmp_path)}, "-c", PRINT_SETTINGS)
    assert first.returncode == 0 and second.returncode == 0
    key_file = tmp_path / "secret_key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert len(key_file.read_text().strip()) >= 50
    other = run_django({"STRATA_HOME": str(tmp_path / "other")}, "-c", PRINT_SETTINGS)
    assert other.returncode == 0
    assert (tmp_path / "other" / "secret_key").read_text() != key_file.read_text()


# Opens the embedded database (WAL mode: -wal and -shm appear), writes, and reports the modes of
# every file in STRATA_HOME while the connection is still open.
WRITE_AND_LIST_MODES = (
    "import json, os, stat, django; from django.conf import settings; django.setup(); "
    "from django.db import connection; c = connection.cursor(); "
    "c.execute('CREATE TABLE t (x)'); c.execute('INSERT INTO t VALUES (1)'); "
    "home = settings.STRATA_HOME; mode = lambda p: stat.S_IMODE(os.stat(p).st_mode); "
    "print(json.dumps({'home': mode(home), "
    "'files': {n: mode(home / n) for n in os.listdir(home) if (home / n).is_file()}}))"
)


def test_strata_home_database_broker_and_key_are_private_whatever_the_umask(tmp_path):
    """Without the launcher (a plain ``manage.py`` under umask 022): STRATA_HOME 0700, the SQLite
    database with its -wal/-shm, the broker file and the secret key 0600; an existing, too open
    STRATA_HOME and database are tightened."""
    fresh = run_django({"STRATA_HOME": str(tmp_path / "fresh")}, "-c", WRITE_AND_LIST_MODES, umask=0o022)
    assert fresh.returncode == 0, fresh.stderr
    got = json.loads(fresh.stdout)
    assert got["home"] == 0o700
    assert {"db.sqlite3", "db.sqlite3-wal", "db.sqlite3-shm", "broker.sqlite3", "secret_key"} <= set(got["files"])
    assert all(m == 0o600 for m in got["files"].values()), {n: oct(m) for n, m in got["files"].items()}

    old = tmp_path / "old"
    old.mkdir()
    old.chmod(0o755)
    (old / "db.sqlite3").touch(mode=0o644)
    (old / "db.sqlite3").chmod(0o644)
    again = run_django({"STRATA_HOME": str(old)}, "-c", WRITE_AND_LIST_MODES, umask=0o022)
    assert again.returncode == 0, again.stderr
    got = json.loads(again.stdout)
    assert got["home"] == 0o700 and got["files"]["db.sqlite3"] == 0o600


def test_private_dir_never_changes_a_shared_sticky_folder(tmp_path):
    from controlplane.env import private_dir

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    private_dir(shared)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777


def test_secret_key_file_is_created_once_and_reused(tmp_path):
    from controlplane.env import secret_key_from_file

    path = tmp_path / "k"
    keys = {secret_key_from_file(path) for _ in range(3)}
    assert len(keys) == 1 and path.read_text().strip() in keys


def test_no_secret_key_or_key_file_is_tracked_in_the_repo():
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    assert not any(name.endswith("secret_key") for name in tracked)
    assert ".strata/" in (REPO / ".gitignore").read_text()


def test_bad_env_values_fail_with_a_clear_message(monkeypatch):
    from controlplane import env

    monkeypatch.setenv("STRATA_MAX_BODY_BYTES", "lots")
    with pytest.raises(env.EnvError, match="STRATA_MAX_BODY_BYTES"):
        env.load()
    monkeypatch.setenv("STRATA_MAX_BODY_BYTES", "10")
    monkeypatch.setenv("STRATA_DEBUG", "maybe")
    with pytest.raises(env.EnvError, match="STRATA_DEBUG"):
        env.load()


def test_test_settings_run_without_debug():
    from django.conf import settings

    assert settings.DEBUG is False


def test_postgresql_pooled_connections_are_checked_when_handed_out(tmp_path):
    """A connection dropped by the server (pg_terminate_backend, a restart) is replaced by the pool, not
    given to a request; the check reaches psycopg_pool through Django (passed twice it is a TypeError
    at the first query: the launcher's migrate failed on it)."""
    import dataclasses

    from django.db.utils import ConnectionHandler

    from controlplane import env
    from controlplane.settings.base import database_config

    base = dataclasses.replace(env.load(), home=tmp_path, database_url="postgres://u@127.0.0.1:1/strata_x")
    config = database_config(base)
    assert config["CONN_HEALTH_CHECKS"] is True and "check" not in config["OPTIONS"]["pool"]
    handler = ConnectionHandler({"default": config})
    pool = handler["default"].pool  # builds psycopg_pool's ConnectionPool (not opened: no server needed)
    assert pool is not None and pool._check is not None
