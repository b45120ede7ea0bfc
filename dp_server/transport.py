"""The grpclib pieces that know about connections: who is connected, and how
their bytes go out.

grpclib writes each HTTP/2 step (response headers, message, trailers) to the
socket as it happens, three sends and three wake-ups of the kubelet per unary
call. Here the writes of one turn of the event loop go out as one send, on the
plugin sockets and on the Register channel to the kubelet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

import grpclib.client
import grpclib.protocol
import h2.exceptions
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.encoding.base import GRPC_CONTENT_TYPE
from grpclib.exceptions import StreamTerminatedError
from grpclib.metadata import Deadline
from grpclib.protocol import H2Protocol
from grpclib.server import Handler, Server
from grpclib.utils import DeadlineWrapper, Wrapper
from h2.connection import H2Connection
from h2.events import RequestReceived
from h2.utilities import SizeLimitDict

from . import raw_calls, unary, wire
from .accepting import accept_at_once

CLOSED_STREAMS_KEPT = 256  # per connection

_log = logging.getLogger("dp.transport")

__all__ = [
    "CoalescingTransport",
    "ConnectionTracker",
    "KubeletChannel",
    "SentUnary",
    "TrackedServer",
]


class ConnectionTracker:
    """Who to tell about connections: `made(transport, listener)` returns the
    connection's id, `lost(id)` is called when it has closed."""

    def __init__(
        self,
        made: Callable[[asyncio.BaseTransport, str | None], int],
        lost: Callable[[int], None],
    ) -> None:
        self.made = made
        self.lost = lost


class CoalescingTransport:
    """A write transport whose writes are sent together once the current callback ends.

    Everything else (close, flow control, extra info) is the wrapped
    transport's; close and abort send what is pending first, so nothing
    written is lost.
    """

    def __init__(self, transport: asyncio.WriteTransport) -> None:
        self._transport = transport
        self._pending: list[bytes] = []
        self._loop = asyncio.get_running_loop()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(bytes(data))

    def flush(self) -> None:
        if not self._pending:
            return
        data = b"".join(self._pending)
        self._pending.clear()
        if not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _Handler(Handler):
    """grpclib's server Handler, forgetting each call as soon as it ends.

    grpclib keeps every finished or cancelled call's task, stream and buffers
    until a later call on the same connection sweeps them (every tenth): with
    64 connections that is hundreds of dead calls, megabytes of RSS; the last
    calls of each connection stay until its next call, and those of a closed
    connection (a kubelet restart closes 64) forever. Here a call is dropped
    when it ends; the tables hold what is in progress and ListAndWatch.
    """

    def accept(
        self,
        stream: grpclib.protocol.Stream,
        headers: list[tuple[str, str]],
        release_stream: Callable[[], Any],
    ) -> None:
        super().accept(stream, headers, release_stream)
        self._tasks[stream].add_done_callback(lambda _: self._tasks.pop(stream, None))

    def cancel(self, stream: grpclib.protocol.Stream) -> None:
        # The peer may reset a stream whose call has already finished.
        if stream in self._tasks:
            super().cancel(stream)
            self._forget_cancelled()

    def close(self) -> None:
        super().close()
        self._forget_cancelled()

    def _forget_cancelled(self) -> None:
        for task in self._cancelled:
            task.add_done_callback(lambda done: self._cancelled.discard(done))


# Where every connection's reads land. asyncio reads a plain Protocol's data with
# recv(256 KiB): a fresh 256 KiB object per read, which the allocator maps and
# unmaps each time, some 14 us for a 100-byte request. A buffered protocol is
# handed a buffer to recv_into instead, and what is read is passed on at once,
# so one buffer serves every connection of a loop. One per thread: a loop runs
# in one thread, and recv_into releases the GIL.
_READ_BUFFER_SIZE = 64 * 1024
_reads = threading.local()


def _read_buffer() -> memoryview:
    try:
        buffer: memoryview = _reads.buffer
    except AttributeError:
        buffer = _reads.buffer = memoryview(bytearray(_READ_BUFFER_SIZE))
    return buffer


class _PendingValues(list[int]):
    """A setting's values, the current one first, then those awaiting acknowledgement.

    h2 keeps them in a deque, whose smallest block takes 0.6 KB: 10 KB for
    the two Settings of every connection, 0.7 MB for a node's 64 kubelet
    connections. There are never more than two or three values; a list does
    the same in a tenth of the room.
    """

    __slots__ = ()

    def popleft(self) -> int:
        return self.pop(0)


def _compact_settings(connection: H2Connection) -> None:
    for settings in (connection.local_settings, connection.remote_settings):
        compact: dict[Any, Any] = {
            code: _PendingValues(values) for code, values in settings._settings.items()
        }
        settings._settings = compact


class _CoalescingProtocol(H2Protocol, asyncio.BufferedProtocol):
    """H2Protocol writing through a CoalescingTransport, remembering few closed streams,
    reading into a shared buffer."""

    def get_buffer(self, sizehint: int) -> memoryview:
        self._read_into = _read_buffer()
        return self._read_into

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(bytes(self._read_into[:nbytes]))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        self.coalescing = CoalescingTransport(transport)
        super().connection_made(self.coalescing)  # type: ignore[arg-type]
        # h2 remembers how each of the last 65,536 streams of a connection
        # closed, to tell a late frame on a reset stream (answered with a
        # RST_STREAM) from a protocol error. A plugin connection lives as long
        # as the kubelet, and every Allocate is a stream: that is up to 10 MB
        # per connection after months of pods. Late frames come within a round
        # trip, so the last few hundred streams are plenty.
        self.connection._connection._closed_streams = SizeLimitDict(size_limit=CLOSED_STREAMS_KEPT)
        _compact_settings(self.connection._connection)
        # The peer waits for our SETTINGS before its first request: send them now.
        self.coalescing.flush()


class KubeletChannel(Channel):
    """A grpclib client Channel whose request headers and message go out in one send."""

    def _protocol_factory(self) -> H2Protocol:
        return _CoalescingProtocol(grpclib.client.Handler(), self._config, self._h2_config)

    async def unary(self, path: str, request: bytes, timeout: float) -> bytes:
        """A unary call with a message encoded already; the reply's bytes.

        The request goes out as soon as it is written rather than at the end
        of the loop's turn: after a kubelet restart each Register waits for
        the last one's dial, so a turn's worth of other work (the previous
        resource's ListAndWatch) would add to every registration.
        """
        sent = self.send_unary(path, request)
        if sent is not None:
            return await sent.reply(timeout)
        # Not connected yet, or the request has to wait for flow control.
        # The deadline is kept here, not sent: grpclib sends grpc-timeout in
        # whole seconds rounded down above 10 s, and grpc-go resets the call
        # at that deadline, before ours, so a stalled kubelet's non-answer
        # would end as a stream reset rather than a timeout.
        async with (
            asyncio.timeout(timeout),
            self.request(path, Cardinality.UNARY_UNARY, wire.Raw, wire.Raw) as stream,
        ):
            # The channel's PreEncodedCodec passes bytes on, and hands `Raw` back as bytes.
            await stream.send_message(request, end=True)  # type: ignore[arg-type]
            if isinstance(self._protocol, _CoalescingProtocol):
                self._protocol.coalescing.flush()
            reply: Any = await stream.recv_message()
        return bytes(reply or b"")

    def send_unary(self, path: str, request: bytes) -> SentUnary | None:
        """Send a unary call's request now, within the caller's callback; None
        when it cannot go out whole at once (not connected, or flow control).

        grpclib sends only from a task, which starts a turn of the loop later,
        after whatever else is ready. A Register sent while the core handles
        the previous registration's GetDevicePluginOptions reaches the kubelet
        before that call's reply does, and the kubelet works on both at once.
        The request is what grpclib's `send_message` would send; the reply is
        read by grpclib as for any call.
        """
        protocol = self._protocol
        if not self._connected or not isinstance(protocol, _CoalescingProtocol):
            return None
        connection = protocol.processor.connection
        h2_connection = connection._connection
        message = wire.grpc_message(request)
        settings = h2_connection.remote_settings
        room = min(
            h2_connection.outbound_flow_control_window,
            settings.initial_window_size,
            h2_connection.max_outbound_frame_size,
        )
        if (
            not connection.write_ready.is_set()
            or h2_connection.open_outbound_streams >= settings.max_concurrent_streams
            or len(message) > room
        ):
            return None
        stream_id = h2_connection.get_next_available_stream_id()
        try:
            h2_connection.send_headers(stream_id, self._request_headers(path))
        except h2.exceptions.ProtocolError:  # the peer is going away: grpclib's path says so
            return None
        # What `Stream.__aenter__`, `send_request` and `send_message` do, without
        # a deadline (see `unary`) and without their waits, ruled out above.
        stream = self.request(path, Cardinality.UNARY_UNARY, wire.Raw, wire.Raw)
        stream._wrapper = Wrapper()
        self._calls_started += 1
        self._last_call_started = time.monotonic()
        h2_stream = connection.create_stream(wrapper=stream._wrapper)
        h2_stream.init_stream(stream_id, connection)
        stream._release_stream = protocol.processor.register(h2_stream)
        h2_connection.send_data(stream_id, message, end_stream=True)
        protocol.coalescing.write(h2_connection.data_to_send())
        protocol.coalescing.flush()
        connection.headers_send_process()
        connection.data_send_process()
        stream._stream = h2_stream
        stream.peer = connection.get_peer()
        stream._send_request_done = stream._send_message_done = stream._end_done = True
        stream._messages_sent = 1
        connection.messages_sent += 1
        connection.last_message_sent = time.monotonic()
        return SentUnary(stream)

    def _request_headers(self, path: str) -> list[tuple[str, str]]:
        """grpclib's request headers for a call with no deadline and no metadata."""
        return [
            (":method", "POST"),
            (":scheme", self._scheme),
            (":path", path),
            (":authority", self._authority),
            ("te", "trailers"),
            ("content-type", GRPC_CONTENT_TYPE),
            ("user-agent", grpclib.client.USER_AGENT),
        ]


class SentUnary:
    """A unary call whose request `KubeletChannel.send_unary` has sent."""

    def __init__(self, stream: grpclib.client.Stream[Any, Any]) -> None:
        self._stream = stream

    async def reply(self, timeout: float) -> bytes:
        """The reply's bytes, or the call's error, as from `KubeletChannel.unary`."""
        async with asyncio.timeout(timeout), self:
            reply: Any = await self._stream.recv_message()
        return bytes(reply or b"")

    async def __aenter__(self) -> SentUnary:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # The end of grpclib's `async with stream`: trailers, status, release.
        await self._stream.__aexit__(exc_type, exc, traceback)


class _TrackedProtocol(_CoalescingProtocol):
    """H2Protocol that tells the tracker when a kubelet connection comes and goes,
    and answers whole unary calls itself (see `dp_server.unary`)."""

    def __init__(
        self,
        *args: Any,
        tracker: ConnectionTracker,
        listener: str | None,
        forget: Callable[[], None],
        answers: Mapping[str, unary.Answer],
    ) -> None:
        super().__init__(*args)
        self._tracker = tracker
        self._listener = listener
        self._forget = forget
        self._answers = answers
        self._dp_connection: int | None = None
        self._late_replies: set[asyncio.Task[None]] = set()  # a loop keeps weak references

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._dp_connection = self._tracker.made(self.coalescing, self._listener)  # type: ignore[arg-type]

    def connection_lost(self, exc: BaseException | None) -> None:
        super().connection_lost(exc)  # ends replies still waiting (their stream's wrapper)
        self._forget()
        if self._dp_connection is not None:
            self._tracker.lost(self._dp_connection)

    def data_received(self, data: bytes) -> None:
        replies: dict[int, unary.Reply] = {}
        if self._dp_connection is not None and not self.connection.is_closing():
            found = raw_calls.read(data, self.connection._connection, self._answers)
            if found is not None:
                replies = self._answer_raw(found)
                if not replies:
                    return
                # A reply too large to go out whole: h2 takes the read (decoding
                # the same indexed-only headers again) and the replies made.
        self._receive(data, replies)

    def _answer_raw(self, found: raw_calls.RawRead) -> dict[int, unary.Reply]:
        """Answer the calls of a read that `raw_calls` took apart; if a reply does
        not fit the peer's windows, return them all for h2's path to send."""
        replies = [unary.reply_frames(call, self._dp_connection) for call in found.calls]  # type: ignore[arg-type]
        h2_connection = self.connection._connection
        blocks = [raw_calls.reply_block(headers, framed) for headers, framed in replies]
        if not found.replies_fit(h2_connection, blocks):
            return {call.stream_id: reply for call, reply in zip(found.calls, replies, strict=True)}
        sent = found.apply(h2_connection, blocks)
        for increment in found.connection_increments:
            self.processor.process(raw_calls.window_updated(increment))
        self.connection.flush()
        self.coalescing.write(sent)
        self.coalescing.flush()
        return {}

    def _receive(self, data: bytes, replies: dict[int, unary.Reply]) -> None:
        try:
            events = self.connection.feed(data)
        except h2.exceptions.ProtocolError:
            _log.debug("protocol error", exc_info=True)
            self.processor.close("Protocol error")
            return
        self.connection.flush()
        calls = unary.whole_calls(events, self._answers) if self._dp_connection is not None else {}
        # A call read after an event grpclib schedules work for waits its turn.
        queued = answered = False
        for event in events:
            stream_id = getattr(event, "stream_id", None)
            call = calls.get(stream_id) if stream_id else None
            if call is None:
                queued = queued or bool(stream_id)
                self.processor.process(event)
            elif type(event) is RequestReceived:
                reply = replies.get(call.stream_id)
                if queued:
                    asyncio.get_running_loop().call_soon(self._answer_now, call, reply)
                else:
                    self._answer(call, reply)
                    answered = True
        self.connection.flush()
        if answered:
            # The replies are complete: send them now rather than a turn later.
            self.coalescing.flush()

    def _answer_now(self, call: unary.WholeCall, reply: unary.Reply | None) -> None:
        self._answer(call, reply)
        self.coalescing.flush()

    def _answer(self, call: unary.WholeCall, reply: unary.Reply | None = None) -> None:
        """Send the reply to `call`, asking for it unless `reply` is the one made already."""
        assert self._dp_connection is not None
        connection = self.connection
        if connection.is_closing():
            return
        h2_connection = connection._connection
        stream_id = call.stream_id
        headers, framed = reply or unary.reply_frames(call, self._dp_connection)
        try:
            if call.flow_controlled:
                h2_connection.acknowledge_received_data(call.flow_controlled, stream_id)
            if framed is None:
                h2_connection.send_headers(stream_id, headers, end_stream=True)
            elif unary.fits(h2_connection, stream_id, framed):
                h2_connection.send_headers(stream_id, headers)
                h2_connection.send_data(stream_id, framed)
                h2_connection.send_headers(stream_id, unary.TRAILERS_OK, end_stream=True)
            else:
                h2_connection.send_headers(stream_id, headers)
                self._reply_later(stream_id, framed, call.deadline)
        except h2.exceptions.StreamClosedError:
            pass  # the peer gave up on the call; nothing to tell it
        except h2.exceptions.ProtocolError as error:
            # Not expected; raised out of data_received it would close the connection.
            fields = {"rpc": call.path, "error": repr(error)}
            _log.warning("reply-failed", extra={"dp_fields": fields})
            with contextlib.suppress(h2.exceptions.ProtocolError):
                h2_connection.reset_stream(stream_id)
        connection.flush()

    def _reply_later(self, stream_id: int, framed: bytes, deadline: Deadline | None) -> None:
        """Send a reply larger than the peer lets us send now, as grpclib would:
        a frame at a time, as its flow-control windows open."""
        stream = self.connection.create_stream(stream_id=stream_id)
        timer: contextlib.AbstractContextManager[Any]
        if deadline is None:
            wrapper, timer = Wrapper(), contextlib.nullcontext()
        else:
            wrapper = timed = DeadlineWrapper()
            timer = timed.start(deadline)
        stream.wrapper = wrapper
        release = self.processor.register(stream)

        async def reply() -> None:
            try:
                with timer, wrapper:
                    await stream.send_data(framed)
                    await stream.send_headers(unary.TRAILERS_OK, end_stream=True)
            except (StreamTerminatedError, h2.exceptions.StreamClosedError):
                pass  # reset or connection closed
            except TimeoutError:
                # What grpclib does at a call's deadline: end it with that status.
                with contextlib.suppress(h2.exceptions.StreamClosedError):
                    await stream.send_headers(
                        [("grpc-status", str(Status.DEADLINE_EXCEEDED.value))], end_stream=True
                    )
            finally:
                release()

        task = asyncio.get_running_loop().create_task(reply())
        self._late_replies.add(task)
        task.add_done_callback(self._late_replies.discard)


class TrackedServer(Server):
    """A grpclib Server for the device plugin service on one listening socket."""

    def __init__(
        self,
        handlers: list[Any],
        tracker: ConnectionTracker,
        listener: str | None,
        answers: Mapping[str, unary.Answer],
    ) -> None:
        super().__init__(handlers, codec=wire.PreEncodedCodec())
        self._dp_tracker = tracker
        self._dp_listener = listener
        self._dp_answers = answers

    async def start_unix(self, path: str, backlog: int = 128) -> None:
        """Listen on the Unix socket `path`, starting each connection as it is accepted
        (see `dp_server.accepting`)."""
        listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listening.bind(path)
            await self.start(sock=listening, backlog=backlog)  # asyncio calls listen()
        except BaseException:
            listening.close()
            raise
        assert self._server is not None
        accept_at_once(self._server, listening, self._protocol_factory)

    def stop_listening(self) -> None:
        """Accept no more connections; those made keep being served until `close()`."""
        if self._server is not None:
            self._server.close()

    @property
    def connected(self) -> bool:
        """Whether a connection made through this server is still open."""
        return bool(self._handlers)

    def _protocol_factory(self) -> H2Protocol:
        self.__gc_step__()
        handler = _Handler(
            self._mapping, self._codec, self._status_details_codec, self.__dispatch__
        )
        self._handlers.add(handler)
        return _TrackedProtocol(
            handler,
            self._config,
            self._h2_config,
            tracker=self._dp_tracker,
            listener=self._dp_listener,
            # grpclib drops a closed connection's handler only at every tenth new
            # connection to the same server; after a kubelet restart the server
            # itself is replaced (the kubelet deleted its socket), so that is never.
            forget=lambda: self._handlers.discard(handler),
            answers=self._dp_answers,
        )
