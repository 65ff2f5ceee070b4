"""Fixtures: a real idempotency-service per store, started once per session.

Every test uses its own namespace, so tests share a server without sharing
keys. Tests marked `postgres` run twice: on the embedded store (SQLite) and on
PostgreSQL, each server with a fresh database.
"""

import uuid

import pytest

from idempotency_client import AsyncIdempotencyClient, IdempotencyClient
from idempotency_client.testing import (
    ServerProcess,
    create_postgres_database,
    drop_postgres_database,
)


def pytest_generate_tests(metafunc):
    if "store" in metafunc.fixturenames:
        stores = ["sqlite", "postgres"] if metafunc.definition.get_closest_marker("postgres") else ["sqlite"]
        metafunc.parametrize("store", stores)


@pytest.fixture(scope="session")
def sqlite_server(tmp_path_factory):
    with ServerProcess.start(data_dir=tmp_path_factory.mktemp("sqlite-store")) as server:
        yield server


@pytest.fixture(scope="session")
def postgres_server(tmp_path_factory):
    url = create_postgres_database()
    try:
        with ServerProcess.start(
            data_dir=tmp_path_factory.mktemp("postgres-store"), database_url=url
        ) as server:
            yield server
    finally:
        drop_postgres_database(url)


@pytest.fixture
def server(request, store):
    return request.getfixturevalue(f"{store}_server")


@pytest.fixture
def namespace(request):
    return f"py-{request.node.name[:60]}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def client(server):
    with IdempotencyClient(server.target) as client:
        yield client


@pytest.fixture
def other_client(server):
    """A second caller, as another replica or service would be."""
    with IdempotencyClient(server.target) as client:
        yield client


@pytest.fixture
async def aclient(server):
    async with AsyncIdempotencyClient(server.target) as client:
        yield client
