"""Database triggers that keep the audit log append-only and its head moving forward, per vendor.

``audit_auditevent`` (rows): UPDATE, DELETE and TRUNCATE are refused; on SQLite also an INSERT that
would collide with an existing seq or hash, which is how ``INSERT OR REPLACE`` / ``REPLACE INTO``
deletes a row without firing DELETE triggers.

``audit_audithead`` (the one-row chain head): DELETE and TRUNCATE are refused and an UPDATE must move
it forward (new seq > old seq, same id); on SQLite an INSERT while the row exists is refused too
(``INSERT OR REPLACE`` could otherwise rewind it).

PostgreSQL: plpgsql functions RAISE (row-level and statement-level triggers). SQLite: BEFORE
triggers ``RAISE(ABORT, ...)``. Other vendors: nothing (the keyed chain and the external head log
still detect tampering). A refused statement fails with a ``DatabaseError``. Installed by migrations
0002 (the event table) and 0003 (everything, for databases migrated before the head was guarded).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

TABLE = "audit_auditevent"
HEAD = "audit_audithead"

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
            f"""CREATE OR REPLACE FUNCTION {HEAD}_forward_only() RETURNS trigger
                LANGUAGE plpgsql AS $$
                BEGIN
                    IF TG_OP = 'UPDATE' THEN
                        IF NEW.id = OLD.id AND NEW.seq > OLD.seq THEN
                            RETURN NEW;
                        END IF;
                    END IF;
                    RAISE EXCEPTION USING MESSAGE = '{HEAD} only moves forward: ' || TG_OP || ' refused';
                END $$""",
            f"""CREATE TRIGGER {HEAD}_forward_only BEFORE UPDATE OR DELETE ON {HEAD}
                FOR EACH ROW EXECUTE FUNCTION {HEAD}_forward_only()""",
            f"""CREATE TRIGGER {HEAD}_no_truncate BEFORE TRUNCATE ON {HEAD}
                FOR EACH STATEMENT EXECUTE FUNCTION {HEAD}_forward_only()""",
        ],
        "uninstall": [
            f"DROP TRIGGER IF EXISTS {TABLE}_no_update_delete ON {TABLE}",
            f"DROP TRIGGER IF EXISTS {TABLE}_no_truncate ON {TABLE}",
            f"DROP TRIGGER IF EXISTS {HEAD}_forward_only ON {HEAD}",
            f"DROP TRIGGER IF EXISTS {HEAD}_no_truncate ON {HEAD}",
        ],
    },
    "sqlite": {
        "install": [
            f"""CREATE TRIGGER IF NOT EXISTS {TABLE}_no_update BEFORE UPDATE ON {TABLE}
                BEGIN SELECT RAISE(ABORT, '{TABLE} is append-only: UPDATE refused'); END""",
            f"""CREATE TRIGGER IF NOT EXISTS {TABLE}_no_delete BEFORE DELETE ON {TABLE}
                BEGIN SELECT RAISE(ABORT, '{TABLE} is append-only: DELETE refused'); END""",
            f"""CREATE TRIGGER IF NOT EXISTS {TABLE}_no_replace BEFORE INSERT ON {TABLE}
                WHEN EXISTS (SELECT 1 FROM {TABLE} WHERE seq = NEW.seq OR hash = NEW.hash)
                BEGIN SELECT RAISE(ABORT, '{TABLE} is append-only: INSERT over an existing row refused'); END""",  # noqa: S608
            f"""CREATE TRIGGER IF NOT EXISTS {HEAD}_forward_only BEFORE UPDATE ON {HEAD}
                WHEN NEW.id != OLD.id OR NEW.seq <= OLD.seq
                BEGIN SELECT RAISE(ABORT, '{HEAD} only moves forward: UPDATE refused'); END""",
            f"""CREATE TRIGGER IF NOT EXISTS {HEAD}_no_delete BEFORE DELETE ON {HEAD}
                BEGIN SELECT RAISE(ABORT, '{HEAD} only moves forward: DELETE refused'); END""",
            f"""CREATE TRIGGER IF NOT EXISTS {HEAD}_no_replace BEFORE INSERT ON {HEAD}
                WHEN EXISTS (SELECT 1 FROM {HEAD} WHERE id = NEW.id)
                BEGIN SELECT RAISE(ABORT, '{HEAD} only moves forward: INSERT over the head refused'); END""",  # noqa: S608
        ],
        "uninstall": [
            f"DROP TRIGGER IF EXISTS {TABLE}_no_update",
            f"DROP TRIGGER IF EXISTS {TABLE}_no_delete",
            f"DROP TRIGGER IF EXISTS {TABLE}_no_replace",
            f"DROP TRIGGER IF EXISTS {HEAD}_forward_only",
            f"DROP TRIGGER IF EXISTS {HEAD}_no_delete",
            f"DROP TRIGGER IF EXISTS {HEAD}_no_replace",
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
    """(Re)create every trigger on ``connection``; idempotent."""
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
