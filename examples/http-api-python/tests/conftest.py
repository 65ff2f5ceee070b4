"""Fixtures: a real idempotency-service (the binary, on a free port, with its
own temporary store) and the API running for real under uvicorn, as a
subprocess on a free port, with its own SQLite file."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, Optional

import httpx
import pytest

from idempotency_client.testing import ServerProcess, free_port

HERE = pathlib.Path(__file__).resolve().parent
EXAMPLE = HERE.parent
REPO = EXAMPLE.parent.parent
#: Two clients of the API, each with its API key.
API_KEYS = {"sk_test_a": "acct_a", "sk_test_b": "acct_b"}
#: The customers whose charges misbehave, for the tests that need it.
FAULTS = {
    "API_TEST_SLOW_CUSTOMERS": "cus_slow",
    "API_TEST_SLOW_SECONDS": "1.5",
    "API_TEST_FAIL_BEFORE_EFFECT": "cus_fail_before",
    "API_TEST_FAIL_AFTER_EFFECT": "cus_fail_after",
}
LEASE_SECONDS = 10


def server_binary() -> pathlib.Path:
    configured = os.environ.get("IDEMPOTENCY_BIN")
    path = pathlib.Path(configured) if configured else REPO / "target/release/idempotency-service"
    if not path.is_absolute():
        path = REPO / path
    if not path.is_file():
        pytest.exit(f"idempotency-service binary not found at {path} (build it, or set IDEMPOTENCY_BIN)", 2)
    return path


@pytest.fixture(scope="session")
def idempotency_server(tmp_path_factory):
    # Refusing late retries unless a Claim says otherwise: the API pins
    # late_retry="reexecute", so a late retry is re-executed whatever the
    # server's or the namespace's policy (issue 33, defect 6).
    with ServerProcess.start(server_binary(), data_dir=tmp_path_factory.mktemp("idempotency-store"),
                             env={"IDEMPOTENCY_LATE_RETRY": "refuse"}) as server:
        yield server


@dataclass
class Api:
    process: subprocess.Popen
    url: str
    database: pathlib.Path
    log_path: pathlib.Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_api(tmp: pathlib.Path, target: str, extra_env: Optional[Dict[str, str]] = None, timeout: float = 30.0) -> Api:
    port = free_port()
    database = tmp / f"api-{port}.db"
    log_path = tmp / f"api-{port}.log"
    env = dict(os.environ)
    env.update(
        {
            "API_KEYS": ",".join(f"{key}={principal}" for key, principal in API_KEYS.items()),
            "IDEMPOTENCY_TARGET": target,
            "API_DB": str(database),
            "API_LEASE_SECONDS": str(LEASE_SECONDS),
            **FAULTS,
        }
    )
    env.update(extra_env or {})
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "app:app", "--host", "127.0.0.1", "--port", str(port),
             "--log-level", "warning"],
            cwd=EXAMPLE, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
    api = Api(process, f"http://127.0.0.1:{port}", database, log_path)
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the API exited with {process.returncode}:\n{api.log()}")
        try:
            if httpx.get(f"{api.url}/healthz", timeout=1).status_code == 200:
                return api
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            api.stop()
            raise TimeoutError(f"the API did not answer /healthz within {timeout} s:\n{api.log()}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def api(tmp_path_factory, idempotency_server):
    """One API for a module's tests; each test uses its own keys and customers."""
    started = start_api(tmp_path_factory.mktemp("api"), idempotency_server.target)
    yield started
    started.stop()
    print(f"--- API log ---\n{started.log()}")


@pytest.fixture
def api_factory(tmp_path):
    started = []

    def start(target: str, extra_env: Optional[Dict[str, str]] = None) -> Api:
        api = start_api(tmp_path, target, extra_env)
        started.append(api)
        return api

    yield start
    for api in started:
        api.stop()
