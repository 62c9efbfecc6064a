"""``manage.py strata_backup`` / ``strata_restore`` end to end, on SQLite and on PostgreSQL.

Each vendor gets a real installation (its own ``STRATA_HOME``, database and ``file://`` L3 outside
the home; the master, audit and secret keys in files the settings create), migrated and seeded by
``backup_state.seed`` (tenants, a live and a revoked API key, an audit chain, two L3 objects written
by ``RemoteStore`` under two data-key versions), then backed up with the real command. Every
restore goes into a FRESH database (PostgreSQL: created here, dropped at the end) and a fresh
``STRATA_HOME`` whose L3 is the default ``$STRATA_HOME/l3``, and ``backup_state.probe`` reads the
result back: the audit chain verifies, the live key authenticates (200) while the revoked one stays
refused (401), both L3 objects decrypt to the bytes written, with the restored master key (another
key opens nothing). Everything runs as an operator runs it: ``manage.py`` subprocesses with the
default (local) settings and no Redis, broker or Ray from the test run's environment.

The PostgreSQL case needs the test run's database to be PostgreSQL (``DATABASE_URL``, as CI sets
it) and ``pg_dump``/``pg_restore``/``psql``: skipped without them on a developer's machine, failed
under ``CI=true``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import pytest

REPO = Path(__file__).resolve().parents[2]
# What the test run's environment says about its own installation; each installation here sets its own.
ISOLATED = {"STRATA_HOME", "STRATA_MASTER_KEY", "STRATA_MASTER_KEY_FILE", "STRATA_L3_URL", "STRATA_AUDIT_KEY",
            "STRATA_SECRET_KEY", "DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "RAY_ADDRESS",
            "DJANGO_SETTINGS_MODULE"}
PG_TOOLS = ("pg_dump", "pg_restore", "psql")


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes", "on"}


def _unavailable(reason: str) -> None:
    if _in_ci():
        pytest.fail(f"{reason}; CI=true requires the PostgreSQL backup test", pytrace=False)
    pytest.skip(reason)


class Postgres:
    """Fresh databases on the test run's PostgreSQL server, each dropped by :meth:`drop_all`."""

    def __init__(self) -> None:
        from django.conf import settings

        db = settings.DATABASES["default"]
        if not db["ENGINE"].endswith("postgresql"):
            _unavailable("the PostgreSQL case needs DATABASE_URL to name a PostgreSQL server (CI sets it)")
        for tool in PG_TOOLS:
            if shutil.which(tool) is None:
                _unavailable(f"{tool} is missing (Debian: apt-get install postgresql-client)")
        self.user, self.password = db.get("USER") or "postgres", db.get("PASSWORD") or ""
        self.host, self.port = db.get("HOST") or "127.0.0.1", db.get("PORT") or 5432
        self.created: list[str] = []
        self.roles: list[str] = []

    def _admin(self):
        import psycopg

        return psycopg.connect(host=self.host, port=self.port, user=self.user, password=self.password or None,
                               dbname="postgres", autocommit=True)

    def create(self, suffix: str) -> str:
        from psycopg import sql

        name = f"strata_backup_{os.getpid()}_{suffix}"
        with self._admin() as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        self.created.append(name)
        auth = quote(self.user) + (f":{quote(self.password)}" if self.password else "")
        return f"postgres://{auth}@{self.host}:{self.port}/{name}"

    def create_with_roles(self, suffix: str) -> tuple[str, str]:
        """A fresh database set up by docker/postgres-init.sql (compose's two roles, names made
        unique): ``(the schema owner's URL, the application role's URL)``."""
        name = self.create(suffix).rsplit("/", 1)[1]
        owner, app = f"strata_migrate_{name}", f"strata_app_{name}"
        self.roles += [app, owner]
        env = {**os.environ, "PGPASSWORD": self.password, "STRATA_DB_MIGRATE_USER": owner, "STRATA_DB_APP_USER": app,
               "STRATA_DB_MIGRATE_PASSWORD": "owner-pw", "STRATA_DB_APP_PASSWORD": "app-pw"}
        script = subprocess.run(["psql", "-X", "-v", "ON_ERROR_STOP=1", "-h", str(self.host), "-p", str(self.port),
                                 "-U", self.user, "-d", name, "-f", str(REPO / "docker" / "postgres-init.sql")],
                                env=env, capture_output=True, text=True, timeout=60)
        assert script.returncode == 0, script.stdout + script.stderr
        base = f"{self.host}:{self.port}/{name}"
        return f"postgres://{owner}:owner-pw@{base}", f"postgres://{app}:app-pw@{base}"

    def drop_all(self) -> None:
        from psycopg import sql

        with self._admin() as conn:
            for name in self.created:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
            for role in self.roles:
                conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


@dataclass
class Installation:
    """One Strata installation, driven through ``manage.py`` as an operator drives it."""

    home: Path
    database_url: str | None
    extra: dict[str, str] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ISOLATED}
        env.update(STRATA_HOME=str(self.home), DJANGO_SETTINGS_MODULE="controlplane.settings.local", **self.extra)
        if self.database_url:
            env["DATABASE_URL"] = self.database_url
        return env

    def manage(self, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "manage.py", *args], cwd=REPO, env=self.env(), capture_output=True,
                              text=True, timeout=240)
        if ok:
            assert done.returncode == 0, f"manage.py {args[0]} failed:\n{done.stdout}\n{done.stderr}"
        return done

    def run(self, function: str, *paths: Path) -> dict:
        """``backup_state.<function>(*paths)`` in this installation; the JSON it wrote last."""
        arguments = ", ".join(repr(str(p)) for p in paths)
        self.manage("shell", "-c", f"from tests.controlplane.backup_state import {function}; {function}({arguments})")
        return json.loads(paths[-1].read_text())

    def tables(self) -> int:
        """Tables in this installation's database (0: nothing was restored into it)."""
        if self.database_url:
            import psycopg

            with psycopg.connect(self.database_url.replace("postgres://", "postgresql://", 1)) as conn:
                return conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").fetchone()[0]
        database = self.home / "db.sqlite3"
        if not database.exists():
            return 0
        with contextlib.closing(sqlite3.connect(database)) as conn:
            return conn.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table'").fetchone()[0]


@dataclass
class Backup:
    vendor: str
    source: Installation
    root: Path
    archive: Path
    seeded: dict
    stdout: str
    pg: Postgres | None

    def target(self, name: str, **extra: str) -> Installation:
        """A fresh installation: an empty home and, on PostgreSQL, an empty database."""
        return Installation(self.root / name, self.pg.create(name) if self.pg else None, extra)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def backup(request, tmp_path_factory):
    pg = Postgres() if request.param == "postgresql" else None
    root = tmp_path_factory.mktemp(f"backup-{request.param}")
    try:
        source = Installation(root / "source", pg.create("source") if pg else None,
                              {"STRATA_L3_URL": (root / "source-l3").as_uri()})
        source.manage("migrate", "-v0")
        seeded = source.run("seed", root / "seed.json")
        archive = root / "strata.tar"
        done = source.manage("strata_backup", str(archive))
        yield Backup(request.param, source, root, archive, seeded, done.stdout, pg)
    finally:
        if pg is not None:
            pg.drop_all()


def _manifest(archive: Path) -> dict:
    with tarfile.open(archive) as tar:
        return json.loads(tar.extractfile("manifest.json").read())


# ---------------------------------------------------------------------------------------- the round trip
def test_restore_into_fresh_database_and_home_verifies_authenticates_and_decrypts(backup):
    target = backup.target("fresh")
    done = target.manage("strata_restore", str(backup.archive))
    assert "keys: master created, audit created, secret replaced" in done.stdout
    assert "L3: 2 objects written" in done.stdout

    state = target.run("probe", backup.root / "seed.json", backup.root / "probe-fresh.json")
    verify = state["verify"]
    assert verify["ok"], verify
    # the seeded chain, then this restore's own event (the backup's event came after the dump)
    assert verify["length"] == backup.seeded["audit_length"] + 1
    assert state["actions"][-1] == "backup.restore" and "backup.create" not in state["actions"]
    assert state["auth"] == {"live_key": 200, "revoked_key": 401}
    # the refused key was audited: the restored audit key goes on extending a verifying chain
    assert state["verify_after"]["ok"] and state["verify_after"]["length"] > verify["length"]
    assert state["master_fingerprint"] == backup.seeded["master_fingerprint"]
    assert state["other_key_opens"] is False
    assert [o["version"] for o in backup.seeded["objects"]] == [1, 2]
    for written, read in zip(backup.seeded["objects"], state["objects"], strict=True):
        assert read == {"seed": written["seed"], "stopped": None, "blocks": 4, "sha256": written["sha256"]}
    assert (target.home / "l3").is_dir() and (target.home / "master.key").stat().st_mode & 0o777 == 0o600


def test_archive_is_private_listed_and_never_overwritten(backup):
    assert stat.S_IMODE(backup.archive.stat().st_mode) == 0o600
    m = _manifest(backup.archive)
    assert m["database"]["vendor"] == backup.vendor
    assert m["audit"]["seq"] == backup.seeded["audit_length"]
    assert m["migrations"]["tenants"] and m["migrations"]["audit"]
    assert {name: entry["source"] for name, entry in m["keys"].items()} == {
        "master": "file", "audit": "file", "secret": "file"}
    assert m["keys"]["master"]["fingerprint"] == backup.seeded["master_fingerprint"]
    assert m["l3"]["kind"] == "file" and m["l3"]["objects"] == 2
    with tarfile.open(backup.archive) as tar:
        names = [member.name for member in tar]
    assert names[-1] == "manifest.json" and sorted(names[:-1]) == sorted(m["files"])
    assert "backup written:" in backup.stdout and f"audit head #{m['audit']['seq']}" in backup.stdout

    before = backup.archive.read_bytes()
    again = backup.source.manage("strata_backup", str(backup.archive), ok=False)
    assert again.returncode == 1 and "never overwrites" in again.stderr
    assert backup.archive.read_bytes() == before
    assert not [p for p in backup.root.iterdir() if p.name.startswith(".strata.tar.partial")]


def test_restore_refuses_a_non_empty_target_unless_forced(backup):
    target = backup.target("twice")
    target.manage("strata_restore", str(backup.archive))
    refused = target.manage("strata_restore", str(backup.archive), ok=False)
    assert refused.returncode == 1 and "the target is not empty" in refused.stderr and "--force" in refused.stderr

    forced = target.manage("strata_restore", "--force", str(backup.archive))
    assert "keys: master kept, audit kept, secret kept" in forced.stdout
    assert "kept as" in forced.stdout  # the replaced head log is moved aside, not deleted
    assert len(list(target.home.glob("audit-head.log.before-restore-*"))) == 1
    verify = json.loads(target.manage("audit_verify").stdout)
    # the forced restore replaced the database: the seeded chain and one restore event, not two
    assert verify["ok"] and verify["length"] == backup.seeded["audit_length"] + 1, verify


def _rewrite(archive: Path, out: Path, change) -> None:
    """A copy of ``archive`` with ``change(name, data) -> data`` applied to every member."""
    with tarfile.open(archive) as src, tarfile.open(out, "w") as dst:
        for member in src:
            data = change(member.name, src.extractfile(member).read())
            member.size = len(data)
            dst.addfile(member, io.BytesIO(data))


def test_damaged_archive_is_refused_before_anything_is_written(backup):
    damaged = backup.root / "damaged.tar"

    def flip_l3_byte(name: str, data: bytes) -> bytes:
        return data[:-1] + bytes([data[-1] ^ 1]) if name.startswith("l3/") else data

    _rewrite(backup.archive, damaged, flip_l3_byte)
    target = backup.target("damaged")
    done = target.manage("strata_restore", str(damaged), ok=False)
    assert done.returncode == 1 and "does not match its checksum" in done.stderr
    assert not (target.home / "master.key").exists() and target.tables() == 0


def test_newer_release_archive_is_refused(backup):
    newer = backup.root / "newer.tar"

    def future_migration(name: str, data: bytes) -> bytes:
        if name != "manifest.json":
            return data
        m = json.loads(data)
        m["migrations"]["tenants"] = ["9999_from_a_later_release"]
        return json.dumps(m).encode()

    _rewrite(backup.archive, newer, future_migration)
    target = backup.target("newer")
    done = target.manage("strata_restore", str(newer), ok=False)
    assert done.returncode == 1 and "newer release" in done.stderr
    assert "tenants.9999_from_a_later_release" in done.stderr
    assert target.tables() == 0


def test_another_master_key_in_the_target_is_refused(backup):
    import base64
    import secrets

    other = base64.b64encode(secrets.token_bytes(32)).decode()
    target = backup.target("otherkey", STRATA_MASTER_KEY=other)
    done = target.manage("strata_restore", str(backup.archive), ok=False)
    assert done.returncode == 1 and "STRATA_MASTER_KEY holds another master key" in done.stderr
    assert backup.seeded["master_fingerprint"] in done.stderr
    assert target.tables() == 0 and not (target.home / "audit.key").exists()


def test_on_postgresql_the_schema_owner_restores_and_the_application_role_serves(backup):
    """Compose's roles (docker/postgres-init.sql): the application role may create nothing, so its
    restore fails and changes nothing; the owner's restore gives the application role its row rights
    through the owner's default privileges, and the audit guards stay out of its reach."""
    if backup.vendor != "postgresql":
        pytest.skip("database roles are PostgreSQL's")
    import psycopg
    from psycopg import errors

    owner_url, app_url = backup.pg.create_with_roles("roles")
    as_app = Installation(backup.root / "roles", app_url)
    refused = as_app.manage("strata_restore", str(backup.archive), ok=False)
    assert refused.returncode == 1 and "permission denied" in refused.stderr and "unchanged" in refused.stderr
    assert as_app.tables() == 0

    Installation(backup.root / "roles", owner_url).manage("strata_restore", str(backup.archive))
    verify = json.loads(as_app.manage("audit_verify").stdout)
    assert verify["ok"] and verify["length"] == backup.seeded["audit_length"] + 1, verify
    as_app.manage("shell", "-c", "from controlplane.common.actor import Actor; "
                  "from controlplane.tenants.services import tenant_create; "
                  "tenant_create(actor=Actor.system('backup-test'), slug='initech', name='Initech')")
    assert json.loads(as_app.manage("audit_verify").stdout)["length"] == verify["length"] + 1
    with psycopg.connect(app_url.replace("postgres://", "postgresql://", 1), autocommit=True) as conn, \
            pytest.raises(errors.InsufficientPrivilege):
        conn.execute("DROP TRIGGER audit_auditevent_no_update_delete ON audit_auditevent")


# ---------------------------------------------------------------------------------------- in process
def test_a_master_key_from_the_environment_is_fingerprinted_not_archived(monkeypatch):
    import base64
    import secrets

    from controlplane.backups import keys
    from controlplane.common.masterkey import fingerprint

    raw = secrets.token_bytes(32)
    monkeypatch.setenv("STRATA_MASTER_KEY", base64.b64encode(raw).decode())
    monkeypatch.delenv("STRATA_MASTER_KEY_FILE", raising=False)
    info = keys.current("master")
    assert (info.source, info.raw) == ("env", None)
    assert keys.manifest_entry(info, "keys/master.key") == {
        "source": "env", "member": None, "fingerprint": fingerprint(raw)}
    # the restore accepts the same key from the environment and refuses another
    assert keys.plan("master", {"fingerprint": fingerprint(raw)}, None).action == "environment"
    with pytest.raises(keys.BackupError, match="another master key"):
        keys.plan("master", {"fingerprint": fingerprint(secrets.token_bytes(32))}, None)


def test_a_redis_l3_is_named_without_its_password_and_not_copied(monkeypatch):
    from controlplane.backups import l3

    monkeypatch.setenv("STRATA_L3_URL", "redis://:s3cret@cache.internal:6379/0")
    store = l3.configured()
    assert (store.kind, store.root) == ("redis", None)
    assert "s3cret" not in store.url and store.url == "redis://***@cache.internal:6379/0"
    monkeypatch.setenv("STRATA_L3_URL", "redis+cluster://user:pw@node-1:7000")
    assert l3.configured().url == "redis+cluster://user:***@node-1:7000"
