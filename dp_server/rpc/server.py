"""The gRPC server of every dp socket: a method it does not serve is a well-formed UNIMPLEMENTED.

grpclib answers a path its handlers do not map with a Trailers-Only response
that lacks `content-type` (`grpclib.server._abort`, 0.4.9). gRPC's
PROTOCOL-HTTP2.md requires one in every response, Trailers-Only included,
and grpc-go, the kubelet's stack, rejects the answer as malformed
("malformed header: missing HTTP content-type", code INTERNAL) instead of
reading UNIMPLEMENTED from it. The kubelet calls methods a plugin may not
serve, and decides from the code (a DRA plugin without the health stream
is asked again every 5 s, and each failure is logged), so every socket dp
serves answers them the way grpc-go's own servers do.

`GrpcServer` does it with grpclib's own answer: each connection looks paths
up in a table that maps every path the handlers lack to a handler raising
`GRPCError(UNIMPLEMENTED)`, and grpclib's `Stream` sends that as it sends
any other status, Trailers-Only with `content-type`, then resets the stream
as it does after any error.

Non-public names touched, and why:

- `grpclib.server.Server._protocol_factory`: the only place grpclib makes a
  connection's protocol, and the one hook dp has on grpclib's server; no
  other module touches it. The override calls it, sets the table on what it
  returns, and hands that to `wrap_protocol`, which a subclass overrides to
  watch the connection (`deviceplugin.connections.ConnectionServer`).

Public attributes written that grpclib does not document:

- `H2Protocol.handler.mapping`, the table grpclib's `request_handler` looks a
  call's `:path` up in with `mapping.get(path)`; grpclib makes it from the
  handlers' public `__mapping__()` and gives every connection the same one.
  Each connection is given `_Answering` instead: the same entries, and a
  `get` that answers any other path.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Collection
from typing import Any

import grpclib.server
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError
from grpclib.server import Server

__all__ = ["GrpcServer"]

_log = logging.getLogger("dp")


async def _unimplemented(
    server: GrpcServer, path: str, stream: grpclib.server.Stream[Any, Any]
) -> None:
    server.unimplemented_asked(path)
    raise GRPCError(Status.UNIMPLEMENTED, f"Method not found: dp does not serve {path} here")


class _Answering(dict[str, Handler]):
    """A server's handlers by path, and UNIMPLEMENTED for any other path."""

    def __init__(self, served: dict[str, Handler], server: GrpcServer) -> None:
        super().__init__(served)
        self._server = server

    def get(self, path: str, default: Any = None) -> Any:  # type: ignore[override]
        handler = super().get(path)
        if handler is not None:
            return handler
        return Handler(
            functools.partial(_unimplemented, self._server, path),
            Cardinality.UNARY_UNARY,
            None,
            None,
        )


class GrpcServer(Server):
    """A grpclib `Server` that answers a method it does not serve with a
    well-formed UNIMPLEMENTED (see the module's docstring); `name` says which
    socket it serves in the log line each such method gets once."""

    def __init__(self, handlers: Collection[Any], *, name: str = "", **options: Any) -> None:
        super().__init__(handlers, **options)
        self._name = name
        self._served: dict[str, Handler] = {}
        for handler in handlers:
            self._served.update(handler.__mapping__())
        self._answering = _Answering(self._served, self)
        self._asked: set[str] = set()

    def _protocol_factory(self) -> Any:
        protocol = super()._protocol_factory()
        protocol.handler.mapping = self._answering
        return self.wrap_protocol(protocol)

    def wrap_protocol(self, protocol: Any) -> Any:
        """The protocol a new connection gets, given grpclib's: grpclib's itself."""
        return protocol

    def unimplemented_asked(self, path: str) -> None:
        if path in self._asked:
            return
        self._asked.add(path)
        _log.info(
            "rpc-unimplemented",
            extra={
                "dp_fields": {
                    "path": path,
                    "socket": self._name,
                    "detail": "answered UNIMPLEMENTED; logged once per method",
                }
            },
        )
