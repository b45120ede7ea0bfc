"""Whole unary calls answered in the turn they are read (dp_server.unary), against
grpclib's own answers: a raw HTTP/2 client sends exactly the bytes each case needs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from dp_core import AllocateRequested, OptionsRequested, SocketMode, WatchStarted
from dp_server import raw_calls, transport, unary
from dp_server.emulator._rpc import dp

from e2e_harness import GPU, Harness, live, served_protocol

BASE = "/v1beta1.DevicePlugin/"

REQUEST_HEADERS = [
    (":method", "POST"),
    (":scheme", "http"),
    (":authority", "localhost"),
    ("te", "trailers"),
    ("content-type", "application/grpc"),
    ("user-agent", "grpc-go/1.65.0"),
    ("grpc-timeout", "9999854u"),
]


def framed(message: bytes, *, compressed: bool = False) -> bytes:
    return bytes([compressed]) + len(message).to_bytes(4, "big") + message


def request_headers(method: str, **changes: str | None) -> list[tuple[str, str]]:
    headers = [(":path", BASE + method), *REQUEST_HEADERS]
    for name, value in changes.items():
        name = name.replace("_", "-")
        headers = [(k, v) for k, v in headers if k != name]
        if value is not None:
            headers.append((name, value))
    return headers


class RawClient:
    """An HTTP/2 client written with h2 directly."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="ascii")
        )
        self.replies: dict[int, dict[str, Any]] = {}
        self.acknowledge = True  # False: a peer that never opens its windows again

    @classmethod
    async def connect(cls, path: str, window: int | None = None) -> RawClient:
        client = cls(*await asyncio.open_unix_connection(path))
        client.h2.initiate_connection()
        if window is not None:
            client.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        await client.flush()
        return client

    def call(self, headers: list[tuple[str, str]], body: bytes) -> int:
        """Queue one call's frames; `flush` sends everything queued in one write."""
        stream_id = self.h2.get_next_available_stream_id()
        self.h2.send_headers(stream_id, headers, end_stream=not body)
        frame = self.h2.max_outbound_frame_size
        for start in range(0, len(body), frame):
            last = start + frame >= len(body)
            self.h2.send_data(stream_id, body[start : start + frame], end_stream=last)
        self.replies[stream_id] = {"headers": [], "data": b"", "trailers": [], "frames": 0}
        return stream_id

    async def flush(self) -> None:
        self.writer.write(self.h2.data_to_send())
        await self.writer.drain()

    async def reply(self, stream_id: int, timeout: float = 5) -> dict[str, Any]:
        reply = self.replies[stream_id]
        async with asyncio.timeout(timeout):
            while "ended" not in reply:
                data = await self.reader.read(65536)
                assert data, "the server closed the connection"
                for event in self.h2.receive_data(data):
                    self._record(event)
                await self.flush()
        return reply

    def _record(self, event: h2.events.Event) -> None:
        reply = self.replies.get(getattr(event, "stream_id", 0) or 0)
        if reply is None:
            return
        if isinstance(event, h2.events.ResponseReceived):
            reply["headers"] = list(event.headers or [])
        elif isinstance(event, h2.events.DataReceived):
            reply["data"] += event.data
            reply["frames"] += 1
            if self.acknowledge:
                self.h2.acknowledge_received_data(
                    event.flow_controlled_length or 0, event.stream_id
                )
        elif isinstance(event, h2.events.TrailersReceived):
            reply["trailers"] = list(event.headers or [])
        elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
            reply["ended"] = True

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


@pytest.fixture
async def gpu_socket(harness: Harness) -> tuple[str, list[str]]:
    """Serve one socket per resource (connections on the GPU's are the GPU's); the GPU socket
    and device IDs."""
    await harness.serve(socket_mode=SocketMode.PER_RESOURCE)
    assert harness.emulator is not None
    state = harness.emulator.resources()[GPU]
    assert state.endpoint is not None
    return str(harness.plugin_dir / state.endpoint), sorted(state.devices)


def allocate_request(*ids: str) -> bytes:
    request = dp.AllocateRequest(container_requests=[dp.ContainerAllocateRequest(devices_ids=ids)])
    return bytes(request.SerializeToString())


def cases(devices: list[str]) -> dict[str, tuple[list[tuple[str, str]], bytes]]:
    """Calls that must get the same answer whether or not they are answered whole."""
    return {
        "options": (request_headers("GetDevicePluginOptions"), framed(b"")),
        "allocate": (request_headers("Allocate"), framed(allocate_request(devices[0]))),
        "allocate an unknown device": (
            request_headers("Allocate"),
            framed(allocate_request("0000:ff:1f.7")),
        ),
        "allocate, malformed": (request_headers("Allocate"), framed(b"\x0a\x05ab")),
        "preferred": (
            request_headers("GetPreferredAllocation"),
            framed(
                dp.PreferredAllocationRequest(
                    container_requests=[
                        dp.ContainerPreferredAllocationRequest(
                            available_deviceIDs=devices, allocation_size=1
                        )
                    ]
                ).SerializeToString()
            ),
        ),
        "pre-start": (request_headers("PreStartContainer"), framed(b"")),
        "proto content type": (
            request_headers("Allocate", content_type="application/grpc+proto"),
            framed(allocate_request(devices[0])),
        ),
        "no message": (request_headers("Allocate"), b""),
        "compressed": (request_headers("Allocate"), framed(b"x", compressed=True)),
        "two messages": (request_headers("Allocate"), framed(b"") + framed(b"")),
        "no te": (request_headers("Allocate", te=None), framed(b"")),
        "json": (request_headers("Allocate", content_type="application/grpc+json"), framed(b"")),
        "bad timeout": (request_headers("Allocate", grpc_timeout="soon"), framed(b"")),
        "deadline passed": (
            request_headers("Allocate", grpc_timeout="0n"),
            framed(allocate_request(devices[0])),
        ),
        "unknown method": (request_headers("Frobnicate"), framed(b"")),
    }


# The cases of `cases` that are answered without grpclib: whole in one read
# (`unary`) or, sent again, read from their frames (`raw_calls`).
ANSWERED_WHOLE = {
    "options",
    "allocate",
    "allocate an unknown device",
    "allocate, malformed",
    "preferred",
    "pre-start",
    "proto content type",
}


async def answers(
    path: str, devices: list[str], monkeypatch: pytest.MonkeyPatch, *, whole: bool
) -> tuple[dict[str, dict[str, Any]], set[str]]:
    """Each case's reply, and the cases answered whole."""
    answered_whole: set[str] = set()
    with monkeypatch.context() as patch:
        if not whole:
            patch.setattr(unary, "whole_calls", lambda events, answers: {})
            patch.setattr(raw_calls, "read", lambda data, h2, answers: None)
        reply_frames = unary.reply_frames

        def spy(call: unary.WholeCall, connection: int) -> Any:
            answered_whole.add(name)
            return reply_frames(call, connection)

        patch.setattr(unary, "reply_frames", spy)
        client = await RawClient.connect(path)
        try:
            replies = {}
            for name, (headers, body) in cases(devices).items():
                stream_id = client.call(headers, body)
                await client.flush()
                replies[name] = await client.reply(stream_id)
            return replies, answered_whole
        finally:
            await client.close()


async def test_whole_calls_are_answered_exactly_as_grpclib_answers_them(
    gpu_socket: tuple[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, devices = gpu_socket
    by_grpclib, none = await answers(path, devices, monkeypatch, whole=False)
    whole, answered_whole = await answers(path, devices, monkeypatch, whole=True)
    assert whole == by_grpclib
    assert none == set()
    assert answered_whole == ANSWERED_WHOLE
    # The cases say what they mean to:
    ok = ("grpc-status", "0")
    assert ok in whole["allocate"]["trailers"] and b"/dev/vfio/" in whole["allocate"]["data"]
    assert ok in whole["options"]["trailers"] and ok in whole["pre-start"]["trailers"]
    assert ok in whole["preferred"]["trailers"]
    assert any(device.encode() in whole["preferred"]["data"] for device in devices)
    assert ("grpc-status", "3") in whole["allocate an unknown device"]["headers"]
    assert ("grpc-status", "3") in whole["allocate, malformed"]["headers"]
    assert ("grpc-status", "12") in whole["unknown method"]["headers"]
    assert ("grpc-status", "3") in whole["no message"]["headers"]
    assert ("grpc-status", "0") not in whole["deadline passed"]["trailers"]


async def test_repeated_calls_read_from_their_frames_are_answered_as_grpclib_answers_them(
    gpu_socket: tuple[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A call's second sending repeats its headers as indexed fields only, which
    # is what `raw_calls` reads; the first, with literals, goes through h2.
    path, devices = gpu_socket
    seconds: dict[bool, dict[str, dict[str, Any]]] = {}
    read_raw: set[str] = set()
    case = [""]
    read = raw_calls.read

    def spy(data: bytes, h2: Any, answers: Any) -> Any:
        found = read(data, h2, answers)
        if found is not None:
            read_raw.add(case[0])
        return found

    for whole in (False, True):
        with monkeypatch.context() as patch:
            patch.setattr(raw_calls, "read", spy)
            if not whole:
                patch.setattr(unary, "whole_calls", lambda events, answers: {})
                patch.setattr(raw_calls, "read", lambda data, h2, answers: None)
            client = await RawClient.connect(path)
            try:
                # The first reply brings the server's SETTINGS, whose ACK the
                # client sends with its next call: a read raw_calls leaves to h2.
                stream_id = client.call(request_headers("GetDevicePluginOptions"), framed(b""))
                await client.flush()
                await client.reply(stream_id)
                seconds[whole] = {}
                for case[0], (headers, body) in cases(devices).items():
                    for _ in range(2):
                        stream_id = client.call(headers, body)
                        await client.flush()
                        seconds[whole][case[0]] = await client.reply(stream_id)
            finally:
                await client.close()
    assert seconds[True] == seconds[False]
    assert read_raw == ANSWERED_WHOLE
    ok = ("grpc-status", "0")
    assert ok in seconds[True]["allocate"]["trailers"]
    assert b"/dev/vfio/" in seconds[True]["allocate"]["data"]
    assert ("grpc-status", "3") in seconds[True]["allocate an unknown device"]["headers"]


class NarrowAfterWide:
    """An Allocate answered on a connection with room, to compare with the same
    call on one whose peer lets 40 bytes through at a time."""

    def __init__(
        self, narrow: RawClient, call: tuple[Any, bytes], expected: dict[str, Any]
    ) -> None:
        self.narrow = narrow
        self.call = call
        self.expected = expected

    async def narrow_allocate(self) -> None:
        """The call on the narrow connection: the same reply, in more frames."""
        stream_id = self.narrow.call(*self.call)
        await self.narrow.flush()
        reply = await self.narrow.reply(stream_id)
        assert reply["frames"] > 2  # 40 bytes at a time
        assert {k: v for k, v in reply.items() if k != "frames"} == {
            k: v for k, v in self.expected.items() if k != "frames"
        }


@contextlib.asynccontextmanager
async def narrow_after_wide(path: str, device: str) -> AsyncIterator[NarrowAfterWide]:
    wide = await RawClient.connect(path)
    narrow = await RawClient.connect(path, window=40)
    try:
        call = request_headers("Allocate"), framed(allocate_request(device))
        stream_id = wide.call(*call)
        await wide.flush()
        yield NarrowAfterWide(narrow, call, await wide.reply(stream_id))
    finally:
        await wide.close()
        await narrow.close()


async def test_a_repeated_call_too_large_for_the_window_is_answered_once_through_h2(
    gpu_socket: tuple[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, devices = gpu_socket
    asked: list[int] = []
    reply_frames = unary.reply_frames

    def counting(call: unary.WholeCall, connection: int) -> Any:
        asked.append(call.stream_id)
        return reply_frames(call, connection)

    monkeypatch.setattr(unary, "reply_frames", counting)
    async with narrow_after_wide(path, devices[0]) as pair:
        asked.clear()
        for _ in range(2):
            await pair.narrow_allocate()
        # The second was read raw, found not to fit, and went out through h2
        # with the answer made: the core was asked once per call.
        assert asked == [1, 3]


async def test_a_connection_window_update_read_raw_reaches_grpclib() -> None:
    protocol, raw = served_protocol({BASE + "Allocate": echo})
    processed: list[h2.events.Event] = []
    process = protocol.processor.process
    protocol.processor.process = lambda event: (processed.append(event), process(event))[1]
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    for stream_id in (1, 3):
        client.send_headers(stream_id, request_headers("Allocate"))
        client.send_data(stream_id, framed(b"ids"), end_stream=True)
        if stream_id == 3:
            client.increment_flow_control_window(777)
        protocol.data_received(client.data_to_send())
    events = client.receive_data(b"".join(raw.sent))
    assert [e.stream_id for e in events if isinstance(e, h2.events.StreamEnded)] == [1, 3]
    [update] = [e for e in processed if isinstance(e, h2.events.WindowUpdated)]
    assert (update.stream_id, update.delta) == (0, 777)
    # Stream 3 never reached grpclib's processor: it was read raw.
    assert {getattr(e, "stream_id", 0) for e in processed} <= {0, 1}


async def test_a_read_h2_refuses_is_not_answered_by_the_core_first() -> None:
    # A reply too large for the window sends the read back to h2 with the answer
    # made; the read must be one h2 accepts, or the core answered a call that
    # is never sent (here: a body longer than its content-length).
    asked: list[bytes] = []

    def allocate(connection: int, message: bytes) -> bytes:
        asked.append(message)
        return b"re:" + message * 100  # larger than the peer's stream window

    protocol, sent = served_protocol({BASE + "Allocate": allocate})
    client = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding="ascii")
    )
    client.initiate_connection()
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 64})
    client.receive_data(b"".join(sent.sent))
    headers = [*request_headers("Allocate"), ("content-length", "8")]
    client.send_headers(1, headers)
    client.send_data(1, framed(b"ids"), end_stream=True)  # as declared: served
    protocol.data_received(client.data_to_send())
    await asyncio.sleep(0.05)
    client.receive_data(b"".join(sent.sent))
    protocol.data_received(client.data_to_send())  # the SETTINGS ACK, alone
    await asyncio.sleep(0.05)
    assert asked == [b"ids"] and not sent.closed
    client.send_headers(3, headers)  # indexed fields only now
    client.send_data(3, framed(b"idsx"), end_stream=True)  # 9 bytes, not 8
    protocol.data_received(client.data_to_send())
    await asyncio.sleep(0.05)
    assert sent.closed or sent.aborted  # h2 refused the read
    assert asked == [b"ids"]  # and the core was not asked for the refused call
    protocol.connection_lost(None)


async def test_a_call_split_across_reads_is_answered_by_grpclib(
    gpu_socket: tuple[str, list[str]],
) -> None:
    path, devices = gpu_socket
    client = await RawClient.connect(path)
    try:
        whole = client.call(request_headers("Allocate"), framed(allocate_request(devices[0])))
        await client.flush()
        expected = await client.reply(whole)
        stream_id = client.h2.get_next_available_stream_id()
        client.replies[stream_id] = {"headers": [], "data": b"", "trailers": [], "frames": 0}
        client.h2.send_headers(stream_id, request_headers("Allocate"))
        await client.flush()
        await asyncio.sleep(0.05)
        client.h2.send_data(stream_id, framed(allocate_request(devices[0])), end_stream=True)
        await client.flush()
        assert await client.reply(stream_id) == expected
    finally:
        await client.close()


async def test_a_reply_larger_than_the_peer_lets_through_goes_out_as_windows_open(
    gpu_socket: tuple[str, list[str]],
) -> None:
    path, devices = gpu_socket
    async with narrow_after_wide(path, devices[0]) as pair:
        assert len(pair.expected["data"]) > 2 * 40, pair.expected
        await pair.narrow_allocate()
        # The connection serves on afterwards.
        narrow = pair.narrow
        stream_id = narrow.call(request_headers("GetDevicePluginOptions"), framed(b""))
        await narrow.flush()
        assert ("grpc-status", "0") in (await narrow.reply(stream_id))["trailers"]


async def test_a_reply_the_peer_never_lets_through_ends_at_the_call_deadline(
    gpu_socket: tuple[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, devices = gpu_socket
    replies = []
    for whole in (False, True):
        with monkeypatch.context() as patch:
            if not whole:
                patch.setattr(unary, "whole_calls", lambda events, answers: {})
            client = await RawClient.connect(path, window=40)
            client.acknowledge = False
            try:
                stream_id = client.call(
                    request_headers("Allocate", grpc_timeout="200m"),
                    framed(allocate_request(devices[0])),
                )
                await client.flush()
                replies.append(await client.reply(stream_id))
            finally:
                await client.close()
    by_grpclib, answered_whole = replies
    assert by_grpclib["trailers"] == [("grpc-status", "4")] and by_grpclib["frames"] == 1
    assert answered_whole == by_grpclib


async def test_a_reply_still_waiting_for_its_window_ends_with_the_connection(
    gpu_socket: tuple[str, list[str]],
) -> None:
    path, devices = gpu_socket
    narrow = await RawClient.connect(path, window=40)
    narrow.call(request_headers("Allocate"), framed(allocate_request(devices[0])))
    await narrow.flush()
    waiting = []
    async with asyncio.timeout(5):
        while not waiting:
            await asyncio.sleep(0.01)
            waiting = [p for p in live(transport._TrackedProtocol) if p._late_replies]
    await narrow.close()  # without ever opening the window
    async with asyncio.timeout(5):
        while waiting[0]._late_replies:
            await asyncio.sleep(0.01)


async def test_a_request_larger_than_one_read_is_answered(
    gpu_socket: tuple[str, list[str]],
) -> None:
    path, devices = gpu_socket
    unknown = [f"0000:{n >> 8 & 0xFF:02x}:{n >> 3 & 0x1F:02x}.{n & 7}-{n}" for n in range(8000)]
    request = framed(allocate_request(devices[0], *unknown))
    assert len(request) > 2 * transport._READ_BUFFER_SIZE
    client = await RawClient.connect(path)
    try:
        # The server's SETTINGS open its windows wide enough for the request.
        async with asyncio.timeout(5):
            while len(request) > min(
                client.h2.outbound_flow_control_window,
                client.h2.remote_settings.initial_window_size,
            ):
                client.h2.receive_data(await client.reader.read(65536))
        stream_id = client.call(request_headers("Allocate"), request)
        await client.flush()
        reply = await client.reply(stream_id)
        assert ("grpc-status", "3") in reply["headers"]
        [message] = [value for name, value in reply["headers"] if name == "grpc-message"]
        assert unknown[0] in message
    finally:
        await client.close()


@pytest.mark.parametrize("first", ["ListAndWatch", "GetDevicePluginOptions"])
async def test_calls_read_together_reach_the_core_in_the_order_they_were_sent(
    gpu_socket: tuple[str, list[str]],
    harness: Harness,
    monkeypatch: pytest.MonkeyPatch,
    first: str,
) -> None:
    # Which call opens a connection decides one-socket attribution, so a call
    # answered whole must not overtake one grpclib was handed first.
    path, devices = gpu_socket
    runtime = harness.runtime
    assert runtime is not None
    seen: list[str] = []
    feed = runtime.feed

    def recording_feed(event: Any) -> Any:
        if isinstance(event, WatchStarted | OptionsRequested | AllocateRequested):
            seen.append(type(event).__name__)
        return feed(event)

    monkeypatch.setattr(runtime, "feed", recording_feed)
    client = await RawClient.connect(path)
    try:
        second = "GetDevicePluginOptions" if first == "ListAndWatch" else "ListAndWatch"
        for method in (first, second):
            client.call(request_headers(method), framed(b""))
        allocate = client.call(request_headers("Allocate"), framed(allocate_request(devices[0])))
        await client.flush()
        await client.reply(allocate)
        expected = {"ListAndWatch": "WatchStarted", "GetDevicePluginOptions": "OptionsRequested"}
        assert seen == [expected[first], expected[second], "AllocateRequested"]
    finally:
        await client.close()


def events_of(*calls: tuple[list[tuple[str, str]], bytes, bool]) -> list[h2.events.Event]:
    """The events a server reads from a client sending `calls` (headers, body, end) at once."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    server = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=False, header_encoding="ascii")
    )
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    for headers, body, end in calls:
        stream_id = client.get_next_available_stream_id()
        client.send_headers(stream_id, headers, end_stream=end and not body)
        if body:
            client.send_data(stream_id, body, end_stream=end)
    return server.receive_data(client.data_to_send())


def answer(connection: int, message: bytes) -> bytes:
    return message


def echo(connection: int, message: bytes) -> bytes:
    return b"re:" + message


ANSWERS = {BASE + "Allocate": answer}


def test_a_whole_call_is_found_among_other_streams() -> None:
    events = events_of(
        (request_headers("ListAndWatch"), framed(b""), True),
        (request_headers("Allocate"), framed(b"ids"), True),
        (request_headers("Allocate"), framed(b"more"), False),  # not ended yet
    )
    calls = unary.whole_calls(events, ANSWERS)
    assert list(calls) == [3]
    assert calls[3].message() == b"ids" and calls[3].answer is answer
    assert calls[3].flow_controlled == len(framed(b"ids"))


@pytest.mark.parametrize(
    "headers, body",
    [
        (request_headers("Allocate", content_type="application/grpc+json"), framed(b"")),
        (request_headers("Allocate", te=None), framed(b"")),
        (request_headers("Allocate", grpc_timeout="1x"), framed(b"")),
        (request_headers("ListAndWatch"), framed(b"")),
        (request_headers("Allocate"), framed(b"x", compressed=True)),
        (request_headers("Allocate"), framed(b"xy")[:-1]),
        (request_headers("Allocate"), framed(b"x") + framed(b"y")),
        (request_headers("Allocate"), b""),
        ([(k, "GET" if k == ":method" else v) for k, v in request_headers("Allocate")], b"\0" * 5),
    ],
)
def test_calls_grpclib_must_answer_are_not_whole(
    headers: list[tuple[str, str]], body: bytes
) -> None:
    assert unary.whole_calls(events_of((headers, body, True)), ANSWERS) == {}


def test_a_call_reset_in_the_same_read_is_not_whole() -> None:
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    server = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=False, header_encoding="ascii")
    )
    client.initiate_connection()
    server.receive_data(client.data_to_send())
    client.send_headers(1, request_headers("Allocate"))
    client.send_data(1, framed(b"ids"), end_stream=True)
    client.reset_stream(1)
    events = server.receive_data(client.data_to_send())
    assert unary.whole_calls(events, ANSWERS) == {}


def whole_call(answer: unary.Answer) -> unary.WholeCall:
    events = events_of((request_headers("Allocate"), framed(b"ids"), True))
    [call] = unary.whole_calls(events, {BASE + "Allocate": answer}).values()
    return call


def test_an_answer_is_framed_as_one_message_after_the_response_headers() -> None:
    headers, message = unary.reply_frames(whole_call(lambda conn, m: m + str(conn).encode()), 7)
    assert headers == [(":status", "200"), ("content-type", "application/grpc+proto")]
    assert message == framed(b"ids7")


def test_an_error_status_is_a_trailers_only_response() -> None:
    def refuse(connection: int, message: bytes) -> bytes:
        raise GRPCError(Status.INVALID_ARGUMENT, "unknown device 'gpu-é'")

    headers, message = unary.reply_frames(whole_call(refuse), 1)
    assert message is None
    assert headers[2:] == [("grpc-status", "3"), ("grpc-message", "unknown device 'gpu-%C3%A9'")]


def test_a_failing_answer_is_logged_and_answered_unknown(caplog: pytest.LogCaptureFixture) -> None:
    def broken(connection: int, message: bytes) -> bytes:
        raise KeyError("bug")

    headers, message = unary.reply_frames(whole_call(broken), 1)
    assert message is None
    assert headers[2:] == [("grpc-status", "2"), ("grpc-message", "Internal Server Error")]
    [record] = [r for r in caplog.records if r.getMessage() == "call-failed"]
    assert record.dp_fields == {"rpc": BASE + "Allocate"} and record.exc_info


async def test_a_whole_call_is_answered_and_sent_in_the_turn_that_reads_it() -> None:
    protocol, raw = served_protocol({BASE + "Allocate": echo})
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    client.send_headers(1, request_headers("Allocate"))
    client.send_data(1, framed(b"ids"), end_stream=True)
    protocol.data_received(client.data_to_send())
    # No turn of the loop has passed: the reply went out with the read.
    events = client.receive_data(b"".join(raw.sent))
    [data] = [e for e in events if isinstance(e, h2.events.DataReceived)]
    assert data.data == framed(b"re:ids")
    [trailers] = [e for e in events if isinstance(e, h2.events.TrailersReceived)]
    assert trailers.headers == [(b"grpc-status", b"0")]
