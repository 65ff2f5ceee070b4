"""The processes a scenario breaks: a throwaway PostgreSQL cluster of the
harness's own (PgCluster) and idempotency-service replicas (Replica).

PostgreSQL refuses to run as root, so as root the cluster's folder belongs to,
and its programs run as, the `postgres` user (`runuser -u postgres --`), as
tests/common/cluster.rs and bench/lib.sh do.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Dict, List, Mapping, Optional

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

#: The service whose health says the store is ready.
HEALTH_SERVICE = "idempotency.v1.IdempotencyService"

REPO = pathlib.Path(__file__).resolve().parents[2]

#: Settings every replica gets unless the scenario overrides them: short, so
#: that faults show within seconds (see faults/README.md).
REPLICA_DEFAULTS: Dict[str, str] = {
    "IDEMPOTENCY_METRICS_ADDR": "",
    "IDEMPOTENCY_DB_TIMEOUT": "2s",
    "IDEMPOTENCY_REAPER_INTERVAL": "1s",
    "IDEMPOTENCY_HEALTH_CHECK_INTERVAL": "250ms",
    "IDEMPOTENCY_SHUTDOWN_TIMEOUT": "5s",
    "IDEMPOTENCY_CALL_TIMEOUT": "15s",
    "IDEMPOTENCY_RECORDS_GAUGE_INTERVAL": "0s",
    "RUST_LOG": "info",
}


#: Every replica process and cluster started, so that an exit that skips the
#: cleanup (SIGTERM, an error in the runner) still kills them (atexit).
_LIVE_PROCESSES: "set[subprocess.Popen]" = set()
_LIVE_CLUSTERS: "set[PgCluster]" = set()


def kill_leftovers() -> None:
    for process in list(_LIVE_PROCESSES):
        if process.poll() is None:
            process.kill()
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                pass
    _LIVE_PROCESSES.clear()
    for cluster in list(_LIVE_CLUSTERS):
        try:
            cluster.destroy()
        except Exception:
            pass
    _LIVE_CLUSTERS.clear()


atexit.register(kill_leftovers)


def server_binary() -> pathlib.Path:
    path = pathlib.Path(os.environ.get("IDEMPOTENCY_BIN") or REPO / "target/release/idempotency-service")
    if not path.is_file():
        raise FileNotFoundError(f"idempotency-service binary not found at {path} (set IDEMPOTENCY_BIN)")
    return path.resolve()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def is_root() -> bool:
    return os.geteuid() == 0


def pg_bindir() -> pathlib.Path:
    configured = os.environ.get("PG_BINDIR")
    if configured:
        return pathlib.Path(configured)
    found = sorted(
        (p for p in pathlib.Path("/usr/lib/postgresql").glob("*/bin") if (p / "initdb").exists()),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    if not found:
        raise FileNotFoundError("no initdb under /usr/lib/postgresql/*/bin (install postgresql, or set PG_BINDIR)")
    return found[-1]


def as_postgres(argv: List[str]) -> List[str]:
    """The command run as the postgres user when we are root."""
    return ["runuser", "-u", "postgres", "--", *argv] if is_root() else argv


async def health_status(target: str, timeout: float = 1.0) -> str:
    """One health check of the service: SERVING, NOT_SERVING, ..., or the
    gRPC error code's name when it does not answer."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=HEALTH_SERVICE), timeout=timeout)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.aio.AioRpcError as error:
            return error.code().name


class PgCluster:
    """A PostgreSQL cluster of our own: initdb into a temp folder, on a free
    port, trust auth, user postgres. `url` is the server's URL without a
    database; `database_url(name)` one with."""

    def __init__(self, root: Optional[pathlib.Path] = None, port: Optional[int] = None):
        self.bindir = pg_bindir()
        self.root = pathlib.Path(root or tempfile.mkdtemp(prefix="faults-pg-"))
        self.data = self.root / "data"
        self.logfile = self.root / "postgres.log"
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self.running = False

    @property
    def url(self) -> str:
        return f"postgres://postgres@{self.host}:{self.port}"

    def database_url(self, name: str = "postgres") -> str:
        return f"{self.url}/{name}"

    def _run(self, argv: List[str], timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(as_postgres(argv), capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()[-2000:]}\n"
                               f"--- postgres log ---\n{self.log_tail()}")
        return result

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.logfile.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def init(self) -> "PgCluster":
        self.root.mkdir(parents=True, exist_ok=True)
        _LIVE_CLUSTERS.add(self)
        if is_root():
            subprocess.run(["chown", "-R", "postgres:postgres", str(self.root)], check=True)
        self._run([str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust",
                   "-E", "UTF8", "--locale=C.UTF-8", "--no-sync"])
        # A throwaway cluster: durability beyond a crash of the server process
        # is all we test (fsync off only loses data on an OS crash).
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.write(f"\nport = {self.port}\nlisten_addresses = '{self.host}'\n"
                       f"unix_socket_directories = '{self.root}'\nfsync = off\n"
                       "max_connections = 200\nshared_buffers = 32MB\n")
        return self

    def start(self) -> "PgCluster":
        if not self.data.exists():
            self.init()
        self._run([str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(self.logfile), "-w", "-t", "60",
                   "start"])
        self.running = True
        return self

    def stop(self, mode: str = "fast") -> None:
        """pg_ctl stop -m fast|immediate|smart ("immediate" is a crash: no
        checkpoint, recovery at the next start)."""
        self._run([str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop"],
                  check=False)
        self.running = False

    def restart(self, mode: str = "fast") -> "PgCluster":
        self.stop(mode)
        return self.start()

    def conf(self, **settings) -> None:
        """Write settings into postgresql.auto.conf (as ALTER SYSTEM does);
        most need restart() (or a reload) to apply."""
        path = self.data / "postgresql.auto.conf"
        lines = path.read_text().splitlines() if path.exists() else []
        names = set(settings)
        kept = [line for line in lines if line.split("=", 1)[0].strip() not in names]
        for name, value in settings.items():
            text = value if isinstance(value, (int, float)) else "'" + str(value).replace("'", "''") + "'"
            kept.append(f"{name} = {text}")
        path.write_text("\n".join(kept) + "\n")
        if is_root():
            shutil.chown(path, "postgres", "postgres")

    def reload(self) -> None:
        self._run([str(self.bindir / "pg_ctl"), "-D", str(self.data), "reload"])

    def psql(self, sql: str, database: str = "postgres", timeout: float = 30) -> str:
        """Run SQL with psql; the output unaligned, tuples only."""
        result = subprocess.run(
            ["psql", self.database_url(database), "-v", "ON_ERROR_STOP=1", "-qAtX", "-c", sql],
            capture_output=True, text=True, timeout=timeout,
        )
        if result.returncode != 0:
            raise RuntimeError(f"psql failed: {result.stderr.strip()}")
        return result.stdout.strip()

    def destroy(self) -> None:
        """Stop (immediate) and delete the folder."""
        if self.data.exists():
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)
        _LIVE_CLUSTERS.discard(self)


class Replica:
    """One idempotency-service process on its own port.

    `env` is added to the harness's defaults (REPLICA_DEFAULTS) and the
    inherited environment minus DATABASE_URL; `wrapper` prefixes the command
    (["faketime", "-f", "+1h"], ["ip", "netns", "exec", "ns1"], ...). The port
    stays the same across restarts (clients reconnect to the same address)."""

    def __init__(self, env: Mapping[str, str], wrapper: Optional[List[str]] = None, port: Optional[int] = None,
                 name: str = "replica", log_dir: Optional[pathlib.Path] = None, host: str = "127.0.0.1"):
        self.name = name
        self.port = port or free_port()
        self.host = host
        self.wrapper = list(wrapper or [])
        self.env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
        self.env.update(REPLICA_DEFAULTS)
        self.env["IDEMPOTENCY_LISTEN_ADDR"] = f"{host}:{self.port}"
        self.env.update(env)
        log_dir = pathlib.Path(log_dir or tempfile.mkdtemp(prefix="faults-replica-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log = log_dir / f"{name}.log"
        self.process: Optional[subprocess.Popen] = None
        self.starts = 0

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> Optional[int]:
        return self.process.pid if self.process else None

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    async def start(self, wait: bool = True, timeout: float = 60.0) -> "Replica":
        """Start the process; with `wait`, return once health says SERVING
        (failing after `timeout`, or at once if the process exits). A port
        still held by the previous process is retried until the deadline."""
        deadline = time.monotonic() + timeout
        tries = 0
        while True:
            tries += 1
            self._spawn()
            if not wait:
                return self
            try:
                await self.wait_serving(max(deadline - time.monotonic(), 0.1))
                return self
            except ProcessLookupError:
                if time.monotonic() >= deadline or tries >= 10:
                    raise RuntimeError(f"{self.name} exited with {self.process.returncode}\n"
                                       f"--- {self.log} ---\n{self.log_tail()}") from None
                await asyncio.sleep(0.1)

    def _spawn(self) -> None:
        self.starts += 1
        with open(self.log, "ab") as log:
            log.write(f"--- start {self.starts} at {time.time():.3f} ---\n".encode())
            log.flush()
            self.process = subprocess.Popen([*self.wrapper, str(server_binary())], env=self.env,
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _LIVE_PROCESSES.add(self.process)

    async def wait_serving(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise ProcessLookupError(self.name)
            last = await health_status(self.target, timeout=min(1.0, max(deadline - time.monotonic(), 0.05)))
            if last == "SERVING":
                return
            await asyncio.sleep(0.05)
        raise TimeoutError(f"{self.name} at {self.target} not SERVING after {timeout:.1f} s ({last})\n"
                           f"--- {self.log} ---\n{self.log_tail()}")

    async def health(self, timeout: float = 1.0) -> str:
        return await health_status(self.target, timeout)

    async def kill(self) -> None:
        """SIGKILL: dies at once, calls in flight get no answer."""
        if self.running():
            self.process.kill()
        if self.process is not None:
            await asyncio.to_thread(self.process.wait)

    async def terminate(self, timeout: float = 30.0) -> Optional[int]:
        """SIGTERM (graceful: drains calls in flight), waits for the exit;
        SIGKILL after `timeout`."""
        if self.process is None:
            return None
        if self.running():
            self.process.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(self.process.wait, timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            await asyncio.to_thread(self.process.wait)
        return self.process.returncode

    async def restart(self, wait: bool = True, timeout: float = 60.0) -> "Replica":
        await self.terminate()
        return await self.start(wait=wait, timeout=timeout)

    def rss_kb(self) -> Optional[int]:
        """VmRSS of the process in KiB (from /proc/PID/status), None when not running.
        With a wrapper that execs (faketime, ip netns exec) the PID is the server's."""
        if not self.running():
            return None
        try:
            for line in pathlib.Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        except OSError:
            return None
        return None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop_now(self) -> None:
        """Synchronous SIGKILL, for cleanup paths."""
        if self.running():
            self.process.kill()
            self.process.wait()
