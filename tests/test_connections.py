"""The plugin sockets' gRPC server, driven over a raw HTTP/2 client: which
connection each call is on, what the server does with frames RFC 9113 says
to ignore, and how malformed calls are answered."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import struct
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import pytest

from dp_core import (
    Input,
    OptionsRequested,
    PluginOptions,
    Reject,
    Reply,
    StatusCode,
)
from dp_core.dra.claims import ClaimRef
from dp_server.deviceplugin import wire
from dp_server.deviceplugin.connections import ConnectionServer, NoConnection, current_connection
from dp_server.deviceplugin.service import SERVICE_PREFIX, DevicePluginService
from dp_server.dra import DraEndpoints, PrepareOutcome, refused
from dp_server.proto import v1beta1 as pb


class Node:
    """The service's NodeCalls, recording each call's connection."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, type[Input]]] = []

    def call(self, connection: int, make: object) -> Reply | Reject | None:
        event = make(connection, len(self.calls) + 1, 0.0)  # type: ignore[operator]
        self.calls.append((connection, type(event)))
        if isinstance(event, OptionsRequested):
            return Reply(event.call, PluginOptions(pre_start_required=True))
        return Reject(event.call, StatusCode.FAILED_PRECONDITION, "refused by the test")

    @contextlib.asynccontextmanager
    async def watch(self, connection: int) -> AsyncIterator[AsyncIterator[bytes]]:
        async def nothing() -> AsyncIterator[bytes]:
            if False:
                yield b""

        yield nothing()


class Events:
    def __init__(self) -> None:
        self.made: list[int] = []
        self.lost: list[int] = []

    def opened(self, listener: str | None) -> int:
        connection = 100 + len(self.made)
        self.made.append(connection)
        return connection

    def closed(self, connection: int) -> None:
        self.lost.append(connection)


class Client:
    """A raw HTTP/2 client on the plugin socket: frames as we choose them."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.h2.initiate_connection()
        self.writer.write(self.h2.data_to_send())

    @classmethod
    async def connect(cls, path: Path) -> Client:
        reader, writer = await asyncio.open_unix_connection(str(path))
        return cls(reader, writer)

    def send_raw(self, frame: bytes) -> None:
        self.writer.write(frame)

    async def unary(self, method: str, message: bytes | None) -> dict[str, str]:
        """Call `method` (a device-plugin method, or a whole path); the response's
        headers and trailers, and its body as `body`."""
        stream = self.h2.get_next_available_stream_id()
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", method if method.startswith("/") else SERVICE_PREFIX + method),
            (":authority", "localhost"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
        self.h2.send_headers(stream, headers, end_stream=message is None)
        if message is not None:
            self.h2.send_data(stream, b"\x00" + struct.pack(">I", len(message)) + message, True)
        self.writer.write(self.h2.data_to_send())
        answer: dict[str, str] = {}
        body = b""
        while True:
            data = await asyncio.wait_for(self.reader.read(65536), 5)
            assert data, "the server closed the connection"
            for event in self.h2.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                    answer.update((_text(k), _text(v)) for k, v in event.headers)
                    answer.setdefault("header blocks", "")
                    answer["header blocks"] += (
                        "H" if isinstance(event, h2.events.ResponseReceived) else "T"
                    )
                elif isinstance(event, h2.events.DataReceived):
                    body += event.data
                    self.h2.acknowledge_received_data(event.flow_controlled_length, stream)
                elif isinstance(event, h2.events.StreamEnded) and event.stream_id == stream:
                    self.writer.write(self.h2.data_to_send())
                    answer["body"] = body[5:].hex()
                    return answer
            self.writer.write(self.h2.data_to_send())

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[Path, Node, Events]]:
    node, events = Node(), Events()
    server = ConnectionServer(
        [DevicePluginService(node)], events, None, codec=wire.PreEncodedCodec()
    )
    path = tmp_path / "dp.sock"
    await server.start(path=str(path))
    try:
        yield path, node, events
    finally:
        server.close()
        await server.wait_closed()


def _options(answer: dict[str, str]) -> pb.DevicePluginOptions:
    return pb.DevicePluginOptions.parse(bytes.fromhex(answer["body"]))


async def test_each_call_is_attributed_to_its_own_connection(
    served: tuple[Path, Node, Events],
) -> None:
    path, node, events = served
    first, second = await Client.connect(path), await Client.connect(path)
    try:
        await first.unary("GetDevicePluginOptions", b"")
        await second.unary("GetDevicePluginOptions", b"")
        await first.unary("GetDevicePluginOptions", b"")
    finally:
        await first.close()
        await second.close()
    assert len(events.made) == 2
    a, b = events.made
    assert [connection for connection, _ in node.calls] == [a, b, a]
    async with asyncio.timeout(5):
        while len(events.lost) < 2:
            await asyncio.sleep(0.01)
    assert sorted(events.lost) == [a, b]


async def test_an_extension_frame_is_ignored_and_the_connection_keeps_serving(
    served: tuple[Path, Node, Events],
) -> None:
    """RFC 9113 §5.5: a frame of an unknown type must be ignored. Before it
    is read and after, calls on the connection are answered."""
    path, node, events = served
    client = await Client.connect(path)
    try:
        before = await client.unary("GetDevicePluginOptions", b"")
        payload = b"an extension"
        # length (24 bits), type 0xFA (unknown), flags, stream 0
        client.send_raw(struct.pack(">I", len(payload))[1:] + b"\xfa\x00" + b"\0\0\0\0" + payload)
        after = await client.unary("GetDevicePluginOptions", b"")
    finally:
        await client.close()
    assert before["grpc-status"] == after["grpc-status"] == "0"
    assert _options(after).pre_start_required is True
    assert len(events.made) == 1
    assert [connection for connection, _ in node.calls] == events.made * 2


async def test_a_core_rejection_becomes_its_status_code(
    served: tuple[Path, Node, Events],
) -> None:
    path, _, _ = served
    client = await Client.connect(path)
    request = bytes(
        pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["x"])])
    )
    try:
        answer = await client.unary("Allocate", request)
    finally:
        await client.close()
    assert answer["grpc-status"] == str(StatusCode.FAILED_PRECONDITION.value)
    assert answer["grpc-message"] == "refused by the test"


@pytest.mark.parametrize(
    ("method", "message", "problem"),
    [
        ("Allocate", b"\x0a\x05\x0a\x01", "runs past the end"),
        ("Allocate", None, "carried no request message"),
        ("GetPreferredAllocation", b"\x0a\x03\x0a\x01\xff", "malformed request"),
    ],
)
async def test_a_malformed_call_is_invalid_argument_and_the_connection_lives(
    served: tuple[Path, Node, Events], method: str, message: bytes | None, problem: str
) -> None:
    path, node, _ = served
    client = await Client.connect(path)
    try:
        answer = await client.unary(method, message)
        again = await client.unary("GetDevicePluginOptions", b"")
    finally:
        await client.close()
    assert answer["grpc-status"] == "3"  # INVALID_ARGUMENT
    assert problem in answer["grpc-message"]
    assert again["grpc-status"] == "0"
    assert [kind for _, kind in node.calls] == [OptionsRequested]  # the bad call reached no one


def test_outside_a_call_there_is_no_connection() -> None:
    with pytest.raises(NoConnection):
        current_connection()


class Preparer:
    async def prepare(self, claims: Sequence[ClaimRef]) -> list[PrepareOutcome | Exception]:
        return [refused(claim, "not in this test", "Test") for claim in claims]

    async def unprepare(self, claim: ClaimRef) -> str | None:
        return None


def _well_formed_unimplemented(answer: dict[str, str], path: str) -> None:
    """gRPC's PROTOCOL-HTTP2.md: Trailers-Only is `:status` 200, a content-type
    of application/grpc[+...] and the status, in one header block ending the stream."""
    assert answer["header blocks"] == "H", answer  # trailers-only: one block
    assert answer[":status"] == "200"
    assert answer.get("content-type", "").startswith("application/grpc"), answer
    assert answer["grpc-status"] == "12", answer  # UNIMPLEMENTED
    assert path in answer["grpc-message"]


@pytest.mark.parametrize("path", ["/no.such.Service/Method", "/v1beta1.DevicePlugin/Unheard"])
async def test_a_method_not_served_on_a_plugin_socket_is_a_well_formed_unimplemented(
    served: tuple[Path, Node, Events], path: str
) -> None:
    socket_path, node, _ = served
    client = await Client.connect(socket_path)
    try:
        answer = await client.unary(path, b"")
        again = await client.unary("GetDevicePluginOptions", b"")
    finally:
        await client.close()
    _well_formed_unimplemented(answer, path)
    assert again["grpc-status"] == "0"
    assert [kind for _, kind in node.calls] == [OptionsRequested]  # the unknown call reached no one


@pytest.mark.parametrize("socket", ["dra", "registration"])
async def test_a_method_not_served_on_a_dra_socket_is_a_well_formed_unimplemented(
    socket: str,
) -> None:
    root = Path(tempfile.mkdtemp(prefix="dp-unimpl-"))  # short: Unix socket paths
    for kubelets in ("reg", "plugins"):  # as a kubelet makes them at start
        (root / kubelets).mkdir()
    endpoints = DraEndpoints("x.example.com", root / "reg", root / "plugins", Preparer())
    await endpoints.start()
    path = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeNoSuchThing"
    try:
        client = await Client.connect(
            endpoints.dra_socket_path if socket == "dra" else endpoints.registration_socket_path
        )
        try:
            answer = await client.unary(path, b"")
            again = await client.unary("/pluginregistration.Registration/GetInfo", b"")
        finally:
            await client.close()
    finally:
        await endpoints.close()
        shutil.rmtree(root, ignore_errors=True)
    _well_formed_unimplemented(answer, path)
    # The connection lives: the next call is answered (served, or well-formed UNIMPLEMENTED).
    assert again["grpc-status"] == ("0" if socket == "registration" else "12")
    assert again.get("content-type", "").startswith("application/grpc")
