"""A Citus cluster on loopback (the citus_* scenarios, issue 21): a
coordinator and two workers, three throwaway PostgreSQL clusters of the
machine's PostgreSQL with `shared_preload_libraries = 'citus'`, each on a
free port of 127.0.0.1, in one folder /dev/shm/faults-citus-<pid>-XXXX
(/tmp without /dev/shm).

    if citus.missing() is None:              # citus.so in `pg_config --pkglibdir`
        cluster = CitusCluster(workers=2).start()   # database "idempotency" on every node,
                                             # CREATE EXTENSION citus, workers registered
        cluster.url()                        # the coordinator's, sslmode=disable
        cluster.ports_of(["evt-000001"])     # the worker port holding each key's shard
        cluster.workers[0].stop("immediate") # a worker crashes (pg_ctl stop -m immediate)
        cluster.workers[0].start()
        cluster.remove()                     # stops the three clusters, deletes the folder

Citus is NOT installed by the project and never will be (no package in the
registries it installs from): it is found on the machine or the scenarios
do not run. `missing()` says why they cannot (None when they can);
FAULTS_CITUS=1 requires Citus (its absence then fails the run),
FAULTS_CITUS=0 leaves the scenarios out even where it is installed.

The three clusters come from one initdb, copied (a second initdb costs a
second or two of the run and gives the same files). Each node runs with
`ssl = off` and `citus.node_conninfo = 'sslmode=disable'` on its command
line: Citus's CREATE EXTENSION would turn TLS on with a self-signed
version-1 certificate (ALTER SYSTEM), which the service's TLS stack cannot
parse, and a command-line setting wins over postgresql.auto.conf. The
replicas' URL says `sslmode=disable` as well. Citus's anonymous statistics
collection (it calls home) is off: every packet stays on loopback.

`sweep()` stops the clusters of runs whose process is gone (each
postmaster by its pid file, checked against its command line, SIGQUIT:
immediate shutdown) and deletes their folders.

Self-contained (subprocess only, the pg module aside, no harness import):
`.venv/bin/python -m faults.infra.citus` from faults/ starts a cluster,
prints its nodes and URL, and removes it on Enter.
"""

from __future__ import annotations

import atexit
import glob
import os
import pathlib
import re
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Dict, Iterable, List, Optional

from .pg import Postgres, _alive, as_postgres, free_port, pg_bindir, run

#: Folders of Citus clusters: <BASE>/faults-citus-<pid>-XXXX.
PREFIX = "faults-citus-"

#: Every node's settings (command line: they win over what CREATE EXTENSION
#: writes into postgresql.auto.conf).
SETTINGS = {
    "shared_preload_libraries": "citus",
    "ssl": "off",
    "citus.node_conninfo": "'sslmode=disable'",
    "citus.enable_statistics_collection": "off",
    "shared_buffers": "32MB",
    "max_connections": 200,
    # the SQLSTATE in every log line (%e): what the service was answered
    "log_line_prefix": "'%m [%p] %e '",
}


#: Clusters started and not yet removed: removed at exit, when a runner's
#: cleanup was skipped (sweep() gets those of a killed process).
_LIVE: "set[CitusCluster]" = set()


@atexit.register
def _remove_live() -> None:
    for cluster in list(_LIVE):
        cluster.remove()


def _base() -> str:
    """/dev/shm when there is one (memory: the runs stay short and steady),
    else the temp folder."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else tempfile.gettempdir()


def _pg_config(flag: str) -> Optional[str]:
    """`pg_config FLAG`: the one on PATH, else the server's own (beside its initdb)."""
    commands = ["pg_config"]
    try:
        commands.append(str(pg_bindir() / "pg_config"))
    except RuntimeError:
        pass
    for command in commands:
        try:
            return subprocess.run([command, flag], capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            continue
    return None


def library() -> Optional[pathlib.Path]:
    """`$(pg_config --pkglibdir)/citus.so` (None without pg_config)."""
    libdir = _pg_config("--pkglibdir")
    return pathlib.Path(libdir) / "citus.so" if libdir else None


def missing() -> Optional[str]:
    """None when Citus is installed for the machine's PostgreSQL (its library
    and its extension control file), else why the Citus scenarios cannot run."""
    lib = library()
    if lib is None:
        return "no pg_config to find PostgreSQL's library folder (Citus unknown)"
    if not lib.is_file():
        return f"Citus is not installed (no {lib}); the project never installs it"
    share = _pg_config("--sharedir")
    control = pathlib.Path(share or "/usr/share/postgresql") / "extension" / "citus.control"
    if not control.is_file():
        return f"Citus is only partly installed ({lib} but no {control})"
    return None


def wanted() -> Optional[bool]:
    """FAULTS_CITUS: "1" requires Citus (True), "0" leaves it out (False);
    unset or anything else: run where it is installed (None)."""
    value = os.environ.get("FAULTS_CITUS", "").strip()
    return True if value == "1" else False if value == "0" else None


def sweep() -> List[str]:
    """Stops the clusters of runs whose process is gone (killed before their
    cleanup) and deletes their folders."""
    removed = []
    bases = sorted({_base(), tempfile.gettempdir()})
    for path in (p for base in bases for p in glob.glob(os.path.join(base, PREFIX + "*"))):
        m = re.match(re.escape(PREFIX) + r"(\d+)-", os.path.basename(path))
        if not m or _alive(int(m.group(1))):
            continue
        for pidfile in glob.glob(os.path.join(path, "*", "data", "postmaster.pid")):
            try:
                pid = int(open(pidfile).readline().strip())
            except (OSError, ValueError):
                continue
            if path in _cmdline(pid):
                try:
                    os.kill(pid, signal.SIGQUIT)  # immediate shutdown: the backends go with it
                except OSError:
                    pass
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _cmdline(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class CitusCluster:
    """A coordinator and `workers` workers, each a `pg.Postgres` on a free
    port of 127.0.0.1, the database `database` with the citus extension on
    every node, the coordinator registered (citus_set_coordinator_host) and
    every worker added (citus_add_node)."""

    def __init__(self, workers: int = 2, database: str = "idempotency", host: str = "127.0.0.1",
                 settings: Optional[dict] = None):
        self.database = database
        self.host = host
        self.folder = pathlib.Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=_base()))
        if os.geteuid() == 0:
            os.chmod(self.folder, 0o755)
        options = {**SETTINGS, **(settings or {})}
        names = ["coordinator"] + [f"worker{i + 1}" for i in range(workers)]
        used: List[int] = []
        self.nodes: List[Postgres] = []
        for name in names:
            port = free_port(host)
            while port in used:
                port = free_port(host)
            used.append(port)
            self.nodes.append(Postgres(listen=host, port=port, name=name, settings=options,
                                       base=self.folder / name))
        self.version: Optional[str] = None
        _LIVE.add(self)

    @property
    def coordinator(self) -> Postgres:
        return self.nodes[0]

    @property
    def workers(self) -> List[Postgres]:
        return self.nodes[1:]

    def url(self, db: Optional[str] = None) -> str:
        """The coordinator's URL, without TLS (see the module's doc)."""
        return self.coordinator.url(db or self.database) + "?sslmode=disable"

    def start(self) -> "CitusCluster":
        bindir = pg_bindir()
        first = self.coordinator
        run(as_postgres([str(bindir / "initdb"), "-D", str(first.data), "-U", "postgres", "-A", "trust",
                         "-E", "UTF8", "--locale=C.UTF-8", "--no-sync"]), timeout=120)
        with open(first.data / "pg_hba.conf", "a") as f:
            f.write(f"host all all {self.host}/32 trust\n")
        for node in self.workers:
            shutil.copytree(first.data, node.data, symlinks=True)
            if os.geteuid() == 0:
                run(["chown", "-R", "postgres:postgres", str(node.data)])
        for node in self.nodes:
            node.start()
        for node in self.nodes:
            node.psql(f'CREATE DATABASE "{self.database}"')
            node.psql("CREATE EXTENSION citus", db=self.database, timeout=60)
        c = self.coordinator
        c.psql(f"SELECT citus_set_coordinator_host('{self.host}', {c.port})", db=self.database)
        for node in self.workers:
            c.psql(f"SELECT citus_add_node('{self.host}', {node.port})", db=self.database, timeout=60)
        self.version = c.psql("SELECT citus_version()", db=self.database)
        return self

    def psql(self, sql: str, node: Optional[Postgres] = None, timeout: float = 30) -> str:
        """SQL on a node (the coordinator by default) in the cluster's
        database, read from stdin (no limit on its length); the output
        unaligned, tuples only."""
        node = node or self.coordinator
        r = run([str(node.bin / "psql"), "-X", "-q", "-At", "-v", "ON_ERROR_STOP=1", "-h", str(node.sock),
                 "-p", str(node.port), "-U", "postgres", "-d", self.database, "-f", "-"],
                timeout=timeout, input=sql)
        return r.stdout.strip()

    def ports_of(self, keys: Iterable[str], table: str = "idempotency_records") -> Dict[str, int]:
        """The port of the node holding each key's shard of `table`
        (distributed by key): from the coordinator's metadata only
        (pg_dist_placement, pg_dist_node), so it answers while a worker is down."""
        keys = list(keys)
        if not keys:
            return {}
        literal = "ARRAY[" + ",".join("'" + k.replace("'", "''") + "'" for k in keys) + "]::text[]"
        out = self.psql(
            f"SELECT k, n.nodeport FROM unnest({literal}) AS k "
            f"JOIN pg_dist_placement AS p ON p.shardid = get_shard_id_for_distribution_column('{table}', k) "
            "JOIN pg_dist_node AS n ON n.groupid = p.groupid", timeout=60)
        ports: Dict[str, int] = {}
        for line in out.splitlines():
            key, _, port = line.rpartition("|")
            ports[key] = int(port)
        return ports

    def shards_by_port(self, table: str = "idempotency_records") -> Dict[int, int]:
        """How many of `table`'s shards each node holds (metadata only)."""
        out = self.psql(
            "SELECT n.nodeport, count(*) FROM pg_dist_shard AS s "
            "JOIN pg_dist_placement AS p USING (shardid) JOIN pg_dist_node AS n USING (groupid) "
            f"WHERE s.logicalrelid = '{table}'::regclass GROUP BY 1 ORDER BY 1")
        return {int(a): int(b) for a, b in (line.split("|") for line in out.splitlines())}

    def wait_accepting(self, node: Postgres, timeout: float = 60) -> None:
        """Until `node` answers a query (after a restart: crash recovery done)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.psql("SELECT 1", node=node, timeout=5)
                return
            except (RuntimeError, subprocess.TimeoutExpired):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{node.name} not answering {timeout:.0f} s after its start: {node.tail()}")
                time.sleep(0.05)

    def logs(self) -> Dict[str, pathlib.Path]:
        """Each node's PostgreSQL log, by a file name."""
        return {f"{node.name}.log": node.log for node in self.nodes if node.log.exists()}

    def remove(self) -> None:
        """Stops the three clusters (immediate) and deletes the folder."""
        for node in self.nodes:
            try:
                node.stop("immediate")
            except Exception:
                pass
        shutil.rmtree(self.folder, ignore_errors=True)
        _LIVE.discard(self)


def main() -> None:
    reason = missing()
    if reason:
        raise SystemExit(f"Citus cannot run here: {reason}")
    swept = sweep()
    if swept:
        print(f"swept {swept}")
    started = time.monotonic()
    cluster = CitusCluster().start()
    try:
        print(f"{cluster.version}: up in {time.monotonic() - started:.1f} s, in {cluster.folder}")
        for node in cluster.nodes:
            print(f"  {node.name:12} 127.0.0.1:{node.port}  log {node.log}")
        print(cluster.psql("SELECT nodename, nodeport, groupid, noderole, shouldhaveshards FROM pg_dist_node "
                           "ORDER BY groupid"))
        print(f"DATABASE_URL={cluster.url()}")
        input("Enter removes the cluster: ")
    finally:
        cluster.remove()


if __name__ == "__main__":
    main()
