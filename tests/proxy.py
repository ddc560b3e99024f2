"""A TCP proxy that can hang: the middlebox that stops forwarding with its sockets open.

Tests put it between a process and a real Postgres (over TCP or its unix
socket) to make a path go silent without a RST or a FIN: while ``stalled``,
the proxy reads nothing and forwards nothing, so the client's kernel still
acknowledges what it sends (into the proxy's receive buffer) and the server
sees a healthy, idle peer. Only timers the two ends set themselves can end
such a session, which is what the lease tests need to show.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path


class StallingProxy:
    """Forward ``127.0.0.1:<port>`` to ``upstream`` (``(host, port)`` or a unix socket path)."""

    def __init__(self, upstream: tuple[str, int] | str):
        self.upstream = upstream
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = False
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name="stalling-proxy", daemon=True).start()

    @classmethod
    def to_postgres(cls, libpq_url: str) -> StallingProxy:
        """A proxy to the Postgres of ``libpq_url`` (``host=`` a socket directory, or TCP)."""
        from psycopg.conninfo import conninfo_to_dict

        params = conninfo_to_dict(libpq_url)
        host, port = params.get("host") or "127.0.0.1", int(params.get("port") or 5432)
        if host.startswith("/"):
            return cls(str(Path(host) / f".s.PGSQL.{port}"))
        return cls((host, port))

    def url(self, libpq_url: str) -> str:
        """``libpq_url`` pointed at this proxy (same database and user), as a URL."""
        from urllib.parse import quote

        from psycopg.conninfo import conninfo_to_dict

        params = conninfo_to_dict(libpq_url)
        user = quote(params.get("user") or "postgres")
        password = f":{quote(params['password'])}" if params.get("password") else ""
        return (f"postgresql://{user}{password}@127.0.0.1:{self.port}/"
                f"{quote(params.get('dbname') or 'postgres')}")

    def stall(self) -> None:
        """Stop forwarding in both directions; every socket stays open."""
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def cut(self) -> None:
        """Break every connection made so far (a shutdown each way, then a close), and keep
        accepting new ones: the path of a session breaks, the route stays."""
        sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def close(self) -> None:
        self._closed = True
        self._flowing.set()
        for sock in [self._listener, *self._sockets]:
            with contextlib.suppress(OSError):
                sock.close()

    def _connect_upstream(self) -> socket.socket:
        if isinstance(self.upstream, str):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(self.upstream)
        else:
            sock = socket.create_connection(self.upstream)
        return sock

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = self._connect_upstream()
            except OSError:
                client.close()
                continue
            self._sockets += [client, server]
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                self._flowing.wait()
                data = src.recv(65536)
                if not data:
                    break
                self._flowing.wait()
                if self._closed:
                    break
                dst.sendall(data)
        except OSError:
            pass
        if self._flowing.is_set():  # a stalled middlebox keeps its sockets open
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
