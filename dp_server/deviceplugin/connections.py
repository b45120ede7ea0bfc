"""Which plugin connection a call arrived on: the one hook on grpclib's server.

The kubelet opens one HTTP/2 connection per resource and names the resource
nowhere on it, so one-socket attribution (docs/design.md §4) needs to know when a
connection opens and closes, and which connection each call is on. grpclib's
public API tells a handler neither, so `ConnectionServer` wraps the protocol
grpclib makes for each accepted connection:

- opening and closing go to a `ConnectionEvents`, which returns the
  connection's id on opening;
- while grpclib reads a connection's bytes, `current_connection()` gives that
  id. grpclib starts a call's handler task as it reads the call's headers, and
  a task copies the context it is created in, so the handler reads the same
  id however much later it runs.

`ConnectionServer` is a `dp_server.rpc.GrpcServer`, so that a method no
handler serves is a well-formed UNIMPLEMENTED here as on every dp socket.

Non-public names touched:

- none of its own: grpclib's protocol for each connection comes through
  `GrpcServer.wrap_protocol`, which `dp_server.rpc.server`, the one module
  with a hook on grpclib's server, calls for every connection it makes.

Public attributes read that grpclib does not document:

- `H2Protocol.processor.processors`, grpclib's table of h2 event handlers. An
  h2 event without an entry raises `NotImplementedError` out of
  `data_received`, which ends the connection; h2 reports an extension frame,
  which RFC 9113 §5.5 says a receiver must ignore, as such an event
  (`UnknownFrameReceived`). Each connection gets a no-op entry for every h2
  event type the table lacks.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import h2.events

from dp_server.rpc import GrpcServer

__all__ = ["ConnectionEvents", "ConnectionServer", "NoConnection", "current_connection"]

_CONNECTION: contextvars.ContextVar[int] = contextvars.ContextVar("dp_plugin_connection")


class NoConnection(LookupError):
    """Asked outside the handling of a call on a `ConnectionServer`."""


def current_connection() -> int:
    """The id of the connection the running call arrived on."""
    try:
        return _CONNECTION.get()
    except LookupError:
        raise NoConnection("not within a call on a plugin socket") from None


class ConnectionEvents(Protocol):
    def opened(self, listener: str | None) -> int:
        """A connection was accepted on `listener`'s socket; return its id."""

    def closed(self, connection: int) -> None:
        """Connection `connection` is gone."""


class ConnectionServer(GrpcServer):
    """A grpclib `Server` that reports its connections to `events`.

    `listener` names the socket's resource in per-resource mode (None for
    the shared socket); it is passed on with every opening.
    """

    def __init__(
        self,
        handlers: Sequence[Any],
        events: ConnectionEvents,
        listener: str | None,
        **options: Any,
    ) -> None:
        super().__init__(handlers, name=listener or "device-plugin", **options)
        self._events = events
        self._listener = listener
        self._open = 0

    @property
    def connected(self) -> bool:
        """Whether a connection accepted by this server is still open."""
        return self._open > 0

    def wrap_protocol(self, protocol: Any) -> asyncio.Protocol:
        return _Reporting(protocol, self)

    def _made(self) -> int:
        self._open += 1
        return self._events.opened(self._listener)

    def _lost(self, connection: int) -> None:
        self._open -= 1
        self._events.closed(connection)


def _event_types() -> Iterator[type[h2.events.Event]]:
    pending: list[type[h2.events.Event]] = [h2.events.Event]
    while pending:
        kind = pending.pop()
        pending.extend(kind.__subclasses__())
        if kind is not h2.events.Event:
            yield kind


def _ignore(event: h2.events.Event) -> None:
    pass


class _Reporting(asyncio.Protocol):
    """grpclib's protocol for one connection, with its opening, reads and
    closing reported (see the module's docstring)."""

    def __init__(self, inner: Any, server: ConnectionServer) -> None:
        self._inner = inner
        self._server = server
        self._connection: int | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)
        processors = self._inner.processor.processors
        for kind in _event_types():
            processors.setdefault(kind, _ignore)
        self._connection = self._server._made()

    def data_received(self, data: bytes) -> None:
        if self._connection is None:
            self._inner.data_received(data)
            return
        token = _CONNECTION.set(self._connection)
        try:
            self._inner.data_received(data)
        finally:
            _CONNECTION.reset(token)

    def eof_received(self) -> bool | None:
        result: bool | None = self._inner.eof_received()
        return result

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._inner.connection_lost(exc)
        connection, self._connection = self._connection, None
        if connection is not None:
            self._server._lost(connection)
