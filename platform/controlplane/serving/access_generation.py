"""The access generation: one number in the database that every change to who may use what moves.

``serving.access_cache`` keeps what a key resolves to (its tenant with the quotas and share group,
the key's state, the granted deployments with their active revisions) and serves it only while this
number is what it was when the entry was read. The number is moved by database triggers, in the
writer's own transaction, on every INSERT, UPDATE, DELETE (and TRUNCATE) of the tables that
admission reads: tenants, share groups, grants, deployments and revisions, LoRA adapters, and API keys (an UPDATE
of a key only when its ``revoked_at``, hash, prefix or tenant is set: marking a key used does not
move it). Any writer, in any process, through services, the Django admin, a bulk ``update()`` or
raw SQL, moves it when its change commits; so a revoked key, a suspended tenant, a withdrawn grant or
a lowered quota is refused or applied on the very next request, by every web process.

PostgreSQL: one plpgsql function and a statement-level trigger per table. SQLite: one trigger per
table and event. Other vendors: no triggers; ``current`` then returns None and nothing is cached.
``install`` runs in this app's migration and again after every ``migrate`` (``apps``): SQLite
rebuilds a table, dropping its triggers, on many schema changes.
"""

from __future__ import annotations

import secrets

TABLE = "serving_accessgeneration"
FUNCTION = "serving_access_changed"
VENDORS = ("postgresql", "sqlite")
# (table, the columns whose UPDATE moves the generation: None = any)
API_KEY_COLUMNS = ("revoked_at", "key_hash", "prefix", "tenant_id")


def watched() -> list[tuple[str, tuple[str, ...] | None]]:
    """The tables admission reads, with the columns whose UPDATE counts (None: every column)."""
    from controlplane.adapters.models import Adapter
    from controlplane.registry.models import ModelDeployment, ModelRevision
    from controlplane.tenants.models import ApiKey, Grant, ShareGroup, Tenant

    return [(Tenant._meta.db_table, None), (ShareGroup._meta.db_table, None), (Grant._meta.db_table, None),
            (ModelDeployment._meta.db_table, None), (ModelRevision._meta.db_table, None),
            (ApiKey._meta.db_table, API_KEY_COLUMNS), (Adapter._meta.db_table, None)]


def _postgresql(install: bool, tables: list[tuple[str, tuple[str, ...] | None]]) -> list[str]:
    out = []
    for table, columns in tables:
        out.append(f"DROP TRIGGER IF EXISTS {table}_access_changed ON {table}")
        if install:
            update = f"UPDATE OF {', '.join(columns)}" if columns else "UPDATE"
            out.append(f"CREATE TRIGGER {table}_access_changed AFTER INSERT OR {update} OR DELETE OR TRUNCATE "
                       f"ON {table} FOR EACH STATEMENT EXECUTE FUNCTION {FUNCTION}()")
    if install:
        out.insert(0, f"""CREATE OR REPLACE FUNCTION {FUNCTION}() RETURNS trigger LANGUAGE plpgsql AS $$
                          BEGIN UPDATE {TABLE} SET value = value + 1; RETURN NULL; END $$""")  # noqa: S608
    else:
        out.append(f"DROP FUNCTION IF EXISTS {FUNCTION}()")
    return out


def _sqlite(install: bool, tables: list[tuple[str, tuple[str, ...] | None]]) -> list[str]:
    out = []
    for table, columns in tables:
        for event in ("insert", "update", "delete"):
            name = f"{table}_access_{event}"
            out.append(f"DROP TRIGGER IF EXISTS {name}")
            if install:
                what = f"UPDATE OF {', '.join(columns)}" if event == "update" and columns else event.upper()
                body = f"UPDATE {TABLE} SET value = value + 1"  # noqa: S608 (constants)
                out.append(f"CREATE TRIGGER {name} AFTER {what} ON {table} BEGIN {body}; END")
    return out


def _statements(connection, install: bool) -> list[str]:
    """The vendor's statements for the watched tables that exist (a table created by a later
    migration gets its trigger from the install after ``migrate``)."""
    if connection.vendor not in VENDORS:
        return []
    present = set(connection.introspection.table_names())
    tables = [(t, c) for t, c in watched() if t in present]
    return _postgresql(install, tables) if connection.vendor == "postgresql" else _sqlite(install, tables)


def install(connection) -> None:
    """(Re)create every trigger on ``connection``; idempotent."""
    with connection.cursor() as cursor:
        for sql in _statements(connection, install=True):
            cursor.execute(sql)


def uninstall(connection) -> None:
    """Drop the triggers (reverse migration; tests that show what the cache would do without them)."""
    with connection.cursor() as cursor:
        for sql in _statements(connection, install=False):
            cursor.execute(sql)


def current(connection) -> int | None:
    """The generation now (one indexed read), or None where there are no triggers (nothing may be
    cached). The row is created when missing (a fresh or flushed database) with a random value, so an
    entry read before the row was removed cannot match the new one."""
    if connection.vendor not in VENDORS:
        return None
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT value FROM {TABLE} WHERE id = 1")  # noqa: S608 (a constant)
        row = cursor.fetchone()
        if row is None:
            cursor.execute(f"INSERT INTO {TABLE} (id, value) VALUES (1, %s) ON CONFLICT (id) DO NOTHING",  # noqa: S608
                           [secrets.randbits(62)])
            cursor.execute(f"SELECT value FROM {TABLE} WHERE id = 1")  # noqa: S608
            row = cursor.fetchone()
    return int(row[0])
