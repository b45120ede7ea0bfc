"""The server end to end, through the grpcio kubelet emulator (docs/design.md §3, §4)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Any

import attrs
import grpc
import grpclib.const
import grpclib.server
import h2.config
import h2.connection
import h2.errors
import h2.events
import pytest
from grpclib.metadata import decode_timeout

from dp_core import Backoff, Config, DevicePluginFrontend, PciId, SocketMode
from dp_server.cli.demo import DEMO_CONFIG
from dp_server.cli.main import load_settings
from dp_server.config.loader import parse_config
from dp_server.deviceplugin import wire
from dp_server.deviceplugin.wiring import DevicePluginRuntime
from dp_server.runtime.runtime import Runtime
from dp_testing.emulator._rpc import dp

from e2e_harness import ALL, FAST, GPU, KVM, NVME, QAT, TUN, VGPU, Harness

pytestmark = pytest.mark.asyncio


def device_ids(harness: Harness, resource: str) -> list[str]:
    assert harness.emulator is not None
    return sorted(harness.emulator.resources()[resource].devices)


# -- registration and attribution ------------------------------------------------


async def test_every_resource_registers_through_one_socket(harness: Harness) -> None:
    await harness.serve()
    ours = [name for name in harness.sockets() if name != "kubelet.sock"]
    assert len(ours) == 1 and ours[0].startswith("dp-")
    emulator = harness.emulator
    assert emulator is not None
    endpoints = {emulator.resources()[name].endpoint for name in ALL}
    assert endpoints == {ours[0]}
    # Attribution put each resource's own devices on its own connection.
    assert device_ids(harness, GPU) == ["0000:3b:00.0", "0000:af:00.0", "0000:d8:00.0"]
    assert device_ids(harness, NVME) == ["0000:5e:00.0", "0000:5e:01.0"]
    assert len(device_ids(harness, KVM)) == 1000
    # The kubelet dialled and asked for options inside each Register call. The
    # emulator logs "replied" once grpcio has sent the reply, which may come
    # after the plugin already serves the list: wait for it.
    assert await harness.wait(
        lambda e: {ev.resource for ev in e.events if ev.kind == "replied"} >= set(ALL)
    )
    for name in ALL:
        kinds = [e.kind for e in emulator.events if e.resource == name]
        assert kinds.index("dial") < kinds.index("options") < kinds.index("replied")
    assert emulator.options(GPU).get_preferred_allocation_available  # type: ignore[union-attr]
    assert not emulator.options(KVM).get_preferred_allocation_available  # type: ignore[union-attr]


async def test_socket_name_changes_with_each_start(harness: Harness) -> None:
    first = await harness.serve()
    name = first.frontend(DevicePluginRuntime).socket_paths[0].name
    first.stop()
    assert harness._serving is not None
    await harness._serving
    assert name not in harness.sockets()
    second = await harness.start_server()
    assert await harness.registered()
    assert second.frontend(DevicePluginRuntime).socket_paths[0].name != name


async def test_per_resource_mode_uses_one_socket_each_on_one_loop(harness: Harness) -> None:
    runtime = await harness.serve(socket_mode=SocketMode.PER_RESOURCE)
    ours = [name for name in harness.sockets() if name != "kubelet.sock"]
    assert len(ours) == len(ALL) == len(runtime.frontend(DevicePluginRuntime).socket_paths)
    assert device_ids(harness, NVME) == ["0000:5e:00.0", "0000:5e:01.0"]
    response = await harness.kubelet("allocate", GPU, ["0000:af:00.0"])
    assert response.envs["PCI_RESOURCE_NVIDIA_COM_TU104GL_TESLA_T4"] == "0000:af:00.0"


async def test_per_resource_socket_names_are_cut_to_fit_a_long_directory(
    harness: Harness,
) -> None:
    # 76 bytes of directory leave 30 for a socket name; "dp-xxxxxx-" and
    # ".sock" alone take 15, and the longest resource name here has 26.
    harness.plugin_dir = harness.root / ("p" * (76 - len(str(harness.root)) - 1))
    runtime = await harness.serve(socket_mode=SocketMode.PER_RESOURCE)
    ours = [name for name in harness.sockets() if name != "kubelet.sock"]
    assert len(ours) == len(ALL) == len(runtime.frontend(DevicePluginRuntime).socket_paths)
    assert max(len(str(path)) for path in runtime.frontend(DevicePluginRuntime).socket_paths) == 107
    assert device_ids(harness, NVME) == ["0000:5e:00.0", "0000:5e:01.0"]
    response = await harness.kubelet("allocate", GPU, ["0000:af:00.0"])
    assert response.envs["PCI_RESOURCE_NVIDIA_COM_TU104GL_TESLA_T4"] == "0000:af:00.0"


@pytest.mark.parametrize(
    ("directory", "room"),
    [
        ("/var/lib/kubelet/device-plugins", 48),  # the kubelet's may be longer than ours
        ("/" + "d" * 75, 30),
    ],
)
async def test_socket_names_leave_room_for_the_directory(
    harness: Harness, directory: str, room: int
) -> None:
    config = parse_config(DEMO_CONFIG, "<demo>")
    runtime = Runtime(harness.settings(device_plugin_dir=directory), config)
    assert runtime.node.frontend(DevicePluginFrontend).endpoint_max_length == room


async def test_old_kubelet_that_dials_after_replying(harness: Harness) -> None:
    await harness.serve(kubelet={"dial_mode": "after-reply"})
    assert device_ids(harness, GPU) == ["0000:3b:00.0", "0000:af:00.0", "0000:d8:00.0"]
    assert device_ids(harness, QAT) == [f"0000:6b:00.{i}" for i in range(1, 5)]
    assert len(device_ids(harness, TUN)) == 110
    response = await harness.kubelet("allocate", QAT, ["0000:6b:00.2"])
    assert response.envs["PCI_RESOURCE_INTEL_COM_QAT_VF"] == "0000:6b:00.2"


async def test_unattributed_connection_is_refused_with_unavailable(harness: Harness) -> None:
    runtime = await harness.serve()
    assert runtime is not None
    target = f"unix://{runtime.frontend(DevicePluginRuntime).socket_paths[0]}"
    with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
        options = ch.unary_unary(
            "/v1beta1.DevicePlugin/GetDevicePluginOptions",
            request_serializer=dp.Empty.SerializeToString,
            response_deserializer=dp.DevicePluginOptions.FromString,
        )
        with pytest.raises(grpc.RpcError) as caught:
            await asyncio.to_thread(options, dp.Empty(), timeout=5)
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "not attributed" in caught.value.details()
    # Every resource still has its own connection and keeps being served.
    response = await harness.kubelet("allocate", GPU, ["0000:3b:00.0"])
    assert response.envs


async def test_a_reconnection_during_the_next_register_is_not_attributed_to_it(
    harness: Harness,
) -> None:
    """grpc-go reconnects a lost connection for the next call, which can reach
    the shared socket while another resource's Register is in flight. The
    emulator (like kubelets from 1.25) opens each registration's connection
    with GetDevicePluginOptions, so a connection opening with ListAndWatch
    then is not that registration's, and gets UNAVAILABLE."""
    import threading

    seen: list[str] = []
    held, go_on = threading.Event(), threading.Event()

    def hold_the_second(request: dp.RegisterRequest) -> str | None:
        if request.resource_name not in seen:
            seen.append(request.resource_name)
        if len(seen) == 2 and request.resource_name == seen[1] and not go_on.is_set():
            held.set()
            go_on.wait(10)
        return None

    harness.start_kubelet(refuse=hold_the_second)
    runtime = await harness.start_server()
    assert await asyncio.to_thread(held.wait, 10)

    def reconnect_and_watch() -> grpc.RpcError:
        target = f"unix://{runtime.frontend(DevicePluginRuntime).socket_paths[0]}"
        with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
            watch = ch.unary_stream(
                "/v1beta1.DevicePlugin/ListAndWatch",
                request_serializer=dp.Empty.SerializeToString,
                response_deserializer=dp.ListAndWatchResponse.FromString,
            )
            try:
                got = list(watch(dp.Empty(), timeout=5))
            except grpc.RpcError as error:
                return error
        raise AssertionError(f"the stream was served: {got}")

    try:
        error = await asyncio.to_thread(reconnect_and_watch)
    finally:
        go_on.set()
    assert error.code() is grpc.StatusCode.UNAVAILABLE
    assert "opened with ListAndWatch" in error.details()
    assert seen[1] in error.details()
    assert await harness.registered()
    # The held resource got its own connection and lists its own devices.
    assert harness.emulator is not None
    counts = {name: len(state.devices) for name, state in harness.emulator.resources().items()}
    assert counts[GPU] == 3 and counts[QAT] == 4 and counts[TUN] == 110


async def test_the_late_dial_of_a_register_that_timed_out_is_not_taken_for_the_next(
    harness: Harness,
) -> None:
    """A kubelet stalled past dp's Register timeout may still handle that call
    and dial. After a timeout dp registers nothing else on the shared socket
    for the late dial wait: the late dial finds no Register in flight and is
    refused, instead of being bound to the next resource's Register (whose
    own dial would then be taken for the one after, and so on)."""
    import threading
    import time

    order: list[str] = []
    lock = threading.Lock()

    def stall(request: dp.RegisterRequest) -> str | None:
        with lock:
            order.append(request.resource_name)
            seen = len(order)
        if seen == 1:
            time.sleep(1.0)  # past dp's 0.5 s timeout: this dial comes late
        elif seen == 2:
            time.sleep(0.8)  # sent at once, this Register would be in flight at 1.0 s
        return None

    timing = attrs.evolve(FAST, late_dial_wait=1.5)
    runtime = await harness.serve(kubelet={"refuse": stall}, register_timeout=0.5, timing=timing)
    emulator = harness.emulator
    assert emulator is not None
    assert emulator.events_of("dial-failed", order[0])  # the late dial, refused
    for name, state in emulator.resources().items():
        assert sorted(state.devices) == sorted(
            d.id for d in runtime.node.frontend(DevicePluginFrontend).advertised(name)
        ), name


class _StalledGoKubelet(asyncio.Protocol):
    """kubelet.sock as grpc-go serves it for a kubelet stalled in Register: no
    reply, and at the deadline the request's grpc-timeout gives, the stream
    reset with RST_STREAM(CANCEL), as grpc-go's server does (http2_server.go,
    operateHeaders: a timer closes the stream on reaching the deadline)."""

    def __init__(self, registers: list[float]) -> None:
        self.registers = registers

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        self.transport = transport
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        self.h2.initiate_connection()
        transport.write(self.h2.data_to_send())

    def data_received(self, data: bytes) -> None:
        loop = asyncio.get_running_loop()
        for event in self.h2.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                self.registers.append(loop.time())
                headers = {bytes(k).decode(): bytes(v).decode() for k, v in event.headers}
                if "grpc-timeout" in headers:
                    timeout = decode_timeout(headers["grpc-timeout"])
                    loop.call_later(timeout, self._reset, event.stream_id)
        self.transport.write(self.h2.data_to_send())

    def _reset(self, stream_id: int) -> None:
        if not self.transport.is_closing():
            self.h2.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
            self.transport.write(self.h2.data_to_send())


async def test_a_register_a_grpc_go_kubelet_would_reset_at_its_deadline_quiets_the_socket(
    harness: Harness,
) -> None:
    """grpclib sends grpc-timeout in whole seconds above 10 s, rounded down
    (15 s goes out as "14S"), and grpc-go resets a call at that deadline: a
    stalled kubelet would end dp's Register with a stream reset a second
    before dp's own timeout, and dp would not know the call went unanswered.
    dp keeps the deadline to itself, so its timeout comes first and the shared
    socket waits for a late dial."""
    loop = asyncio.get_running_loop()
    harness.plugin_dir.mkdir(parents=True, exist_ok=True)
    registers: list[float] = []
    kubelet = await loop.create_unix_server(
        lambda: _StalledGoKubelet(registers), path=str(harness.plugin_dir / "kubelet.sock")
    )
    try:
        runtime = await harness.start_server(register_timeout=10.9)
        registrar = runtime.node.frontend(DevicePluginFrontend).registrar
        async with asyncio.timeout(15):
            while not registrar.quiet_until and len(registers) < 2:
                await asyncio.sleep(0.05)
        await asyncio.sleep(1.5)  # well past the backoff (FAST: 0.05 s)
        assert len(registers) == 1, "the Register ended early, and another started"
        assert registrar.quiet_until > runtime.now()
    finally:
        kubelet.close()


async def test_kubelet_started_after_the_server(harness: Harness) -> None:
    await harness.start_server()
    await asyncio.sleep(0.2)
    assert [n for n in harness.sockets() if n != "kubelet.sock"]
    harness.start_kubelet()
    assert await harness.registered(timeout=5)


async def test_kubelet_restart_reregisters_everything(harness: Harness) -> None:
    await harness.serve()
    emulator = harness.emulator
    assert emulator is not None
    before = await harness.restart_kubelet()
    # The dropped connections are noticed before the new kubelet.sock's file
    # event: looking at kubelet.sock first makes that one round of Registers,
    # not a Register per lost connection followed by another for the restart.
    await asyncio.sleep(0.3)
    assert {n: emulator.registration_count(n) - before[n] for n in ALL} == dict.fromkeys(ALL, 1)
    # The old kubelet's connections are gone: one connection per registration.
    assert harness.runtime is not None
    assert harness.runtime.frontend(DevicePluginRuntime).kubelet.connections == len(ALL)
    ours = [name for name in harness.sockets() if name != "kubelet.sock"]
    assert len(ours) == 1  # the deleted socket was created again
    response = await harness.kubelet("allocate", NVME, ["0000:5e:01.0"])
    assert response.envs["PCI_RESOURCE_DEVICES_KUBEVIRT_IO_NVME"] == "0000:5e:01.0"


@pytest.mark.parametrize("mode", [SocketMode.SINGLE, SocketMode.PER_RESOURCE])
async def test_a_kubelet_still_holding_a_lost_client_is_asked_again_at_once(
    harness: Harness, mode: SocketMode
) -> None:
    """Kubelets from 1.26 answer a Register for a name whose client they still
    hold without dialling ("already connected"), and drop the client once they
    see its stream end. A Register sent the moment dp sees the connection
    close can meet the client still held; dp asks again shortly after, rather
    than wait for a dial that will not come."""
    await harness.serve(socket_mode=mode)
    emulator = harness.emulator
    assert emulator is not None
    before = emulator.registration_count(GPU)
    await harness.kubelet("break_connection", GPU, linger=0.25)
    assert await harness.wait(lambda e: bool(e.events_of("already-connected", GPU)))
    assert await harness.wait(lambda e: e.registration_count(GPU) > before)
    assert await harness.registered((GPU,))
    held = emulator.events_of("already-connected", GPU)[0].time
    (registered,) = [e.time for e in emulator.events_of("registered", GPU) if e.time > held]
    # Waiting for a dial, as for a kubelet that dials after replying, would
    # take FAST.dial_wait twice over.
    assert registered - held < FAST.dial_wait, registered - held
    response = await harness.kubelet("allocate", GPU, ["0000:3b:00.0"])
    assert response.envs["PCI_RESOURCE_NVIDIA_COM_TU104GL_TESLA_T4"] == "0000:3b:00.0"
    others = [name for name in ALL if name != GPU]
    assert {name: emulator.registration_count(name) for name in others} == dict.fromkeys(others, 1)


async def test_every_lost_client_still_held_gets_the_short_wait(harness: Harness) -> None:
    timing = attrs.evolve(FAST, backoff=Backoff(first=0.05, cap=0.5, healthy_after=0.5))
    await harness.serve(timing=timing)
    emulator = harness.emulator
    assert emulator is not None
    took = []
    for _ in range(3):
        before = emulator.registration_count(GPU)
        held_before = len(emulator.events_of("already-connected", GPU))
        await harness.kubelet("break_connection", GPU, linger=0.25)
        assert await harness.wait(
            lambda e, n=held_before: len(e.events_of("already-connected", GPU)) > n
        )
        assert await harness.wait(lambda e, n=before: e.registration_count(GPU) > n)
        assert await harness.registered((GPU,))
        held = emulator.events_of("already-connected", GPU)[held_before].time
        registered = [e.time for e in emulator.events_of("registered", GPU) if e.time > held][0]
        took.append(round(registered - held, 2))
        await asyncio.sleep(1.0)  # live past healthy_after
    # Each incident is one reply without a dial, then a dial: none waits for
    # a dial as for a kubelet that dials after replying.
    assert all(t < FAST.dial_wait for t in took), took


async def test_register_refused_is_retried_with_backoff(harness: Harness) -> None:
    refusals = {"count": 0}

    def refuse(request: dp.RegisterRequest) -> str | None:
        if request.resource_name == GPU and refusals["count"] < 3:
            refusals["count"] += 1
            return "resource name already taken"
        return None

    await harness.serve(kubelet={"refuse": refuse})
    assert refusals["count"] == 3
    assert device_ids(harness, GPU)


# -- allocation ---------------------------------------------------------------------


async def test_allocate_for_each_class_of_device(harness: Harness) -> None:
    await harness.serve()
    gpu = await harness.kubelet("allocate", GPU, ["0000:af:00.0", "0000:3b:00.0"])
    assert gpu.envs["PCI_RESOURCE_NVIDIA_COM_TU104GL_TESLA_T4"] == "0000:af:00.0,0000:3b:00.0"
    paths = [(d.host_path, d.container_path, d.permissions) for d in gpu.devices]
    assert paths == [
        ("/dev/vfio/vfio", "/dev/vfio/vfio", "mrw"),
        ("/dev/vfio/175", "/dev/vfio/175", "mrw"),
        ("/dev/vfio/59", "/dev/vfio/59", "mrw"),
    ]
    uuid = device_ids(harness, VGPU)[0]
    mdev = await harness.kubelet("allocate", VGPU, [uuid])
    assert mdev.envs["MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_RTX6000-4Q"] == uuid
    assert [d.host_path for d in mdev.devices][0] == "/dev/vfio/vfio"
    kvm = await harness.kubelet("allocate", KVM, device_ids(harness, KVM)[:2])
    # Host paths are the host's, not the --dev root the server scanned.
    assert [(d.host_path, d.permissions) for d in kvm.devices] == [("/dev/kvm", "rw")]
    assert not any(str(harness.dev) in d.host_path for d in gpu.devices)


async def test_unknown_device_id_is_invalid_argument(harness: Harness) -> None:
    await harness.serve()
    with pytest.raises(grpc.RpcError) as caught:
        await harness.kubelet("allocate", GPU, ["0000:00:00.0"])
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "'0000:00:00.0'" in caught.value.details() and GPU in caught.value.details()
    response = await harness.kubelet("allocate", GPU, ["0000:3b:00.0"])
    assert response.envs


async def test_device_id_of_ten_thousand_characters(harness: Harness) -> None:
    await harness.serve()
    huge = "x" * 10_000
    with pytest.raises(grpc.RpcError) as caught:
        await harness.kubelet("allocate", QAT, [huge])
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "10000 characters" in caught.value.details()
    assert len(caught.value.details()) < 400
    response = await harness.kubelet("allocate", QAT, ["0000:6b:00.1"])
    assert response.envs


async def test_preferred_allocation_keeps_numa_and_must_include(harness: Harness) -> None:
    await harness.serve()
    healthy = ["0000:3b:00.0", "0000:af:00.0"]
    picked = await harness.kubelet("preferred_allocation", GPU, healthy, ["0000:af:00.0"], 1)
    assert picked == ["0000:af:00.0"]
    qat = [f"0000:6b:00.{i}" for i in range(1, 4)]
    two = await harness.kubelet("preferred_allocation", QAT, qat, [], 2)
    assert len(two) == 2 and set(two) <= set(qat)


async def test_list_and_watch_carries_numa_topology(harness: Harness) -> None:
    await harness.serve()
    assert harness.emulator is not None
    devices = harness.emulator.resources()[GPU].devices
    assert devices["0000:3b:00.0"].numa_nodes == (0,)
    assert devices["0000:af:00.0"].numa_nodes == (1,)
    assert devices["0000:d8:00.0"].health == "Unhealthy"
    assert harness.emulator.resources()[KVM].devices["kvm-000"].numa_nodes == ()


async def test_a_host_change_resends_only_the_touched_resource(harness: Harness) -> None:
    await harness.serve()
    emulator = harness.emulator
    assert emulator is not None
    lists_before = {name: emulator.resources()[name].lists for name in ALL}
    (harness.dev / "vfio" / "109").unlink()  # QAT VF 0000:6b:00.2 loses its group node
    assert await harness.wait(
        lambda e: e.resources()[QAT].devices["0000:6b:00.2"].health == "Unhealthy"
    )
    await asyncio.sleep(0.3)
    lists_after = {name: emulator.resources()[name].lists for name in ALL}
    assert lists_after[QAT] == lists_before[QAT] + 1
    assert {n: lists_after[n] for n in ALL if n != QAT} == {
        n: lists_before[n] for n in ALL if n != QAT
    }


async def test_group_reservation_until_pod_resources_release(harness: Harness) -> None:
    await harness.serve()
    await harness.kubelet("admit", "vm-a", "compute", {NVME: 1})
    assert await harness.wait(
        lambda e: sum(not d.healthy for d in e.resources()[NVME].devices.values()) == 1
    )
    assert harness.emulator is not None
    held = next(d for d, s in harness.emulator.resources()[NVME].devices.items() if s.healthy)
    sibling = next(d for d in device_ids(harness, NVME) if d != held)
    with pytest.raises(grpc.RpcError) as caught:
        await harness.kubelet("allocate", NVME, [sibling])
    assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "IOMMU group 93" in caught.value.details() and held in caught.value.details()
    await harness.kubelet("remove_pod", "vm-a")
    # The PodResources API no longer lists the pod: the group is free again.
    assert await harness.wait(
        lambda e: all(d.healthy for d in e.resources()[NVME].devices.values())
    )
    response = await harness.kubelet("allocate", NVME, [sibling])
    assert response.envs["PCI_RESOURCE_DEVICES_KUBEVIRT_IO_NVME"] == sibling


async def test_a_restarted_server_reserves_the_groups_running_pods_hold(
    harness: Harness,
) -> None:
    """dp restarts (an upgrade) while a VM holds one of two NVMe drives that
    share an IOMMU group: the new process has no allocation of it, and learns
    from PodResources, when the kubelet is seen, which groups are in use."""
    await harness.serve()
    await harness.kubelet("admit", "vm-a", "compute", {NVME: 1})
    assert harness.emulator is not None
    held = next(d for d, s in harness.emulator.resources()[NVME].devices.items() if s.healthy)
    sibling = next(d for d in device_ids(harness, NVME) if d != held)
    assert harness.runtime is not None and harness._serving is not None
    harness.runtime.stop()
    await asyncio.wait_for(harness._serving, 10)
    runtime = await harness.start_server()
    assert await harness.registered()
    for _ in range(100):
        if len(runtime.node.frontend(DevicePluginFrontend).allocations):
            break
        await asyncio.sleep(0.05)
    assert [
        a.device_ids for a in runtime.node.frontend(DevicePluginFrontend).allocations.all()
    ] == [(held,)]
    assert await harness.wait(
        lambda e: (
            e.resources()[NVME].devices[held].healthy
            and not e.resources()[NVME].devices[sibling].healthy
        )
    )
    with pytest.raises(grpc.RpcError) as caught:
        await harness.kubelet("allocate", NVME, [sibling])
    assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION


async def test_a_garbled_pod_resources_answer_keeps_group_reservations(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """A PodResources answer that is not a ListPodResourcesResponse must not
    read as "no pod holds anything": that would free the sibling of a running
    VM's device, and the next VM would split the IOMMU group."""
    caplog.set_level(logging.WARNING, logger="dp.runtime")
    answers = 0

    class Garbled:
        async def list(self, stream: Any) -> None:
            nonlocal answers
            await stream.recv_message()
            await stream.send_message(b"\xff\xfe\xfd\x00\x01")
            answers += 1

        def __mapping__(self) -> dict[str, grpclib.const.Handler]:
            return {
                "/v1.PodResourcesLister/List": grpclib.const.Handler(
                    self.list, grpclib.const.Cardinality.UNARY_UNARY, wire.Raw, wire.Raw
                )
            }

    garbled = grpclib.server.Server([Garbled()], codec=wire.PreEncodedCodec())
    await garbled.start(path=str(harness.pod_resources))
    try:
        runtime = await harness.serve(kubelet={"pod_resources_socket": None})
        await harness.kubelet("admit", "vm-a", "compute", {NVME: 1})
        assert harness.emulator is not None
        held = next(d for d, s in harness.emulator.resources()[NVME].devices.items() if s.healthy)
        sibling = next(d for d in device_ids(harness, NVME) if d != held)
        # Polls every 0.2 s while anything is reserved, with 0.2 s of grace: wait
        # for several answers after the grace has passed.
        seen = answers
        for _ in range(100):
            if answers >= seen + 4:
                break
            await asyncio.sleep(0.05)
        assert answers >= seen + 4
        assert len(runtime.node.frontend(DevicePluginFrontend).allocations) == 1
        with pytest.raises(grpc.RpcError) as caught:
            await harness.kubelet("allocate", NVME, [sibling])
        assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        warnings = [r for r in caplog.records if r.getMessage() == "pod-resources-unavailable"]
        assert len(warnings) == 1  # once, not at every poll
        reason = warnings[0].dp_fields["reason"]  # type: ignore[attr-defined]
        assert reason.startswith("malformed answer: ListPodResourcesResponse")
    finally:
        garbled.close()
        await garbled.wait_closed()


# -- bad input ---------------------------------------------------------------------


async def test_garbage_bytes_on_the_plugin_socket(harness: Harness) -> None:
    runtime = await harness.serve()
    assert runtime is not None

    def send_garbage() -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.connect(str(runtime.frontend(DevicePluginRuntime).socket_paths[0]))
            raw.sendall(os.urandom(4096) + b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + os.urandom(512))
            raw.settimeout(2)
            try:
                while raw.recv(4096):
                    pass
            except OSError:
                pass

    await asyncio.to_thread(send_garbage)
    response = await harness.kubelet("allocate", GPU, ["0000:3b:00.0"])
    assert response.envs
    assert harness.emulator is not None
    assert all(harness.emulator.resources()[n].registered for n in ALL)


async def test_client_that_disconnects_mid_stream(harness: Harness) -> None:
    await harness.serve()
    assert harness.emulator is not None
    stream = harness.emulator.call(GPU, "ListAndWatch", dp.Empty())
    first = await asyncio.to_thread(next, stream)
    assert {d.ID for d in first.devices} == set(device_ids(harness, GPU))
    stream.cancel()
    await asyncio.sleep(0.2)
    response = await harness.kubelet("allocate", GPU, ["0000:af:00.0"])
    assert response.envs
    assert harness.emulator.resources()[GPU].registered


async def test_kubelet_socket_missing_keeps_the_server_up(harness: Harness) -> None:
    runtime = await harness.start_server()
    await asyncio.sleep(0.3)
    assert runtime.node.frontend(DevicePluginFrontend).registrar.kubelet_present is False
    assert (
        runtime.frontend(DevicePluginRuntime).socket_paths
        and runtime.frontend(DevicePluginRuntime).socket_paths[0].exists()
    )
    harness.start_kubelet()
    assert await harness.registered()


async def test_a_configmap_update_is_applied_and_other_files_beside_it_are_ignored(
    harness: Harness,
) -> None:
    # A ConfigMap volume as the kubelet writes it: config.yaml -> ..data/config.yaml,
    # ..data -> ..<timestamp>/, swapped atomically on an update.
    volume = harness.root / "cm"
    (volume / "..v1").mkdir(parents=True)
    (volume / "..v1" / "config.yaml").write_text(DEMO_CONFIG)
    (volume / "..data").symlink_to("..v1")
    path = volume / "config.yaml"
    path.symlink_to("..data/config.yaml")
    reloads = []

    def reload() -> tuple[Config, dict[PciId, str]]:
        reloads.append(1)
        return load_settings(str(path))

    await harness.serve_config_file(path, reload)

    (volume / "notes.txt").write_text("not the config")
    await asyncio.sleep(0.6)  # the watcher groups events for up to 200 ms
    assert reloads == []

    (volume / "..v2").mkdir()
    (volume / "..v2" / "config.yaml").write_text(DEMO_CONFIG.replace("{count: 1000}", "{count: 7}"))
    (volume / "..data_tmp").symlink_to("..v2")
    os.replace(volume / "..data_tmp", volume / "..data")
    assert await harness.wait(lambda e: len(e.resources()[KVM].devices) == 7)
    assert reloads


async def test_editing_the_file_a_config_link_points_to_is_applied(harness: Harness) -> None:
    # config.yaml -> config.prod.yaml: an edit of the target is reported for
    # config.prod.yaml only, yet it changes the config.
    etc = harness.root / "etc"
    etc.mkdir()
    (etc / "config.prod.yaml").write_text(DEMO_CONFIG)
    path = etc / "config.yaml"
    path.symlink_to("config.prod.yaml")
    await harness.serve_config_file(path)
    (etc / "config.prod.yaml").write_text(DEMO_CONFIG.replace("{count: 1000}", "{count: 9}"))
    assert await harness.wait(lambda e: len(e.resources()[KVM].devices) == 9)


async def test_config_file_change_is_applied_and_a_broken_one_is_kept_out(
    harness: Harness,
) -> None:
    config_dir = harness.root / "cfg"
    config_dir.mkdir()
    path = config_dir / "config.yaml"
    path.write_text(DEMO_CONFIG)
    runtime, config = await harness.serve_config_file(path)

    path.write_text("permittedHostDevices: [unclosed\n")
    await harness.config_read(runtime)
    assert runtime.config == config  # the broken file changed nothing
    path.write_text(
        DEMO_CONFIG.replace("{count: 1000}", "{count: 50}")
        + "  example.com/fuse: {path: /dev/kvm, count: 3}\n"
    )
    assert await harness.wait(
        lambda e: (
            len(e.resources()[KVM].devices) == 50
            and "example.com/fuse" in e.resources()
            and e.resources()["example.com/fuse"].registered
        )
    )
    response = await harness.kubelet("allocate", GPU, ["0000:3b:00.0"])
    assert response.envs
