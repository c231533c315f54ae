"""A tiny loopback TCP proxy for fault tests: adds latency and jitter, or holds all traffic.

::

    with TcpProxy(port_of_redis, latency=0.05, jitter=0.02) as proxy:
        client = redis.Redis(port=proxy.port)   # every chunk now arrives 50-70 ms late
        proxy.blackhole()                       # nothing gets through, connections stay open
        proxy.restore()
        proxy.hold_replies()                    # requests reach the server; its replies wait
        proxy.restore()

It runs an asyncio loop on one daemon thread of the calling process. Each direction of each
connection delivers its chunks in order, each no earlier than ``latency + uniform(0, jitter)``
seconds after it was read. :meth:`blackhole` holds every byte (like a partition: nothing is lost,
nothing arrives, new connections are accepted but nothing flows) until :meth:`restore`.
:meth:`hold_replies` holds only what the server sends back: a command takes effect on the server
and its reply is delayed until :meth:`restore` (a reply lost, then found, after the effect).
"""

from __future__ import annotations

import asyncio
import random
import threading
from types import TracebackType

__all__ = ["TcpProxy"]

_CHUNK = 65536


class TcpProxy:
    """Forward ``127.0.0.1:<port>`` to ``target_host:target_port``, with injected faults.

    Args:
        target_port: where to forward to.
        target_host: loopback only (default ``127.0.0.1``).
        latency: seconds added to every chunk in both directions.
        jitter: up to this many extra seconds, uniformly random per chunk (order is kept).
        seed: seed of the jitter's random generator.
    """

    def __init__(
        self,
        target_port: int,
        *,
        target_host: str = "127.0.0.1",
        latency: float = 0.0,
        jitter: float = 0.0,
        seed: int | None = None,
    ) -> None:
        if target_host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"target_host={target_host!r}: the proxy is for loopback only")
        self.target_host = target_host
        self.target_port = target_port
        self.latency = latency
        self.jitter = jitter
        self.port = 0
        self.chunks = 0
        """Chunks forwarded so far (both directions)."""
        self._random = random.Random(seed)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._open: asyncio.Event | None = None
        self._replies: asyncio.Event | None = None
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    # Control ----------------------------------------------------------------------------------

    def start(self) -> TcpProxy:
        """Start listening on a free port of 127.0.0.1 (see :attr:`port`)."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(5)
        return self

    def set_latency(self, latency: float, jitter: float = 0.0) -> None:
        """Change the delay of chunks read from now on."""
        self.latency, self.jitter = latency, jitter

    def blackhole(self) -> None:
        """Hold all traffic from now on (connections stay open, nothing is delivered)."""
        self._call(lambda: self._open_event().clear())

    def hold_replies(self) -> None:
        """Hold what the server sends from now on; requests still reach it."""
        self._call(lambda: self._replies_event().clear())

    def restore(self) -> None:
        """Deliver traffic again (both directions), held bytes first."""

        def reopen() -> None:
            self._open_event().set()
            self._replies_event().set()

        self._call(reopen)

    def close(self) -> None:
        """Close every connection and the listener, and stop the thread."""
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # Loop side --------------------------------------------------------------------------------

    def _call(self, fn: object) -> None:
        async def run() -> None:
            fn()  # type: ignore[operator]

        asyncio.run_coroutine_threadsafe(run(), self._loop).result(5)

    def _open_event(self) -> asyncio.Event:
        assert self._open is not None
        return self._open

    def _replies_event(self) -> asyncio.Event:
        assert self._replies is not None
        return self._replies

    async def _start(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._replies = asyncio.Event()
        self._replies.set()
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self._writers.add(client_w)
        try:
            upstream_r, upstream_w = await asyncio.open_connection(
                self.target_host, self.target_port
            )
        except OSError:
            client_w.close()
            self._writers.discard(client_w)
            return
        self._writers.add(upstream_w)
        try:
            await asyncio.gather(
                self._pump(client_r, upstream_w, replies=False),
                self._pump(upstream_r, client_w, replies=True),
                return_exceptions=True,
            )
        except asyncio.CancelledError:
            pass  # closing the proxy: a cancelled handler would be logged by asyncio as an error
        finally:
            for writer in (client_w, upstream_w):
                writer.close()
                self._writers.discard(writer)

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, replies: bool
    ) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                at, data = await queue.get()
                if not data:
                    break
                delay = at - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                await self._open_event().wait()
                if replies:
                    await self._replies_event().wait()
                try:
                    writer.write(data)
                    await writer.drain()
                except OSError:
                    return
                self.chunks += 1
            writer.close()

        delivering = asyncio.ensure_future(deliver())
        last = 0.0
        try:
            while True:
                try:
                    data = await reader.read(_CHUNK)
                except OSError:
                    data = b""
                delay = self.latency + (self._random.uniform(0, self.jitter) if self.jitter else 0)
                last = max(last, loop.time() + delay)
                queue.put_nowait((last, data))
                if not data:
                    break
            await delivering
        except (OSError, asyncio.CancelledError):
            delivering.cancel()
            raise
