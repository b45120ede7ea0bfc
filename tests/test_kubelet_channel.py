"""Register calls sent within the caller's callback (`KubeletChannel.send_unary`).

After the first Register the channel to kubelet.sock is connected, and each
later request goes out before `send_unary` returns, as grpclib would have sent
it a loop turn later; the reply and its status are read by grpclib.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpclib.const
import h2.connection
import pytest
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError
from grpclib.server import Server

from dp_core import PluginOptions, Register
from dp_server import wire
from dp_server.emulator import KubeletEmulator
from dp_server.register_client import REGISTER_PATH
from dp_server.transport import KubeletChannel

from e2e_harness import Harness

pytestmark = pytest.mark.asyncio

REFUSAL = "refused by the test"


def register_request(resource: str) -> bytes:
    return wire.register_request(f"{resource.replace('/', '-')}.sock", resource, PluginOptions())


class Kubelet:
    """A Registration service on grpclib that records each request and answers Empty."""

    def __init__(self) -> None:
        self.requests: list[bytes] = []

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            REGISTER_PATH: grpclib.const.Handler(
                self._register, Cardinality.UNARY_UNARY, wire.Raw, wire.Raw
            )
        }

    async def _register(self, stream: Any) -> None:
        self.requests.append(await stream.recv_message())
        await stream.send_message(b"")


@pytest.fixture
async def kubelet(tmp_path: Path) -> AsyncIterator[tuple[Kubelet, Path]]:
    service = Kubelet()
    server = Server([service], codec=wire.PreEncodedCodec())
    path = tmp_path / "kubelet.sock"
    await server.start(path=str(path))
    try:
        yield service, path
    finally:
        server.close()
        await server.wait_closed()


@pytest.fixture
def channel_to(tmp_path: Path) -> Iterator[Any]:
    channels: list[KubeletChannel] = []

    def make(path: Path) -> KubeletChannel:
        channels.append(KubeletChannel(path=str(path), codec=wire.PreEncodedCodec()))
        return channels[-1]

    yield make
    for channel in channels:
        channel.close()


def recorded_headers(monkeypatch: pytest.MonkeyPatch) -> list[list[tuple[str, str]]]:
    """The request headers of every stream the client's h2 opens from now on."""
    seen: list[list[tuple[str, str]]] = []
    send_headers = h2.connection.H2Connection.send_headers

    def record(self: h2.connection.H2Connection, stream_id: int, headers: Any, **kw: Any) -> Any:
        if self.config.client_side:
            seen.append([(str(k), str(v)) for k, v in headers])
        return send_headers(self, stream_id, headers, **kw)

    monkeypatch.setattr(h2.connection.H2Connection, "send_headers", record)
    return seen


async def test_a_connected_channel_sends_the_request_before_send_unary_returns(
    tmp_path: Path, channel_to: Any
) -> None:
    # The kubelet runs in threads of its own: it sees the request while this
    # loop is blocked, so the request left in the call, not a loop turn later.
    emulator = KubeletEmulator(tmp_path / "plugins", refuse=lambda request: REFUSAL).start()
    try:
        channel = channel_to(emulator.socket_path)
        with pytest.raises(GRPCError):  # connects the channel
            await channel.unary(REGISTER_PATH, register_request("example.com/first"), 5.0)
        sent = channel.send_unary(REGISTER_PATH, register_request("example.com/second"))
        assert sent is not None
        deadline = time.monotonic() + 10.0
        while not emulator.events_of("register", "example.com/second"):
            assert time.monotonic() < deadline, "the request had not left when the call returned"
            time.sleep(0.01)
        # The kubelet's error status comes back as from grpclib's own calls.
        with pytest.raises(GRPCError) as refused:
            await sent.reply(5.0)
        assert refused.value.status is Status.UNKNOWN
        assert refused.value.message == REFUSAL
    finally:
        emulator.stop()


async def test_a_request_sent_at_once_is_the_one_grpclib_sends(
    kubelet: tuple[Kubelet, Path], channel_to: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    service, path = kubelet
    channel = channel_to(path)
    headers = recorded_headers(monkeypatch)
    assert channel.send_unary(REGISTER_PATH, register_request("example.com/a")) is None
    assert await channel.unary(REGISTER_PATH, register_request("example.com/a"), 5.0) == b""
    sent = channel.send_unary(REGISTER_PATH, register_request("example.com/b"))
    assert sent is not None
    assert await sent.reply(5.0) == b""
    # Both through `unary`: the second goes out at once as well.
    assert await channel.unary(REGISTER_PATH, register_request("example.com/c"), 5.0) == b""
    assert len(headers) == 3
    assert headers[1] == headers[0] and headers[2] == headers[0]
    assert ("te", "trailers") in headers[0] and (":path", REGISTER_PATH) in headers[0]
    expected = [register_request(f"example.com/{name}") for name in "abc"]
    assert service.requests == expected


@pytest.fixture
async def connected(kubelet: tuple[Kubelet, Path], channel_to: Any) -> tuple[Kubelet, Any]:
    """A channel that has made one call, so is connected."""
    service, path = kubelet
    channel = channel_to(path)
    await channel.unary(REGISTER_PATH, register_request("example.com/a"), 5.0)
    return service, channel


async def test_a_request_that_does_not_fit_the_window_waits_for_grpclibs_path(
    connected: tuple[Kubelet, Any],
) -> None:
    service, channel = connected
    h2_connection = channel._protocol.processor.connection._connection
    opened = h2_connection.highest_outbound_stream_id
    window = h2_connection.outbound_flow_control_window
    h2_connection.outbound_flow_control_window = 10
    assert channel.send_unary(REGISTER_PATH, register_request("example.com/b")) is None
    assert h2_connection.highest_outbound_stream_id == opened  # no stream was opened
    h2_connection.outbound_flow_control_window = window
    assert await channel.unary(REGISTER_PATH, register_request("example.com/b"), 5.0) == b""
    assert len(service.requests) == 2


async def test_a_channel_whose_kubelet_has_gone_sends_nothing_at_once(
    connected: tuple[Kubelet, Any],
) -> None:
    _, channel = connected
    channel._protocol.processor.connection._connection.close_connection()  # a GOAWAY sent
    assert channel.send_unary(REGISTER_PATH, register_request("example.com/b")) is None


def register_of(runtime: Any, resource: str, attempt: int) -> Register:
    """A Register like the core's for `resource` (an attempt the core did not start)."""
    endpoint = next(iter(runtime._sockets._listeners))
    return Register(resource, endpoint, PluginOptions(), attempt)


def seen_while_blocked(emulator: KubeletEmulator, resource: str, seconds: float) -> bool:
    """Whether the kubelet sees a Register for `resource` while this loop is blocked."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if emulator.events_of("register", resource):
            return True
        time.sleep(0.01)
    return False


async def test_a_register_goes_out_at_once_only_while_its_socket_is_listening(
    harness: Harness,
) -> None:
    runtime = await harness.serve()
    emulator = harness.emulator
    assert emulator is not None
    registers = runtime._registers
    # Served and connected: sent before `call` returns.
    completion = registers.call(register_of(runtime, "example.com/now", 10_000))
    assert seen_while_blocked(emulator, "example.com/now", 10.0)
    await completion
    # The kubelet deleted the socket: the call listens again first, in its task.
    endpoint = next(iter(runtime._sockets._listeners))
    (harness.plugin_dir / endpoint).unlink()
    assert not runtime._sockets.is_listening(endpoint)
    completion = registers.call(register_of(runtime, "example.com/later", 10_001))
    assert not seen_while_blocked(emulator, "example.com/later", 0.3)
    await completion
    assert emulator.events_of("register", "example.com/later")
    assert runtime._sockets.is_listening(endpoint)
    assert (harness.plugin_dir / endpoint).is_socket()


async def test_a_register_sent_at_once_whose_task_never_ran_leaves_no_channel_at_shutdown(
    harness: Harness,
) -> None:
    runtime = await harness.serve()
    registers = runtime._registers
    channel = registers._channel
    assert channel is not None
    completion = registers.call(register_of(runtime, "example.com/cut", 10_000))
    task = asyncio.get_running_loop().create_task(completion)
    task.cancel()  # before its first step: its `finally` never runs
    await asyncio.gather(task, return_exceptions=True)
    assert registers._users == {channel: 1}
    runtime.stop()
    await asyncio.wait_for(harness._serving, 10)  # type: ignore[arg-type]
    assert channel._protocol is None or channel._protocol.handler.connection_lost
    assert not registers._users and registers._channel is None
