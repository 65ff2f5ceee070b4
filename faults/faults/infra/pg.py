"""PostgreSQL infrastructure of the network, failover and pgbouncer scenarios.

Self-contained (subprocess only, no harness import), so that each piece can
be tried by hand:

- `Postgres`: a throwaway cluster (initdb into a temp dir, run as the
  `postgres` user when root) listening on the addresses you name, with its
  own unix socket directory, so several clusters may share one port on
  different loopback addresses (127.0.0.2:P and 127.0.0.3:P).
  `standby_of(primary)` makes a streaming standby with pg_basebackup -R.
- `PgBouncer`: Debian's pgbouncer in front of a cluster, in the pooling mode
  you name.
- `ensure_commands()`: apt-get installs the Debian packages a scenario needs
  when a command is missing.
"""

from __future__ import annotations

import glob
import os
import pathlib
import re
import shutil
import socket
import subprocess
import tempfile
import time
from typing import Iterable, List, Optional


#: Folders of clusters and pgbouncers: /tmp/faults-infra-<pid>-<name>-XXXX.
PREFIX = "faults-infra-"


def sweep() -> List[str]:
    """Stops and deletes the clusters and pgbouncers of runs whose process is
    gone (killed before their cleanup): each by its own pid file."""
    removed = []
    for path in glob.glob(os.path.join(tempfile.gettempdir(), PREFIX + "*")):
        m = re.match(re.escape(PREFIX) + r"(\d+)-", os.path.basename(path))
        if not m or _alive(int(m.group(1))):
            continue
        for pidfile in (os.path.join(path, "data", "postmaster.pid"), os.path.join(path, "pgbouncer.pid")):
            try:
                pid = int(open(pidfile).readline().strip())
                os.kill(pid, 9 if pidfile.endswith("pgbouncer.pid") else 3)  # postgres: SIGQUIT, immediate
            except (OSError, ValueError):
                pass
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def ensure_commands(commands: dict[str, str]) -> None:
    """`commands` maps a command to the Debian package that has it; installs
    the packages of the missing ones (apt-get, waiting for the dpkg lock)."""
    missing = sorted({pkg for cmd, pkg in commands.items() if not _which(cmd)})
    if not missing:
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "-o", "DPkg::Lock::Timeout=120", "install", "-y", "-qq", *missing]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        subprocess.run(["apt-get", "-o", "DPkg::Lock::Timeout=120", "update", "-qq"], env=env, capture_output=True)
        result = subprocess.run(cmd, env=env, capture_output=True, text=True)
    still = [cmd for cmd in commands if not _which(cmd)]
    if still:
        raise RuntimeError(f"cannot install {missing} (apt-get: {result.stderr.strip()[-500:]}); missing {still}")


def _which(cmd: str) -> Optional[str]:
    return shutil.which(cmd) or next(
        (p for p in (f"/usr/sbin/{cmd}", f"/sbin/{cmd}") if os.access(p, os.X_OK)), None
    )


def pg_bindir() -> pathlib.Path:
    try:
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=True).stdout.strip()
        if (pathlib.Path(out) / "initdb").exists():
            return pathlib.Path(out)
    except (OSError, subprocess.CalledProcessError):
        pass
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[4]))
    if not dirs:
        raise RuntimeError("no initdb found: install PostgreSQL's server package (postgresql)")
    return pathlib.Path(dirs[-1])


def free_port(host: str = "127.0.0.1", also: Iterable[str] = ()) -> int:
    """A port free on `host` and on every address in `also`."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        ok = True
        for other in also:
            with socket.socket() as s:
                try:
                    s.bind((other, port))
                except OSError:
                    ok = False
        if ok:
            return port
    raise RuntimeError("no free port")


def as_postgres(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


def run(cmd: list[str], timeout: float = 60, check: bool = True, **kw) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr.strip()[-800:]}")
    return result


class Postgres:
    """A throwaway PostgreSQL cluster. `listen` is the listen_addresses
    value; the URL uses its first address."""

    def __init__(self, listen: str = "127.0.0.1", port: Optional[int] = None, name: str = "pg",
                 settings: Optional[dict] = None, base: Optional[pathlib.Path] = None):
        self.bin = pg_bindir()
        self.listen = listen
        self.host = listen.split(",")[0].strip()
        self.port = port or free_port(self.host)
        self.name = name
        self.settings = dict(settings or {})
        #: extra environment of the server (LD_PRELOAD and FAKETIME, for a
        #: node off the real clock: infra/clock.py preload_env)
        self.environment: dict = {}
        self.dir = pathlib.Path(base) if base else pathlib.Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-{name}-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.data = self.dir / "data"
        self.sock = self.dir / "sock"
        self.log = self.dir / "postgres.log"
        if os.geteuid() == 0:
            os.chmod(self.dir, 0o755)
            shutil.chown(self.dir, "postgres", "postgres")

    def url(self, db: str = "postgres", host: Optional[str] = None, port: Optional[int] = None) -> str:
        return f"postgres://postgres@{host or self.host}:{port or self.port}/{db}"

    def _mkdirs(self) -> None:
        self.sock.mkdir(exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(self.sock, "postgres", "postgres")

    def init(self) -> "Postgres":
        run(as_postgres([str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust",
                         "-E", "UTF8", "--locale=C.UTF-8"]), timeout=120)
        with open(self.data / "pg_hba.conf", "a") as f:
            f.write("host all all 0.0.0.0/0 trust\nhost replication all 0.0.0.0/0 trust\n")
        return self

    def _options(self) -> str:
        opts = {"port": self.port, "listen_addresses": f"'{self.listen}'",
                "unix_socket_directories": f"'{self.sock}'", "max_connections": 200,
                "fsync": "off", "full_page_writes": "off"}
        opts.update(self.settings)
        return " ".join(f"-c {k}={v}" for k, v in opts.items())

    def start(self, wait: bool = True) -> "Postgres":
        self._mkdirs()
        cmd = [str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", self._options(), "start"]
        cmd[1:1] = ["-w", "-t", "60"] if wait else ["-W"]
        if self.environment:
            cmd = ["env", *(f"{k}={v}" for k, v in self.environment.items()), *cmd]
        result = run(as_postgres(cmd), check=False, timeout=90)
        if result.returncode != 0:
            raise RuntimeError(f"PostgreSQL {self.name} did not start: {self.tail()}")
        return self

    def stop(self, mode: str = "fast") -> None:
        if (self.data / "postmaster.pid").exists():
            run(as_postgres([str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop"]),
                check=False, timeout=90)

    def restart(self, **settings) -> "Postgres":
        self.settings.update(settings)
        self.stop("fast")
        return self.start()

    def promote(self) -> None:
        run(as_postgres([str(self.bin / "pg_ctl"), "-D", str(self.data), "-w", "-t", "60", "promote"]), timeout=90)

    def is_running(self) -> bool:
        r = run(as_postgres([str(self.bin / "pg_ctl"), "-D", str(self.data), "status"]), check=False)
        return r.returncode == 0

    def psql(self, sql: str, db: str = "postgres", timeout: float = 30) -> str:
        r = run([str(self.bin / "psql"), "-X", "-q", "-At", "-v", "ON_ERROR_STOP=1", "-h", str(self.sock),
                 "-p", str(self.port), "-U", "postgres", "-d", db, "-c", sql], timeout=timeout)
        return r.stdout.strip()

    def create_db(self, db: str) -> str:
        self.psql(f'CREATE DATABASE "{db}"')
        return self.url(db)

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def standby_of(self, primary: "Postgres", app_name: str = "standby1",
                   via: Optional[tuple] = None) -> "Postgres":
        """Makes this (not yet initialised) cluster a streaming standby of
        `primary`: pg_basebackup -R, with application_name `app_name` (the
        name synchronous_standby_names lists); streaming from `via` (host,
        port: a relay in front of the primary) when given."""
        run(as_postgres([str(self.bin / "pg_basebackup"), "-h", str(primary.sock), "-p", str(primary.port),
                         "-U", "postgres", "-D", str(self.data), "-R", "-X", "stream", "-c", "fast"]), timeout=120)
        host, port = via or (primary.host, primary.port)
        conninfo = f"host={host} port={port} user=postgres application_name={app_name}"
        with open(self.data / "postgresql.auto.conf", "a") as f:
            f.write(f"primary_conninfo = '{conninfo}'\n")
        return self

    def remove(self) -> None:
        if self.is_running():
            self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)


class PgBouncer:
    """Debian's pgbouncer listening on `host`:`port`, forwarding every
    database to `server` (a Postgres) in `pool_mode`."""

    def __init__(self, server: Postgres, pool_mode: str = "transaction", host: str = "127.0.0.1",
                 settings: Optional[dict] = None):
        self.server = server
        self.host = host
        self.port = free_port(host)
        self.pool_mode = pool_mode
        self.settings = dict(settings or {})
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-pgbouncer-"))
        self.ini = self.dir / "pgbouncer.ini"
        self.log = self.dir / "pgbouncer.log"
        self.proc: Optional[subprocess.Popen] = None

    def url(self, db: str) -> str:
        return f"postgres://postgres@{self.host}:{self.port}/{db}"

    def version(self) -> str:
        return run([_which("pgbouncer") or "pgbouncer", "--version"]).stdout.splitlines()[0].strip()

    def start(self) -> "PgBouncer":
        (self.dir / "users.txt").write_text('"postgres" ""\n')
        conf = {
            "listen_addr": self.host, "listen_port": self.port, "unix_socket_dir": "",
            "auth_type": "trust", "auth_file": str(self.dir / "users.txt"),
            "pool_mode": self.pool_mode, "max_client_conn": 1000, "default_pool_size": 20,
            "logfile": str(self.log), "pidfile": str(self.dir / "pgbouncer.pid"),
            "admin_users": "postgres", "server_reset_query": "DISCARD ALL",
        }
        conf.update(self.settings)
        lines = ["[databases]", f"* = host={self.server.host} port={self.server.port}", "", "[pgbouncer]"]
        lines += [f"{k} = {v}" for k, v in conf.items()]
        self.ini.write_text("\n".join(lines) + "\n")
        if os.geteuid() == 0:
            for p in (self.dir, self.ini, self.dir / "users.txt"):
                shutil.chown(p, "postgres", "postgres")
        user = ["-u", "postgres"] if os.geteuid() == 0 else []
        self.proc = subprocess.Popen([_which("pgbouncer") or "pgbouncer", *user, str(self.ini)],
                                     stdout=subprocess.DEVNULL, stderr=open(self.dir / "stderr.log", "w"))
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited: {self.tail()} {(self.dir / 'stderr.log').read_text()}")
            try:
                socket.create_connection((self.host, self.port), timeout=0.5).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"pgbouncer did not listen on {self.host}:{self.port}: {self.tail()}")

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
