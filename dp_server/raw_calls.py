"""Steady-state unary calls read from the HTTP/2 frames themselves.

A kubelet's calls on a connection repeat their headers, so from its second
call on, each one arrives as the same few frames: HEADERS whose block is only
references into the HPACK tables, WINDOW_UPDATEs, and one DATA frame that ends
the stream. `dp_server.unary` answers such a call in the turn it is read, but
still through h2, whose state machines, frame objects and events cost more
than everything else on the server's Allocate path (and, on a busy 2-vCPU
host, where every wake-up meets cold caches, several times what a loop of
them costs).

`read` recognises a read made only of such calls (and WINDOW_UPDATEs on the
connection), checking everything h2 would; `Reply` lays out the frames that
answer them. Nothing is changed until the caller applies a read, so when
anything else is in it (SETTINGS, a PING's ACK, a literal header, padding, a
frame cut by the read, a window too small for a reply) the read goes to h2 as
it is.

What h2 would have recorded is kept in its connection, so that what comes
after meets the same state: the highest stream id and the flow-control
windows both ways. h2 also remembers how each of its last streams closed;
for a stream at or below the highest id that it does not know, a late
WINDOW_UPDATE or RST_STREAM is ignored, late DATA is refused with a stream
reset, and late HEADERS end the connection, just as for a stream it recorded
(the last with PROTOCOL_ERROR rather than STREAM_CLOSED). So the raw streams
are not recorded there: with 64 kubelet
connections that record would hold 16,000 entries, 1.2 MB, after enough pods.
The replies' header blocks use
only the static HPACK table and literals that are never indexed, so h2's
encoder and the peer's decoder stay in step without h2 seeing them. An
indexed-only header block changes no table, so decoding it here and again in
h2 (when the read goes there after all) decodes it the same both times.
"""

from __future__ import annotations

import struct
import weakref
from collections.abc import Mapping

from h2.connection import ConnectionState, H2Connection
from h2.events import WindowUpdated
from hpack import Encoder, HPACKError, NeverIndexedHeaderTuple

from .unary import CONTENT_TYPE, Answer, WholeCall, call_path, routed

__all__ = ["RawRead", "encode_block", "read", "reply_block", "window_updated"]

_DATA, _HEADERS, _PING, _WINDOW_UPDATE = 0x0, 0x1, 0x6, 0x8
_END_STREAM, _END_HEADERS = 0x1, 0x4
_ACK = 0x1  # on PING
_LAST_HEADERS = _END_HEADERS | _END_STREAM
_FRAME_HEADER = struct.Struct(">BHBBL")  # length (24 bits), type, flags, stream id
_FRAME_HEADER_SIZE = _FRAME_HEADER.size
_LARGEST_WINDOW = 2**31 - 1
# Headers h2 checks whatever grpclib's configuration says (a body that does not
# match its content-length, a response status in a request ends the connection).
_H2_CHECKS = frozenset({"content-length", ":status"})


def encode_block(headers: list[tuple[str, str]]) -> bytes:
    """An HPACK block of `headers` that references only the static table.

    A fresh encoder's dynamic table is empty and never-indexed literals are
    not added to it, so the block means the same to any decoder, whatever its
    dynamic table holds.
    """
    return Encoder().encode([NeverIndexedHeaderTuple(name, value) for name, value in headers])


RESPONSE_HEADERS_BLOCK = encode_block([(":status", "200"), ("content-type", CONTENT_TYPE)])
TRAILERS_OK_BLOCK = encode_block([("grpc-status", "0")])


def reply_block(headers: list[tuple[str, str]], framed: bytes | None) -> tuple[bytes, bytes | None]:
    """The header block and message of a reply from `unary.reply_frames`."""
    if framed is not None:
        return RESPONSE_HEADERS_BLOCK, framed  # its headers never change
    return encode_block(headers), None


def window_updated(increment: int) -> WindowUpdated:
    """The event h2 gives for a WINDOW_UPDATE on the connection (grpclib wakes
    the streams that wait for room on it)."""
    return WindowUpdated(stream_id=0, delta=increment)


def _frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    length = len(payload)
    return _FRAME_HEADER.pack(length >> 16, length & 0xFFFF, kind, flags, stream_id) + payload


class RawRead:
    """The whole unary calls of one read, and the PINGs and connection window
    updates among them."""

    __slots__ = ("calls", "connection_increments", "pings")

    def __init__(self) -> None:
        self.calls: list[WholeCall] = []
        self.connection_increments: list[int] = []
        self.pings: list[bytes] = []  # their opaque data, to send back

    def replies_fit(self, h2: H2Connection, replies: list[tuple[bytes, bytes | None]]) -> bool:
        """Whether every reply (header block, framed message) goes out whole now: each
        block in one frame, each message in one DATA frame within the windows."""
        window = h2.outbound_flow_control_window + sum(self.connection_increments)
        frame_limit = h2.max_outbound_frame_size
        for call, (block, message) in zip(self.calls, replies, strict=True):
            if len(block) > frame_limit:
                return False
            if message is None:
                continue
            stream_window = h2.remote_settings.initial_window_size + call.window
            if len(message) > min(window, stream_window, frame_limit):
                return False
            window -= len(message)
        return True

    def apply(self, h2: H2Connection, replies: list[tuple[bytes, bytes | None]]) -> bytes:
        """Record in `h2` what receiving these frames and sending the replies does;
        returns the bytes to send: window updates and replies, in order."""
        for increment in self.connection_increments:
            h2.outbound_flow_control_window += increment
        inbound = h2._inbound_flow_control_window_manager
        # PINGs are acknowledged at once, as h2 does: first.
        out = [_frame(_PING, _ACK, 0, opaque) for opaque in self.pings]
        for call, (block, message) in zip(self.calls, replies, strict=True):
            stream_id = call.stream_id
            h2.highest_inbound_stream_id = stream_id
            # Received, and acknowledged at once, as `unary` acknowledges a whole call.
            inbound.window_consumed(call.flow_controlled)
            acknowledged = inbound.process_bytes(call.flow_controlled)
            if acknowledged:
                out.append(_frame(_WINDOW_UPDATE, 0, 0, acknowledged.to_bytes(4, "big")))
            if message is None:
                out.append(_frame(_HEADERS, _LAST_HEADERS, stream_id, block))
            else:
                h2.outbound_flow_control_window -= len(message)
                out.append(_frame(_HEADERS, _END_HEADERS, stream_id, block))
                out.append(_frame(_DATA, 0, stream_id, message))
                out.append(_frame(_HEADERS, _LAST_HEADERS, stream_id, TRAILERS_OK_BLOCK))
        return b"".join(out)


def read(data: bytes, h2: H2Connection, answers: Mapping[str, Answer]) -> RawRead | None:
    """The calls `data` holds, if it holds nothing h2 must see: every frame whole
    and one of HEADERS (indexed fields only), DATA (no padding), PING or
    WINDOW_UPDATE (for the connection, a call of the read, or a stream h2 has
    closed), on a connection h2 has nothing pending for. None sends the read
    to h2."""
    if h2.state_machine.state is not ConnectionState.SERVER_OPEN:
        return None
    pending = h2.incoming_buffer
    if pending._data or pending._preamble_len or pending._headers_buffer:
        return None
    if h2.encoder.header_table.resized:
        return None  # h2's encoder owes a table size update at the start of its next block
    found = RawRead()
    calls: dict[int, WholeCall] = {}  # this read's, by stream
    call: WholeCall | None = None  # the one whose body is still coming
    highest = h2.highest_inbound_stream_id
    frame_limit = h2.max_inbound_frame_size
    stream_window = h2.local_settings.initial_window_size
    end = len(data)
    at = 0
    while at < end:
        if end - at < _FRAME_HEADER_SIZE:
            return None
        high, low, kind, flags, stream_id = _FRAME_HEADER.unpack_from(data, at)
        length = high << 16 | low
        stream_id &= 0x7FFFFFFF
        start = at + _FRAME_HEADER_SIZE
        at = start + length
        if at > end or length > frame_limit:
            return None
        if kind == _HEADERS:
            if call is not None or flags != _END_HEADERS:
                return None  # a call still open, padding, priority, no body, CONTINUATION
            if stream_id <= highest or not stream_id & 1:
                return None
            # h2 refuses a stream past the limit, counting those the read opened
            # (each open until answered); its count culls closed streams first.
            limit = h2.local_settings.max_concurrent_streams
            if len(h2.streams) + len(calls) >= limit and (
                h2.open_inbound_streams + len(calls) >= limit
            ):
                return None
            call = _open(data[start:at], stream_id, h2, answers)
            if call is None:
                return None
            highest = stream_id
            calls[stream_id] = call
        elif kind == _DATA:
            if call is None or stream_id != call.stream_id or flags & ~_END_STREAM:
                return None
            call.chunks.append(data[start:at])
            call.flow_controlled += length
            if call.flow_controlled > stream_window:
                return None
            if flags & _END_STREAM:
                call.request = call.message()
                if call.request is None:
                    return None
                found.calls.append(call)
                call = None
        elif kind == _WINDOW_UPDATE:
            if length != 4 or not _window_update(found, calls, stream_id, data[start:at], h2):
                return None
        elif kind == _PING:
            if stream_id or length != 8 or flags:
                return None  # a PING's ACK, or one h2 would refuse
            found.pings.append(data[start:at])
        else:
            return None
    if call is not None:
        return None
    window = h2.outbound_flow_control_window + sum(found.connection_increments)
    if window > _LARGEST_WINDOW:
        return None
    received = sum(call.flow_controlled for call in found.calls)
    if received > h2._inbound_flow_control_window_manager.current_window_size:
        return None
    return found


def _window_update(
    found: RawRead, calls: dict[int, WholeCall], stream_id: int, payload: bytes, h2: H2Connection
) -> bool:
    """Take in a WINDOW_UPDATE: False when h2 must see it."""
    increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
    if not increment:
        return False
    if stream_id == 0:
        found.connection_increments.append(increment)
        return True
    call = calls.get(stream_id)
    if call is not None:
        call.window += increment
        return h2.remote_settings.initial_window_size + call.window <= _LARGEST_WINDOW
    # One for a stream h2 has closed and forgotten (a call answered before) it
    # ignores; one for a stream it has open (ListAndWatch) changes that stream.
    return (
        stream_id & 1 == 1
        and stream_id <= h2.highest_inbound_stream_id
        and (stream_id not in h2.streams)
    )


class _KnownBlocks:
    """What the header blocks of indexed fields one connection's decoder has
    decoded asked for, while its dynamic table stays as it was.

    A kubelet's calls repeat the same few blocks, and decoding one costs more
    than the rest of reading its call. Such a block changes no table, so it
    means the same until the table changes. Any entry the decoder adds is a
    new tuple at its head, and a resize evicts entries: (head, count) tells.
    The head is held here, so its identity cannot pass to another object.
    Only the call's path and timeout are kept, not its headers: a few dozen
    bytes per block rather than a kilobyte, on each of 64 connections.
    """

    __slots__ = ("count", "head", "paths")

    def __init__(self) -> None:
        self.head: object = None
        self.count = -1
        self.paths: dict[bytes, tuple[str, float | None] | None] = {}


_BLOCKS_KEPT = 32  # per connection; a kubelet sends four or five
_known_blocks: weakref.WeakKeyDictionary[H2Connection, _KnownBlocks] = weakref.WeakKeyDictionary()


def _call_path(
    block: bytes, h2: H2Connection, answers: Mapping[str, Answer]
) -> tuple[str, float | None] | None:
    """`unary.call_path` of an indexed-only `block`; None when h2 must take it."""
    entries = h2.decoder.header_table.dynamic_entries
    head = entries[0] if entries else None
    known = _known_blocks.get(h2)
    if known is None:
        known = _known_blocks[h2] = _KnownBlocks()
    if known.head is not head or known.count != len(entries):
        known.head, known.count = head, len(entries)
        known.paths.clear()
    elif block in known.paths:
        return known.paths[block]
    try:
        decoded = h2.decoder.decode(block, raw=True)
        headers = [(name.decode("ascii"), value.decode("ascii")) for name, value in decoded]
    except (HPACKError, UnicodeDecodeError):
        found = None  # h2 answers these itself
    else:
        checked = any(name in _H2_CHECKS for name, _ in headers)
        found = None if checked else call_path(headers, answers)
    if len(known.paths) >= _BLOCKS_KEPT:
        known.paths.clear()
    known.paths[block] = found
    return found


def _open(
    block: bytes, stream_id: int, h2: H2Connection, answers: Mapping[str, Answer]
) -> WholeCall | None:
    """The call a header block opens, if it is made of indexed fields only and
    names a unary answer (see `unary.call_route`)."""
    if not block or min(block) < 0x80:
        return None  # a literal (which may change a table), or an index past 126
    route = routed(_call_path(block, h2, answers), answers)
    if route is None:
        return None
    return WholeCall(stream_id, *route)
