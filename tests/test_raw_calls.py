"""Unary calls read from the raw frames (dp_server.raw_calls): which reads it takes,
what it sends, and that h2's connection state after it is what h2 itself would
have made, so the calls h2 handles afterwards (both ways) still decode."""

from __future__ import annotations

from collections.abc import Callable

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from hpack import Encoder

from dp_server import raw_calls, unary

BASE = "/v1beta1.DevicePlugin/"
HEADERS = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", BASE + "Allocate"),
    (":authority", "localhost"),
    ("content-type", "application/grpc"),
    ("user-agent", "grpc-go/1.65.0"),
    ("te", "trailers"),
]
# What grpclib configures its server connections with.
SERVER_CONFIG = h2.config.H2Configuration(
    client_side=False,
    header_encoding="ascii",
    validate_inbound_headers=False,
    validate_outbound_headers=False,
    normalize_inbound_headers=False,
    normalize_outbound_headers=False,
)


def framed(message: bytes) -> bytes:
    return b"\x00" + len(message).to_bytes(4, "big") + message


def echo(connection: int, message: bytes) -> bytes:
    return b"re:" + message


def refuse(connection: int, message: bytes) -> bytes:
    raise GRPCError(Status.INVALID_ARGUMENT, f"unknown device {message.decode()!r}")


def size(connection: int, message: bytes) -> bytes:
    return str(len(message)).encode()


ANSWERS: dict[str, unary.Answer] = {
    BASE + "Allocate": echo,
    BASE + "PreStartContainer": refuse,
    BASE + "GetPreferredAllocation": size,
}


def headers_for(method: str) -> list[tuple[str, str]]:
    return [(k, BASE + method if k == ":path" else v) for k, v in HEADERS]


class Pair:
    """A server connection configured as grpclib's, and a client, talking in memory."""

    def __init__(self, *, client_settings: dict[int, int] | None = None) -> None:
        self.client = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="ascii")
        )
        self.server = h2.connection.H2Connection(SERVER_CONFIG)
        self.client.initiate_connection()
        if client_settings:
            self.client.update_settings(client_settings)
        self.server.initiate_connection()
        self.client_events: list[h2.events.Event] = []
        self.pump()

    def pump(self) -> None:
        while True:
            to_server, to_client = self.client.data_to_send(), self.server.data_to_send()
            if not to_server and not to_client:
                return
            if to_server:
                self.served(self.server.receive_data(to_server))
            if to_client:
                self.receive(to_client)

    def receive(self, data: bytes) -> list[h2.events.Event]:
        events = self.client.receive_data(data)
        for event in events:
            if isinstance(event, h2.events.DataReceived):
                self.client.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        self.client_events += events
        return events

    def served(self, events: list[h2.events.Event]) -> None:
        """Answer whole calls through h2, as the slow path would."""
        calls = unary.whole_calls(events, ANSWERS)
        for call in calls.values():
            headers, message = unary.reply_frames(call, 1)
            self.server.acknowledge_received_data(call.flow_controlled, call.stream_id)
            if message is None:
                self.server.send_headers(call.stream_id, headers, end_stream=True)
            else:
                self.server.send_headers(call.stream_id, headers)
                if len(message) > self.server.local_flow_control_window(call.stream_id):
                    continue  # a narrow window: the reply waits, the stream stays open
                self.server.send_data(call.stream_id, message)
                self.server.send_headers(call.stream_id, unary.TRAILERS_OK, end_stream=True)

    def request(
        self, body: bytes = framed(b"ids"), headers: list[tuple[str, str]] = HEADERS
    ) -> tuple[int, bytes]:
        """One call's bytes as the client sends them (not yet to the server)."""
        stream_id = self.client.get_next_available_stream_id()
        self.client.send_headers(stream_id, headers)
        size = self.client.max_outbound_frame_size
        for start in range(0, len(body), size):
            last = start + size >= len(body)
            self.client.send_data(stream_id, body[start : start + size], end_stream=last)
        return stream_id, self.client.data_to_send()

    def warm(self) -> None:
        """One call through h2, so that the client's next ones are indexed fields only."""
        _, data = self.request()
        assert raw_calls.read(data, self.server, ANSWERS) is None  # literals the first time
        self.served(self.server.receive_data(data))
        self.pump()

    def raw_call(self) -> int:
        """A call through h2, then one read raw: the raw one's stream."""
        self.warm()
        stream_id, data = self.request()
        self.answer_raw(data)
        return stream_id

    def answer_raw(self, data: bytes) -> list[h2.events.Event]:
        found = raw_calls.read(data, self.server, ANSWERS)
        assert found is not None
        blocks = [raw_calls.reply_block(*unary.reply_frames(c, 1)) for c in found.calls]
        assert found.replies_fit(self.server, blocks)
        return self.receive(found.apply(self.server, blocks))


def replies(events: list[h2.events.Event]) -> dict[int, list[tuple[str, object]]]:
    """Per stream, what the client saw, in order."""
    seen: dict[int, list[tuple[str, object]]] = {}
    for event in events:
        stream_id = getattr(event, "stream_id", 0)
        if isinstance(event, h2.events.ResponseReceived):
            seen.setdefault(stream_id, []).append(("headers", event.headers))
        elif isinstance(event, h2.events.DataReceived):
            seen.setdefault(stream_id, []).append(("data", event.data))
        elif isinstance(event, h2.events.TrailersReceived):
            seen.setdefault(stream_id, []).append(("trailers", event.headers))
        elif isinstance(event, h2.events.StreamEnded):
            seen.setdefault(stream_id, []).append(("ended", None))
    return seen


OK_REPLY = [
    ("headers", [(":status", "200"), ("content-type", "application/grpc+proto")]),
    ("data", framed(b"re:ids")),
    ("trailers", [("grpc-status", "0")]),
    ("ended", None),
]


def test_a_repeated_call_is_read_and_answered_from_its_frames() -> None:
    pair = Pair()
    pair.warm()
    stream_id, data = pair.request()
    found = raw_calls.read(data, pair.server, ANSWERS)
    assert found is not None
    [call] = found.calls
    assert (call.stream_id, call.path, call.request) == (stream_id, BASE + "Allocate", b"ids")
    assert call.flow_controlled == len(framed(b"ids"))
    window = pair.server.outbound_flow_control_window
    assert replies(pair.answer_raw(data)) == {stream_id: OK_REPLY}
    assert pair.server.highest_inbound_stream_id == stream_id
    assert pair.server.outbound_flow_control_window == window - len(framed(b"re:ids"))
    assert stream_id not in pair.server.streams


def test_h2_state_after_raw_calls_serves_what_h2_handles_next_both_ways() -> None:
    pair = Pair()
    pair.warm()
    for _ in range(3):
        stream_id, data = pair.request()
        assert replies(pair.answer_raw(data)) == {stream_id: OK_REPLY}
    # A new header (a literal, added to both HPACK tables) goes through h2; its
    # reply is encoded by h2's encoder; the next indexed-only call is read raw.
    changed = [*HEADERS, ("grpc-timeout", "5S")]
    stream_id, data = pair.request(headers=changed)
    assert raw_calls.read(data, pair.server, ANSWERS) is None
    events = pair.server.receive_data(data)
    [request] = [e for e in events if isinstance(e, h2.events.RequestReceived)]
    assert request.stream_id == stream_id and ("grpc-timeout", "5S") in request.headers
    pair.served(events)
    before = len(pair.client_events)
    pair.pump()
    assert replies(pair.client_events[before:]) == {stream_id: OK_REPLY}
    stream_id, data = pair.request(headers=changed)
    assert replies(pair.answer_raw(data)) == {stream_id: OK_REPLY}
    assert not [e for e in pair.client_events if isinstance(e, h2.events.ConnectionTerminated)]


def test_an_error_answer_is_a_trailers_only_reply() -> None:
    pair = Pair()
    headers = headers_for("PreStartContainer")
    _, data = pair.request(framed(b"gpu"), headers)
    pair.served(pair.server.receive_data(data))
    pair.pump()
    stream_id, data = pair.request(framed(b"gpu"), headers)
    window = pair.server.outbound_flow_control_window
    assert replies(pair.answer_raw(data)) == {
        stream_id: [
            (
                "headers",
                [
                    (":status", "200"),
                    ("content-type", "application/grpc+proto"),
                    ("grpc-status", "3"),
                    ("grpc-message", "unknown device 'gpu'"),
                ],
            ),
            ("ended", None),
        ]
    }
    assert pair.server.outbound_flow_control_window == window  # no DATA went out


def test_calls_read_together_are_answered_in_order_with_the_connection_windows() -> None:
    pair = Pair()
    pair.warm()
    first, one = pair.request(framed(b"a"))
    second, two = pair.request(framed(b"bb"))
    found = raw_calls.read(one + two, pair.server, ANSWERS)
    assert found is not None and [c.request for c in found.calls] == [b"a", b"bb"]
    seen = replies(pair.answer_raw(one + two))
    assert list(seen) == [first, second]
    assert seen[second][1] == ("data", framed(b"re:bb"))


def test_received_data_is_acknowledged_as_h2_would() -> None:
    raw, through_h2 = Pair(), Pair()
    big, headers = framed(b"x" * 20_000), headers_for("GetPreferredAllocation")
    for pair in (raw, through_h2):
        _, data = pair.request(big, headers)
        pair.served(pair.server.receive_data(data))
        pair.pump()
    for _ in range(3):  # past half the connection window: a WINDOW_UPDATE is due
        _, data = raw.request(big, headers)
        raw.answer_raw(data)
        _, data = through_h2.request(big, headers)
        through_h2.served(through_h2.server.receive_data(data))
        through_h2.pump()
    windows = [
        (
            pair.server._inbound_flow_control_window_manager.current_window_size,
            pair.client.outbound_flow_control_window,
        )
        for pair in (raw, through_h2)
    ]
    assert windows[0] == windows[1]
    assert windows[0][1] > 65_535 - 3 * len(big)  # the client was given room back


def test_window_updates_in_the_read_count_for_the_replies() -> None:
    pair = Pair(client_settings={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 4})
    pair.warm()  # through h2: its reply waits for a window that never opens
    stream_id = pair.client.get_next_available_stream_id()
    pair.client.send_headers(stream_id, HEADERS)
    pair.client.increment_flow_control_window(100, stream_id=stream_id)
    pair.client.send_data(stream_id, framed(b"ids"), end_stream=True)
    data = pair.client.data_to_send()
    found = raw_calls.read(data, pair.server, ANSWERS)
    assert found is not None and found.calls[0].window == 100
    assert replies(pair.answer_raw(data))[stream_id] == OK_REPLY


def test_a_reply_larger_than_the_window_is_left_to_h2() -> None:
    pair = Pair(client_settings={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 8})
    pair.warm()
    _, data = pair.request()
    found = raw_calls.read(data, pair.server, ANSWERS)
    assert found is not None
    blocks = [raw_calls.reply_block(*unary.reply_frames(c, 1)) for c in found.calls]
    assert not found.replies_fit(pair.server, blocks)


def test_connection_window_updates_are_applied() -> None:
    pair = Pair()
    pair.warm()
    stream_id, data = pair.request()
    pair.client.increment_flow_control_window(1000)
    data += pair.client.data_to_send()
    found = raw_calls.read(data, pair.server, ANSWERS)
    assert found is not None and found.connection_increments == [1000]
    window = pair.server.outbound_flow_control_window
    pair.answer_raw(data)
    assert pair.server.outbound_flow_control_window == window + 1000 - len(framed(b"re:ids"))
    assert raw_calls.window_updated(1000) == h2.events.WindowUpdated(stream_id=0, delta=1000)


def test_late_frames_on_a_raw_stream_are_what_h2_expects_of_a_closed_one() -> None:
    pair = Pair()
    stream_id = pair.raw_call()
    window_update = raw_calls._frame(0x8, 0, stream_id, (5).to_bytes(4, "big"))
    reset = raw_calls._frame(0x3, 0, stream_id, (8).to_bytes(4, "big"))  # CANCEL
    assert pair.server.receive_data(window_update + reset) == []
    next_id, data = pair.request()
    assert replies(pair.answer_raw(data)) == {next_id: OK_REPLY}
    # Raw streams are not added to h2's record of closed streams (it would
    # grow to its bound on every connection)...
    assert stream_id not in pair.server._closed_streams
    # ...and late DATA on one is refused as on any closed stream: a stream reset.
    pair.server.receive_data(raw_calls._frame(0x0, 0x1, stream_id, framed(b"late")))
    sent = pair.server.data_to_send()
    reset = raw_calls._frame(0x3, 0, stream_id, (5).to_bytes(4, "big"))  # STREAM_CLOSED
    assert sent.endswith(reset)
    # Late HEADERS end the connection (as after any stream that ended).
    with pytest.raises(h2.exceptions.ProtocolError):
        pair.server.receive_data(raw_calls._frame(0x1, 0x5, stream_id, bytes([0x83])))


def _with(pair: Pair, change: Callable[[Pair, bytes], bytes]) -> bytes:
    pair.warm()
    _, data = pair.request()
    return change(pair, data)


HEADERS_LENGTH = 9 + 7  # the indexed-only block of HEADERS: one byte per field


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda p, d: d[:-1], id="a frame cut by the read"),
        pytest.param(lambda p, d: d[: 9 + HEADERS_LENGTH], id="headers without the body"),
        pytest.param(lambda p, d: d + raw_calls._frame(0x6, 0x1, 0, bytes(8)), id="a PING ACK"),
        pytest.param(
            lambda p, d: d + raw_calls._frame(0x6, 0, 1, bytes(8)), id="a PING on a stream"
        ),
        pytest.param(lambda p, d: d + raw_calls._frame(0x6, 0, 0, bytes(7)), id="a short PING"),
        pytest.param(lambda p, d: raw_calls._frame(0x4, 0x1, 0, b"") + d, id="a SETTINGS ack"),
        pytest.param(
            lambda p, d: d + raw_calls._frame(0x8, 0, 0, bytes(4)), id="a zero window increment"
        ),
        pytest.param(
            lambda p, d: d + raw_calls._frame(0x8, 0, 101, (1).to_bytes(4, "big")),
            id="a window update for a stream never opened",
        ),
        pytest.param(
            lambda p, d: d + raw_calls._frame(0x8, 0, 2, (1).to_bytes(4, "big")),
            id="a window update for a server stream",
        ),
        pytest.param(
            lambda p, d: d + raw_calls._frame(0x8, 0, 0, (2**31 - 1).to_bytes(4, "big")),
            id="a connection window past 2^31-1",
        ),
        pytest.param(
            lambda p, d: raw_calls._frame(0x1, 0x4, 1, bytes([0x82])) + d, id="a lower stream id"
        ),
        pytest.param(
            lambda p, d: raw_calls._frame(0x1, 0x5, 99, d[9:HEADERS_LENGTH]),
            id="headers ending the stream",
        ),
        pytest.param(
            lambda p, d: (
                raw_calls._frame(0x1, 0x4, 99, d[9:HEADERS_LENGTH])
                + raw_calls._frame(0x0, 0x9, 99, b"\x00" + framed(b"ids"))
            ),
            id="padded data",
        ),
        pytest.param(
            lambda p, d: (
                raw_calls._frame(0x1, 0x4, 99, d[9:HEADERS_LENGTH])
                + raw_calls._frame(0x0, 0x1, 99, framed(b"a") + framed(b"b"))
            ),
            id="two messages",
        ),
        pytest.param(
            lambda p, d: (
                raw_calls._frame(0x1, 0x4, 99, bytes([0x82]) + d[10:HEADERS_LENGTH])
                + raw_calls._frame(0x0, 0x1, 99, framed(b"a"))
            ),
            id="GET",
        ),
        pytest.param(
            lambda p, d: (
                raw_calls._frame(0x1, 0x4, 99, d[9:HEADERS_LENGTH] + bytes([0xFF]))
                + raw_calls._frame(0x0, 0x1, 99, framed(b"a"))
            ),
            id="an index past the tables",
        ),
    ],
)
def test_reads_with_anything_else_go_to_h2(change: Callable[[Pair, bytes], bytes]) -> None:
    pair = Pair()
    data = _with(pair, change)
    highest, window = (
        pair.server.highest_inbound_stream_id,
        pair.server.outbound_flow_control_window,
    )
    assert raw_calls.read(data, pair.server, ANSWERS) is None
    assert pair.server.highest_inbound_stream_id == highest
    assert pair.server.outbound_flow_control_window == window


def test_a_ping_is_acknowledged_with_its_data() -> None:
    pair = Pair()
    pair.warm()
    ping = raw_calls._frame(0x6, 0, 0, b"12345678")
    stream_id, data = pair.request()
    found = raw_calls.read(ping + data + ping, pair.server, ANSWERS)
    assert found is not None and found.pings == [b"12345678"] * 2
    events = pair.answer_raw(ping + data + ping)
    acks = [e for e in events if isinstance(e, h2.events.PingAckReceived)]
    assert [a.ping_data for a in acks] == [b"12345678"] * 2
    assert replies(events) == {stream_id: OK_REPLY}
    # A read of PINGs alone is answered too.
    assert [type(e) for e in pair.answer_raw(ping)] == [h2.events.PingAckReceived]


def test_window_updates_for_closed_calls_are_ignored_and_for_open_streams_left_to_h2() -> None:
    pair = Pair()
    stream_id = pair.raw_call()
    late = raw_calls._frame(0x8, 0, stream_id, (9).to_bytes(4, "big"))
    found = raw_calls.read(late, pair.server, ANSWERS)
    assert found is not None and found.calls == [] and found.connection_increments == []
    # After the end of the stream, in the same read, it still counts for the reply.
    stream_id, data = pair.request()
    data += raw_calls._frame(0x8, 0, stream_id, (9).to_bytes(4, "big"))
    found = raw_calls.read(data, pair.server, ANSWERS)
    assert found is not None and found.calls[0].window == 9
    # A stream h2 has open (a ListAndWatch, say) is h2's to update.
    watch = pair.client.get_next_available_stream_id()
    pair.client.send_headers(watch, headers_for("ListAndWatch"))
    pair.client.send_data(watch, framed(b""))
    pair.server.receive_data(pair.client.data_to_send())
    assert watch in pair.server.streams
    update = raw_calls._frame(0x8, 0, watch, (9).to_bytes(4, "big"))
    assert raw_calls.read(update, pair.server, ANSWERS) is None


def twins(headers: list[tuple[str, str]] = HEADERS) -> tuple[Pair, Pair]:
    """Two identical connections after one call through h2."""
    pairs = Pair(), Pair()
    for pair in pairs:
        _, data = pair.request(framed(b"ids"), headers)
        pair.served(pair.server.receive_data(data))
        pair.pump()
    return pairs


def test_a_body_not_matching_its_content_length_is_left_to_h2() -> None:
    # h2 checks content-length whatever grpclib configures, and ends the connection.
    headers = [*HEADERS, ("content-length", "8")]  # len(framed(b"ids")) == 8
    raw, twin = twins(headers)
    _, data = raw.request(framed(b"idsx"), headers)  # 9 bytes, every header indexed
    _, same = twin.request(framed(b"idsx"), headers)
    assert data == same
    with pytest.raises(h2.exceptions.InvalidBodyLengthError):
        twin.server.receive_data(same)
    assert raw_calls.read(data, raw.server, ANSWERS) is None


def test_a_read_opening_more_streams_than_allowed_is_left_to_h2() -> None:
    # h2 counts the streams the read opened before (open until answered).
    raw, twin = twins()
    _, one = raw.request()
    block = one[9 : 9 + int.from_bytes(one[:3], "big")]
    assert min(block) >= 0x80
    limit = raw.server.local_settings.max_concurrent_streams
    data = b"".join(
        raw_calls._frame(0x1, 0x4, stream_id, block)
        + raw_calls._frame(0x0, 0x1, stream_id, framed(b"ids"))
        for stream_id in range(3, 3 + 2 * (limit + 1), 2)
    )
    with pytest.raises(h2.exceptions.TooManyStreamsError):
        twin.server.receive_data(data)
    assert raw_calls.read(data, raw.server, ANSWERS) is None
    # One fewer is h2's to serve, and raw_calls'.
    assert raw_calls.read(data[: len(data) // (limit + 1) * limit], raw.server, ANSWERS)


def test_a_literal_header_or_an_unknown_path_goes_to_h2() -> None:
    pair = Pair()
    pair.warm()
    _, data = pair.request(headers=[*HEADERS, ("x-new", "1")])
    assert raw_calls.read(data, pair.server, ANSWERS) is None
    pair.served(pair.server.receive_data(data))
    pair.pump()
    unknown = headers_for("Frobnicate")
    _, data = pair.request(headers=unknown)
    pair.server.receive_data(data)  # its literal :path is now in the table
    _, data = pair.request(headers=unknown)
    assert raw_calls.read(data, pair.server, ANSWERS) is None


def test_an_owed_table_size_update_sends_the_read_to_h2() -> None:
    pair = Pair()
    pair.warm()
    _, data = pair.request()
    pair.server.encoder.header_table_size = 256  # as a peer's smaller SETTINGS would
    assert raw_calls.read(data, pair.server, ANSWERS) is None
    # The same size again: hpack then owes nothing (it keeps the size in a list
    # it never empties), and neither does the raw path.
    pair.server.encoder.header_table_size = 256
    assert pair.server.encoder.table_size_changes == [256]
    assert raw_calls.read(data, pair.server, ANSWERS) is not None


def test_reply_blocks_reference_only_the_static_table() -> None:
    block = raw_calls.encode_block([("grpc-status", "0"), ("grpc-message", "x")])
    # Any decoder, whatever its dynamic table, reads the same headers.
    full = h2.connection.H2Connection(SERVER_CONFIG).decoder
    full.decode(Encoder().encode([("a", "b"), ("c", "d")]))
    empty = h2.connection.H2Connection(SERVER_CONFIG).decoder
    assert (
        full.decode(block) == empty.decode(block) == [("grpc-status", "0"), ("grpc-message", "x")]
    )
    assert len(full.header_table.dynamic_entries) == 2  # and it added nothing
    assert raw_calls.RESPONSE_HEADERS_BLOCK == raw_calls.encode_block(
        [(":status", "200"), ("content-type", "application/grpc+proto")]
    )


def headers_frame(stream_id: int, block: bytes) -> bytes:
    return raw_calls._frame(0x1, 0x4, stream_id, block)


def test_a_repeated_header_block_is_decoded_once() -> None:
    pair = Pair()
    pair.warm()
    decoder = pair.server.decoder
    decode = decoder.decode
    blocks: list[bytes] = []

    def counted(data: bytes, raw: bool = False) -> object:
        blocks.append(bytes(data))
        return decode(data, raw=raw)

    decoder.decode = counted  # type: ignore[method-assign]
    for _ in range(5):
        stream_id, data = pair.request()
        assert replies(pair.answer_raw(data)) == {stream_id: OK_REPLY}
    assert len(blocks) == 1
    # Another call's :path, a literal the first time, goes through h2 and into
    # the table; then the blocks of both calls are decoded once each.
    _, data = pair.request(headers=headers_for("GetPreferredAllocation"))
    pair.served(pair.server.receive_data(data))
    pair.pump()
    blocks.clear()
    for method in ("Allocate", "GetPreferredAllocation") * 3:
        stream_id, data = pair.request(headers=headers_for(method))
        assert set(replies(pair.answer_raw(data))) == {stream_id}
    assert len(blocks) == 2


def test_a_header_block_is_decoded_anew_once_the_table_has_changed() -> None:
    """The same indexed fields mean other headers once the peer added to the
    table: the block is read as the table says now, as h2 would read it."""
    pair = Pair()
    pair.warm()
    stream_id, data = pair.request()
    block = data[9 : 9 + int.from_bytes(data[:3], "big")]
    assert min(block) >= 0x80  # indexed fields only
    assert replies(pair.answer_raw(data)) == {stream_id: OK_REPLY}
    # A call with a new header: h2 takes it, and both tables gain an entry,
    # which moves every dynamic index by one.
    _, data = pair.request(headers=[*headers_for("GetPreferredAllocation"), ("x-new", "1")])
    pair.served(pair.server.receive_data(data))
    pair.pump()
    now = [
        (name.decode(), value.decode())
        for name, value in pair.server.decoder.decode(block, raw=True)
    ]
    assert now != HEADERS  # the same bytes, other headers
    stream_id = pair.client.get_next_available_stream_id()
    replayed = headers_frame(stream_id, block) + raw_calls._frame(0x0, 0x1, stream_id, framed(b"x"))
    found = raw_calls.read(replayed, pair.server, ANSWERS)
    route = unary.call_route(now, ANSWERS)
    if route is None:
        assert found is None
    else:
        assert found is not None and found.calls[0].path == route[0] != BASE + "Allocate"
