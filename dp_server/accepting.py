"""Connections started within the listening socket's callback.

asyncio accepts a connection in the listening socket's callback, then starts
a task that makes its transport, and the transport schedules the protocol's
`connection_made`: two more turns of the loop, each behind whatever else
became ready meanwhile. A plugin connection's `connection_made` sends the
server's HTTP/2 SETTINGS, and the kubelet's gRPC client (grpc-go, and grpcio
in the emulator) sends no call, not even the GetDevicePluginOptions inside
Register, until it has them. After a kubelet restart each registration waits
for the last one's connection, so those turns, and the previous resource's
ListAndWatch they carry, add to every one of them.

Here the connection is accepted, its transport made and its protocol started
in one callback. The transport is asyncio's own, made with the selector
loop's `_make_socket_transport` as asyncio's accept makes it; a loop without
it (uvloop, say) keeps asyncio's way.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable
from typing import Any

__all__ = ["RETRY_AFTER_EXHAUSTION", "accept_at_once"]

_log = logging.getLogger("dp.transport")

# Out of descriptors or memory the listening socket stays readable: stop
# looking at it for this long, as asyncio does, rather than spin.
RETRY_AFTER_EXHAUSTION = 1.0
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class _Starting(asyncio.Protocol):
    """Stands in while asyncio makes the transport; the connection's own
    protocol has been started by then, so what asyncio schedules for this one
    (its `connection_made`) is left to do nothing."""


def accept_at_once(
    server: asyncio.AbstractServer,
    listening: socket.socket,
    protocol_factory: Callable[[], asyncio.BaseProtocol],
) -> bool:
    """Make `server` (serving on `listening`) start each connection in the
    callback that accepts it. False when the loop cannot, and keeps its own way."""
    loop = asyncio.get_running_loop()
    if not callable(getattr(loop, "_make_socket_transport", None)):
        return False
    fd = listening.fileno()
    where = str(listening.getsockname())  # for the warnings

    def readable() -> None:
        # One connection per callback: the socket is level-triggered, so one
        # still waiting makes it readable again, and a try that would find
        # none (one more system call per connection) is never made.
        try:
            connection, address = listening.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as error:
            _log.warning(
                "accept-failed",
                extra={"dp_fields": {"socket": where, "error": str(error)}},
            )
            if error.errno in _EXHAUSTED:
                loop.remove_reader(fd)
                loop.call_later(RETRY_AFTER_EXHAUSTION, resume)
            return
        start(connection, address)

    def start(connection: socket.socket, address: Any) -> None:
        transport = None
        try:
            connection.setblocking(False)
            protocol = protocol_factory()
            transport = loop._make_socket_transport(  # type: ignore[attr-defined]
                connection, _Starting(), extra={"peername": address}, server=server
            )
            transport.set_protocol(protocol)
            protocol.connection_made(transport)
        except Exception as error:  # one connection must not stop the others
            _log.warning(
                "connection-start-failed",
                extra={"dp_fields": {"socket": where, "error": repr(error)}},
            )
            if transport is not None:
                # Whatever the protocol got to, it hears nothing more.
                transport.set_protocol(_Starting())
                transport.abort()
            else:
                connection.close()

    def resume() -> None:
        if server.is_serving() and listening.fileno() == fd:
            loop.add_reader(fd, readable)

    loop.remove_reader(fd)
    loop.add_reader(fd, readable)
    return True
