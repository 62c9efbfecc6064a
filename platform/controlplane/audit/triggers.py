"""Database triggers that make ``audit_auditevent`` append-only, per vendor.

PostgreSQL: a plpgsql function RAISEs on UPDATE, DELETE (row level) and TRUNCATE (statement level).
SQLite: BEFORE UPDATE / BEFORE DELETE triggers ``RAISE(ABORT, ...)``. Other vendors: nothing (the
hash chain still detects tampering). The refused statement fails with a ``DatabaseError``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

TABLE = "audit_auditevent"

_SQL = {
    "postgresql": {
        "install": [
            f"""CREATE OR REPLACE FUNCTION {TABLE}_refuse_change() RETURNS trigger
                LANGUAGE plpgsql AS $$
                BEGIN
                    RAISE EXCEPTION USING MESSAGE = '{TABLE} is append-only: ' || TG_OP || ' refused';
                END $$""",
            f"""CREATE TRIGGER {TABLE}_no_update_delete BEFORE UPDATE OR DELETE ON {TABLE}
                FOR EACH ROW EXECUTE FUNCTION {TABLE}_refuse_change()""",
            f"""CREATE TRIGGER {TABLE}_no_truncate BEFORE TRUNCATE ON {TABLE}
                FOR EACH STATEMENT EXECUTE FUNCTION {TABLE}_refuse_change()""",
        ],
        "uninstall": [
            f"DROP TRIGGER IF EXISTS {TABLE}_no_update_delete ON {TABLE}",
            f"DROP TRIGGER IF EXISTS {TABLE}_no_truncate ON {TABLE}",
        ],
    },
    "sqlite": {
        "install": [
            f"""CREATE TRIGGER IF NOT EXISTS {TABLE}_no_update BEFORE UPDATE ON {TABLE}
                BEGIN SELECT RAISE(ABORT, '{TABLE} is append-only: UPDATE refused'); END""",
            f"""CREATE TRIGGER IF NOT EXISTS {TABLE}_no_delete BEFORE DELETE ON {TABLE}
                BEGIN SELECT RAISE(ABORT, '{TABLE} is append-only: DELETE refused'); END""",
        ],
        "uninstall": [
            f"DROP TRIGGER IF EXISTS {TABLE}_no_update",
            f"DROP TRIGGER IF EXISTS {TABLE}_no_delete",
        ],
    },
}


def _run(connection, step: str) -> None:
    # No params: keeps the driver from treating any '%' in the DDL as a placeholder.
    statements = _SQL.get(connection.vendor, {}).get(step, [])
    with connection.cursor() as cursor:
        for sql in statements:
            cursor.execute(sql)


def install(connection) -> None:
    """(Re)create the triggers on ``connection``; idempotent."""
    _run(connection, "uninstall")
    _run(connection, "install")


def uninstall(connection) -> None:
    """Drop the triggers (reverse migration, test flush, tamper tests)."""
    _run(connection, "uninstall")


@contextmanager
def suspended(connection) -> Iterator[None]:
    """Drop the triggers for the block and put them back afterwards, even on error."""
    uninstall(connection)
    try:
        yield
    finally:
        install(connection)
