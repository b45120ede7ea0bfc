"""The grpcio kubelet emulator against a tiny grpclib device plugin.

The plugin here is deliberately minimal and self-contained (the real server is
built elsewhere): it serves one socket with grpclib and betterproto2 messages,
records every RPC with its `:authority` and connection, and lets a test push
ListAndWatch lists or end the streams.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpclib.server
import h2.config
import h2.connection
import h2.events
import pytest
from grpclib import GRPCError
from grpclib.client import Channel
from grpclib.const import Cardinality, Handler, Status

from dp_server.deviceplugin.connections import ConnectionServer, current_connection
from dp_server.proto import v1beta1 as bp
from dp_testing.emulator import (
    CHECKPOINT_FILE,
    AdmissionError,
    KubeletEmulator,
    KubeletError,
    PluginOptions,
    Startup,
)
from dp_testing.emulator._rpc import is_extended_resource_name
from dp_testing.emulator.pb.deviceplugin.v1beta1 import api_pb2 as dp_pb2
from dp_testing.emulator.pb.podresources.v1 import api_pb2 as pr_pb2

RESOURCE = "example.com/widget"
WAIT = 10.0

# --------------------------------------------------------------------------- helpers


@pytest.fixture
def sock_dir(short_dir: Path) -> Path:
    return short_dir


def device(device_id: str, healthy: bool = True, numa: int | None = None) -> bp.Device:
    topology = bp.TopologyInfo(nodes=[bp.NumaNode(id=numa)]) if numa is not None else None
    return bp.Device(id=device_id, health="Healthy" if healthy else "Unhealthy", topology=topology)


@dataclass
class Rpc:
    method: str
    connection: int
    time: float


@dataclass
class MiniPlugin:
    """A one-socket grpclib device plugin that records what the kubelet does."""

    socket_path: Path
    devices: list[bp.Device]
    options: bp.DevicePluginOptions = field(default_factory=bp.DevicePluginOptions)
    rpcs: list[Rpc] = field(default_factory=list)
    allocations: list[list[str]] = field(default_factory=list)
    streams_closed: int = 0
    fail_options: bool = False
    _queues: list[asyncio.Queue[list[bp.Device] | None]] = field(default_factory=list)
    connections: int = 0
    _server: grpclib.server.Server | None = None

    def _record(self, stream: grpclib.server.Stream[Any, Any], method: str) -> None:
        self.rpcs.append(Rpc(method, current_connection(), time.monotonic()))

    # ConnectionEvents: the kubelet's connections, numbered.
    def opened(self, listener: str | None) -> int:
        self.connections += 1
        return self.connections

    def closed(self, connection: int) -> None:
        pass

    async def _get_options(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        await stream.recv_message()
        self._record(stream, "GetDevicePluginOptions")
        if self.fail_options:
            raise GRPCError(Status.UNAVAILABLE, "no resource bound to this connection")
        await stream.send_message(self.options)

    async def _list_and_watch(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        await stream.recv_message()
        self._record(stream, "ListAndWatch")
        queue: asyncio.Queue[list[bp.Device] | None] = asyncio.Queue()
        self._queues.append(queue)
        try:
            await stream.send_message(bp.ListAndWatchResponse(devices=self.devices))
            while (devices := await queue.get()) is not None:
                await stream.send_message(bp.ListAndWatchResponse(devices=devices))
        finally:
            self._queues.remove(queue)
            self.streams_closed += 1

    async def _preferred(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        request = await stream.recv_message()
        assert request is not None
        self._record(stream, "GetPreferredAllocation")
        # Prefer from the end of the list, so the test can tell it was used.
        responses = [
            bp.ContainerPreferredAllocationResponse(
                device_i_ds=sorted(r.available_deviceIDs, reverse=True)[: r.allocation_size]
            )
            for r in request.container_requests
        ]
        await stream.send_message(bp.PreferredAllocationResponse(container_responses=responses))

    async def _allocate(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        request = await stream.recv_message()
        assert request is not None
        self._record(stream, "Allocate")
        known = {d.id for d in self.devices}
        responses = []
        for creq in request.container_requests:
            unknown = [i for i in creq.devices_ids if i not in known]
            if unknown:
                raise GRPCError(Status.INVALID_ARGUMENT, f"unknown device {unknown[0][:40]!r}")
            self.allocations.append(list(creq.devices_ids))
            responses.append(
                bp.ContainerAllocateResponse(envs={"WIDGETS": ",".join(creq.devices_ids)})
            )
        await stream.send_message(bp.AllocateResponse(container_responses=responses))

    async def _pre_start(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        await stream.recv_message()
        self._record(stream, "PreStartContainer")
        await stream.send_message(bp.PreStartContainerResponse())

    def __mapping__(self) -> dict[str, Handler]:
        unary = Cardinality.UNARY_UNARY
        p = "/v1beta1.DevicePlugin/"
        return {
            p + "GetDevicePluginOptions": Handler(
                self._get_options, unary, bp.Empty, bp.DevicePluginOptions
            ),
            p + "ListAndWatch": Handler(
                self._list_and_watch, Cardinality.UNARY_STREAM, bp.Empty, bp.ListAndWatchResponse
            ),
            p + "GetPreferredAllocation": Handler(
                self._preferred,
                unary,
                bp.PreferredAllocationRequest,
                bp.PreferredAllocationResponse,
            ),
            p + "Allocate": Handler(self._allocate, unary, bp.AllocateRequest, bp.AllocateResponse),
            p + "PreStartContainer": Handler(
                self._pre_start, unary, bp.PreStartContainerRequest, bp.PreStartContainerResponse
            ),
        }

    async def start(self) -> None:
        self._server = ConnectionServer([self], self, None)
        await self._server.start(path=str(self.socket_path))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    def methods(self) -> list[str]:
        return [r.method for r in self.rpcs]

    def push(self, devices: list[bp.Device]) -> None:
        for queue in list(self._queues):
            queue.put_nowait(devices)

    def end_streams(self) -> None:
        for queue in list(self._queues):
            queue.put_nowait(None)

    async def register(
        self,
        kubelet: KubeletEmulator,
        resource: str = RESOURCE,
        *,
        version: str = "v1beta1",
        endpoint: str | None = None,
    ) -> float:
        """Register over grpclib; return time.monotonic() when the reply arrived."""
        channel = Channel(path=str(kubelet.socket_path))
        try:
            await bp.RegistrationStub(channel).register(
                bp.RegisterRequest(
                    version=version,
                    endpoint=endpoint if endpoint is not None else self.socket_path.name,
                    resource_name=resource,
                    options=self.options,
                ),
                timeout=WAIT + 5,
            )
            return time.monotonic()
        finally:
            channel.close()


@pytest.fixture
async def make_plugin(sock_dir: Path) -> AsyncIterator[Callable[..., Any]]:
    plugins: list[MiniPlugin] = []

    async def make(
        name: str = "widget.sock",
        devices: list[bp.Device] | None = None,
        options: bp.DevicePluginOptions | None = None,
    ) -> MiniPlugin:
        plugin = MiniPlugin(
            sock_dir / name,
            devices if devices is not None else [device("w0"), device("w1"), device("w2")],
            options or bp.DevicePluginOptions(),
        )
        await plugin.start()
        plugins.append(plugin)
        return plugin

    yield make
    for plugin in plugins:
        await plugin.close()


@pytest.fixture
async def make_kubelet(sock_dir: Path) -> AsyncIterator[Callable[..., KubeletEmulator]]:
    emulators: list[KubeletEmulator] = []

    def make(**kwargs: Any) -> KubeletEmulator:
        emulator = KubeletEmulator(sock_dir, **kwargs).start()
        emulators.append(emulator)
        return emulator

    yield make
    for emulator in emulators:
        await asyncio.to_thread(emulator.stop)


async def wait(kubelet: KubeletEmulator, predicate: Callable[[KubeletEmulator], bool]) -> None:
    assert await asyncio.to_thread(kubelet.wait_for, predicate, WAIT)


def kinds(kubelet: KubeletEmulator, resource: str = RESOURCE) -> list[str]:
    return [e.kind for e in kubelet.events if e.resource == resource]


# --------------------------------------------------------------------------- Register


async def test_sync_register_dials_and_gets_options_before_replying(
    make_kubelet: Any, make_plugin: Any
) -> None:
    kubelet = make_kubelet()
    plugin = await make_plugin(options=bp.DevicePluginOptions(pre_start_required=True))
    replied_at = await plugin.register(kubelet)

    # The options call was served before the Register reply reached the plugin.
    assert plugin.rpcs[0].method == "GetDevicePluginOptions"
    assert plugin.rpcs[0].time < replied_at
    events = {e.kind: e for e in kubelet.events}
    assert events["dial"].time < events["options"].time < replied_at
    order = [k for k in kinds(kubelet) if k in ("register", "dial", "options", "registered")]
    assert order == ["register", "dial", "options", "registered"]
    assert kubelet.options(RESOURCE) == PluginOptions(pre_start_required=True)

    assert await asyncio.to_thread(kubelet.wait_registered, RESOURCE, WAIT, listed=True)
    assert kubelet.capacity() == {RESOURCE: 3}
    assert kubelet.allocatable() == {RESOURCE: 3}
    assert "ListAndWatch" in plugin.methods()
    assert kubelet.registration_count(RESOURCE) == 1
    # Both RPCs came over the one connection the kubelet opened for this registration.
    assert len({r.connection for r in plugin.rpcs}) == 1


class _HeaderRecordingPlugin(asyncio.Protocol):
    """A device plugin at the HTTP/2 level, to see the pseudo-headers grpclib
    keeps from handlers: each request's headers are recorded, and every call
    is answered with the message `replies` gives for its path."""

    def __init__(self, requests: list[dict[str, str]], replies: dict[str, bytes]) -> None:
        self.requests, self.replies = requests, replies

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        self.transport = transport
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        self.h2.initiate_connection()
        transport.write(self.h2.data_to_send())

    def data_received(self, data: bytes) -> None:
        for event in self.h2.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                headers = {bytes(k).decode(): bytes(v).decode() for k, v in event.headers}
                self.requests.append(headers)
                message = self.replies[headers[":path"]]
                stream = event.stream_id
                self.h2.send_headers(
                    stream, [(":status", "200"), ("content-type", "application/grpc")]
                )
                self.h2.send_data(stream, b"\x00" + struct.pack(">I", len(message)) + message)
                if not headers[":path"].endswith("/ListAndWatch"):
                    self.h2.send_headers(stream, [("grpc-status", "0")], end_stream=True)
            elif isinstance(event, h2.events.DataReceived):
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        self.transport.write(self.h2.data_to_send())


async def test_authority_is_localhost(make_kubelet: Any, sock_dir: Path) -> None:
    """The kubelet dials with `:authority` forced to localhost (docs/design.md §3)."""
    kubelet = make_kubelet()
    requests: list[dict[str, str]] = []
    p = "/v1beta1.DevicePlugin/"
    replies = {
        p + "GetDevicePluginOptions": bytes(bp.DevicePluginOptions()),
        p + "ListAndWatch": bytes(bp.ListAndWatchResponse(devices=[device("w0")])),
        p + "Allocate": bytes(
            bp.AllocateResponse(container_responses=[bp.ContainerAllocateResponse()])
        ),
    }
    path = sock_dir / "raw.sock"
    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(
        lambda: _HeaderRecordingPlugin(requests, replies), path=str(path)
    )
    channel = Channel(path=str(kubelet.socket_path))
    try:
        await bp.RegistrationStub(channel).register(
            bp.RegisterRequest(version="v1beta1", endpoint=path.name, resource_name=RESOURCE),
            timeout=WAIT,
        )
        await wait(kubelet, lambda k: k.resources()[RESOURCE].lists > 0)
        await asyncio.to_thread(kubelet.allocate, RESOURCE, ["w0"])
    finally:
        channel.close()
        server.close()
    assert {r[":path"] for r in requests} >= set(replies)
    assert {r[":authority"] for r in requests} == {"localhost"}


async def test_after_reply_mode_dials_after_the_reply(make_kubelet: Any, make_plugin: Any) -> None:
    kubelet = make_kubelet(dial_mode="after-reply")
    plugin = await make_plugin(
        options=bp.DevicePluginOptions(get_preferred_allocation_available=True)
    )
    replied_at = await plugin.register(kubelet)
    assert await asyncio.to_thread(kubelet.wait_registered, RESOURCE, WAIT, listed=True)

    order = [k for k in kinds(kubelet) if k in ("register", "replied", "dial", "registered")]
    assert order == ["register", "replied", "dial", "registered"]
    # Old kubelets took the options from the request and opened with ListAndWatch.
    assert plugin.methods()[0] == "ListAndWatch"
    assert "GetDevicePluginOptions" not in plugin.methods()
    assert plugin.rpcs[0].time > replied_at
    assert kubelet.options(RESOURCE) == PluginOptions(get_preferred_allocation_available=True)


@pytest.mark.parametrize(
    ("version", "resource", "message"),
    [
        ("v1alpha", RESOURCE, "requested API version"),
        ("v1beta1", "widget", "is invalid"),
        ("v1beta1", "kubernetes.io/widget", "is invalid"),
        ("v1beta1", "Example.com/widget", "is invalid"),
    ],
)
async def test_invalid_registration_is_an_error(
    make_kubelet: Any, make_plugin: Any, version: str, resource: str, message: str
) -> None:
    kubelet = make_kubelet()
    plugin = await make_plugin()
    with pytest.raises(GRPCError) as err:
        await plugin.register(kubelet, resource, version=version)
    assert err.value.status is Status.UNKNOWN
    assert message in (err.value.message or "")
    assert plugin.rpcs == []  # rejected before dialling
    assert kubelet.resources() == {}


async def test_refuse_hook_fails_register(make_kubelet: Any, make_plugin: Any) -> None:
    seen: list[dp_pb2.RegisterRequest] = []

    def refuse(request: dp_pb2.RegisterRequest) -> str | None:
        seen.append(request)
        return "no widgets today" if len(seen) == 1 else None

    kubelet = make_kubelet(refuse=refuse)
    plugin = await make_plugin()
    with pytest.raises(GRPCError) as err:
        await plugin.register(kubelet)
    assert err.value.message == "no widgets today"
    assert seen[0].resource_name == RESOURCE and seen[0].endpoint == "widget.sock"
    assert "refused" in kinds(kubelet) and plugin.rpcs == []

    await plugin.register(kubelet)  # the hook lets the second one through
    assert kubelet.registration_count(RESOURCE) == 1


async def test_dial_failure_fails_register(make_kubelet: Any, make_plugin: Any) -> None:
    kubelet = make_kubelet(dial_timeout=0.3)
    plugin = await make_plugin()
    with pytest.raises(GRPCError) as err:
        await plugin.register(kubelet, endpoint="nobody-listens.sock")
    assert err.value.status is Status.UNKNOWN
    assert "failed to dial device plugin" in (err.value.message or "")
    assert "dial-failed" in kinds(kubelet)
    assert RESOURCE not in kubelet.resources()


async def test_failing_options_call_fails_register(make_kubelet: Any, make_plugin: Any) -> None:
    kubelet = make_kubelet()
    plugin = await make_plugin()
    plugin.fail_options = True
    with pytest.raises(GRPCError) as err:
        await plugin.register(kubelet)
    assert err.value.status is Status.UNKNOWN
    assert "no resource bound" in (err.value.message or "")
    assert kubelet.registration_count(RESOURCE) == 0
    assert "ListAndWatch" not in plugin.methods()


async def test_each_registration_gets_its_own_connection(
    make_kubelet: Any, make_plugin: Any
) -> None:
    """Two resources behind ONE plugin socket: the plugin must see two connections.

    grpcio would share one connection between channels to the same target;
    the kubelet (grpc-go) does not, and one-socket attribution relies on that.
    """
    kubelet = make_kubelet()
    plugin = await make_plugin()
    await plugin.register(kubelet, "example.com/a")
    await plugin.register(kubelet, "example.com/b")
    assert await asyncio.to_thread(
        kubelet.wait_registered, ["example.com/a", "example.com/b"], WAIT, listed=True
    )
    options_calls = [r for r in plugin.rpcs if r.method == "GetDevicePluginOptions"]
    assert len(options_calls) == 2
    assert options_calls[0].connection is not options_calls[1].connection
    assert len({r.connection for r in plugin.rpcs}) == 2


async def test_reregistration_replaces_and_closes_the_old_endpoint(
    make_kubelet: Any, make_plugin: Any
) -> None:
    kubelet = make_kubelet(keeps_clients=False)  # as kubelets before 1.26
    first = await make_plugin("first.sock")
    second = await make_plugin("second.sock", devices=[device("n0"), device("n1")])
    await first.register(kubelet)
    assert await asyncio.to_thread(kubelet.wait_registered, RESOURCE, WAIT, listed=True)
    await second.register(kubelet)
    assert await asyncio.to_thread(kubelet.wait_registered, RESOURCE, WAIT, listed=True)

    # The kubelet stopped the old client: its stream ends without marking the
    # (new) registration unhealthy.
    for _ in range(100):
        if first.streams_closed:
            break
        await asyncio.sleep(0.02)
    assert first.streams_closed == 1
    await wait(kubelet, lambda k: bool(k.events_of("stale-stream-ended", RESOURCE)))
    state = kubelet.resources()[RESOURCE]
    assert state.registered and state.endpoint == "second.sock"
    assert sorted(state.devices) == ["n0", "n1"] and state.allocatable == 2
    assert kubelet.registration_count(RESOURCE) == 2
    assert "replaced" in kinds(kubelet)


async def test_a_held_client_answers_a_register_without_a_dial(
    make_kubelet: Any, make_plugin: Any
) -> None:
    """1.26 and later: a Register for a name whose client the kubelet holds is
    answered at once for the same socket, and refused for another."""
    kubelet = make_kubelet()
    first = await make_plugin("first.sock")
    second = await make_plugin("second.sock")
    await first.register(kubelet)
    assert await asyncio.to_thread(kubelet.wait_registered, RESOURCE, WAIT, listed=True)
    await first.register(kubelet)
    assert [e.detail for e in kubelet.events_of("already-connected", RESOURCE)] == ["first.sock"]
    assert first.methods().count("GetDevicePluginOptions") == 1
    with pytest.raises(GRPCError, match="already registered with a different socket path"):
        await second.register(kubelet)
    assert second.methods() == []
    assert kubelet.registration_count(RESOURCE) == 1
    assert kubelet.resources()[RESOURCE].endpoint == "first.sock"


async def test_a_broken_connection_drops_the_client_after_its_linger(
    make_kubelet: Any, make_plugin: Any
) -> None:
    kubelet = make_kubelet()
    plugin = await make_plugin()
    await plugin.register(kubelet)
    assert await asyncio.to_thread(kubelet.wait_registered, RESOURCE, WAIT, listed=True)
    kubelet.break_connection(RESOURCE, linger=2.0)
    await plugin.register(kubelet)  # the client is still held
    assert len(kubelet.events_of("already-connected", RESOURCE)) == 1
    await wait(kubelet, lambda k: plugin.streams_closed == 1)
    await wait(kubelet, lambda k: not k.resources()[RESOURCE].registered)
    ended = kubelet.events_of("stream-ended", RESOURCE)
    assert ended[0].time - kubelet.events_of("already-connected")[0].time > 1.0
    await plugin.register(kubelet)  # dropped: dialled anew
    assert await asyncio.to_thread(kubelet.wait_registered, RESOURCE, WAIT, listed=True)
    assert kubelet.registration_count(RESOURCE) == 2
    with pytest.raises(KubeletError, match="has no client"):
        kubelet.break_connection("example.com/none")


# --------------------------------------------------------------------------- ListAndWatch


async def test_each_list_replaces_the_device_list(make_kubelet: Any, make_plugin: Any) -> None:
    kubelet = make_kubelet()
    plugin = await make_plugin()
    await plugin.register(kubelet)
    await wait(kubelet, lambda k: k.resources()[RESOURCE].lists == 1)

    plugin.push([device("w0"), device("w1", healthy=False), device("w3", numa=1)])
    plugin.push([device("w1", numa=0), device("w4", healthy=False)])
    await wait(kubelet, lambda k: k.resources()[RESOURCE].lists == 3)

    devices = kubelet.resources()[RESOURCE].devices
    assert sorted(devices) == ["w1", "w4"]
    assert devices["w1"].healthy and devices["w1"].numa_nodes == (0,)
    assert devices["w4"].health == "Unhealthy"
    assert kubelet.capacity() == {RESOURCE: 2}
    assert kubelet.allocatable() == {RESOURCE: 1}


async def test_stream_end_marks_devices_unhealthy_and_never_redials(
    make_kubelet: Any, make_plugin: Any
) -> None:
    kubelet = make_kubelet()
    plugin = await make_plugin()
    await plugin.register(kubelet)
    await wait(kubelet, lambda k: k.allocatable() == {RESOURCE: 3})

    plugin.end_streams()
    await wait(kubelet, lambda k: not k.resources()[RESOURCE].registered)

    assert kubelet.capacity() == {RESOURCE: 3}
    assert kubelet.allocatable() == {RESOURCE: 0}
    assert {d.health for d in kubelet.resources()[RESOURCE].devices.values()} == {"Unhealthy"}
    (ended,) = kubelet.events_of("stream-ended", RESOURCE)
    assert "EOF" in ended.detail
    with pytest.raises(KubeletError):
        await asyncio.to_thread(kubelet.allocate, RESOURCE, ["w0"])
    await asyncio.sleep(0.3)
    assert plugin.methods().count("ListAndWatch") == 1  # no redial


# --------------------------------------------------------------------------- restart/stop


async def test_restart_deletes_sockets_but_keeps_the_checkpoint(
    make_kubelet: Any, make_plugin: Any, sock_dir: Path
) -> None:
    kubelet = make_kubelet()
    plugin = await make_plugin()
    checkpoint = sock_dir / CHECKPOINT_FILE
    (sock_dir / "DEPRECATION").write_text("")  # a plain file: the kubelet leaves it
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock_dir / "stale.sock"))
    stale.close()
    await plugin.register(kubelet)
    await wait(kubelet, lambda k: k.allocatable() == {RESOURCE: 3})
    await written(kubelet, 1)
    kept = checkpoint.read_bytes()
    assert json.loads(kept)["Data"]["RegisteredDevices"] == {RESOURCE: ["w0", "w1", "w2"]}

    before = time.monotonic()
    await asyncio.to_thread(kubelet.restart)

    assert sorted(p.name for p in sock_dir.iterdir()) == sorted(
        ["DEPRECATION", CHECKPOINT_FILE, "kubelet.sock"]
    )
    assert checkpoint.read_bytes() == kept
    assert kubelet.last_restart is not None and kubelet.last_restart >= before
    state = kubelet.resources()[RESOURCE]
    assert not state.registered and state.capacity == 3 and state.allocatable == 0
    for _ in range(100):
        if plugin.streams_closed:
            break
        await asyncio.sleep(0.02)
    assert plugin.streams_closed == 1

    # The plugin comes back on a new socket and registers again.
    again = await make_plugin("widget2.sock")
    await again.register(kubelet)
    assert await asyncio.to_thread(kubelet.wait_registered, RESOURCE, WAIT, listed=True)
    assert kubelet.allocatable() == {RESOURCE: 3}
    assert kubelet.registration_count(RESOURCE) == 2
    (restart,) = kubelet.events_of("restart")
    assert kubelet.resources()[RESOURCE].registered_at > restart.time  # type: ignore[operator]


async def test_stop_is_idempotent_and_leaves_no_threads(sock_dir: Path, make_plugin: Any) -> None:
    plugin = await make_plugin()
    with KubeletEmulator(sock_dir) as kubelet:
        await plugin.register(kubelet)
        await wait(kubelet, lambda k: k.allocatable() == {RESOURCE: 3})
        await asyncio.to_thread(kubelet.stop)
        await asyncio.to_thread(kubelet.stop)
    assert not kubelet.socket_path.exists()
    leftover = [t.name for t in threading.enumerate() if t.name.startswith("kubelet-law")]
    assert leftover == []
    with pytest.raises(KubeletError):
        kubelet.start()


def test_socket_path_too_long_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unix socket path"):
        KubeletEmulator(tmp_path / ("d" * 120))


# --------------------------------------------------------------------------- plugin calls


async def test_raw_calls_surface_grpc_status(make_kubelet: Any, make_plugin: Any) -> None:
    kubelet = make_kubelet()
    plugin = await make_plugin()
    await plugin.register(kubelet)
    await wait(kubelet, lambda k: k.allocatable() == {RESOURCE: 3})

    response = await asyncio.to_thread(kubelet.allocate, RESOURCE, ["w1"])
    assert dict(response.envs) == {"WIDGETS": "w1"}

    long_id = "x" * 10_000
    request = dp_pb2.AllocateRequest(
        container_requests=[dp_pb2.ContainerAllocateRequest(devices_ids=[long_id])]
    )
    with pytest.raises(grpc.RpcError) as err:
        await asyncio.to_thread(kubelet.call, RESOURCE, "Allocate", request)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    with pytest.raises(grpc.RpcError) as err:
        await asyncio.to_thread(kubelet.allocate, RESOURCE, ["nope"])
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    with pytest.raises(ValueError):
        kubelet.call(RESOURCE, "Frobnicate", request)


async def test_admit_remove_pod_and_pod_resources(
    make_kubelet: Any, make_plugin: Any, sock_dir: Path
) -> None:
    pr_socket = sock_dir / "pod-resources" / "kubelet.sock"
    kubelet = make_kubelet(pod_resources_socket=pr_socket)
    plugin = await make_plugin(
        devices=[device("w0", numa=0), device("w1", numa=0), device("w2", numa=1)],
        options=bp.DevicePluginOptions(
            pre_start_required=True, get_preferred_allocation_available=True
        ),
    )
    await plugin.register(kubelet)
    await wait(kubelet, lambda k: k.allocatable() == {RESOURCE: 3})

    responses = await asyncio.to_thread(kubelet.admit, "vm-a", "compute", {RESOURCE: 2})
    # The plugin's preference (highest IDs first) was honoured.
    assert dict(responses[RESOURCE].envs) == {"WIDGETS": "w2,w1"}
    assert plugin.allocations == [["w2", "w1"]]
    assert plugin.methods()[-3:] == ["GetPreferredAllocation", "Allocate", "PreStartContainer"]

    with pytest.raises(AdmissionError, match="Available: 1"):
        await asyncio.to_thread(kubelet.admit, "vm-b", "compute", {RESOURCE: 2})
    with pytest.raises(AdmissionError, match="unregistered"):
        await asyncio.to_thread(kubelet.admit, "vm-b", "compute", {"example.com/none": 1})

    def list_pods() -> pr_pb2.ListPodResourcesResponse:
        with grpc.insecure_channel(f"unix:{pr_socket}") as channel:
            return channel.unary_unary(
                "/v1.PodResourcesLister/List",
                request_serializer=pr_pb2.ListPodResourcesRequest.SerializeToString,
                response_deserializer=pr_pb2.ListPodResourcesResponse.FromString,
            )(pr_pb2.ListPodResourcesRequest(), timeout=WAIT)

    def allocatable() -> pr_pb2.AllocatableResourcesResponse:
        with grpc.insecure_channel(f"unix:{pr_socket}") as channel:
            return channel.unary_unary(
                "/v1.PodResourcesLister/GetAllocatableResources",
                request_serializer=pr_pb2.AllocatableResourcesRequest.SerializeToString,
                response_deserializer=pr_pb2.AllocatableResourcesResponse.FromString,
            )(pr_pb2.AllocatableResourcesRequest(), timeout=WAIT)

    listed = await asyncio.to_thread(list_pods)
    (pod,) = listed.pod_resources
    assert (pod.name, pod.namespace) == ("vm-a", "default")
    (container,) = pod.containers
    assert container.name == "compute"
    per_numa = {cd.topology.nodes[0].ID: list(cd.device_ids) for cd in container.devices}
    assert per_numa == {1: ["w2"], 0: ["w1"]}
    assert {cd.resource_name for cd in container.devices} == {RESOURCE}

    def get_pod(name: str) -> pr_pb2.GetPodResourcesResponse:
        with grpc.insecure_channel(f"unix:{pr_socket}") as channel:
            return channel.unary_unary(
                "/v1.PodResourcesLister/Get",
                request_serializer=pr_pb2.GetPodResourcesRequest.SerializeToString,
                response_deserializer=pr_pb2.GetPodResourcesResponse.FromString,
            )(pr_pb2.GetPodResourcesRequest(pod_name=name, pod_namespace="default"), timeout=WAIT)

    assert (await asyncio.to_thread(get_pod, "vm-a")).pod_resources == pod
    with pytest.raises(grpc.RpcError):
        await asyncio.to_thread(get_pod, "vm-z")

    alloc = await asyncio.to_thread(allocatable)
    assert sorted(i for cd in alloc.devices for i in cd.device_ids) == ["w0", "w1", "w2"]

    assert kubelet.remove_pod("vm-a")
    assert not kubelet.remove_pod("vm-a")
    assert (await asyncio.to_thread(list_pods)).pod_resources == []
    # The devices are free again.
    await asyncio.to_thread(kubelet.admit, "vm-b", "compute", {RESOURCE: 3})


async def test_pod_resources_rate_limit(make_kubelet: Any, sock_dir: Path) -> None:
    pr_socket = sock_dir / "pr.sock"
    make_kubelet(pod_resources_socket=pr_socket, pod_resources_qps=1.0, startup=Startup.none())

    def burst() -> list[grpc.StatusCode]:
        codes = []
        with grpc.insecure_channel(f"unix:{pr_socket}") as channel:
            call = channel.unary_unary(
                "/v1.PodResourcesLister/List",
                request_serializer=pr_pb2.ListPodResourcesRequest.SerializeToString,
                response_deserializer=pr_pb2.ListPodResourcesResponse.FromString,
            )
            for _ in range(15):
                try:
                    call(pr_pb2.ListPodResourcesRequest(), timeout=WAIT)
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as exc:
                    codes.append(exc.code())  # type: ignore[attr-defined]
        return codes

    codes = await asyncio.to_thread(burst)
    assert codes[:10] == [grpc.StatusCode.OK] * 10
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes[10:]


# --------------------------------------------------------------------------- names


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("devices.kubevirt.io/kvm", True),
        ("nvidia.com/TU104GL_Tesla_T4", True),
        ("example.com/a.b-c_d", True),
        ("kvm", False),
        ("kubernetes.io/kvm", False),
        ("sub.kubernetes.io/kvm", False),
        ("requests.example.com/kvm", False),
        ("example.com/a/b", False),
        ("Example.com/kvm", False),
        ("example.com/", False),
        ("example.com/-kvm", False),
        ("example.com/" + "k" * 64, False),
        ("a" * 245 + ".com/kvm", False),
    ],
)
def test_extended_resource_names(name: str, ok: bool) -> None:
    assert is_extended_resource_name(name) is ok


def test_a_waiter_with_an_interval_looks_at_that_pace_not_at_every_change(
    tmp_path: Path,
) -> None:
    kubelet = KubeletEmulator(tmp_path)  # not started: only its state is used
    state = kubelet._state
    stop = threading.Event()

    def churn() -> None:  # as many changes as the machine makes while the waiter waits
        while not stop.is_set():
            state.event("churn", RESOURCE, "")

    looks = {"woken": 0, "interval": 0}

    def never(_: KubeletEmulator) -> bool:
        looks["interval"] += 1
        return False

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        assert not kubelet.wait_for(never, 0.3, interval=0.05)
    finally:
        stop.set()
        worker.join()
    # However many changes came (a fast machine makes thousands), it looked
    # at its own pace: once at the start, then once per interval.
    assert looks["interval"] <= 0.3 / 0.05 + 2

    # Without an interval it looks at every change: each change is made only
    # once the waiter has looked at the one before (it looks under the state
    # lock, and waits for the next change before it lets go of it), so the
    # count is exact however fast the machine is.
    changes = 20

    def one_at_a_time() -> None:
        for made in range(changes):
            deadline = time.monotonic() + 5
            while looks["woken"] <= made and time.monotonic() < deadline:
                time.sleep(0.001)
            state.event("churn", RESOURCE, "")

    def every_change(_: KubeletEmulator) -> bool:
        looks["woken"] += 1
        return looks["woken"] > changes

    worker = threading.Thread(target=one_at_a_time)
    worker.start()
    try:
        assert kubelet.wait_for(every_change, 10.0)
    finally:
        worker.join()
    assert looks["woken"] == changes + 1  # the first look, then one per change
    # It sees a change all the same, within its interval.
    threading.Timer(0.1, lambda: state.event("late", RESOURCE, "")).start()
    assert kubelet.wait_for(lambda k: bool(k.events_of("late")), 5.0, interval=0.01)


# -- a kubelet that has just started, and its checkpoint ------------------------------


def _list_pods(pr_socket: Path) -> tuple[str, int]:
    """("refused" | "listed", pods) from one PodResources List."""
    with grpc.insecure_channel(f"unix:{pr_socket}") as channel:
        try:
            answer = channel.unary_unary(
                "/v1.PodResourcesLister/List",
                request_serializer=pr_pb2.ListPodResourcesRequest.SerializeToString,
                response_deserializer=pr_pb2.ListPodResourcesResponse.FromString,
            )(pr_pb2.ListPodResourcesRequest(), timeout=1.0)
        except grpc.RpcError as error:
            assert error.code() is grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
            return "refused", 0
    return "listed", len(answer.pod_resources)


async def written(kubelet: KubeletEmulator, writes: int) -> None:
    """Wait for the checkpoint write that follows a device list (just after it is stored)."""
    for _ in range(200):
        if kubelet.checkpoint.writes >= writes:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{kubelet.checkpoint.writes} checkpoint writes, not {writes}")


async def test_a_kubelet_that_has_just_started_refuses_then_lists_no_pods_then_lists_them(
    make_kubelet: Any, make_plugin: Any, sock_dir: Path
) -> None:
    pr_socket = sock_dir / "pr.sock"
    kubelet = make_kubelet(pod_resources_socket=pr_socket, startup=Startup(refuse=0.3, empty=0.5))
    plugin = await make_plugin()
    await plugin.register(kubelet)
    await wait(kubelet, lambda k: k.allocatable() == {RESOURCE: 3})
    await asyncio.to_thread(kubelet.admit, "vm-a", "compute", {RESOURCE: 1})
    await asyncio.to_thread(kubelet.restart)
    assert kubelet.last_restart is not None
    assert kubelet.synced_at == pytest.approx(kubelet.last_restart + 0.8, abs=0.05)

    def poll() -> list[tuple[float, str, int]]:
        seen = []
        while time.monotonic() < kubelet.synced_at + 0.3:
            seen.append((time.monotonic() - kubelet.last_restart, *_list_pods(pr_socket)))
            time.sleep(0.05)
        return seen

    seen = await asyncio.to_thread(poll)
    phases = [(state, pods) for _, state, pods in seen]
    # Refused, then no pods, then the pod: in that order, each for a while.
    changes = [phase for i, phase in enumerate(phases) if i == 0 or phases[i - 1] != phase]
    assert changes == [("refused", 0), ("listed", 0), ("listed", 1)]
    first_empty = next(t for t, state, _ in seen if state == "listed")
    first_pod = next(t for t, _, pods in seen if pods)
    assert 0.25 <= first_empty <= 0.5 and 0.75 <= first_pod <= 1.0


async def test_a_new_pod_is_admitted_once_the_kubelet_has_synced(
    make_kubelet: Any, make_plugin: Any
) -> None:
    kubelet = make_kubelet(startup=Startup(refuse=0.1, empty=0.4))
    plugin = await make_plugin()
    await plugin.register(kubelet)
    await wait(kubelet, lambda k: k.allocatable() == {RESOURCE: 3})
    await asyncio.to_thread(kubelet.admit, "vm-a", "compute", {RESOURCE: 1})
    assert time.monotonic() >= kubelet.synced_at
    (admitted,) = kubelet.events_of("admit")
    assert admitted.time >= kubelet.synced_at


async def test_the_checkpoint_is_written_as_the_kubelet_writes_it(
    make_kubelet: Any, make_plugin: Any, sock_dir: Path
) -> None:
    kubelet = make_kubelet()
    plugin = await make_plugin(devices=[device("w0", numa=0), device("w1", numa=1), device("w2")])
    await plugin.register(kubelet)
    await wait(kubelet, lambda k: k.allocatable() == {RESOURCE: 3})
    await written(kubelet, 1)  # at the device list
    writes = kubelet.checkpoint.writes
    await asyncio.to_thread(kubelet.admit, "vm-a", "compute", {RESOURCE: 3})
    assert kubelet.checkpoint.writes == writes + 1  # at the admission
    pod = kubelet.pods()["default/vm-a"]
    document = json.loads((sock_dir / CHECKPOINT_FILE).read_bytes())
    assert set(document) == {"Data", "Checksum"} and isinstance(document["Checksum"], int)
    (entry,) = document["Data"]["PodDeviceEntries"]
    assert {k: v for k, v in entry.items() if k != "AllocResp"} == {
        "PodUID": pod.uid,
        "ContainerName": "compute",
        "ResourceName": RESOURCE,
        "DeviceIDs": {"0": ["w0"], "1": ["w1"], "-1": ["w2"]},
    }
    answer = dp_pb2.ContainerAllocateResponse.FromString(base64.b64decode(entry["AllocResp"]))
    assert sorted(answer.envs["WIDGETS"].split(",")) == ["w0", "w1", "w2"]
    assert document["Data"]["RegisteredDevices"] == {RESOURCE: ["w0", "w1", "w2"]}
    # And at every device list the plugin sends.
    plugin.push([device("w0", numa=0), device("w1", healthy=False, numa=1), device("w2")])
    await wait(kubelet, lambda k: k.allocatable() == {RESOURCE: 2})
    await written(kubelet, writes + 2)
    document = json.loads((sock_dir / CHECKPOINT_FILE).read_bytes())
    assert document["Data"]["RegisteredDevices"] == {RESOURCE: ["w0", "w2"]}


async def test_a_pod_deleted_while_the_kubelet_was_down_holds_its_devices_until_it_has_synced(
    make_kubelet: Any, make_plugin: Any, sock_dir: Path
) -> None:
    """Its devices stay allocated, and named in the checkpoint, until the
    kubelet has synced; then the next List or admission drops them, and the
    next write of the checkpoint shows it."""
    pr_socket = sock_dir / "pr.sock"
    kubelet = make_kubelet(pod_resources_socket=pr_socket, startup=Startup(refuse=0.0, empty=0.6))
    plugin = await make_plugin()
    await plugin.register(kubelet)
    await wait(kubelet, lambda k: k.allocatable() == {RESOURCE: 3})
    await asyncio.to_thread(kubelet.admit, "vm-a", "compute", {RESOURCE: 2})
    uid = kubelet.pods()["default/vm-a"].uid
    await asyncio.to_thread(kubelet.restart, removed=["vm-a"])
    assert kubelet.pods() == {}

    def named() -> list[str]:
        entries = json.loads((sock_dir / CHECKPOINT_FILE).read_bytes())["Data"]["PodDeviceEntries"]
        return [e["PodUID"] for e in entries or ()]

    assert named() == [uid]
    again = await make_plugin("widget2.sock")
    await again.register(kubelet)
    await wait(kubelet, lambda k: k.allocatable() == {RESOURCE: 3})
    assert time.monotonic() < kubelet.synced_at
    assert named() == [uid]  # the list was written, vm-a's devices with it
    # Synced: List drops them (in memory), the next list writes that down.
    await asyncio.sleep(max(0.0, kubelet.synced_at - time.monotonic()))
    assert await asyncio.to_thread(_list_pods, pr_socket) == ("listed", 0)
    assert [e.detail for e in kubelet.events_of("dropped")] == [uid]
    assert named() == [uid]
    again.push([device("w0"), device("w1"), device("w2")])
    for _ in range(100):
        if not named():
            break
        await asyncio.sleep(0.01)
    assert named() == []
    await asyncio.to_thread(kubelet.admit, "vm-b", "compute", {RESOURCE: 3})
