"""Coordinators: the few collectives a multi-writer save needs (barrier, allgather, broadcast).

Call-order contract (every implementation):

1. Every rank calls the same operations (``barrier``, ``allgather``, ``broadcast``) with the same
   names, in the same order; ``broadcast`` also with the same ``root``. Each operation returns
   only after every rank has entered it (``broadcast`` too), so each one is also a barrier.
2. A kind, name, root or count mismatch is an error, not a hang: every rank raises
   :class:`CheckpointError` as soon as the coordinator sees the mismatch.
3. Every wait is bounded by ``timeout_s`` (``None``: the coordinator's default). A rank that does
   not arrive in time makes the others raise :class:`CoordinatorTimeoutError`, which names the
   operation and the missing ranks.
4. When a peer or the coordinator process dies, the others raise :class:`CoordinatorLostError`
   as soon as the broken connection is seen, not after the timeout.
5. After any of these errors the coordinator is unusable: further calls raise
   :class:`CoordinatorLostError`. Make a new one (on a fresh port) to try again.
6. Arguments of the wrong type raise ``TypeError``/``ValueError`` on the calling rank only.

Payloads are opaque bytes and are never unpickled. They are meant to be small (metadata):
rank 0 relays every one of them.
"""

from __future__ import annotations

import selectors
import socket
import struct
import threading
import time
from typing import Any, Protocol, runtime_checkable

import msgpack

from ckptfmt.errors import CheckpointError, CoordinatorLostError, CoordinatorTimeoutError

__all__ = ["Coordinator", "LocalCoordinator", "TcpCoordinator", "free_port", "as_bytes"]

_PROTOCOL = "ckptfmt.coord/1"
_HEADER = struct.Struct(">I")


@runtime_checkable
class Coordinator(Protocol):
    """What a save session needs from its process group; see the module docstring for the contract.

    ``timeout_s=None`` means the coordinator's own default timeout.
    """

    rank: int
    world: int

    def barrier(self, name: str, timeout_s: float | None = None) -> None:
        """Return once every rank has called ``barrier(name)``."""
        ...

    def allgather(self, name: str, payload: bytes, timeout_s: float | None = None) -> list[bytes]:
        """Return every rank's payload; index = rank."""
        ...

    def broadcast(self, name: str, payload: bytes | None, root: int = 0,
                  timeout_s: float | None = None) -> bytes:
        """Return ``root``'s payload on every rank (``payload`` is ignored on the other ranks)."""
        ...


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name:
        raise TypeError(f"operation name must be a non-empty str, got {name!r}")


def as_bytes(payload: Any, what: str = "payload") -> bytes:
    """``payload`` as bytes; TypeError (a caller's mistake) for anything that is not bytes-like."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"{what} must be bytes, got {type(payload).__name__}")
    return bytes(payload)


class LocalCoordinator:
    """The coordinator of a single process (``world == 1``); every collective returns at once."""

    rank: int = 0
    world: int = 1

    def barrier(self, name: str, timeout_s: float | None = None) -> None:
        _check_name(name)

    def allgather(self, name: str, payload: bytes, timeout_s: float | None = None) -> list[bytes]:
        _check_name(name)
        return [as_bytes(payload, "allgather payload")]

    def broadcast(self, name: str, payload: bytes | None, root: int = 0,
                  timeout_s: float | None = None) -> bytes:
        _check_name(name)
        if root != 0:
            raise ValueError(f"broadcast root {root} is out of range for world size 1")
        return as_bytes(payload, "broadcast payload on the root")

    def close(self) -> None:
        pass

    def __enter__(self) -> LocalCoordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free a moment ago (another process may still take it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"coordinator address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


def _frame(message: dict[str, Any]) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return _HEADER.pack(len(body)) + body


def _parse_body(body: bytes) -> dict[str, Any]:
    n = len(body)
    msg = msgpack.unpackb(body, raw=False, strict_map_key=True, max_str_len=n, max_bin_len=n,
                          max_array_len=n, max_map_len=n // 2, max_ext_len=0)
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise ValueError("message is not a map with a type field")
    return msg


class _Conn:
    """One socket plus a receive buffer that yields whole frames."""

    def __init__(self, sock: socket.socket, max_message_bytes: int) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.max = max_message_bytes
        self.rank: int | None = None

    def feed(self) -> bool:
        """Read what is available; return False on EOF. Raises OSError on a reset connection."""
        data = self.sock.recv(1 << 20)
        if not data:
            return False
        self.buf += data
        return True

    def pop(self) -> dict[str, Any] | None:
        """Return the next whole message, or None. Raises ValueError on a malformed frame."""
        if len(self.buf) < _HEADER.size:
            return None
        (length,) = _HEADER.unpack_from(self.buf)
        if length > self.max:
            raise ValueError(f"frame of {length} bytes exceeds the {self.max}-byte limit")
        if len(self.buf) < _HEADER.size + length:
            return None
        body = bytes(self.buf[_HEADER.size:_HEADER.size + length])
        del self.buf[:_HEADER.size + length]
        return _parse_body(body)

    def send(self, message: dict[str, Any], timeout_s: float) -> None:
        self.sock.settimeout(max(timeout_s, 0.001))
        self.sock.sendall(_frame(message))

    def close(self) -> None:
        self.sock.close()


def _error_class(kind: str) -> type[CheckpointError]:
    return {"timeout": CoordinatorTimeoutError, "lost": CoordinatorLostError}.get(kind, CheckpointError)


class TcpCoordinator:
    """A coordinator over plain TCP: rank 0 listens on ``address``, the other ranks connect to it.

    Each collective: every rank sends ``(seq, kind, name, root, payload)`` to rank 0; rank 0 checks
    that all of them match its own call, then replies with the result (or with the error, so that
    every rank fails the same way). Messages are a 4-byte big-endian length and a msgpack map, at
    most ``max_message_bytes``. Rank 0 accepts connections while it waits in a collective. A lock
    serializes calls, so one background thread may run a whole save while others leave it alone.

    Raises :class:`CoordinatorTimeoutError` if the non-zero ranks cannot connect within
    ``timeout_s``; :class:`CheckpointError` if rank 0 cannot listen on ``address``.
    """

    def __init__(self, address: str, rank: int, world: int, *, timeout_s: float = 120.0,
                 max_message_bytes: int = 1 << 30) -> None:
        if not (isinstance(world, int) and world >= 1 and isinstance(rank, int) and 0 <= rank < world):
            raise ValueError(f"need 0 <= rank < world, got rank={rank!r} world={world!r}")
        self.address = address
        self.rank = rank
        self.world = world
        self.timeout_s = float(timeout_s)
        self._max = max_message_bytes
        self._lock = threading.Lock()
        self._seq = 0
        self._broken: CheckpointError | None = None
        self._closed = False
        self._listener: socket.socket | None = None
        self._pending: list[_Conn] = []          # rank 0: accepted, hello not yet read
        self._sel = selectors.DefaultSelector()  # rank 0: listener + connections (no FD_SETSIZE cap)
        self._peers: dict[int, _Conn] = {}       # rank 0: rank -> connection
        self._conn: _Conn | None = None          # other ranks: connection to rank 0
        host, port = _parse_address(address)
        if rank == 0:
            try:
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                self._listener = socket.create_server((host, port), family=family, backlog=max(world, 8))
                self._sel.register(self._listener, selectors.EVENT_READ, None)
            except OSError as exc:
                raise CheckpointError(f"coordinator cannot listen on {address}: {exc}",
                                      object=address) from exc
        else:
            self._conn = self._connect(host, port)

    # ------------------------------------------------------------------------ public API

    def barrier(self, name: str, timeout_s: float | None = None) -> None:
        """Return once every rank called ``barrier(name)``; see the module docstring for errors."""
        self._collective("barrier", name, None, 0, timeout_s)

    def allgather(self, name: str, payload: bytes, timeout_s: float | None = None) -> list[bytes]:
        """Return every rank's payload (index = rank); see the module docstring for errors."""
        result = self._collective("allgather", name, as_bytes(payload, "allgather payload"), 0, timeout_s)
        return list(result)

    def broadcast(self, name: str, payload: bytes | None, root: int = 0,
                  timeout_s: float | None = None) -> bytes:
        """Return ``root``'s payload on every rank. Waits for all ranks, like a barrier."""
        if not (isinstance(root, int) and 0 <= root < self.world):
            raise ValueError(f"broadcast root {root!r} is out of range for world size {self.world}")
        data = as_bytes(payload, "broadcast payload on the root") if self.rank == root else None
        return bytes(self._collective("broadcast", name, data, root, timeout_s))

    def close(self) -> None:
        """Close every socket. Peers still waiting see :class:`CoordinatorLostError`. Idempotent."""
        self._closed = True
        for conn in [*self._pending, *self._peers.values(), *([self._conn] if self._conn else [])]:
            conn.close()
        self._pending.clear()
        self._peers.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._sel.close()

    def __enter__(self) -> TcpCoordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------ internals

    def _connect(self, host: str, port: int) -> _Conn:
        deadline = time.monotonic() + self.timeout_s
        last: OSError | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CoordinatorTimeoutError(
                    f"rank {self.rank} could not connect to the coordinator at {self.address} "
                    f"within {self.timeout_s:g} s (last error: {last})", object=self.address)
            try:
                sock = socket.create_connection((host, port), timeout=min(remaining, 5.0))
                break
            except OSError as exc:  # refused while rank 0 is still starting: retry
                last = exc
                time.sleep(min(0.05, max(remaining, 0)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn(sock, self._max)
        try:
            conn.send({"t": "hello", "proto": _PROTOCOL, "rank": self.rank, "world": self.world},
                      deadline - time.monotonic())
        except OSError as exc:
            conn.close()
            raise CoordinatorLostError(f"rank {self.rank} lost the coordinator at {self.address} "
                                       f"while saying hello: {exc}", object=self.address) from exc
        return conn

    def _collective(self, kind: str, name: str, payload: bytes | None, root: int,
                    timeout_s: float | None) -> Any:
        _check_name(name)
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        with self._lock:
            if self._closed:
                raise CoordinatorLostError(f"{kind} {name!r}: coordinator is closed")
            if self._broken is not None:
                raise CoordinatorLostError(f"{kind} {name!r}: coordinator is unusable after an "
                                           f"earlier failure: {self._broken}") from self._broken
            self._seq += 1
            op = {"t": "op", "seq": self._seq, "kind": kind, "name": name, "root": root,
                  "payload": payload}
            try:
                if self.world == 1:
                    return [payload] if kind == "allgather" else payload
                if self.rank == 0:
                    return self._serve(op, timeout)
                return self._request(op, timeout)
            except CheckpointError as exc:
                self._broken = exc
                raise
            except (OSError, ValueError) as exc:  # e.g. close() from another thread mid-call
                lost = CoordinatorLostError(f"{self._describe(op)}: coordinator failed: {exc}")
                self._broken = lost
                raise lost from exc

    @staticmethod
    def _describe(op: dict[str, Any]) -> str:
        root = f" root={op.get('root')}" if op.get("kind") == "broadcast" else ""
        return f"{op.get('kind')} {op.get('name')!r}{root} (op #{op.get('seq')})"

    # Non-zero ranks ----------------------------------------------------------------------

    def _request(self, op: dict[str, Any], timeout: float) -> Any:
        conn = self._conn
        assert conn is not None
        what = self._describe(op)
        # Wait a little longer than rank 0 does, so that rank 0's report (which names the
        # missing ranks) arrives before this rank gives up on its own.
        deadline = time.monotonic() + timeout + 1.0 + 0.05 * timeout
        sel = selectors.DefaultSelector()
        try:
            sel.register(conn.sock, selectors.EVENT_READ)
            conn.send(op, timeout)
            while True:
                msg = conn.pop()
                if msg is not None:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CoordinatorTimeoutError(
                        f"rank {self.rank}: {what} got no answer from the coordinator (rank 0) "
                        f"within {timeout:g} s")
                if sel.select(remaining) and not conn.feed():
                    raise CoordinatorLostError(
                        f"rank {self.rank}: {what}: the coordinator (rank 0) closed the connection")
        except (OSError, ValueError) as exc:
            conn.close()
            raise CoordinatorLostError(f"rank {self.rank}: {what}: connection to the coordinator "
                                       f"failed: {exc}") from exc
        finally:
            sel.close()
        if msg.get("t") == "err":
            raise _error_class(str(msg.get("kind")))(str(msg.get("message")))
        if msg.get("t") != "ok" or msg.get("seq") != op["seq"]:
            raise CoordinatorLostError(f"rank {self.rank}: {what}: unexpected reply {msg.get('t')!r} "
                                       f"for op #{msg.get('seq')}")
        return msg.get("payload")

    # Rank 0 ------------------------------------------------------------------------------

    def _serve(self, op: dict[str, Any], timeout: float) -> Any:
        what = self._describe(op)
        arrived: dict[int, dict[str, Any]] = {0: op}
        try:
            self._gather(op, what, arrived, time.monotonic() + timeout, timeout)
            kind = op["kind"]
            result = ([arrived[r]["payload"] for r in range(self.world)] if kind == "allgather"
                      else arrived[op["root"]]["payload"] if kind == "broadcast" else None)
            reply = _frame({"t": "ok", "seq": op["seq"], "payload": result})
            if len(reply) - _HEADER.size > self._max:
                raise CheckpointError(f"{what}: result exceeds max_message_bytes={self._max}")
            for r, conn in sorted(self._peers.items()):
                try:
                    conn.sock.settimeout(timeout)
                    conn.sock.sendall(reply)
                except OSError as exc:
                    raise CoordinatorLostError(f"{what}: lost rank {r} while replying: {exc}") from exc
        except CheckpointError as exc:
            self._abort(exc)
            raise
        return result

    def _gather(self, op: dict[str, Any], what: str, arrived: dict[int, dict[str, Any]],
                deadline: float, timeout: float) -> None:
        for conn in list(self._peers.values()):  # messages buffered by an earlier round
            self._drain(conn, op, what, arrived)
        while len(arrived) < self.world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [r for r in range(self.world) if r not in arrived]
                unconnected = [r for r in missing if r not in self._peers]
                detail = f" (never connected: {unconnected})" if unconnected else ""
                raise CoordinatorTimeoutError(
                    f"{what} timed out after {timeout:g} s: ranks {missing} did not arrive{detail}",
                    expected=list(range(self.world)), found=sorted(arrived))
            if self._listener is None:
                raise CoordinatorLostError(f"{what}: coordinator was closed")
            for key, _ in self._sel.select(remaining):
                conn = key.data
                if conn is None:
                    self._accept()
                    continue
                try:
                    alive = conn.feed()
                except OSError:
                    alive = False
                if conn.rank is None:  # not yet identified: needs a hello first
                    self._hello(conn, alive)
                    if conn.rank is None:
                        continue
                if not alive:
                    raise CoordinatorLostError(f"{what}: lost the connection to rank {conn.rank}",
                                               found=conn.rank)
                self._drain(conn, op, what, arrived)

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn(sock, self._max)
        self._pending.append(conn)
        self._sel.register(sock, selectors.EVENT_READ, conn)

    def _hello(self, conn: _Conn, alive: bool) -> None:
        """Register ``conn`` once its hello arrived; reject (close) bad or duplicate hellos."""
        try:
            msg = conn.pop() if alive else {}
        except ValueError:
            msg = {}
        if msg is None:
            return
        self._pending.remove(conn)
        rank = msg.get("rank")
        if msg.get("t") != "hello" or msg.get("proto") != _PROTOCOL:
            problem = "not a ckptfmt coordinator hello"
        elif msg.get("world") != self.world:
            problem = f"world size {msg.get('world')!r} does not match the coordinator's {self.world}"
        elif not isinstance(rank, int) or not 0 < rank < self.world or rank in self._peers:
            problem = f"rank {rank!r} is out of range or already connected"
        else:
            conn.rank = rank
            self._peers[rank] = conn
            return
        try:
            conn.send({"t": "err", "kind": "mismatch", "message": f"connection rejected: {problem}"}, 1.0)
        except OSError:
            pass
        self._sel.unregister(conn.sock)
        conn.close()

    def _drain(self, conn: _Conn, op: dict[str, Any], what: str,
               arrived: dict[int, dict[str, Any]]) -> None:
        assert conn.rank is not None
        try:
            msg = conn.pop()
        except ValueError as exc:
            raise CoordinatorLostError(f"{what}: rank {conn.rank} sent a malformed message: {exc}",
                                       found=conn.rank) from exc
        if msg is None:
            return
        fields = ("t", "seq", "kind", "name", "root")
        if conn.rank in arrived or any(msg.get(k) != op[k] for k in fields):
            found = self._describe(msg) if msg.get("t") == "op" else f"message type {msg.get('t')!r}"
            raise CheckpointError(
                f"call-order mismatch: rank 0 called {what} but rank {conn.rank} called {found}",
                expected=what, found=found)
        needs_bytes = op["kind"] == "allgather" or (op["kind"] == "broadcast" and conn.rank == op["root"])
        if needs_bytes and not isinstance(msg.get("payload"), bytes):
            raise CheckpointError(f"{what}: rank {conn.rank} sent no bytes payload")
        arrived[conn.rank] = msg

    def _abort(self, exc: CheckpointError) -> None:
        """Tell every connected rank why this coordinator failed, then stop serving."""
        kind = ("timeout" if isinstance(exc, CoordinatorTimeoutError)
                else "lost" if isinstance(exc, CoordinatorLostError) else "mismatch")
        for conn in self._peers.values():
            try:
                conn.send({"t": "err", "kind": kind,
                           "message": f"reported by the coordinator (rank 0): {exc.message}"}, 1.0)
                # Half-close, not close: closing with unread input sends a reset, which can
                # discard the error message before the peer reads it.
                conn.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        if self._listener is not None:
            self._sel.unregister(self._listener)
            self._listener.close()
            self._listener = None
