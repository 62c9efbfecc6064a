"""The control plane's database, dumped into a file and restored from one, per vendor.

PostgreSQL: :func:`dump` opens a REPEATABLE READ transaction, exports its snapshot, reads the audit
head and the applied migrations in it and runs ``pg_dump --format=custom --snapshot=...``, so the
dump and the manifest's figures are one consistent state while web, Celery and workers keep
writing. :func:`restore` pipes ``pg_restore --no-owner --no-privileges --file=-`` into
``psql --single-transaction`` with ``ON_ERROR_STOP``: the restore commits whole or not at all, owned
by the target's user, without the source's grants. With ``force`` the same transaction first drops
every table, view, sequence and function of the target's current schema (not those of extensions),
so a failed forced restore leaves the target as it was. The password never reaches a command line:
the tools get a private ``passfile`` that lives as long as the call.

SQLite: SQLite's backup API, both ways (one step, so the copy is consistent while other connections
write); the copy in the archive is one self-contained file (journal mode DELETE), and restoring it
replaces the target's whole content in one transaction.

A dump from one vendor is restored only into the same vendor (:func:`restore` is told the vendor the
manifest names and refuses another).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.db import connections

from controlplane.audit.models import GENESIS_HASH, AuditEvent, AuditHead
from controlplane.backups.manifest import BackupError

# Connection options of Django's settings that are libpq's own (the rest, e.g. ``pool``, are Django's).
LIBPQ_OPTIONS = frozenset({
    "sslmode", "sslrootcert", "sslcert", "sslkey", "sslcrl", "sslpassword", "options", "application_name",
    "connect_timeout", "target_session_attrs", "service", "gssencmode", "channel_binding",
})
_PG_TABLES = """
    SELECT c.relkind, n.nspname, c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p', 'v', 'm', 'S', 'f')
      AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid
                      AND d.deptype = 'e')
    ORDER BY c.relname"""
_PG_FUNCTIONS = """
    SELECT p.oid::regprocedure::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
    WHERE n.nspname = current_schema() AND p.prokind = 'f'
      AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_proc'::regclass AND d.objid = p.oid
                      AND d.deptype = 'e')"""
_PG_DROP = {"r": "TABLE", "p": "TABLE", "v": "VIEW", "m": "MATERIALIZED VIEW", "S": "SEQUENCE", "f": "FOREIGN TABLE"}


@dataclass(frozen=True)
class Dumped:
    """What :func:`dump` read inside the dumped state."""

    vendor: str  # "postgresql" | "sqlite"
    server_version: str
    tool: str  # the program that made the dump, with its version
    audit: dict[str, Any]  # {"seq", "hash", "length"}: the chain head and the number of events
    applied: list[tuple[str, str]]  # django_migrations' (app, name) rows


def vendor(*, using: str = "default") -> str:
    return connections[using].vendor


def dump(target: Path, *, using: str = "default") -> Dumped:
    """Dump the database ``using`` into the new file ``target``."""
    kind = vendor(using=using)
    if kind == "postgresql":
        return _pg_dump(target, using)
    if kind == "sqlite":
        return _sqlite_dump(target, using)
    raise BackupError(f"backups support PostgreSQL and SQLite, not {kind}")


def tables(*, using: str = "default") -> list[str]:
    """The tables and views of the database ``using`` (its current schema on PostgreSQL): empty for a
    database nothing was created in."""
    kind = vendor(using=using)
    if kind == "postgresql":
        import psycopg

        with _conninfo(using) as conninfo, psycopg.connect(conninfo) as conn:
            return [name for relkind, _, name in conn.execute(_PG_TABLES).fetchall() if relkind != "S"]
    path = _sqlite_path(using)
    if not path.exists() or path.stat().st_size == 0:
        return []
    with contextlib.closing(sqlite3.connect(path, timeout=20)) as conn:
        return [row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view') "
                                               "AND name NOT LIKE 'sqlite_%' ORDER BY name")]


def restore(source: Path, *, dumped_vendor: str, force: bool, using: str = "default") -> None:
    """Load the dump ``source`` (made from a ``dumped_vendor`` database) into the database ``using``.
    The caller checked that the target is empty or that ``force`` was given."""
    kind = vendor(using=using)
    if kind != dumped_vendor:
        raise BackupError(f"the archive holds a {dumped_vendor} database and this installation uses {kind}: "
                          "restore into the same kind of database")
    connections[using].close()  # nothing of ours stays open on what is replaced
    if kind == "postgresql":
        _pg_restore(source, force=force, using=using)
    else:
        _sqlite_restore(source, using=using)


# ---------------------------------------------------------------------------------------- shared
def _audit_state(cursor) -> dict[str, Any]:
    # Table names from the models (not user input); the cursor is a DB-API one of either vendor.
    cursor.execute(f"SELECT seq, hash FROM {AuditHead._meta.db_table} WHERE id = 1")  # noqa: S608
    row = cursor.fetchone()
    cursor.execute(f"SELECT COUNT(*) FROM {AuditEvent._meta.db_table}")  # noqa: S608
    (length,) = cursor.fetchone()
    return {"seq": int(row[0]) if row else 0, "hash": str(row[1]) if row else GENESIS_HASH, "length": int(length)}


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise BackupError(f"{name} is not installed: install PostgreSQL's client programs (Debian: apt-get "
                          "install postgresql-client), of the server's major version or newer")
    return path


def _run(command: list[str], what: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise BackupError(f"{what} failed (exit {done.returncode}): {_tail(done.stderr)}")
    return done.stdout


def _tail(text: str, lines: int = 6) -> str:
    return " | ".join(line for line in text.strip().splitlines()[-lines:]) or "no message"


# ---------------------------------------------------------------------------------------- PostgreSQL
def _pgpass_escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace(":", "\\:")


@contextlib.contextmanager
def _conninfo(using: str) -> Iterator[str]:
    """A libpq connection string for the database ``using``; a password goes into a private
    ``passfile`` (removed when the block ends), never into the string itself."""
    from psycopg.conninfo import make_conninfo

    db = connections[using].settings_dict
    params = {"dbname": db.get("NAME"), "user": db.get("USER"), "host": db.get("HOST"), "port": db.get("PORT")}
    params.update({k: v for k, v in (db.get("OPTIONS") or {}).items() if k in LIBPQ_OPTIONS})
    params = {k: str(v) for k, v in params.items() if v not in (None, "")}
    with tempfile.TemporaryDirectory(prefix="strata-pg-") as private:  # mode 0700
        if db.get("PASSWORD"):
            passfile = Path(private) / "pgpass"
            fd = os.open(passfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(f"*:*:*:*:{_pgpass_escape(str(db['PASSWORD']))}\n")
            params["passfile"] = str(passfile)
        yield make_conninfo(**params)


def _pg_dump(target: Path, using: str) -> Dumped:
    import psycopg

    pg_dump = _tool("pg_dump")
    with _conninfo(using) as conninfo, psycopg.connect(conninfo) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        with conn.cursor() as cursor:
            cursor.execute("SELECT pg_export_snapshot(), current_setting('server_version')")
            snapshot, server = cursor.fetchone()
            audit = _audit_state(cursor)
            cursor.execute("SELECT app, name FROM django_migrations")
            applied = [(str(app), str(name)) for app, name in cursor.fetchall()]
        # The snapshot lives while this transaction is open: pg_dump reads exactly what we read.
        _run([pg_dump, "--format=custom", f"--snapshot={snapshot}", f"--file={target}", f"--dbname={conninfo}"],
             "pg_dump")
        conn.rollback()
    tool = _run([pg_dump, "--version"], "pg_dump --version").strip()
    return Dumped("postgresql", str(server), tool, audit, applied)


def _wipe_sql(conninfo: str) -> str:
    """DROP statements for every table, view, sequence and function of the current schema."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(conninfo) as conn:
        statements = [
            sql.SQL("DROP {} IF EXISTS {}.{} CASCADE;").format(
                sql.SQL(_PG_DROP[relkind]), sql.Identifier(schema), sql.Identifier(name)).as_string(conn)
            for relkind, schema, name in conn.execute(_PG_TABLES).fetchall()]
        # regprocedure's text is the server's own quoting of the function's name and signature.
        statements += [f"DROP FUNCTION IF EXISTS {signature} CASCADE;"
                       for (signature,) in conn.execute(_PG_FUNCTIONS).fetchall()]
    return "\n".join(statements) + "\n"


def _pg_restore(source: Path, *, force: bool, using: str) -> None:
    pg_restore, psql = _tool("pg_restore"), _tool("psql")
    with _conninfo(using) as conninfo, tempfile.TemporaryFile() as psql_out, \
            tempfile.TemporaryFile() as restore_err:
        wipe = _wipe_sql(conninfo) if force else ""
        loader = subprocess.Popen(
            [psql, "--no-psqlrc", "--quiet", "--single-transaction", "--set=ON_ERROR_STOP=1", f"--dbname={conninfo}"],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=psql_out)  # errors only
        assert loader.stdin is not None
        reader = subprocess.Popen([pg_restore, "--no-owner", "--no-privileges", "--file=-", str(source)],
                                  stdout=subprocess.PIPE, stderr=restore_err)
        assert reader.stdout is not None
        try:
            loader.stdin.write(wipe.encode("utf-8"))
            shutil.copyfileobj(reader.stdout, loader.stdin, 1 << 20)
        except BrokenPipeError:
            pass  # psql stopped at an error: its output says which
        finally:
            reader.stdout.close()
            read_rc = reader.wait()
        if read_rc != 0:
            # psql would COMMIT at the end of a truncated script: kill it, so the server rolls back.
            loader.kill()
            loader.wait()
            restore_err.seek(0)
            raise BackupError(f"pg_restore failed (exit {read_rc}); the database is unchanged: "
                              f"{_tail(restore_err.read().decode('utf-8', 'replace'))}")
        with contextlib.suppress(BrokenPipeError):
            loader.stdin.close()
        load_rc = loader.wait()
        if load_rc != 0:
            psql_out.seek(0)
            raise BackupError(f"loading the dump failed (psql exit {load_rc}); the database is unchanged: "
                              f"{_tail(psql_out.read().decode('utf-8', 'replace'))}")


# ---------------------------------------------------------------------------------------- SQLite
def _sqlite_path(using: str) -> Path:
    name = str(connections[using].settings_dict.get("NAME") or "")
    if not name or name == ":memory:" or name.startswith("file:"):
        raise BackupError(f"the SQLite database {name!r} is not a plain file: nothing to back up or restore into")
    return Path(name)


def _sqlite_dump(target: Path, using: str) -> Dumped:
    source = _sqlite_path(using)
    if not source.exists():
        raise BackupError(f"there is no database at {source}")
    os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    with contextlib.closing(sqlite3.connect(source, timeout=20)) as src, \
            contextlib.closing(sqlite3.connect(target)) as dst:
        src.backup(dst)  # all pages in one step: one consistent state
        dst.execute("PRAGMA journal_mode=DELETE")  # one self-contained file, no -wal beside it
        try:
            audit = _audit_state(dst.cursor())
            applied = [(str(app), str(name)) for app, name in dst.execute("SELECT app, name FROM django_migrations")]
        except sqlite3.Error as exc:
            raise BackupError(f"{source} is not a migrated Strata database ({exc})") from None
    return Dumped("sqlite", sqlite3.sqlite_version, f"sqlite3 {sqlite3.sqlite_version} backup API", audit, applied)


def _sqlite_restore(source: Path, *, using: str) -> None:
    from django.conf import settings

    from controlplane import env as envmod

    target = envmod.private_file(_sqlite_path(using), *settings.SQLITE_COMPANIONS)  # 0600 whatever the umask
    with contextlib.closing(sqlite3.connect(source.as_uri() + "?mode=ro", uri=True)) as src, \
            contextlib.closing(sqlite3.connect(target, timeout=20)) as dst:
        src.backup(dst)  # replaces every page of the target in one transaction
