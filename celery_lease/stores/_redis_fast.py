"""The Redis store's fast path: one dedicated connection per process for acquire, renew, release.

redis-py spends 60-90 us of Python on every command (pool checkout and return, argument
encoding, retry wrapper, response callbacks) against about 25 us for the round trip itself on
loopback. The three calls on a task's hot path therefore go, on a standalone server, over a
connection of their own: the request bytes are packed here (the ``EVALSHA <sha> <numkeys>``
head once per script), written with one ``sendall`` and the reply read with a small RESP2/RESP3
parser that knows the only reply shapes the scripts return (bulk string, nil, integer, error)
and skips RESP3 push frames (maintenance notifications), as redis-py's parsers do.

Everything else stays on redis-py: the connection is *opened* by redis-py's own connection
class with the pool's settings (so AUTH/ACL, ``SELECT db``, TLS, unix sockets, client name and
socket timeouts are exactly the client's), and Sentinel, Cluster, ``min_replicas`` (WAIT),
client-side caching and custom connection classes never take this path (see
:func:`fast_path_for`); RESP2 and RESP3 clients both do.

Safety of the wire:

- **One request in flight, its reply read before anyone else sends.** A lock guards the
  connection; a thread that finds it busy does not queue behind it but returns :data:`BUSY`
  and the caller uses redis-py's pool instead (so threads never serialise on this socket).
- **A connection that may hold an unread reply is never reused.** ``_pending`` is set before
  the write and cleared only after the whole reply was parsed; any error, timeout or
  asynchronous exception (``SoftTimeLimitExceeded`` raised into the body, Ctrl-C) between the
  two leaves it set, and the next call closes that socket and opens a new one. A reply that
  arrives late can therefore never be taken for the answer to a later request.
- **A connection found dead before it answered costs no retry.** A reused connection the
  server closed while it sat idle (``timeout``, ``CLIENT KILL``, a restart) fails with no byte
  of a reply read; the request is then sent once more on a new connection, as redis-py's pool
  reconnects such a connection at checkout, so the caller's one retry stays for a reply lost
  later (every script sent this way may run twice).
- **Errors are redis-py's own classes**: a socket timeout is ``redis.exceptions.TimeoutError``,
  a dropped or refused connection ``ConnectionError``, an error reply the class redis-py's
  parser picks (``NoScriptError`` for NOSCRIPT, ``ReadOnlyError``, ``ResponseError``...), so the
  store's retry-once and error reporting treat both paths alike.
- **fork()**: the connection remembers the pid that opened it; a child never writes to its
  parent's socket (it drops the object without shutting the socket down and opens its own).
- The release reply is read before ``release()`` returns: the key is free on the server before
  the caller goes on to publish a task's result.

The threads, locks and fork resets this module takes part in: ``docs/internals.md``.
"""

from __future__ import annotations

import _socket
import contextlib
import logging
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, Final

import redis
import redis.connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import InvalidResponse, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from celery_lease import _forking as forking
from celery_lease.stores._redis_compat import connection_socket, parse_error

__all__ = ["BUSY", "FastConnection", "fast_path_for", "pack_eval_head", "pack_head", "pack_request"]

logger = logging.getLogger("celery_lease.stores._redis_fast")

BUSY: Final = object()
"""Returned by :meth:`FastConnection.call` when another thread is using the connection."""

_STOCK_CLASSES = (
    redis.connection.Connection,
    redis.connection.SSLConnection,
    redis.connection.UnixDomainSocketConnection,
)
_STOCK_POOLS = (redis.ConnectionPool, redis.BlockingConnectionPool)
_CRLF: Final = b"\r\n"
_RECV: Final = 65536

SPIN_SECONDS = 0.0
"""How long a read polls the socket before it blocks in ``recv`` (seconds; 0, the default: off).

A blocked thread costs a wake-up when the reply lands: 40-50 us on the 2-core VM the benchmarks
run on, as much as a loopback round trip. With a poll of 200 us (non-blocking reads, the GIL
released in each) an uncontended acquire + release cycle on loopback took 115 us instead of
244 us there; but in a worker on a busy 2-core host the poll took the core the lock server
needed (``bench_task_throughput --spin-us 0`` against ``200``: 280 against 350 us added per
task), and against a server on another host (round trips of 100 us and more) it mostly burns
CPU. So it is off; set it in the worker process (e.g. in ``worker_process_init``) where Redis
is on the same host with cores to spare, and measure. Only plain kernel sockets poll (not TLS,
nor gevent's or eventlet's cooperative sockets, which must yield to their hub), only with a
socket timeout or a blocking socket, and only where the process may run on more than one CPU.
"""


def _can_spin() -> bool:
    try:
        return len(os.sched_getaffinity(0)) > 1
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return (os.cpu_count() or 1) > 1


_MULTI_CPU = _can_spin()


def _poller(sock: socket.socket) -> Callable[[], bytes] | None:
    """A non-blocking read of ``sock``'s replies (raises ``BlockingIOError`` when none came),
    or None when reads must block: one CPU, TLS, or a cooperative (gevent, eventlet) socket."""
    if not _MULTI_CPU or not isinstance(sock, _socket.socket):  # gevent, eventlet: no
        return None
    ssl = sys.modules.get("ssl")
    if ssl is not None and isinstance(sock, ssl.SSLSocket):  # bytes on the fd are not replies
        return None
    timeout = sock.gettimeout()
    if timeout is None:  # a blocking fd: one recv that does not wait
        return partial(sock.recv, _RECV, socket.MSG_DONTWAIT)
    # With a timeout CPython polls before each recv, waiting; the fd itself is non-blocking.
    return partial(os.read, sock.fileno(), _RECV)


def pack_head(sha: str, numkeys: int, nargs: int) -> bytes:
    """``*<n>\\r\\n$7\\r\\nEVALSHA\\r\\n$40\\r\\n<sha>\\r\\n$<..>\\r\\n<numkeys>\\r\\n``: the
    constant start of an EVALSHA request with ``numkeys`` keys and ``nargs`` arguments."""
    count = str(numkeys).encode()
    return b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%s\r\n$%d\r\n%s\r\n" % (
        3 + numkeys + nargs,
        sha.encode(),
        len(count),
        count,
    )


def pack_eval_head(source: str, numkeys: int, nargs: int) -> bytes:
    """The start of an ``EVAL <source> <numkeys>`` request (the NOSCRIPT fallback)."""
    body = source.encode()
    count = str(numkeys).encode()
    return b"*%d\r\n$4\r\nEVAL\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (
        3 + numkeys + nargs,
        len(body),
        body,
        len(count),
        count,
    )


def pack_request(head: bytes, items: Iterable[str | int], encoding: str, errors: str) -> bytes:
    """A request: its packed ``head`` (see :func:`pack_head`) and each key and argument as a
    bulk string (text encoded as the client encodes it)."""
    parts = [head]
    for item in items:
        data = item.encode(encoding, errors) if isinstance(item, str) else b"%d" % item
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def fast_path_for(client: object) -> FastConnection | None:
    """A :class:`FastConnection` for ``client`` when it is a plain standalone client, else None.

    Only for a ``redis.Redis`` whose pool is a stock ``ConnectionPool`` or
    ``BlockingConnectionPool`` (not Sentinel's) with a stock connection class (TCP, TLS or unix
    socket) and no client-side cache. RESP2 and RESP3 (redis-py 8's default) both work: the
    scripts' replies differ only in how nil and booleans are written. A subclassed connection
    class may change what goes over the wire, so it keeps redis-py's path for every call.
    """
    if type(client) is not redis.Redis:
        return None
    pool = client.connection_pool
    if type(pool) not in _STOCK_POOLS or pool.connection_class not in _STOCK_CLASSES:
        return None
    if getattr(pool, "cache", None) is not None:  # client-side caching: push messages
        return None
    return FastConnection(pool)


class FastConnection:
    """One connection per process, opened by redis-py's connection class, driven directly.

    Args:
        pool: the client's pool; only its ``connection_class`` and ``connection_kwargs`` are
            used (the connection is not taken from the pool and does not count against its
            ``max_connections``).
    """

    def __init__(self, pool: redis.ConnectionPool) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._conn: Any = None
        self._sock: socket.socket | None = None
        self._pid = 0
        self._pending = False
        self._buf = bytearray()
        self._poll_read: Callable[[], bytes] | None = None  # see _poller
        self._polled: socket.socket | None = None
        # Requests sent by send_deferred() whose replies are not read yet, in order: for each,
        # the function that takes its reply (or the exception standing for it).
        self._unread: list[Callable[[Any], None]] = []
        _ALL.add(self)

    def call(self, request: bytes) -> Any:
        """Send ``request`` (one packed command) and return its parsed reply, or :data:`BUSY`.

        Raises:
            redis.exceptions.ConnectionError / TimeoutError: the connection failed or the
                socket timed out (the connection is dropped; the caller may retry once).
            redis.exceptions.ResponseError: (or a subclass) the server answered with an error.
        """
        if not self._lock.acquire(blocking=False):
            return BUSY
        try:
            sock = self._sock
            fresh = self._stale(sock)
            if sock is None or fresh:
                sock = self._reconnect()
            try:
                reply = self._exchange(sock, request)
            except RedisConnectionError:
                if fresh or self._buf:
                    raise
                # The reused connection was dead before a byte of the reply came (closed by
                # the server as idle, CLIENT KILL, a restart). redis-py's pool finds that out
                # at checkout and reconnects without a retry; so does this, or the caller's
                # one retry would be spent on it. Sending again is safe: every script the
                # store runs this way may run twice.
                reply = self._exchange(self._reconnect(), request)
        finally:
            self._lock.release()
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def send_deferred(self, request: bytes, on_reply: Callable[[Any], None]) -> bool:
        """Send ``request`` and return without reading its reply; False when not sent.

        The reply is read before the reply of the next request on this connection (the server
        answers in order), or by :meth:`flush`, and handed to ``on_reply``: the parsed reply,
        the exception an error reply stands for, or a ``ConnectionError`` when the connection
        failed before it could be read (the request may or may not have run). ``on_reply`` runs
        on whichever thread reads it: keep it to logging. False (nothing sent) when another
        thread is using the connection or it cannot be written to; the caller then sends the
        request the usual way.
        """
        if not self._lock.acquire(blocking=False):
            return False
        try:
            sock = self._sock
            if sock is None or self._stale(sock):
                try:
                    sock = self._reconnect()
                except RedisError:
                    return False
            # Recorded before the write, and _pending cleared only after it: an interrupt
            # anywhere in between leaves _pending set, so the next call drops the connection
            # (reporting this request as unanswered) instead of reading its reply as its own.
            self._unread.append(on_reply)
            self._pending = True
            try:
                sock.sendall(request)
            except OSError:
                self._drop()  # whether any of it went out is unknown: reported as unanswered
                return True  # it may have run: the caller must not release it a second way
            self._pending = False
            return True
        finally:
            self._lock.release()

    def flush(self) -> None:
        """Read the replies of deferred requests now (blocks until they came, or failed)."""
        if not self._unread:
            return
        with self._lock:
            sock = self._sock
            if not self._unread or sock is None:
                return
            if self._stale(sock):
                # An exchange was cut short after its write (its reply, of unknown shape, may
                # come before or among these): nothing on this socket can be trusted. Dropping
                # it reports the deferred requests as unanswered.
                self._drop()
                return
            self._pending = True
            try:
                self._read_unread(sock)
            except RedisError:
                return  # told to on_reply; _pending stays set, so the next call reconnects
            self._pending = False

    def close(self) -> None:
        """Close the connection (only this process's own; a parent's socket is left alone),
        after reading the replies of deferred requests still unread."""
        self.flush()
        with self._lock:
            self._drop()

    # Internals ---------------------------------------------------------------------------------

    def _stale(self, sock: socket.socket | None) -> bool:
        """Whether the next request needs a new connection: none yet, an exchange cut short
        after its write (its reply, of unknown shape, may still come), or a forked child."""
        return sock is None or self._pending or self._pid != os.getpid()

    def _exchange(self, sock: socket.socket, request: bytes) -> Any:
        """Write ``request`` and read its reply; ``_pending`` is set until the reply is read."""
        self._pending = True
        try:
            sock.sendall(request)
        except TimeoutError:
            raise RedisTimeoutError("Timeout writing to socket") from None
        except OSError as exc:
            raise RedisConnectionError(f"Error while writing to socket: {exc}") from exc
        if self._unread:
            self._read_unread(sock)
        reply = self._read(sock)
        self._pending = False
        return reply

    def _read_unread(self, sock: socket.socket) -> None:
        """Read the replies of deferred requests, in order, handing each to its function."""
        unread = self._unread
        while unread:
            try:
                reply = self._read(sock)
            except RedisError as exc:
                self._fail_unread(exc)
                raise
            _hand(unread.pop(0), reply)

    def _fail_unread(self, exc: BaseException) -> None:
        unread, self._unread = self._unread, []
        for on_reply in unread:
            _hand(on_reply, RedisConnectionError(f"the connection failed before the reply: {exc}"))

    def _reconnect(self) -> socket.socket:
        self._drop()
        conn = self._pool.connection_class(**self._pool.connection_kwargs)
        conn.connect()  # AUTH, HELLO/SELECT, CLIENT SETNAME/SETINFO: redis-py's handshake
        sock = connection_socket(conn)
        if sock is None:  # pragma: no cover - connect() either sets it or raises
            raise RedisConnectionError("the connection has no socket after connect()")
        self._conn, self._sock, self._pid = conn, sock, os.getpid()
        self._poll_read = _poller(sock)
        self._polled = sock  # the poll reads this socket's fd: only for reads of this socket
        self._pending = False
        self._buf.clear()
        return sock

    def _drop(self) -> None:
        if self._unread:
            self._fail_unread(RedisConnectionError("the connection was dropped"))
        conn, self._conn, self._sock = self._conn, None, None
        self._poll_read, self._polled = None, None
        self._buf.clear()
        self._pending = False
        if conn is None:
            return
        if self._pid == os.getpid():
            # Closing a broken socket may fail; it is dropped either way.
            with contextlib.suppress(Exception):
                conn.disconnect()
        # In a forked child the parent's socket object is just dropped: no shutdown() on it.

    def _fill(self, sock: socket.socket) -> None:
        poll = self._poll_read
        if poll is not None and sock is self._polled and SPIN_SECONDS > 0 and self._poll(poll):
            return
        try:
            chunk = sock.recv(_RECV)
        except TimeoutError:
            raise RedisTimeoutError("Timeout reading from socket") from None
        except OSError as exc:
            raise RedisConnectionError(f"Error while reading from socket: {exc}") from exc
        if not chunk:
            raise RedisConnectionError("Connection closed by server.")
        self._buf += chunk

    def _poll(self, read: Callable[[], bytes]) -> bool:
        """Poll the socket for up to :data:`SPIN_SECONDS`; True when bytes were appended."""
        deadline = time.perf_counter() + SPIN_SECONDS
        while True:
            try:
                chunk = read()
            except BlockingIOError:
                if time.perf_counter() >= deadline:
                    return False
                continue
            except OSError as exc:
                raise RedisConnectionError(f"Error while reading from socket: {exc}") from exc
            if not chunk:
                raise RedisConnectionError("Connection closed by server.")
            self._buf += chunk
            return True

    def _read(self, sock: socket.socket) -> Any:
        """One reply: bytes, None, an int, or the exception an error reply stands for."""
        buf = self._buf
        end = self._line_end(sock)
        while buf[0] == 0x3E:  # '>'
            # A RESP3 push frame (a server in maintenance pushes MIGRATING / MOVING to clients
            # that asked for it, which redis-py's handshake does) comes before or between
            # replies and is no reply: skip it, as redis-py's parsers do.
            self._skip(sock)
            end = self._line_end(sock)
        kind = buf[0]
        if kind == 0x24:  # '$' bulk string
            return self._bulk(sock, end)
        line = bytes(buf[1:end])
        del buf[: end + 2]
        return _one_line_reply(kind, line)

    def _line_end(self, sock: socket.socket) -> int:
        """Where the first line of the buffer ends (its CRLF), reading until it is there."""
        buf = self._buf
        end = buf.find(_CRLF)
        while end < 0:
            self._fill(sock)
            end = buf.find(_CRLF)
        return end

    def _bulk(self, sock: socket.socket, end: int) -> bytes | None:
        """A bulk string whose ``$<size>`` line ends at ``end``; None for a nil (size -1)."""
        buf = self._buf
        try:
            size = int(buf[1:end])
        except ValueError:
            raise InvalidResponse(f"Protocol error, bad bulk length {bytes(buf[:end])!r}") from None
        if size < 0:
            del buf[: end + 2]
            return None
        stop = end + 2 + size
        while len(buf) < stop + 2:
            self._fill(sock)
        data = bytes(buf[end + 2 : stop])
        del buf[: stop + 2]
        return data

    def _skip(self, sock: socket.socket) -> None:
        """Read one RESP2/RESP3 element of any type (a push frame and its parts) and drop it."""
        buf = self._buf
        end = self._line_end(sock)
        kind = buf[0]
        head = bytes(buf[1:end])
        del buf[: end + 2]
        if kind not in b"$=!*>~%|":  # a one-line element: '+', '-', ':', '_', '#', ',', '('
            return
        try:
            size = int(head)
        except ValueError:
            raise InvalidResponse(f"Protocol error, bad length {head!r} in a push") from None
        if kind in b"$=!":  # blob string, verbatim string, blob error
            if size >= 0:
                while len(buf) < size + 2:
                    self._fill(sock)
                del buf[: size + 2]
            return
        for _ in range(size * 2 if kind in b"%|" else size):  # maps and attributes: pairs
            self._skip(sock)


def _one_line_reply(kind: int, line: bytes) -> Any:
    """The reply of a one-line RESP element of type byte ``kind`` and text ``line``."""
    if kind == 0x3A:  # ':' integer
        return int(line)
    if kind == 0x5F:  # '_' RESP3 null (a script's false or nil)
        return None
    if kind == 0x23:  # '#' RESP3 boolean
        return 1 if line == b"t" else 0
    if kind == 0x2D:  # '-' error
        # redis-py's own mapping: NOSCRIPT -> NoScriptError, READONLY -> ReadOnlyError...
        return parse_error(line.decode(errors="replace"))
    if kind == 0x2B:  # '+' simple string
        return line
    # Nothing the scripts return looks like this: the stream cannot be trusted any more.
    raise InvalidResponse(f"Protocol error, got {chr(kind)!r} as reply type byte")


def _hand(on_reply: Callable[[Any], None], reply: Any) -> None:
    """Give a deferred request's reply to its function; what that raises is logged, never
    passed on into the exchange that read the reply."""
    try:
        on_reply(reply)
    except Exception:
        logger.exception("celery-lease: handling a deferred Redis reply failed")


_ALL: weakref.WeakSet[FastConnection] = weakref.WeakSet()


def _reset_after_fork() -> None:
    """In a forked child: a fresh lock for every fast connection (a child forked while another
    thread held one would find it held forever); the parent's socket is dropped at the next
    call, since its pid differs."""
    for fast in list(_ALL):
        fast._lock = threading.Lock()
        fast._unread = []  # the parent's deferred requests: the parent reads their replies


forking.on_fork_child(_reset_after_fork, name="redis fast connections: locks, unread replies")
