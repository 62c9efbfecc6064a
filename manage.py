#!/usr/bin/env python
"""Django's command-line utility for the Strata control plane.

``platform/`` is a source root (never a package: it would shadow the stdlib ``platform`` module), so
it is put on ``sys.path`` here before ``controlplane`` is imported.
"""

import os
import sys
from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parent / "platform"


# Commands that run without a migrated Strata database (they make it, or need none).
NO_DATABASE_NEEDED = {"migrate", "makemigrations", "help", "version", "check", "collectstatic", "showmigrations",
                      "sqlmigrate", "shell", "dbshell", "test", "strata_restore", "--help", "-h", "--version"}


def _home() -> Path:
    """The state folder the settings will use (``strata_env.home``: ``STRATA_HOME``, else ``.strata``
    beside this file), the same rule as ``make run``'s launcher and the workers."""
    from strata_env import home  # this file's folder is on sys.path: the repository root

    return home()


def _database_missing(home: Path, home_existed: bool) -> str | None:
    """One line saying why there is no Strata database to work on, or None when there is one."""
    from django.db import connection
    from django.db.utils import Error

    if connection.vendor == "sqlite" and not Path(connection.settings_dict["NAME"]).exists():
        where = f"no Strata database in {home}"
    else:
        try:
            tables = connection.introspection.table_names()
        except Error as exc:
            return f"strata: cannot reach the database ({str(exc).splitlines()[0]})"
        if "tenants_tenant" in tables:
            return None
        where = f"the database of {home} has no Strata tables"
    if not home_existed:  # the settings just made this folder: leave nothing behind
        import shutil

        shutil.rmtree(home, ignore_errors=True)
    return (f"strata: {where}. Run this with the STRATA_HOME (or DATABASE_URL) that `make run` uses, "
            f"or start the platform once (`make run`) to create it.")


def main() -> None:
    if str(SOURCE_ROOT) not in sys.path:
        sys.path.insert(1, str(SOURCE_ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings.local")
    command = sys.argv[1] if len(sys.argv) > 1 else "help"
    home = _home()
    home_existed = home.exists()
    import django
    from django.core.management import execute_from_command_line

    if command not in NO_DATABASE_NEEDED and os.environ["DJANGO_SETTINGS_MODULE"].endswith(".local"):
        django.setup()
        problem = _database_missing(home, home_existed)
        if problem:
            print(problem, file=sys.stderr)
            sys.exit(2)
    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
