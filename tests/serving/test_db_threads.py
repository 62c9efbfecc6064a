"""``serving.db_threads``: the serving path's database work keeps its thread's connection from one job
to the next (no new connection per request), and drops it after a database error (or, with a
connection pool, after every job, back to the pool)."""

from __future__ import annotations

import asyncio

import pytest
from django.db import DatabaseError, connection

from controlplane.serving import db_threads

pytestmark = pytest.mark.django_db(transaction=True)


def _conn_id() -> int:
    connection.ensure_connection()
    return id(connection.connection)


def _bad_query() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM no_such_table_here")


def _run(fn):
    async def one():
        return await db_threads.run(fn)

    return asyncio.run(one())


@pytest.fixture
def one_thread(monkeypatch):
    """One database thread, so consecutive jobs share it (and its connection)."""
    from concurrent.futures import ThreadPoolExecutor

    executor = ThreadPoolExecutor(1, thread_name_prefix="strata-serving-db-test")
    monkeypatch.setattr(db_threads, "_executor", executor)
    yield
    executor.submit(lambda: connection.close()).result()
    executor.shutdown()


def test_a_thread_keeps_its_connection_between_jobs_and_drops_it_after_an_error(one_thread):
    first, second = _run(_conn_id), _run(_conn_id)
    if db_threads._pooled():  # PostgreSQL's pool: every job hands its connection back
        assert _run(lambda: connection.connection) is None
    else:
        assert first == second
    with pytest.raises(DatabaseError):
        _run(_bad_query)
    assert _run(lambda: connection.connection) is None  # closed after the error: the next job reconnects
    assert _run(lambda: connection.cursor().execute("SELECT 1").fetchone()) == (1,)
