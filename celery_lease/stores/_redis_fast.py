"""The Redis store's fast path: one dedicated connection per process for acquire, renew, release.

Pre-packed requests over a connection opened by redis-py's own class, replies parsed here; one
request in flight (:data:`BUSY` sends the caller to redis-py's pool), a connection left pending is
never reused, a forked child never writes to its parent's socket. See docs/stores.md (Redis, The
fast path).
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
"""How long a read polls the socket before it blocks in ``recv`` (seconds; default 0: off).

Saves a thread's wake-up per reply when Redis is on the same host with cores to spare, but
burns a core otherwise (measurements: docs/stores.md, The fast path); set it in the worker
process and measure. Only plain kernel sockets on a multi-CPU process poll (not TLS, gevent or
eventlet sockets).
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
    return _fd_reader(sock)


def _fd_reader(sock: socket.socket) -> Callable[[], bytes]:
    """``os.read`` of ``sock``'s fd, looked up at each call: a socket closed under us reads fd
    -1 (``EBADF``, as ``recv`` raises), never the socket the kernel gave the old number next."""
    fileno, read = sock.fileno, os.read
    return lambda: read(fileno(), _RECV)


def _fd_writer(sock: socket.socket) -> Callable[[bytes], int]:
    """``os.write`` to ``sock``'s fd, looked up at each call (see :func:`_fd_reader`)."""
    fileno, write = sock.fileno, os.write
    return lambda data: write(fileno(), data)


def _direct_io(sock: socket.socket) -> tuple[Callable[[bytes], int], Callable[[], bytes]] | None:
    """A write and a read of ``sock``'s fd that skip the ``poll()`` CPython makes before each
    send and recv of a socket with a timeout (the fd is non-blocking then: both raise
    ``BlockingIOError`` where the socket method would wait); None where the socket methods
    poll nothing (no timeout: a blocking fd), or where bytes on the fd are not the stream
    (TLS) or the socket is cooperative (gevent, eventlet).

    Relies on the fd staying non-blocking while the socket has its timeout: ``O_NONBLOCK``
    belongs to the open file description, so a ``dup()`` of this fd made blocking elsewhere
    would let a read of a reply that never comes wait for good. The connection owns its socket
    and hands its fd to no one; nothing in celery-lease or redis-py dups it."""
    if not isinstance(sock, _socket.socket) or sock.gettimeout() is None:
        return None
    ssl = sys.modules.get("ssl")
    if ssl is not None and isinstance(sock, ssl.SSLSocket):
        return None
    return _fd_writer(sock), _fd_reader(sock)


def pack_head(sha: str, numkeys: int, nargs: int) -> bytes:
    """The constant start of an ``EVALSHA <sha> <numkeys>`` request of ``numkeys`` keys and
    ``nargs`` arguments."""
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
    """A request: ``head`` and each key and argument as a bulk string (encoded as the client
    encodes text)."""
    parts = [head]
    for item in items:
        data = item.encode(encoding, errors) if isinstance(item, str) else b"%d" % item
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def fast_path_for(client: object) -> FastConnection | None:
    """A :class:`FastConnection` for a plain ``redis.Redis`` (a stock pool, not Sentinel's,
    with a stock TCP, TLS or unix connection class and no client-side cache), else None: a
    subclassed connection class may change what goes over the wire."""
    if type(client) is not redis.Redis:
        return None
    pool = client.connection_pool
    if type(pool) not in _STOCK_POOLS or pool.connection_class not in _STOCK_CLASSES:
        return None
    if getattr(pool, "cache", None) is not None:  # client-side caching: push messages
        return None
    return FastConnection(pool)


class FastConnection:
    """One connection per process, opened by redis-py's connection class, driven directly;
    ``pool``: the client's pool, whose ``connection_class`` and ``connection_kwargs`` it uses
    (not counted against its ``max_connections``)."""

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
        # See _direct_io; only for reads and writes of the socket in _direct (a test or a
        # wrapper may stand another object in for it).
        self._direct_write: Callable[[bytes], int] | None = None
        self._direct_read: Callable[[], bytes] | None = None
        self._direct: socket.socket | None = None
        # Set while deferred replies are read: they were sent earlier, so most have come and
        # a read tries the fd first (one syscall) before polling.
        self._eager = False
        # Requests sent by send_deferred() whose replies are not read yet, in order: for each,
        # the function that takes its reply (or the exception standing for it).
        self._unread: list[Callable[[Any], None]] = []
        _ALL.add(self)

    def call(self, request: bytes) -> Any:
        """Send ``request`` (one packed command); its parsed reply, or :data:`BUSY`. Raises
        redis-py's ConnectionError / TimeoutError (the connection dropped; the caller may retry
        once) or a ResponseError (the server's error reply)."""
        if not self._lock.acquire(blocking=False):
            return BUSY
        try:
            sock = self._sock
            # A new connection is needed: none yet, an exchange cut short after its write (its
            # reply, of unknown shape, may still come), or a forked child (send_deferred and
            # flush ask the same).
            fresh = sock is None or self._pending or self._pid != os.getpid()
            if sock is None or fresh:
                sock = self._reconnect()
            try:
                reply = self._exchange(sock, request)
            except RedisConnectionError:
                if fresh or self._buf:
                    raise
                # Dead before a byte of the reply came: reconnect without spending the
                # caller's retry (every script sent this way may run twice).
                reply = self._exchange(self._reconnect(), request)
        finally:
            self._lock.release()
        if isinstance(reply, BaseException):
            raise reply
        return reply

    def send_deferred(self, request: bytes, on_reply: Callable[[Any], None]) -> bool:
        """Send ``request`` without reading its reply; False (nothing sent) when the
        connection is busy or cannot be opened. The reply, read before the next request's or by
        :meth:`flush`, goes to ``on_reply`` on whichever thread reads it (keep it to logging):
        the parsed reply, the exception an error reply stands for, or a ``ConnectionError``
        when the connection failed first (the request may or may not have run)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            sock = self._sock
            if sock is None or self._pending or self._pid != os.getpid():  # as call() asks
                try:
                    sock = self._reconnect()
                except RedisError:
                    return False
            # An interrupt between here and the end of the write leaves _pending set: the
            # next call drops the connection, reporting this request as unanswered.
            self._unread.append(on_reply)
            self._pending = True
            try:
                self._send(sock, request)
            except OSError:
                self._drop()  # whether any of it went out is unknown: reported as unanswered
                return True  # it may have run: the caller must not release it a second way
            self._pending = False
            return True
        finally:
            self._lock.release()

    def flush(self, *, wait: bool = False) -> None:
        """Read the replies of deferred requests now (blocks until they came, or failed);
        ``wait``: also wait for a thread that is reading them right now to hand them over."""
        if not self._unread and not wait:
            return
        with self._lock:
            sock = self._sock
            if not self._unread or sock is None:
                return
            if self._pending or self._pid != os.getpid():  # as call() asks (sock is set)
                # An exchange was cut short: nothing on this socket can be trusted (dropping it
                # reports the deferred requests as unanswered).
                self._drop()
                return
            self._pending = True
            try:
                self._read_unread(sock)
            except RedisError:
                return  # told to on_reply; _pending stays set, so the next call reconnects
            self._pending = False

    def close(self) -> None:
        """Read the deferred replies, then close this process's connection."""
        self.flush()
        with self._lock:
            self._drop()

    def _exchange(self, sock: socket.socket, request: bytes) -> Any:
        """Write ``request`` and read its reply; ``_pending`` is set until the reply is read."""
        self._pending = True
        try:
            self._send(sock, request)
        except TimeoutError:
            raise RedisTimeoutError("Timeout writing to socket") from None
        except OSError as exc:
            raise RedisConnectionError(f"Error while writing to socket: {exc}") from exc
        if self._unread:
            self._read_unread(sock)
        reply = self._read(sock)
        self._pending = False
        return reply

    def _send(self, sock: socket.socket, request: bytes) -> None:
        """Write all of ``request``: straight to the fd when the kernel takes it (see
        :func:`_direct_io`), the rest (or all, when the fd would block) by ``sendall``, which
        waits up to the socket's timeout. Raises what ``sendall`` raises."""
        write = self._direct_write
        if write is not None and sock is self._direct:
            try:
                sent = write(request)
            except BlockingIOError:
                sent = 0
            if sent == len(request):
                return
            sock.sendall(memoryview(request)[sent:])
            return
        sock.sendall(request)

    def _read_unread(self, sock: socket.socket) -> None:
        """Read the replies of deferred requests, in order, handing each to its function."""
        unread = self._unread
        self._eager = True
        try:
            while unread:
                try:
                    reply = self._read(sock)
                except RedisError as exc:
                    self._fail_unread(exc)
                    raise
                on_reply = unread.pop(0)
                try:  # _hand, inline
                    on_reply(reply)
                except Exception:
                    logger.exception(_HAND_FAILED)
        finally:
            self._eager = False

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
        direct = _direct_io(sock)
        self._direct_write, self._direct_read = direct if direct is not None else (None, None)
        self._direct = sock
        self._pending = False
        self._buf.clear()
        return sock

    def _drop(self) -> None:
        if self._unread:
            self._fail_unread(RedisConnectionError("the connection was dropped"))
        conn, self._conn, self._sock = self._conn, None, None
        self._poll_read, self._polled = None, None
        self._direct_write, self._direct_read, self._direct = None, None, None
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
        read = self._direct_read
        if self._eager and read is not None and sock is self._direct:
            # One read of bytes already there (no wait).
            try:
                chunk = read()
            except BlockingIOError:
                chunk = None
            except OSError as exc:
                raise RedisConnectionError(f"Error while reading from socket: {exc}") from exc
            if chunk is not None:
                if not chunk:
                    raise RedisConnectionError("Connection closed by server.")
                self._buf += chunk
                return
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
        end = buf.find(_CRLF)
        while end < 0:  # _line_end, inline
            self._fill(sock)
            end = buf.find(_CRLF)
        kind = buf[0]
        while kind == 0x3E:  # '>'
            # A RESP3 push frame (maintenance notifications) is no reply: skip it.
            self._skip(sock)
            end = self._line_end(sock)
            kind = buf[0]
        if kind == 0x24:  # '$' bulk string: None for a nil (size -1)
            try:
                size = int(buf[1:end])
            except ValueError:
                raise InvalidResponse(
                    f"Protocol error, bad bulk length {bytes(buf[:end])!r}"
                ) from None
            if size < 0:
                del buf[: end + 2]
                return None
            stop = end + 2 + size
            while len(buf) < stop + 2:
                self._fill(sock)
            data = bytes(buf[end + 2 : stop])
            del buf[: stop + 2]
            return data
        line = bytes(buf[1:end])
        del buf[: end + 2]
        if kind == 0x3A:  # ':' integer
            return int(line)
        return _one_line_reply(kind, line)

    def _line_end(self, sock: socket.socket) -> int:
        """Where the first line of the buffer ends (its CRLF), reading until it is there."""
        buf = self._buf
        end = buf.find(_CRLF)
        while end < 0:
            self._fill(sock)
            end = buf.find(_CRLF)
        return end

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
    """Give a deferred reply to its function; what that raises is logged, never passed on."""
    try:
        on_reply(reply)
    except Exception:
        logger.exception(_HAND_FAILED)


_HAND_FAILED: Final = "celery-lease: handling a deferred Redis reply failed"


_ALL: weakref.WeakSet[FastConnection] = weakref.WeakSet()


def _reset_after_fork() -> None:
    """In a forked child: fresh locks; the parent's socket is dropped at the next call (pid)."""
    for fast in list(_ALL):
        fast._lock = threading.Lock()
        fast._unread = []  # the parent's deferred requests: the parent reads their replies
        fast._eager = False  # a thread of the parent may have been reading them


forking.on_fork_child(_reset_after_fork, name="redis fast connections: locks, unread replies")
