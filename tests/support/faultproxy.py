"""A TCP proxy on loopback that injects network faults between a client and a real server.

Modes, per connection:

- ``pass``: forwards both ways;
- ``drop_after``: closes both sides once the client has sent more than ``limit`` bytes since the
  server last answered (a large upload dies mid-body; small requests pass, on a reused
  connection too);
- ``down_after``: as ``drop_after``, and from that drop on the network is down: every later
  connection is closed unread (a save's clean-up after a failed upload reaches no server);
- ``stall``: forwards the request but never a byte of the answer (a server that hangs);
- ``drop_matching``: closes both sides, without forwarding it, at a request whose request line
  holds ``match`` (``b"PUT /bucket/prefix/sharded_state.json"``): that request never reaches
  the server; other requests pass;
- ``lose_answer``: forwards a request whose request line holds ``match``, lets the server
  answer, and closes both sides without forwarding the answer: the server did it, the client
  never hears (other requests pass);
- ``slow``: forwards both ways, the answers at most ``limit`` bytes a second per connection
  (a slow network: a read that lasts long enough to kill its reader in the middle).

It counts the bytes each way (``sent``: client to server; ``received``: server to
client), so a test can tell how much one client read. ``host`` is the address it listens
on (loopback by default; a bridge's address for clients in other network namespaces).

Bounded: one thread per connection, all closed with the proxy; it stops by itself when
the ``with`` block ends.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time


class FaultProxy:
    def __init__(
        self, target_port: int, mode: str = "pass", limit: int = 0, host: str = "127.0.0.1", match: bytes = b""
    ) -> None:
        self.target_port, self.mode, self.limit, self.host, self.match = target_port, mode, limit, host, match
        self.listener = socket.create_server((host, 0))
        self.port = self.listener.getsockname()[1]
        self.dropped = self.refused = 0
        self.sent = self.received = 0
        self._count = threading.Lock()
        self._closing = threading.Event()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> FaultProxy:
        thread = threading.Thread(target=self._accept, daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing.set()
        for s in [self.listener, *self._sockets]:
            with contextlib.suppress(OSError):
                s.close()
        for t in self._threads:
            t.join(timeout=5)

    def _accept(self) -> None:
        self.listener.settimeout(0.2)
        while not self._closing.is_set():
            try:
                client, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            if self.mode == "down_after" and self.dropped:
                self.refused += 1
                client.close()
                continue
            server = socket.create_connection(("127.0.0.1", self.target_port))
            self._sockets += [client, server]
            thread = threading.Thread(target=self._relay, args=(client, server), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _relay(self, client: socket.socket, server: socket.socket) -> None:
        sent = 0  # by the client since the server last answered: one request's bytes
        doomed = False  # lose_answer: this connection's answer is never forwarded
        try:
            while not self._closing.is_set():
                ready, _, _ = select.select([client, server], [], [], 0.2)
                for source in ready:
                    data = source.recv(65536)
                    if not data:
                        return
                    if source is client:
                        sent += len(data)
                        if self.mode in ("drop_after", "down_after") and sent > self.limit:
                            self.dropped += 1
                            return
                        if self.mode in ("drop_matching", "lose_answer") and self.match in data.split(b"\r\n", 1)[0]:
                            if self.mode == "drop_matching":
                                self.dropped += 1
                                return
                            doomed = True
                        server.sendall(data)
                        with self._count:
                            self.sent += len(data)
                        continue
                    if doomed:
                        self.dropped += 1
                        return
                    sent = 0  # the server answers: the client's next bytes are a new request
                    if self.mode == "slow":
                        for start in range(0, len(data), 4096):
                            piece = data[start : start + 4096]
                            time.sleep(4096 / self.limit)
                            client.sendall(piece)
                            with self._count:
                                self.received += len(piece)
                    elif self.mode != "stall":
                        client.sendall(data)
                        with self._count:
                            self.received += len(data)
        except OSError:
            return
        finally:
            for s in (client, server):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                    s.close()
