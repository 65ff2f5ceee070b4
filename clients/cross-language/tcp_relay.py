"""A TCP relay between a server and PostgreSQL that a test can cut and
restore, so the server's store becomes unreachable on cue.

    with TcpRelay("127.0.0.1", 5432) as relay:
        url = f"postgres://postgres@127.0.0.1:{relay.port}/db"
        relay.cut()        # every connection reset, new ones reset at once
        relay.restore()    # forwarded again

cut() resets (RST) every open connection and every new one as soon as it is
accepted, as a database that went away does: the server's queries fail at
once and its reconnects are refused, so its calls answer UNAVAILABLE within
its database timeout. stall() instead keeps connections open and forwards
nothing, as a dead link does: queries hang until the server's timeouts.
Threads, loopback only; stops with the `with` block.
"""

from __future__ import annotations

import socket
import struct
import threading
from typing import List, Tuple

OPEN, CUT, STALL = "open", "cut", "stall"


def _reset(sock: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0) rather than a FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class TcpRelay:
    def __init__(self, upstream_host: str, upstream_port: int):
        self.upstream = (upstream_host, upstream_port)
        self.mode = OPEN
        self._lock = threading.Lock()
        self._pairs: List[Tuple[socket.socket, socket.socket]] = []
        self._held: List[socket.socket] = []
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._closed = False
        #: Connections accepted in all (the server's reconnects show here).
        self.accepted = 0
        threading.Thread(target=self._accept_loop, name="tcp-relay-accept", daemon=True).start()

    def __enter__(self) -> "TcpRelay":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                self.accepted += 1
                mode = self.mode
                if mode == CUT:
                    _reset(client)
                    continue
                if mode == STALL:
                    self._held.append(client)
                    continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _reset(client)
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = (client, upstream)
            with self._lock:
                self._pairs.append(pair)
            for source, target in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(pair, source, target), daemon=True).start()

    def _pump(self, pair, source: socket.socket, target: socket.socket) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if self.mode == STALL:
                    continue  # swallowed: the peer waits for an answer that never comes
                target.sendall(data)
        except OSError:
            pass
        self._drop(pair)

    def _drop(self, pair) -> None:
        with self._lock:
            if pair not in self._pairs:
                return
            self._pairs.remove(pair)
        for sock in pair:
            _reset(sock)

    def _reset_all(self) -> None:
        with self._lock:
            pairs, self._pairs = self._pairs, []
            held, self._held = self._held, []
        for pair in pairs:
            for sock in pair:
                _reset(sock)
        for sock in held:
            _reset(sock)

    def cut(self) -> None:
        """Reset every connection, and every new one as it arrives."""
        with self._lock:
            self.mode = CUT
        self._reset_all()

    def stall(self) -> None:
        """Forward nothing more: connections stay open, and answer nothing."""
        with self._lock:
            self.mode = STALL

    def restore(self) -> None:
        """Forward again; connections left from a stall are reset (the
        server reconnects)."""
        with self._lock:
            was, self.mode = self.mode, OPEN
        if was == STALL:
            self._reset_all()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._listener.close()
        except OSError:
            pass
        self._reset_all()
