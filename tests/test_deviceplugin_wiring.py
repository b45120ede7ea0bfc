"""The device-plugin wiring follows the core through its effects alone
(dp_server.deviceplugin.wiring): the garbage collected once a storm of
Registers has settled, the kubelet's checkpoint read again while the core
wants it, and /readyz and the status page from the view the core hands out.

The wiring runs on a real `Loop` and `Node`, without the runtime: background
tasks are not started, and the collector's schedule is recorded.
"""

from __future__ import annotations

import gc
import json
import socket
import typing
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path

import attrs
import pytest

from dp_core import (
    AllocationsObserved,
    Config,
    ConnectionClosed,
    ConnectionOpened,
    Effect,
    HostObserved,
    HostSnapshot,
    KubeletStarted,
    Ledger,
    Log,
    Node,
    OptionsRequested,
    RegistrationSucceeded,
    SharedDevice,
    Tick,
)
from dp_server.config.settings import Settings
from dp_server.deviceplugin.kubelet_checkpoint import CHECKPOINT_FILE
from dp_server.deviceplugin.wiring import DevicePluginRuntime
from dp_server.loop import CollectionPolicy, Loop, Readiness, Services

from core_builders import QAT_RESOURCE, qat_config, shared_group_host

KVM = SharedDevice("devices.kubevirt.io/kvm", "/dev/kvm", count=2)
POD = "5d3c1f4e-9b2a-4f61-8c7e-2a1b3c4d5e6f"
QAT_0, QAT_1 = "0000:3f:01.0", "0000:3f:01.1"  # one IOMMU group


@attrs.define
class Wired:
    wiring: DevicePluginRuntime
    loop: Loop
    scheduled: list[tuple[float, Callable[[], None]]]
    logs: list[Log]

    def connect(self, connection: int, now: float) -> None:
        """A kubelet's dial inside Register: the connection, then its options call."""
        self.loop.feed(ConnectionOpened(connection, now))
        self.loop.call(lambda call: OptionsRequested(connection, call, now))

    def events(self) -> list[str]:
        return [log.event for log in self.logs]


def _never_run(coroutine: Coroutine[object, object, object], **_: object) -> None:
    coroutine.close()


@pytest.fixture
def plugin_dir(short_dir: Path) -> Path:
    path = short_dir / "device-plugins"
    path.mkdir()
    return path


def wired(plugin_dir: Path, config: Config) -> Wired:
    settings = Settings(device_plugin_dir=str(plugin_dir), endpoint_prefix="dp")
    ledger = Ledger()
    wiring = DevicePluginRuntime(settings, config, ledger)
    loop = Loop(Node(config, [wiring.core], ledger=ledger), clock=lambda: 0.0)
    scheduled: list[tuple[float, Callable[[], None]]] = []
    memory = CollectionPolicy(schedule=lambda delay, call: scheduled.append((delay, call)))
    wiring.attach(loop, Services(_never_run, memory, lambda: False))
    logs: list[Log] = []
    loop.on(Log, logs.append)
    for kind in typing.get_args(Effect):  # the other sub-systems' (moves, CDI): none come
        if not loop.handles(kind):
            loop.on(kind, lambda effect: None)
    return Wired(wiring, loop, scheduled, logs)


def test_what_lost_connections_left_is_collected_once_the_registrations_settle(
    plugin_dir: Path,
) -> None:
    """A second after the last Register of a storm, once per storm, and not
    on the inputs between: the core says when (`RegistrationsSettled`)."""
    dp = wired(plugin_dir, Config(shared_devices=(KVM,)))
    dp.loop.feed(HostObserved(HostSnapshot(dev_nodes={"/dev/kvm"}), 1.0))
    dp.loop.feed(KubeletStarted(1.0))
    dp.loop.feed(AllocationsObserved({}, 1.0))
    assert dp.wiring.readiness() == Readiness(
        False, "1 of 1 resources not registered: devices.kubevirt.io/kvm (registering)"
    )
    dp.connect(7, 1.1)
    assert dp.scheduled == []  # registering: not yet
    dp.loop.feed(RegistrationSucceeded(KVM.resource_name, 1, 1.2))
    assert dp.scheduled == [(1.0, gc.collect)]
    assert dp.wiring.readiness() == Readiness(True, "1 resources")
    assert dp.wiring.serving()["resources"] == 1
    assert dp.wiring.remarks() == ()
    dp.loop.feed(Tick(2.0))
    assert dp.scheduled == [(1.0, gc.collect)]  # once per storm
    # The kubelet's connection is lost: the resource registers again.
    dp.loop.feed(ConnectionClosed(7, 3.0))
    assert not dp.wiring.readiness().ready
    dp.connect(8, 3.1)
    assert dp.scheduled == [(1.0, gc.collect)]
    dp.loop.feed(RegistrationSucceeded(KVM.resource_name, 2, 3.2))
    assert dp.scheduled == [(1.0, gc.collect)] * 2
    assert dp.wiring.readiness() == Readiness(True, "1 resources")


def _write_checkpoint(plugin_dir: Path, *devices: str) -> None:
    entries = [
        {
            "PodUID": POD,
            "ContainerName": "compute",
            "ResourceName": QAT_RESOURCE,
            "DeviceIDs": {"0": list(devices)},
            "AllocResp": "",
        }
    ]
    data = {"PodDeviceEntries": entries if devices else None, "RegisteredDevices": {}}
    (plugin_dir / CHECKPOINT_FILE).write_text(json.dumps({"Data": data, "Checksum": 1}))


@pytest.fixture
def kubelet_socket(plugin_dir: Path) -> Iterator[Path]:
    """A kubelet.sock for the wiring to find (nothing is served on it)."""
    path = plugin_dir / "kubelet.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    try:
        yield path
    finally:
        listener.close()


async def test_the_kubelets_checkpoint_is_read_again_while_the_core_wants_it(
    plugin_dir: Path, kubelet_socket: Path
) -> None:
    """A kubelet that has just started gives QAT_0 to a pod it does not list
    yet: QAT_1, its group sibling, is held. Once the kubelet writes its
    checkpoint without the pod, the wiring reads it again (the core said it
    wants it: `KubeletCheckpointWanted`), and the group is free."""
    _write_checkpoint(plugin_dir, QAT_0)
    dp = wired(plugin_dir, qat_config(shared_devices=()))
    dp.loop.feed(HostObserved(shared_group_host(), 0.0))  # at the loop's clock, which stays
    await dp.wiring.restore()  # kubelet.sock is there: the kubelet started
    node = dp.loop.node
    [resource] = node.inventory.resources
    assert [d.healthy for d in dp.wiring.core.advertised(resource.name)] == [True, False, True]
    dp.loop.feed(AllocationsObserved({}, 0.0))  # a young kubelet lists no pods
    await dp.wiring.restore()  # the checkpoint did not change: nothing to read
    assert "kubelet-synced" not in dp.events()
    _write_checkpoint(plugin_dir)  # the kubelet dropped the pod
    await dp.wiring.restore()
    assert "kubelet-synced" in dp.events()
    assert [d.healthy for d in dp.wiring.core.advertised(resource.name)] == [True, True, True]
