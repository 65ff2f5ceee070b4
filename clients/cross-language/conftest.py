"""What every cross-language test module shares: one real server per module
(embedded store), a Python client of it, and a fresh namespace per test."""

import uuid

import pytest

from idempotency_client import IdempotencyClient
from idempotency_client.testing import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess.start(data_dir=tmp_path_factory.mktemp("cross-language")) as server:
        yield server


@pytest.fixture
def client(server):
    with IdempotencyClient(server.target) as client:
        yield client


@pytest.fixture
def namespace():
    return f"cross-{uuid.uuid4().hex[:12]}"
