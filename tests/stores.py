"""Event-store locations for tests: one suite runs on SQLite and on Postgres.

    with store_location("postgres", tmp_path) as location:   # "sqlite", or a Postgres URL
        store = open_event_store(tmp_path, location)           # what ServeConfig.store takes, too

Each Postgres use gets a schema of its own (created here, dropped afterwards, whatever the test did),
so runs never see each other's rows. Postgres tests skip, with the reason, only when no server answers
at RTRL_TEST_POSTGRES_URL (default postgresql://127.0.0.1:5432/test, the project's machines) or
psycopg is not installed.
"""

from __future__ import annotations

import functools
import os
import urllib.parse
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from realtime_rl import collect

PG_URL = os.environ.get("RTRL_TEST_POSTGRES_URL", "postgresql://127.0.0.1:5432/test")
BACKENDS = ["sqlite", "postgres"]


@functools.cache
def postgres_unavailable() -> str | None:
    """None when the Postgres server answers, else why not."""
    return collect.postgres_unavailable(PG_URL)


def with_search_path(url: str, schema: str) -> str:
    """The URL with libpq's `options=-csearch_path=<schema>`."""
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qsl(parts.query) + [("options", f"-csearch_path={schema}")]
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))


@contextmanager
def postgres_schema() -> Iterator[str]:
    """A fresh schema; yields a URL that selects it; drops it (CASCADE) afterwards."""
    reason = postgres_unavailable()
    if reason is not None:
        pytest.skip(reason)
    import psycopg

    name = f"rtrl_test_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {name}")
    try:
        yield with_search_path(PG_URL, name)
    finally:
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")


@contextmanager
def store_location(backend: str, run_dir: Path) -> Iterator[str]:
    """"sqlite" (the store is run_dir/events.sqlite) or a Postgres URL in a schema of its own."""
    if backend == "sqlite":
        yield "sqlite"
    elif backend == "postgres":
        with postgres_schema() as url:
            yield url
    else:
        raise ValueError(f"unknown backend {backend!r}")
