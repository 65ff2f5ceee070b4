"""A Patroni cluster on loopback (the patroni scenario, issue 21): Debian's
etcd, Patroni and HAProxy, every one on free ports of 127.0.0.1, in one
throwaway folder /dev/shm/faults-patroni-<pid>-XXXX (/tmp without /dev/shm).

    cluster = PatroniCluster(nodes=2, ttl=10, loop_wait=1, retry_timeout=3)
    cluster.start()                 # etcd, the nodes (one bootstraps, the other clones it), haproxy
    cluster.wait_synchronous()      # a leader and a synchronous standby
    cluster.url("postgres")         # through HAProxy: always the primary
    leader = cluster.leader()       # the node whose /primary answers 200
    leader.crash()                  # SIGKILL: its Patroni and its postmaster's process group
    leader.start()                  # Patroni again (rejoins as a standby, pg_rewind)
    cluster.remove()                # kills everything, deletes the folder

- `Etcd`: a one-member etcd (v3 API), data in the folder.
- `PatroniNode`: Patroni with a generated configuration (JSON, which YAML
  reads), run as the `postgres` user when root; its PostgreSQL listens on a
  free port with its unix socket in the node's folder.
- `HAProxy`: one TCP listener in front of every node, each checked by HTTP
  on Patroni's REST API `/primary` (200 on the leader only), so connections
  go to the primary alone.
- `ensure_packages()`: apt-get installs patroni, etcd-server, etcd-client and
  haproxy when missing; `sweep()`: kills what runs of a killed harness left
  (each process by the pid file it wrote, checked against its command line)
  and deletes their folders.

Self-contained (subprocess and urllib only, no harness import), so that it
can be tried by hand from faults/: `.venv/bin/python -m faults.infra.patroni`
starts a cluster, prints its state and URL, and removes it on Enter.
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from typing import Dict, List, Optional

from .pg import _alive, _which, ensure_commands, free_port, pg_bindir

#: Folders of Patroni clusters: <BASE>/faults-patroni-<pid>-XXXX.
PREFIX = "faults-patroni-"


def _base() -> str:
    """/dev/shm when there is one (memory: etcd's and PostgreSQL's fsyncs
    cost nothing, which keeps the run short and its timings steady; the
    ~250 MB go at once), else the temp folder."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else tempfile.gettempdir()

#: command -> the Debian package that has it
PACKAGES = {"patroni": "patroni", "etcd": "etcd-server", "etcdctl": "etcd-client", "haproxy": "haproxy"}


def ensure_packages() -> None:
    """Installs Debian's patroni, etcd-server, etcd-client and haproxy when a
    command is missing (root; apt-get update first when the install fails)."""
    ensure_commands(PACKAGES)


def versions() -> Dict[str, str]:
    """The versions of the installed packages (dpkg-query)."""
    out = subprocess.run(["dpkg-query", "-W", "-f", "${Package} ${Version}\\n", *sorted(set(PACKAGES.values()))],
                         capture_output=True, text=True).stdout
    return dict(line.split(" ", 1) for line in out.splitlines() if " " in line)


def sweep() -> List[str]:
    """Kills the etcd, Patroni, PostgreSQL and HAProxy processes of runs
    whose process is gone (killed before their cleanup), then deletes their
    folders. Patroni first, so that it restarts nothing."""
    removed = []
    bases = sorted({_base(), tempfile.gettempdir()})
    for path in (p for base in bases for p in glob.glob(os.path.join(base, PREFIX + "*"))):
        m = re.match(re.escape(PREFIX) + r"(\d+)-", os.path.basename(path))
        if not m or _alive(int(m.group(1))):
            continue
        _kill_folder(pathlib.Path(path))
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _kill_folder(folder: pathlib.Path) -> None:
    """SIGKILL to every process that a pid file in `folder` names and whose
    command line mentions `folder` (a pid reused since is left alone)."""
    pidfiles = sorted(folder.glob("*/patroni.pid")) + sorted(folder.glob("*/data/postmaster.pid")) \
        + sorted(folder.glob("*.pid"))
    for pidfile in pidfiles:
        try:
            pid = int(pidfile.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        if str(folder) not in _cmdline(pid):
            continue
        try:
            if pidfile.name == "postmaster.pid":
                _kill_postmaster(pid)
            else:
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _kill_postmaster(pid: int) -> None:
    """SIGKILL to a postmaster and its children: its process group (Patroni
    starts it in a session of its own), else the postmaster alone."""
    try:
        group = os.getpgid(pid)
    except ProcessLookupError:
        return
    if group not in (os.getpgrp(), 0, 1):
        os.killpg(group, signal.SIGKILL)
    else:
        os.kill(pid, signal.SIGKILL)


def _cmdline(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _as_postgres(cmd: List[str]) -> List[str]:
    """`cmd` run as `postgres` when root: setpriv execs it (no fork, so the
    pid is the command's), and Popen can vfork, where `Popen(user=...)`
    would fork, running the gRPC fork handlers of the harness's process in
    the child (which crashed it with SIGSEGV now and then)."""
    if os.geteuid() != 0:
        return cmd
    return ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", "--", *cmd]


def _chown_postgres(*paths: pathlib.Path) -> None:
    if os.geteuid() == 0:
        for path in paths:
            shutil.chown(path, "postgres", "postgres")


def http_get(url: str, timeout: float = 1.0) -> tuple:
    """(status, body) of a GET; (None, error text) when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")
    except (OSError, urllib.error.URLError) as error:
        return None, str(error)


def _wait_port(host: str, port: int, proc: subprocess.Popen, what: str, log: pathlib.Path,
               timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {_tail(log)}")
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {host}:{port} within {timeout:.0f} s: {_tail(log)}")


def _tail(path: pathlib.Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _stop(proc: Optional[subprocess.Popen]) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


class Etcd:
    """A one-member etcd on 127.0.0.1 (client and peer ports free), its data
    in `folder`/etcd."""

    def __init__(self, folder: pathlib.Path, host: str = "127.0.0.1"):
        self.folder = folder
        self.host = host
        self.port = free_port(host)
        self.peer_port = free_port(host)
        self.data = folder / "etcd"
        self.log = folder / "etcd.log"
        self.proc: Optional[subprocess.Popen] = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> "Etcd":
        client = f"http://{self.host}:{self.port}"
        peer = f"http://{self.host}:{self.peer_port}"
        cmd = [_which("etcd") or "etcd", "--name", "faults", "--data-dir", str(self.data),
               "--listen-client-urls", client, "--advertise-client-urls", client,
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", f"faults={peer}", "--initial-cluster-state", "new",
               "--initial-cluster-token", self.folder.name]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        (self.folder / "etcd.pid").write_text(f"{self.proc.pid}\n")
        _wait_port(self.host, self.port, self.proc, "etcd", self.log)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status, body = http_get(f"{client}/health")
            if status == 200 and '"true"' in body:
                return self
            time.sleep(0.1)
        raise RuntimeError(f"etcd not healthy: {_tail(self.log)}")

    def stop(self) -> None:
        _stop(self.proc)


class PatroniNode:
    """One Patroni node: `name`, PostgreSQL on 127.0.0.1:`port`, the REST
    API on 127.0.0.1:`api_port`, everything in `folder`/`name`."""

    def __init__(self, folder: pathlib.Path, name: str, scope: str, etcd: Etcd, dcs: dict,
                 host: str = "127.0.0.1", parameters: Optional[dict] = None):
        self.name = name
        self.host = host
        self.port = free_port(host)
        self.api_port = free_port(host)
        self.dir = folder / name
        self.data = self.dir / "data"
        self.config = self.dir / "patroni.json"
        self.log = self.dir / "patroni.log"
        self.proc: Optional[subprocess.Popen] = None
        self.dir.mkdir(parents=True)
        _chown_postgres(self.dir)
        bindir = pg_bindir()
        trust = ["local all all trust", f"host all all {host}/32 trust", f"host replication all {host}/32 trust"]
        config = {
            "scope": scope,
            "namespace": "/faults/",
            "name": name,
            "log": {"level": "INFO"},
            "restapi": {"listen": f"{host}:{self.api_port}", "connect_address": f"{host}:{self.api_port}"},
            "etcd3": {"hosts": [etcd.endpoint]},
            "bootstrap": {
                "dcs": dcs,
                "initdb": [{"encoding": "UTF8"}, {"locale": "C.UTF-8"}],
                "pg_hba": trust,
            },
            "postgresql": {
                "listen": f"{host}:{self.port}",
                "connect_address": f"{host}:{self.port}",
                "data_dir": str(self.data),
                "bin_dir": str(bindir),
                "pgpass": str(self.dir / "pgpass"),
                "basebackup": [{"checkpoint": "fast"}],
                "authentication": {"superuser": {"username": "postgres"},
                                   "replication": {"username": "postgres"},
                                   "rewind": {"username": "postgres"}},
                "parameters": {"unix_socket_directories": str(self.dir), **(parameters or {})},
                "pg_hba": trust,
            },
        }
        self.config.write_text(json.dumps(config, indent=1) + "\n")
        _chown_postgres(self.config)

    def start(self, wait: bool = True) -> "PatroniNode":
        """Starts Patroni (which starts, bootstraps, clones or rewinds its
        PostgreSQL); with `wait`, returns once the REST API answers."""
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": str(self.dir)}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(_as_postgres([_which("patroni") or "patroni", str(self.config)]), env=env,
                                         cwd=self.dir, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        (self.dir / "patroni.pid").write_text(f"{self.proc.pid}\n")
        if wait:
            self.wait_api()
        return self

    def wait_api(self, timeout: float = 60) -> None:
        _wait_port(self.host, self.api_port, self.proc, f"patroni {self.name}", self.log, timeout=timeout)

    def postmaster_pid(self) -> Optional[int]:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def crash(self) -> Dict[str, Optional[int]]:
        """The node dies: SIGKILL to Patroni and to its postmaster's process
        group (Patroni starts the postmaster in a session of its own: the
        backends, walsenders and the rest go with it), one right after the
        other. Returns the pids."""
        postmaster = self.postmaster_pid()
        patroni = self.proc.pid if self.proc is not None and self.proc.poll() is None else None
        if patroni is not None:
            os.kill(patroni, signal.SIGKILL)
        if postmaster is not None and str(self.dir) in _cmdline(postmaster):
            _kill_postmaster(postmaster)
        if self.proc is not None:
            self.proc.wait()
        return {"patroni": patroni, "postmaster": postmaster}

    def get(self, path: str, timeout: float = 1.0) -> tuple:
        """(status, body) of Patroni's REST API at `path`."""
        return http_get(f"http://{self.host}:{self.api_port}{path}", timeout=timeout)

    def state(self) -> dict:
        status, body = self.get("/patroni")
        try:
            return json.loads(body) if status is not None else {}
        except ValueError:
            return {}

    def is_primary(self) -> bool:
        return self.get("/primary")[0] == 200

    def is_sync_standby(self) -> bool:
        return self.get("/sync")[0] == 200

    def stop(self) -> None:
        """Kills Patroni and PostgreSQL (cleanup: no shutdown checkpoint wanted)."""
        if (self.proc is not None and self.proc.poll() is None) or self.postmaster_pid():
            self.crash()


class HAProxy:
    """Debian's HAProxy on 127.0.0.1:`port` (TCP), forwarding to the node
    whose Patroni answers `/primary` with 200: checked every `inter_ms`,
    down after `fall` failed checks, up after `rise`; the sessions of a node
    marked down are cut. Patroni's example configuration, with checks every
    500 ms instead of 3 s. `rise` 2 matters: Patroni's /primary answers 200
    from its promote request on, ~0.1 s before PostgreSQL leaves recovery,
    and a single check in that gap would send writes to a read-only server."""

    def __init__(self, folder: pathlib.Path, nodes: List[PatroniNode], host: str = "127.0.0.1",
                 inter_ms: int = 500, fall: int = 3, rise: int = 2):
        self.folder = folder
        self.host = host
        self.port = free_port(host)
        self.nodes = nodes
        self.inter_ms, self.fall, self.rise = inter_ms, fall, rise
        self.config = folder / "haproxy.cfg"
        self.log = folder / "haproxy.log"
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> "HAProxy":
        lines = [
            "global", "    maxconn 2000", "    log stdout format raw local0 info",
            "defaults", "    mode tcp", "    log global", "    option tcplog", "    retries 2",
            "    timeout connect 2s", "    timeout client 30m", "    timeout server 30m", "    timeout check 1s",
            "listen postgres", f"    bind {self.host}:{self.port}",
            "    option httpchk OPTIONS /primary", "    http-check expect status 200",
            f"    default-server inter {self.inter_ms}ms fall {self.fall} rise {self.rise} "
            "on-marked-down shutdown-sessions",
        ]
        lines += [f"    server {n.name} {n.host}:{n.port} maxconn 500 check port {n.api_port}" for n in self.nodes]
        self.config.write_text("\n".join(lines) + "\n")
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([_which("haproxy") or "haproxy", "-db", "-f", str(self.config)],
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        (self.folder / "haproxy.pid").write_text(f"{self.proc.pid}\n")
        _wait_port(self.host, self.port, self.proc, "haproxy", self.log)
        return self

    def stop(self) -> None:
        _stop(self.proc)


class PatroniCluster:
    """etcd, `nodes` Patroni nodes in synchronous_mode_strict, and HAProxy
    routing to the primary. `dcs` adds to (or overrides) the bootstrap DCS
    settings; `parameters` to PostgreSQL's."""

    def __init__(self, nodes: int = 2, ttl: int = 10, loop_wait: int = 1, retry_timeout: int = 3,
                 dcs: Optional[dict] = None, parameters: Optional[dict] = None, haproxy: Optional[dict] = None):
        self.folder = pathlib.Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=_base()))
        os.chmod(self.folder, 0o755)
        self.scope = f"faults-{os.getpid()}-{self.folder.name[-6:]}"
        self.ttl, self.loop_wait, self.retry_timeout = ttl, loop_wait, retry_timeout
        self.dcs = {
            "ttl": ttl, "loop_wait": loop_wait, "retry_timeout": retry_timeout,
            "maximum_lag_on_failover": 1048576,
            "synchronous_mode": True, "synchronous_mode_strict": True,
            "postgresql": {
                "use_pg_rewind": True, "use_slots": True,
                "remove_data_directory_on_rewind_failure": True,
                "remove_data_directory_on_diverged_timelines": True,
                "parameters": {"wal_level": "replica", "hot_standby": "on", "wal_log_hints": "on",
                               "max_wal_senders": 10, "max_replication_slots": 10, "max_connections": 300,
                               "wal_sender_timeout": "5s", "wal_receiver_status_interval": "1s",
                               "logging_collector": "on", "log_directory": "log"},
            },
            **(dcs or {}),
        }
        self.etcd = Etcd(self.folder)
        self.nodes = [PatroniNode(self.folder, f"node{i}", self.scope, self.etcd, self.dcs, parameters=parameters)
                      for i in range(nodes)]
        self.haproxy = HAProxy(self.folder, self.nodes, **(haproxy or {}))

    def url(self, db: str = "postgres") -> str:
        """Through HAProxy: the primary, whichever node it is."""
        return f"postgres://postgres@{self.haproxy.host}:{self.haproxy.port}/{db}"

    def start(self) -> "PatroniCluster":
        """etcd, then every node at once (the first to take the initialize
        key bootstraps: initdb, leader; the others wait for it and clone it
        with pg_basebackup), then HAProxy. wait_synchronous() waits for them."""
        self.etcd.start()
        for node in self.nodes:
            node.start(wait=False)
        for node in self.nodes:
            node.wait_api()
        self.haproxy.start()
        return self

    def wait_synchronous(self, timeout: float = 90) -> Dict[str, str]:
        """Until there is a leader and every other node streams, one of them
        as the synchronous standby; returns {name: role} from /cluster."""
        found: Dict[str, str] = {}

        def ready() -> bool:
            nonlocal found
            members = self.members()
            found = {m["name"]: f"{m.get('role')}/{m.get('state')}" for m in members}
            roles = [m.get("role") for m in members]
            streaming = [m for m in members if m.get("role") in ("replica", "sync_standby")
                         and m.get("state") in ("streaming", "running")]
            return (len(members) == len(self.nodes) and roles.count("leader") == 1
                    and "sync_standby" in roles and len(streaming) == len(self.nodes) - 1)

        self._until(ready, timeout, lambda: f"no leader with a synchronous standby: {found}")
        return found

    def members(self) -> List[dict]:
        for node in self.nodes:
            status, body = node.get("/cluster")
            if status == 200:
                try:
                    return json.loads(body).get("members", [])
                except ValueError:
                    pass
        return []

    def leader(self) -> Optional[PatroniNode]:
        return next((n for n in self.nodes if n.is_primary()), None)

    def psql(self, sql: str, db: str = "postgres", timeout: float = 30) -> str:
        """On the primary, through HAProxy."""
        r = subprocess.run([str(pg_bindir() / "psql"), "-X", "-q", "-At", "-v", "ON_ERROR_STOP=1",
                            self.url(db), "-c", sql], capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"psql {sql!r} through haproxy: {r.stderr.strip()}")
        return r.stdout.strip()

    def logs(self) -> Dict[str, pathlib.Path]:
        """name -> log file: etcd, haproxy, each node's Patroni and PostgreSQL."""
        found = {"etcd.log": self.etcd.log, "haproxy.log": self.haproxy.log}
        for node in self.nodes:
            found[f"{node.name}-patroni.log"] = node.log
            for pglog in sorted((node.data / "log").glob("*")) if (node.data / "log").is_dir() else []:
                found[f"{node.name}-{pglog.name}"] = pglog
        return found

    def remove(self) -> None:
        """Kills HAProxy, every node (Patroni first), etcd; deletes the folder."""
        self.haproxy.stop()
        for node in self.nodes:
            node.stop()
        self.etcd.stop()
        _kill_folder(self.folder)  # anything started behind our back (a postmaster Patroni restarted)
        shutil.rmtree(self.folder, ignore_errors=True)

    @staticmethod
    def _until(predicate, timeout: float, message) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.1)
        raise RuntimeError(message() if callable(message) else message)


if __name__ == "__main__":
    ensure_packages()
    print("swept:", sweep())
    cluster = PatroniCluster()
    try:
        cluster.start()
        print(json.dumps(cluster.wait_synchronous(), indent=1))
        print(cluster.url(), "->", cluster.psql("SELECT inet_server_port()"))
        input("Enter removes it: ")
    finally:
        cluster.remove()
