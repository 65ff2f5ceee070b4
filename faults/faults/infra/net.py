"""A network namespace for the replicas, with the network to PostgreSQL
breakable on its own (the network scenario).

    host                                   namespace `idemfPID`
    10.200.N.1/30  (PostgreSQL listens) <-- db veth -->  10.200.N.2/30
    10.201.N.1/30                        <-- client veth --> 10.201.N.2/30 (replicas' gRPC)

Two veth pairs, so that a fault on the database link (drop everything, a
delay, loss) leaves the clients' path to the replicas alone. The faults are
applied inside the namespace (nftables table and the netem qdisc of the
namespace's end) and on the host's end of the database pair (netem, for loss
in both directions); deleting the namespace deletes both pairs, their qdiscs
and the nftables table, so `remove()` (and a namespace left over by a run
that was killed: `sweep()`) cleans up everything.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from typing import List, Optional

from .pg import ensure_commands

PREFIX = "idemf"


def sh(cmd: List[str], check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def sweep() -> List[str]:
    """Deletes namespaces of ours whose creating process is gone (a run that
    was killed before its cleanup), and the processes still in them."""
    removed = []
    out = sh(["ip", "netns", "list"], check=False).stdout
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(PREFIX + r"(\d+)", name)
        if m and not _pid_alive(int(m.group(1))):
            # Its processes (replicas left by a run killed before its
            # cleanup) go first, by the namespace's own list of pids.
            for pid in sh(["ip", "netns", "pids", name], check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            sh(["ip", "netns", "del", name], check=False)
            removed.append(name)
    return removed


class NetNs:
    def __init__(self, index: Optional[int] = None):
        ensure_commands({"ip": "iproute2", "tc": "iproute2", "nft": "nftables"})
        if os.geteuid() != 0:
            raise PermissionError("the network scenario needs root (network namespaces, tc, nftables)")
        sweep()
        self.name = f"{PREFIX}{os.getpid()}"
        tag = f"{os.getpid() % 100000}"
        self.db_host_if, self.db_ns_if = f"fd{tag}h", f"fd{tag}n"
        self.cl_host_if, self.cl_ns_if = f"fc{tag}h", f"fc{tag}n"
        self.n = index if index is not None else self._free_subnet()
        self.db_host = f"10.200.{self.n}.1"
        self.db_ns = f"10.200.{self.n}.2"
        self.client_host = f"10.201.{self.n}.1"
        self.client_ns = f"10.201.{self.n}.2"
        self.created = False
        self.faults: List[str] = []
        self.relay: Optional[Relay] = None

    def start_relay(self, upstream_host: str, upstream_port: int, log: Optional[str] = None) -> "Relay":
        """A TCP relay on the host's end of the database link
        (db_host:relay.port) to PostgreSQL at upstream; the replicas'
        DATABASE_URL points at it."""
        self.relay = Relay(self.db_host, upstream_host, upstream_port, log).start()
        return self.relay

    @staticmethod
    def _free_subnet() -> int:
        used = sh(["ip", "-o", "-4", "addr", "show"]).stdout
        for n in range(1, 255):
            if f"10.200.{n}." not in used and f"10.201.{n}." not in used:
                return n
        raise RuntimeError("no free 10.200.N.0/30 subnet")

    @property
    def wrapper(self) -> List[str]:
        """The command prefix that runs a process inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def ns(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return sh([*self.wrapper, *cmd], check=check)

    def create(self) -> "NetNs":
        sh(["ip", "netns", "add", self.name])
        self.created = True
        try:
            self.ns("ip", "link", "set", "lo", "up")
            for host_if, ns_if, host_addr, ns_addr in (
                (self.db_host_if, self.db_ns_if, self.db_host, self.db_ns),
                (self.cl_host_if, self.cl_ns_if, self.client_host, self.client_ns),
            ):
                sh(["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if, "netns", self.name])
                sh(["ip", "addr", "add", f"{host_addr}/30", "dev", host_if])
                sh(["ip", "link", "set", host_if, "up"])
                self.ns("ip", "addr", "add", f"{ns_addr}/30", "dev", ns_if)
                self.ns("ip", "link", "set", ns_if, "up")
        except BaseException:
            self.remove()
            raise
        return self

    # --- faults on the database link -----------------------------------

    def partition(self) -> None:
        """Drops every packet between the namespace and PostgreSQL, both ways
        (no RST, no ICMP: connections hang as behind a dead link)."""
        rules = (f"table inet {PREFIX} {{\n"
                 f"  chain out {{ type filter hook output priority 0; policy accept; oifname \"{self.db_ns_if}\" drop; }}\n"
                 f"  chain in {{ type filter hook input priority 0; policy accept; iifname \"{self.db_ns_if}\" drop; }}\n"
                 "}\n")
        subprocess.run([*self.wrapper, "nft", "-f", "-"], input=rules, text=True, check=True, capture_output=True)
        self.faults.append("partition")

    def delay(self, ms: int = 200) -> str:
        """Adds `ms` to everything the namespace sends to PostgreSQL (each
        round trip gets `ms` longer): `tc netem` on the namespace's end when
        the kernel has it, else the relay's delay line (this machine's
        kernel is built without sch_netem). Returns how."""
        if netem_available():
            self.ns("tc", "qdisc", "replace", "dev", self.db_ns_if, "root", "netem", "delay", f"{ms}ms")
            how = "tc netem"
        elif self.relay is not None:
            self.relay.set_delay(ms)
            how = "relay delay line"
        else:
            raise RuntimeError("no sch_netem in this kernel and no relay to delay with")
        self.faults.append(f"delay {ms}ms ({how})")
        return how

    def loss(self, percent: int = 5) -> None:
        """Drops `percent` of the packets in each direction on the database
        link (nftables `numgen random mod 100 < percent drop`, in the
        namespace's input and output)."""
        rules = (f"table inet {PREFIX} {{\n"
                 f"  chain out {{ type filter hook output priority 0; policy accept; oifname \"{self.db_ns_if}\" numgen random mod 100 < {int(percent)} drop; }}\n"
                 f"  chain in {{ type filter hook input priority 0; policy accept; iifname \"{self.db_ns_if}\" numgen random mod 100 < {int(percent)} drop; }}\n"
                 "}\n")
        subprocess.run([*self.wrapper, "nft", "-f", "-"], input=rules, text=True, check=True, capture_output=True)
        self.faults.append(f"loss {percent}%")

    def heal(self) -> None:
        """Removes every fault: the nftables table, any netem qdisc, the
        relay's delay."""
        self.ns("nft", "delete", "table", "inet", PREFIX, check=False)
        self.ns("tc", "qdisc", "del", "dev", self.db_ns_if, "root", check=False)
        if self.relay is not None:
            self.relay.set_delay(0)
        self.faults.append("heal")

    def state(self) -> str:
        """The rules and qdiscs in force, for the log."""
        rules = self.ns("nft", "list", "ruleset", check=False).stdout.strip()
        q = self.ns("tc", "qdisc", "show", "dev", self.db_ns_if, check=False).stdout.strip()
        qh = sh(["tc", "qdisc", "show", "dev", self.db_host_if], check=False).stdout.strip()
        return f"nft: {rules or '(none)'}\nns qdisc: {q}\nhost qdisc: {qh}"

    def remove(self) -> None:
        """Deletes the namespace (and with it both veth pairs, their qdiscs and
        the nftables table). Safe to call twice."""
        if self.created:
            sh(["ip", "netns", "del", self.name], check=False)
            # The host ends go with their peers; make sure.
            for ifname in (self.db_host_if, self.cl_host_if):
                sh(["ip", "link", "del", ifname], check=False)
            self.created = False
        if self.relay is not None:
            self.relay.stop()


_netem: Optional[bool] = None


def netem_available() -> bool:
    """Whether the kernel has sch_netem (tried in a scratch namespace)."""
    global _netem
    if _netem is None:
        name = f"{PREFIX}probe{os.getpid()}"
        sh(["ip", "netns", "add", name])
        try:
            r = sh(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                   check=False)
            _netem = r.returncode == 0
        finally:
            sh(["ip", "netns", "del", name], check=False)
    return _netem


class Relay:
    """A TCP relay in its own process (`python -m faults.infra.net relay`),
    so that the workload's event loop does not slow it: listens on
    host:port, forwards to upstream. SIGUSR1 turns on a delay line (every
    byte from the replicas, and with `both_ways` from the upstream too, is
    forwarded DELAY ms after it arrived, in order; the delay is read from
    the file `delay_file`; set_delay(0) turns it off)."""

    def __init__(self, host: str, upstream_host: str, upstream_port: int, log: Optional[str] = None,
                 both_ways: bool = False):
        from .pg import free_port
        #: delay the upstream's answers too (not only what clients send)
        self.both_ways = both_ways
        self.host = host
        self.port = free_port(host)
        self.upstream = (upstream_host, upstream_port)
        self.log = log
        self.proc: Optional[subprocess.Popen] = None
        self.delay_file = f"/tmp/{PREFIX}-relay-{os.getpid()}-{self.port}.delay"

    def start(self) -> "Relay":
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # faults/
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "faults.infra.net", "relay", self.host, str(self.port), self.upstream[0],
             str(self.upstream[1]), self.delay_file, "both" if self.both_ways else "up"],
            cwd=pkg_root, stdout=out, stderr=out, start_new_session=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"relay exited with {self.proc.returncode}")
            try:
                socket.create_connection((self.host, self.port), timeout=0.5).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("relay did not listen")

    def set_delay(self, ms: int) -> None:
        with open(self.delay_file, "w") as f:
            f.write(str(ms))
        self.proc.send_signal(signal.SIGUSR1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        try:
            os.unlink(self.delay_file)
        except OSError:
            pass


async def _relay_main(host: str, port: int, up_host: str, up_port: int, delay_file: str,
                      both: bool = False) -> None:
    state = {"delay": 0.0}

    def reread() -> None:
        try:
            state["delay"] = int(open(delay_file).read().strip() or 0) / 1000.0
        except (OSError, ValueError):
            state["delay"] = 0.0

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, reread)

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delayed: bool) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def send() -> None:
            try:
                while True:
                    due, data = await queue.get()
                    if data is None:
                        break
                    wait = due - loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        sender = asyncio.create_task(send())
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                queue.put_nowait((loop.time() + (state["delay"] if delayed else 0.0), data))
        except (ConnectionError, OSError):
            pass
        queue.put_nowait((0.0, None))
        await sender

    async def handle(c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            u_reader, u_writer = await asyncio.open_connection(up_host, up_port)
        except OSError:
            c_writer.close()
            return
        for w in (c_writer, u_writer):
            sock = w.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(pump(c_reader, u_writer, True), pump(u_reader, c_writer, both))

    async def orphaned() -> None:
        # The harness was killed before its cleanup: go too.
        parent = os.getppid()
        while os.getppid() == parent:
            await asyncio.sleep(1.0)
        os._exit(0)

    asyncio.create_task(orphaned())
    server = await asyncio.start_server(handle, host, port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    if len(sys.argv) in (7, 8) and sys.argv[1] == "relay":
        asyncio.run(_relay_main(sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6],
                                sys.argv[7:] == ["both"]))
    else:
        sys.exit("usage: python -m faults.infra.net relay HOST PORT UPSTREAM_HOST UPSTREAM_PORT DELAY_FILE [up|both]")
