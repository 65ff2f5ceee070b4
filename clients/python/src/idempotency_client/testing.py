"""Start a real idempotency-service for tests: a process on a free loopback
port, ready once its health check says SERVING.

    with ServerProcess.start(binary, data_dir=tmp) as server:
        client = IdempotencyClient(server.target)

With TLS on the main port (IDEMPOTENCY_TLS_CERT_FILE in `env`), the helper
also opens the plaintext health listener (IDEMPOTENCY_HEALTH_LISTEN_ADDR) on
another free port, unless `env` sets it, and waits on that one.

Needs grpcio-health-checking (the package's `test` extra). PostgreSQL-backed
servers get a fresh database from create_postgres_database().
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Mapping, Optional

#: The service name whose health says the store is ready.
HEALTH_SERVICE = "idempotency.v1.IdempotencyService"

#: Where tests find the server binary unless IDEMPOTENCY_BIN says otherwise.
DEFAULT_BINARY = "target/release/idempotency-service"

#: The PostgreSQL server the tests create their databases on.
DEFAULT_POSTGRES = "postgres://postgres@127.0.0.1:5432"


def server_binary() -> pathlib.Path:
    """The binary from $IDEMPOTENCY_BIN, or target/release/ of the repository."""
    configured = os.environ.get("IDEMPOTENCY_BIN")
    if configured:
        path = pathlib.Path(configured)
    else:
        repo = pathlib.Path(__file__).resolve().parents[4]
        path = repo / DEFAULT_BINARY
        if not path.exists():
            path = pathlib.Path(DEFAULT_BINARY)
    if not path.is_file():
        raise FileNotFoundError(f"idempotency-service binary not found at {path} (set IDEMPOTENCY_BIN)")
    return path.resolve()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_serving(target: str, timeout: float, process: Optional[subprocess.Popen] = None) -> None:
    """Poll the health check until SERVING, failing after `timeout` seconds or
    as soon as the process exits."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    last = "no answer yet"
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"idempotency-service exited with status {process.returncode}")
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(service=HEALTH_SERVICE), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as error:
                last = f"{error.code().name}: {error.details()}"
            time.sleep(0.05)
    raise TimeoutError(f"idempotency-service at {target} not SERVING after {timeout} s ({last})")


@dataclass
class ServerProcess:
    process: subprocess.Popen
    target: str
    log_path: pathlib.Path
    env: Mapping[str, str] = field(default_factory=dict)
    #: Where the health check answers without credentials: the extra plaintext
    #: listener when there is one, else the main port.
    health_target: Optional[str] = None
    #: The binary it runs (for restart()).
    binary: Optional[pathlib.Path] = None

    @classmethod
    def start(
        cls,
        binary: Optional[pathlib.Path] = None,
        *,
        data_dir: Optional[pathlib.Path] = None,
        database_url: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        ready_timeout: float = 60.0,
    ) -> "ServerProcess":
        """Start the server on the embedded store in data_dir (a temporary
        directory if None), or on PostgreSQL when database_url is given."""
        binary = binary or server_binary()
        if data_dir is None:
            data_dir = pathlib.Path(tempfile.mkdtemp(prefix="idempotency-test-"))
        port = free_port()
        target = f"127.0.0.1:{port}"
        server_env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
        server_env.update(
            # Metrics off: the default port (8464) is one for every server here.
            {"IDEMPOTENCY_LISTEN_ADDR": target, "IDEMPOTENCY_DATA_DIR": str(data_dir), "IDEMPOTENCY_METRICS_ADDR": ""}
        )
        if database_url:
            server_env["DATABASE_URL"] = database_url
        env = dict(env or {})
        if env.get("IDEMPOTENCY_TLS_CERT_FILE") and "IDEMPOTENCY_HEALTH_LISTEN_ADDR" not in env:
            # The main port speaks TLS only; wait on a plaintext health listener.
            env["IDEMPOTENCY_HEALTH_LISTEN_ADDR"] = f"127.0.0.1:{free_port()}"
        server_env.update(env)
        health_target = server_env.get("IDEMPOTENCY_HEALTH_LISTEN_ADDR") or target
        log_path = pathlib.Path(data_dir) / "server.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                [str(binary)], env=server_env, stdout=log, stderr=subprocess.STDOUT
            )
        server = cls(process, target, log_path, server_env, health_target, binary)
        try:
            wait_until_serving(health_target, ready_timeout, process)
        except Exception as error:
            server.stop()
            raise RuntimeError(f"{error}\n--- server log ---\n{server.log()}") from None
        return server

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def restart(self, ready_timeout: float = 60.0) -> "ServerProcess":
        """Stop the server (SIGTERM) if it runs, and start the same binary with
        the same settings, on the same port, as a rolling restart does; back
        once it is SERVING. A port still held by the old process is tried
        again until ready_timeout."""
        self.stop()
        deadline = time.monotonic() + ready_timeout
        while True:
            with open(self.log_path, "ab") as log:
                log.write(b"--- restart ---\n")
                log.flush()
                self.process = subprocess.Popen(
                    [str(self.binary or server_binary())],
                    env=dict(self.env),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            try:
                wait_until_serving(
                    self.health_target or self.target, max(deadline - time.monotonic(), 0.1), self.process
                )
                return self
            except RuntimeError:  # exited: the port may still be held for a moment
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"restart failed\n--- server log ---\n{self.log()}") from None
                time.sleep(0.1)
            except Exception:
                self.stop()
                raise RuntimeError(f"restart failed\n--- server log ---\n{self.log()}") from None

    def kill(self) -> Optional[int]:
        """SIGKILL: the server dies without draining its calls."""
        if self.process.poll() is None:
            self.process.kill()
        return self.process.wait()

    def stop(self, timeout: float = 10.0) -> Optional[int]:
        """SIGTERM (graceful), then SIGKILL if it has not exited within timeout."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def _psql(base_url: str, sql: str) -> None:
    subprocess.run(
        ["psql", f"{base_url}/postgres", "-v", "ON_ERROR_STOP=1", "-q", "-c", sql],
        check=True,
        capture_output=True,
        timeout=30,
    )


def create_postgres_database(base_url: Optional[str] = None) -> str:
    """Create a fresh database (via psql) and return its URL."""
    base_url = (base_url or os.environ.get("IDEMPOTENCY_TEST_POSTGRES") or DEFAULT_POSTGRES).rstrip("/")
    name = f"idempotency_client_{uuid.uuid4().hex[:16]}"
    try:
        _psql(base_url, f"CREATE DATABASE {name}")
    except subprocess.CalledProcessError as error:
        raise RuntimeError(f"could not create a database on {base_url}: {error.stderr.decode()}") from None
    return f"{base_url}/{name}"


def drop_postgres_database(url: str) -> None:
    base_url, name = url.rsplit("/", 1)
    _psql(base_url, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
