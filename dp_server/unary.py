"""Unary calls answered in the turn of the event loop that reads them.

grpclib serves every call in a task of its own: a Stream, a deadline wrapper,
an events dispatcher, a buffered read and three awaited writes. For a
device plugin's unary calls that machinery costs more than the answer: about
a third of the server's CPU per Allocate. The answers need no waiting (the
core decides synchronously), so when one read from the socket holds a unary
call whole (its headers, one uncompressed message and the end of its
stream) the answer is written straight through h2, in the same turn.

Everything else is grpclib's, unchanged: a call split across reads, a
compressed message, headers grpclib would refuse, a stream reset in the same
read, and ListAndWatch. So every error a peer can provoke is still grpclib's
answer to it.

The order in which calls of one connection reach the core is kept: a call
read after something grpclib must handle first is answered with `call_soon`,
which queues it behind the task steps those events scheduled (one-socket
attribution depends on which call opens a connection).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.metadata import Deadline, decode_timeout, encode_grpc_message
from h2.connection import H2Connection
from h2.events import DataReceived, Event, RequestReceived, StreamEnded, StreamReset

from . import wire

__all__ = [
    "CONTENT_TYPE",
    "TRAILERS_OK",
    "Answer",
    "Reply",
    "WholeCall",
    "call_path",
    "call_route",
    "fits",
    "reply_frames",
    "routed",
    "whole_calls",
]

Answer = Callable[[int, bytes], bytes]
"""(connection, request message) -> reply message, or raises GRPCError."""
Reply = tuple[list[tuple[str, str]], bytes | None]
"""Response headers and the framed reply message, or trailers-only headers and None."""

CONTENT_TYPE = "application/grpc+proto"
TRAILERS_OK = [("grpc-status", "0")]
_ACCEPTED_CONTENT_TYPES = frozenset({"application/grpc", CONTENT_TYPE})
_MESSAGE_PREFIX = 5  # compressed flag, then the length as 4 bytes big-endian
# grpclib refuses a call whose deadline is over when its task starts; leave
# calls this close to theirs to grpclib, so they get its answer.
_MIN_TIMEOUT = 0.001

_log = logging.getLogger("dp.transport")


class WholeCall:
    """One unary call whose request arrived complete in a single read."""

    __slots__ = (
        "answer",
        "chunks",
        "deadline",
        "ended",
        "flow_controlled",
        "path",
        "request",
        "stream_id",
        "window",
    )

    def __init__(
        self, stream_id: int, path: str, answer: Answer, deadline: Deadline | None = None
    ) -> None:
        self.deadline = deadline  # the call's grpc-timeout, from when it was read
        self.stream_id = stream_id
        self.path = path
        self.answer = answer
        self.chunks: list[bytes] = []
        self.flow_controlled = 0  # what to acknowledge to h2, padding included
        self.ended = False
        self.request: bytes | None = None  # `message()`, once the call is whole
        self.window = 0  # WINDOW_UPDATE increments the peer gave this stream so far

    def message(self) -> bytes | None:
        """The request message, or None unless the body is one uncompressed message."""
        body = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        if len(body) < _MESSAGE_PREFIX or body[0] != 0:
            return None
        if int.from_bytes(body[1:_MESSAGE_PREFIX], "big") != len(body) - _MESSAGE_PREFIX:
            return None
        return body[_MESSAGE_PREFIX:]


def call_route(
    headers: Sequence[tuple[str, str]], answers: Mapping[str, Answer]
) -> tuple[str, Answer, Deadline | None] | None:
    """The path, answer and deadline of a request grpclib would accept and route to a
    unary answer, else None."""
    return routed(call_path(headers, answers), answers)


def routed(
    found: tuple[str, float | None] | None, answers: Mapping[str, Answer]
) -> tuple[str, Answer, Deadline | None] | None:
    """`call_route` of a request whose `call_path` was `found`; its deadline starts now."""
    if found is None:
        return None
    path, timeout = found
    return path, answers[path], None if timeout is None else Deadline.from_timeout(timeout)


def call_path(
    headers: Sequence[tuple[str, str]], answers: Mapping[str, Answer]
) -> tuple[str, float | None] | None:
    """The path and grpc-timeout of a request grpclib would accept and route to a unary
    answer, else None."""
    path = method = content_type = te = timeout = None
    for name, value in headers:
        if name == ":path":
            path = value
        elif name == ":method":
            method = value
        elif name == "content-type":
            content_type = value
        elif name == "te":
            te = value
        elif name == "grpc-timeout":
            try:
                seconds = decode_timeout(value)
            except ValueError:
                return None  # grpclib answers this itself
            timeout = seconds if timeout is None else min(timeout, seconds)
    if method != "POST" or content_type not in _ACCEPTED_CONTENT_TYPES or te != "trailers":
        return None
    if path is None or path not in answers:
        return None
    if timeout is not None and timeout < _MIN_TIMEOUT:
        return None
    return path, timeout


def whole_calls(events: Sequence[Event], answers: Mapping[str, Answer]) -> dict[int, WholeCall]:
    """The unary calls, by stream, that `events` (one read's worth) hold whole."""
    calls: dict[int, WholeCall] = {}
    for event in events:
        kind = type(event)
        if kind is RequestReceived:
            assert isinstance(event, RequestReceived) and event.stream_id is not None
            route = call_route(event.headers or (), answers)  # type: ignore[arg-type]
            if route is not None:
                calls[event.stream_id] = WholeCall(event.stream_id, *route)
        elif kind is DataReceived:
            assert isinstance(event, DataReceived)
            call = calls.get(event.stream_id or 0)
            if call is not None:
                call.chunks.append(event.data or b"")
                call.flow_controlled += event.flow_controlled_length or 0
        elif kind is StreamEnded:
            call = calls.get(getattr(event, "stream_id", 0))
            if call is not None:
                call.ended = True
        elif kind is StreamReset:
            calls.pop(getattr(event, "stream_id", 0), None)
    whole = {}
    for stream_id, call in calls.items():
        if call.ended:
            call.request = call.message()
            if call.request is not None:
                whole[stream_id] = call
    return whole


def reply_frames(call: WholeCall, connection: int) -> Reply:
    """What to send for `call`: the response headers and the framed reply message,
    or trailers-only headers and None when the answer is an error status."""
    assert call.request is not None, "only whole calls are answered"
    try:
        reply = call.answer(connection, call.request)
    except GRPCError as error:
        return _trailers_only(error.status, error.message), None
    except Exception:
        # What grpclib answers an exception in a handler with. A bug of ours:
        # say so, and serve on.
        _log.exception("call-failed", extra={"dp_fields": {"rpc": call.path}})
        return _trailers_only(Status.UNKNOWN, "Internal Server Error"), None
    return [(":status", "200"), ("content-type", CONTENT_TYPE)], wire.grpc_message(reply)


def _trailers_only(status: Status, message: str | None) -> list[tuple[str, str]]:
    headers = [(":status", "200"), ("content-type", CONTENT_TYPE)]
    headers.append(("grpc-status", str(status.value)))
    if message is not None:
        headers.append(("grpc-message", encode_grpc_message(message)))
    return headers


def fits(h2: H2Connection, stream_id: int, framed: bytes) -> bool:
    """Whether `framed` can go out now, as one DATA frame within the peer's windows."""
    return len(framed) <= min(h2.local_flow_control_window(stream_id), h2.max_outbound_frame_size)
