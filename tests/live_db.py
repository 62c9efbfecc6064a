"""The test database as a ``DATABASE_URL``, for the real subprocesses a test starts (a Celery worker,
web processes) so that they read and write what the test process does."""

from __future__ import annotations

from django.db import connection


def database_url() -> str:
    db = connection.settings_dict
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    user = db.get("USER") or "postgres"
    host = db.get("HOST") or "127.0.0.1"
    port = db.get("PORT") or 5432
    return f"postgres://{user}@{host}:{port}/{db['NAME']}"
