"""Fixtures: a real idempotency-service (the binary, on a free port, with its
own temporary store) and the receiver running for real under uvicorn, as a
subprocess on a free port, with its own SQLite file and namespace."""

from __future__ import annotations

import hashlib
import hmac
import os
import pathlib
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Dict, Optional

import httpx
import pytest

from idempotency_client.testing import ServerProcess, free_port

HERE = pathlib.Path(__file__).resolve().parent
EXAMPLE = HERE.parent
REPO = EXAMPLE.parent.parent
SECRET = "whsec_example_test_secret"
PROVIDER = "acmepay"


def server_binary() -> pathlib.Path:
    configured = os.environ.get("IDEMPOTENCY_BIN")
    path = pathlib.Path(configured) if configured else REPO / "target/release/idempotency-service"
    if not path.is_absolute():
        path = REPO / path
    if not path.is_file():
        pytest.exit(f"idempotency-service binary not found at {path} (build it, or set IDEMPOTENCY_BIN)", 2)
    return path


def sign(body: bytes, *, secret: str = SECRET, timestamp: Optional[int] = None) -> str:
    """The provider's side, written independently of receiver.py."""
    t = int(time.time()) if timestamp is None else timestamp
    mac = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={t},v1={mac}"


@pytest.fixture(scope="session")
def idempotency_server(tmp_path_factory):
    with ServerProcess.start(server_binary(), data_dir=tmp_path_factory.mktemp("idempotency-store")) as server:
        yield server


@dataclass
class Receiver:
    process: subprocess.Popen
    url: str
    database: pathlib.Path
    namespace: str
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


def start_receiver(tmp: pathlib.Path, target: str, extra_env: Dict[str, str], timeout: float = 30.0) -> Receiver:
    port = free_port()
    namespace = f"webhooks-test-{uuid.uuid4().hex[:12]}"
    database = tmp / f"receiver-{port}.db"
    log_path = tmp / f"receiver-{port}.log"
    env = dict(os.environ)
    env.update(
        {
            "WEBHOOK_SECRET": SECRET,
            "WEBHOOK_PROVIDER": PROVIDER,
            "WEBHOOK_NAMESPACE": namespace,
            "IDEMPOTENCY_TARGET": target,
            "RECEIVER_DB": str(database),
        }
    )
    env.update(extra_env)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "receiver:app", "--host", "127.0.0.1", "--port", str(port),
             "--log-level", "warning"],
            cwd=EXAMPLE,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    receiver = Receiver(process, f"http://127.0.0.1:{port}", database, namespace, log_path)
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the receiver exited with {process.returncode}:\n{receiver.log()}")
        try:
            if httpx.get(f"{receiver.url}/healthz", timeout=1).status_code == 200:
                return receiver
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            receiver.stop()
            raise TimeoutError(f"the receiver did not answer /healthz within {timeout} s:\n{receiver.log()}")
        time.sleep(0.05)


@pytest.fixture
def receiver_factory(tmp_path, idempotency_server, request):
    started = []

    def start(extra_env: Optional[Dict[str, str]] = None, target: Optional[str] = None) -> Receiver:
        receiver = start_receiver(tmp_path, target or idempotency_server.target, extra_env or {})
        started.append(receiver)
        return receiver

    yield start
    for receiver in started:
        receiver.stop()
    failed = getattr(request.node, "rep_call", None)
    if failed is not None and failed.failed:
        for receiver in started:
            print(f"--- receiver log ({receiver.url}) ---\n{receiver.log()}")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
