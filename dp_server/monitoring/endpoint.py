"""An HTTP endpoint for monitoring and probes, on the server's own event loop.

`GET /metrics` answers in Prometheus' text format, which prometheus-client
renders from a registry of the endpoint's own (dp's families beside its
process and platform collectors). `GET /healthz` and `GET /readyz` answer
what the probes' policy says (`probes`: alive, and ready). HTTP/1.1 is parsed
by h11 on the running loop: no thread and no HTTP server is added
(prometheus-client's own are not used); a client that stalls is cut off, and
a malformed request gets a 4xx naming what is wrong, without touching
anything else the server does.

What is reported is read through `ServerView`, never from the runtime itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import attrs
import h11
from prometheus_client import CollectorRegistry

from dp_server.monitoring.exposition import CONTENT_TYPE, metrics_registry, render
from dp_server.monitoring.probes import Check, runtime_families, runtime_health, runtime_readiness
from dp_server.monitoring.view import ServerView

__all__ = ["StatusEndpoint", "start_status"]

_log = logging.getLogger("dp.status")

_READ_SIZE = 8192
_MAX_HEADER_BYTES = 16 * 1024
_TEXT = "text/plain; charset=utf-8"


@attrs.frozen
class _Route:
    check: Callable[[], Check] | None = None
    metrics: CollectorRegistry | None = None


class StatusEndpoint:
    """Serves `/metrics`, `/healthz` and `/readyz` until closed.

    `/metrics` renders what the `metrics` registry collects at that moment, in
    prometheus-client's text format; the probes answer what their checks say.

    A request must arrive whole within `request_timeout` of the connection
    opening or of the previous answer, and a client must take each answer
    within that time too; otherwise the connection is dropped. At most
    `max_clients` connections are kept: a new one pushes out the oldest, so
    stalled or slow clients can never keep a probe out.
    """

    def __init__(
        self,
        *,
        metrics: CollectorRegistry,
        health: Callable[[], Check],
        readiness: Callable[[], Check],
        request_timeout: float = 10.0,
        max_clients: int = 16,
    ) -> None:
        self._routes = {
            "/metrics": _Route(metrics=metrics),
            "/healthz": _Route(check=health),
            "/readyz": _Route(check=readiness),
        }
        self.request_timeout = request_timeout
        self.max_clients = max_clients
        self._server: asyncio.Server | None = None
        # Oldest first; a connection stays here until its task has ended.
        self._clients: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self.address: tuple[str, int] | None = None

    @property
    def clients(self) -> int:
        return len(self._clients)

    async def start(self, host: str | None, port: int) -> None:
        """Listen on `host:port`; None: every address, IPv4 and IPv6. Port 0: any free one."""
        self._server = await asyncio.start_server(self._client, host, port)
        bound = self._server.sockets[0].getsockname()
        self.address = (bound[0], bound[1])
        shown = f"{host or '*'}:{bound[1]}"
        _log.info("status-listening", extra={"dp_fields": {"address": shown}})

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for task, writer in list(self._clients.items()):
            writer.transport.abort()
            task.cancel()
        await asyncio.gather(*self._clients, return_exceptions=True)
        await self._server.wait_closed()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._clients) >= self.max_clients:
            oldest, oldest_writer = next(iter(self._clients.items()))
            oldest_writer.transport.abort()
            oldest.cancel()
        self._clients[task] = writer
        finished = False
        try:
            await self._converse(reader, writer)
            finished = True
        except (OSError, TimeoutError, h11.ProtocolError):
            pass  # the peer went away, stalled or broke HTTP; nothing of ours is half-done
        except asyncio.CancelledError:
            pass  # closed or pushed out; this task is the connection's own, nobody awaits it
        finally:
            try:
                if finished:
                    writer.close()  # sends what is buffered (a last answer), then closes
                    await asyncio.wait_for(writer.wait_closed(), self.request_timeout)
            except (OSError, TimeoutError, asyncio.CancelledError):
                pass
            finally:
                writer.transport.abort()  # no-op once closed; never waits on the peer
                del self._clients[task]

    async def _converse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEADER_BYTES)
        deadline = loop.time() + self.request_timeout
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as error:
                if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    message = f"bad request: {error}\n"
                    await self._send(conn, writer, error.error_status_hint, message, close=True)
                return
            if event is h11.NEED_DATA:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise TimeoutError
                data = await asyncio.wait_for(reader.read(_READ_SIZE), remaining)
                conn.receive_data(data)
            elif isinstance(event, h11.Request):
                await self._answer(conn, writer, event)
            elif event is h11.PAUSED:
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
                deadline = loop.time() + self.request_timeout
            elif isinstance(event, h11.ConnectionClosed):
                return
            if conn.our_state is h11.MUST_CLOSE:
                return

    async def _answer(
        self, conn: h11.Connection, writer: asyncio.StreamWriter, request: h11.Request
    ) -> None:
        method = request.method.decode("ascii", "replace")
        head = method == "HEAD"
        path = request.target.decode("ascii", "replace").partition("?")[0]
        route = self._routes.get(path)
        if route is None:
            known = ", ".join(sorted(self._routes))
            text = f"no such path {path!r}; try {known}\n"
            await self._send(conn, writer, 404, text, head=head)
            return
        if method not in ("GET", "HEAD"):
            text = f"{method} is not allowed on {path}; use GET\n"
            await self._send(conn, writer, 405, text, allow=True)
            return
        try:
            if route.metrics is not None:
                status, body, content_type = 200, render(route.metrics), CONTENT_TYPE
            else:
                assert route.check is not None
                check = route.check()
                status, body = (200 if check.ok else 503), (check.detail + "\n").encode()
                content_type = _TEXT
        except Exception as error:  # noqa: BLE001 - answer it; the server goes on
            _log.exception("status-failed", extra={"dp_fields": {"path": path}})
            status, body, content_type = 500, f"{path} failed: {error!r}\n".encode(), _TEXT
        await self._send(conn, writer, status, body, content_type, head=head)

    async def _send(
        self,
        conn: h11.Connection,
        writer: asyncio.StreamWriter,
        status: int,
        body: str | bytes,
        content_type: str = _TEXT,
        *,
        head: bool = False,
        allow: bool = False,
        close: bool = False,
    ) -> None:
        payload = body.encode() if isinstance(body, str) else body
        headers = [
            ("content-type", content_type),
            ("content-length", str(len(payload))),
            ("cache-control", "no-store"),
        ]
        if allow:
            headers.append(("allow", "GET, HEAD"))
        if close:
            headers.append(("connection", "close"))
        writer.write(conn.send(h11.Response(status_code=status, headers=headers)))
        if not head:
            writer.write(conn.send(h11.Data(data=payload)))
        writer.write(conn.send(h11.EndOfMessage()))
        await asyncio.wait_for(writer.drain(), self.request_timeout)


async def start_status(view: ServerView, address: tuple[str | None, int]) -> StatusEndpoint:
    """Serve `view`'s metrics and probes on `address`, on the running loop."""
    endpoint = StatusEndpoint(
        metrics=metrics_registry(lambda: runtime_families(view)),
        health=lambda: runtime_health(view),
        readiness=lambda: runtime_readiness(view),
    )
    await endpoint.start(*address)
    return endpoint
