"""The StandardNode as a whole: streams, publishing, health reports and its contract."""

from __future__ import annotations

import attrs
import pytest

from dp_core import (
    AdvertisedDevice,
    AllocateRequested,
    ConnectionClosed,
    EndStream,
    HealthChanged,
    HostObserved,
    Log,
    OptionsRequested,
    PluginOptions,
    PreferredAllocationRequested,
    PreStartAnswer,
    PreStartRequested,
    Publish,
    Reject,
    Reply,
    StandardNode,
    StatusCode,
    Tick,
    UsageError,
    WatchEnded,
    WatchStarted,
)
from dp_core.inputs import ContainerPreference

from core_builders import (
    GPU,
    GPU_RESOURCE,
    QAT_RESOURCE,
    VF,
    VF_RESOURCE,
    effects_of,
    gpu_config,
    live_node,
    one,
    pci,
    qat_config,
    shared_group_host,
    snapshot,
    started_node,
    two_gpus_and_vfs,
    without_logs,
)

T4_A, T4_B = "0000:3b:00.0", "0000:af:00.0"


def host_without(*missing: str) -> object:
    base = two_gpus_and_vfs()
    return attrs.evolve(base, dev_nodes=base.dev_nodes - set(missing))


# ---------------------------------------------------------------------------
# ListAndWatch


def test_watch_started_publishes_the_current_list() -> None:
    node, kubelet = live_node()
    connection = kubelet.connection_of[GPU_RESOURCE]
    effects = node.handle(WatchStarted(connection, 900, 1.0))
    publish = one(effects, Publish)
    assert publish.stream == 900 and publish.resource == GPU_RESOURCE
    assert [(d.id, d.health) for d in publish.devices] == [
        (T4_A, "Healthy"),
        (T4_B, "Healthy"),
    ]
    assert publish.devices == node.device_plugin.advertised(GPU_RESOURCE)
    assert sorted(node.device_plugin.streams(GPU_RESOURCE)) == sorted(
        [kubelet.stream_of[GPU_RESOURCE], 900]
    )


def test_unchanged_rescan_publishes_nothing() -> None:
    node, kubelet = live_node()
    effects = node.handle(HostObserved(two_gpus_and_vfs(), 1.0))
    assert effects == []


def test_change_to_one_resource_publishes_only_its_streams() -> None:
    node, kubelet = live_node()
    extra = kubelet.fresh()
    node.handle(WatchStarted(kubelet.connection_of[GPU_RESOURCE], extra, 0.5))
    effects = node.handle(HostObserved(host_without("/dev/vfio/20"), 1.0))
    publishes = effects_of(effects, Publish)
    assert {p.stream for p in publishes} == {kubelet.stream_of[GPU_RESOURCE], extra}
    assert {p.resource for p in publishes} == {GPU_RESOURCE}
    # The whole list is sent every time, not just the changed device.
    for publish in publishes:
        assert [(d.id, d.healthy) for d in publish.devices] == [(T4_A, True), (T4_B, False)]


def test_health_changes_are_reported_and_logged() -> None:
    node, kubelet = live_node()
    effects = node.handle(HostObserved(host_without("/dev/vfio/20"), 1.0))
    report = one(effects, HealthChanged)
    assert report == HealthChanged(GPU_RESOURCE, T4_B, False, "/dev/vfio/20 does not exist")
    (log,) = [e for e in effects_of(effects, Log) if e.event == "health-changed"]
    assert log.level == "warning"
    assert dict(log.fields) == {
        "resource": GPU_RESOURCE,
        "health": "Unhealthy",
        "devices": 1,
        "ids": T4_B,
        "reason": "/dev/vfio/20 does not exist",
    }
    # And back again.
    effects = node.handle(HostObserved(two_gpus_and_vfs(), 2.0))
    assert one(effects, HealthChanged) == HealthChanged(GPU_RESOURCE, T4_B, True, "")
    (log,) = [e for e in effects_of(effects, Log) if e.event == "health-changed"]
    assert log.level == "info"
    assert one(effects, Publish).devices[1].healthy


def test_many_devices_turning_unhealthy_for_one_reason_are_one_log_line() -> None:
    """A host without /dev/vhost-net: 110 HealthChanged (the metrics count each),
    one warning with the count; when it comes back, one line again."""
    from dp_core import Config, SharedDevice

    vhost = SharedDevice("devices.kubevirt.io/vhost-net", "/dev/vhost-net")
    node = StandardNode(Config(shared_devices=(vhost,)))
    present = attrs.evolve(two_gpus_and_vfs(), dev_nodes={"/dev/vhost-net"})
    node.handle(HostObserved(present, 0.0))
    effects = node.handle(HostObserved(attrs.evolve(present, dev_nodes=set()), 1.0))
    assert len(effects_of(effects, HealthChanged)) == 110
    (log,) = [e for e in effects_of(effects, Log) if e.event == "health-changed"]
    assert (log.level, dict(log.fields)) == (
        "warning",
        {
            "resource": "devices.kubevirt.io/vhost-net",
            "health": "Unhealthy",
            "devices": 110,
            "ids": "vhost-net-000, vhost-net-001, vhost-net-002, ...",
            "reason": "/dev/vhost-net does not exist",
        },
    )
    effects = node.handle(HostObserved(present, 2.0))
    (log,) = [e for e in effects_of(effects, Log) if e.event == "health-changed"]
    assert (log.level, dict(log.fields)["devices"], dict(log.fields)["reason"]) == ("info", 110, "")


def test_a_change_of_reason_only_is_published_but_not_reported() -> None:
    node, kubelet = live_node()
    node.handle(HostObserved(host_without("/dev/vfio/20"), 1.0))
    effects = node.handle(HostObserved(host_without("/dev/vfio/20", "/dev/vfio/vfio"), 2.0))
    reported = [(r.resource, r.device_id, r.healthy) for r in effects_of(effects, HealthChanged)]
    # T4_B was already Unhealthy: only its reason changed, so no new report.
    assert reported == [
        (VF_RESOURCE, "0000:3d:01.0", False),
        (VF_RESOURCE, "0000:3d:01.1", False),
        (VF_RESOURCE, "0000:3d:01.2", False),
        (VF_RESOURCE, "0000:3d:01.3", False),
        (GPU_RESOURCE, T4_A, False),
    ]
    gpu = [p for p in effects_of(effects, Publish) if p.resource == GPU_RESOURCE]
    assert [d.reason for d in gpu[0].devices] == [
        "/dev/vfio/vfio does not exist (is the vfio module loaded?)"
    ] * 2


def test_new_unhealthy_device_is_reported_and_new_healthy_one_is_not() -> None:
    node, kubelet = live_node()
    base = two_gpus_and_vfs()
    grown = snapshot(
        [
            *base.pci_devices,
            pci("0000:d8:00.0", GPU, 50, driver=None),
            pci("0000:d9:00.0", GPU, 51),
        ]
    )
    effects = node.handle(HostObserved(grown, 1.0))
    reports = effects_of(effects, HealthChanged)
    assert [(r.device_id, r.healthy) for r in reports] == [("0000:d8:00.0", False)]
    assert "not bound" in reports[0].reason
    publish = one(effects, Publish)
    assert [d.id for d in publish.devices] == [T4_A, T4_B, "0000:d8:00.0", "0000:d9:00.0"]


def test_removing_every_device_publishes_an_empty_list() -> None:
    node, kubelet = live_node()
    only_vfs = snapshot([d for d in two_gpus_and_vfs().pci_devices if d.pci_id == VF])
    effects = node.handle(HostObserved(only_vfs, 1.0))
    publish = one(effects, Publish)
    assert publish == Publish(kubelet.stream_of[GPU_RESOURCE], GPU_RESOURCE, ())
    # The resource stays known (the kubelet cannot unregister one).
    assert GPU_RESOURCE in node.device_plugin.resource_names()
    assert node.device_plugin.advertised(GPU_RESOURCE) == ()
    # A new watch gets the empty list too.
    effects = node.handle(WatchStarted(kubelet.connection_of[GPU_RESOURCE], 999, 2.0))
    assert one(effects, Publish).devices == ()
    # And an Allocate of a vanished device is refused.
    kubelet.now = 2.0
    reject = one(kubelet.allocate(GPU_RESOURCE, (T4_A,)), Reject)
    assert reject.status is StatusCode.FAILED_PRECONDITION
    assert "no devices" in reject.message


def test_watch_ended_and_connection_closed_forget_streams() -> None:
    node, kubelet = live_node()
    gpu_conn = kubelet.connection_of[GPU_RESOURCE]
    node.handle(WatchStarted(gpu_conn, 901, 0.0))
    node.handle(WatchEnded(901))
    assert node.device_plugin.streams(GPU_RESOURCE) == [kubelet.stream_of[GPU_RESOURCE]]
    node.handle(ConnectionClosed(gpu_conn, 1.0))
    assert node.device_plugin.streams(GPU_RESOURCE) == []
    effects = node.handle(HostObserved(host_without("/dev/vfio/20"), 2.0))
    assert effects_of(effects, Publish) == []
    # Its device list is still kept for the next watch.
    assert not node.device_plugin.advertised(GPU_RESOURCE)[1].healthy


def test_ending_an_unknown_stream_is_harmless() -> None:
    node, kubelet = live_node()
    assert node.handle(WatchEnded(123456)) == []


# ---------------------------------------------------------------------------
# RPCs


@pytest.mark.parametrize(
    ("resource", "options"),
    [(GPU_RESOURCE, PluginOptions(False, True)), (VF_RESOURCE, PluginOptions(False, True))],
)
def test_options_per_resource(resource: str, options: PluginOptions) -> None:
    node, kubelet = live_node()
    effects = node.handle(OptionsRequested(kubelet.connection_of[resource], 3, 0.0))
    assert effects == [Reply(3, options)]


def _rpcs(connection: int, call: int) -> list[object]:
    return [
        OptionsRequested(connection, call, 5.0),
        AllocateRequested(connection, call, [[T4_A]], 5.0),
        PreferredAllocationRequested(connection, call, [ContainerPreference([T4_A], [], 1)], 5.0),
        PreStartRequested(connection, call, [T4_A], 5.0),
    ]


@pytest.mark.parametrize("index", range(4), ids=["options", "allocate", "preferred", "prestart"])
def test_rpcs_on_an_unattributed_connection_are_unavailable(index: int) -> None:
    node, kubelet = live_node()
    event = _rpcs(777, 55)[index]
    effects = node.handle(event)  # type: ignore[arg-type]
    assert effects_of(effects, Reply) == []
    reject = one(effects, Reject)
    assert reject.call == 55 and reject.status is StatusCode.UNAVAILABLE
    assert len(node.device_plugin.allocations) == 0
    # The operator sees it in dp's log too, with the method and no resource.
    log = one(effects, Log)
    rpc = ["GetDevicePluginOptions", "Allocate", "GetPreferredAllocation", "PreStartContainer"]
    assert (log.level, log.event) == ("warning", "rejected")
    assert dict(log.fields) == {
        "rpc": rpc[index],
        "resource": "",
        "status": "UNAVAILABLE",
        "reason": reject.message,
    }


def test_a_watch_on_an_unattributed_connection_is_ended_and_logged() -> None:
    node, kubelet = live_node()
    effects = node.handle(WatchStarted(777, 56, 5.0))
    end = one(effects, EndStream)
    assert end.stream == 56 and "not attributed" in end.reason
    assert dict(one(effects, Log).fields) == {
        "rpc": "ListAndWatch",
        "resource": "",
        "status": "UNAVAILABLE",
        "reason": end.reason,
    }
    assert node.device_plugin.streams(GPU_RESOURCE) == [kubelet.stream_of[GPU_RESOURCE]]


@pytest.mark.parametrize(
    ("ids", "status", "part"),
    [
        ((T4_A,), None, None),
        ((T4_A, T4_B), None, None),
        ((), None, None),
        (("0000:00:00.0",), StatusCode.INVALID_ARGUMENT, "0000:00:00.0"),
        ((T4_A, T4_A), StatusCode.INVALID_ARGUMENT, "twice"),
    ],
)
def test_prestart_validates_ids(
    ids: tuple[str, ...], status: StatusCode | None, part: str | None
) -> None:
    node, kubelet = live_node()
    effects = node.handle(PreStartRequested(kubelet.connection_of[GPU_RESOURCE], 8, ids, 0.0))
    if status is None:
        assert effects == [Reply(8, PreStartAnswer())]
    else:
        reject = one(effects, Reject)
        assert reject.status is status and part is not None and part in reject.message
        fields = dict(one(effects, Log).fields)
        assert fields["resource"] == GPU_RESOURCE and fields["reason"] == reject.message


# ---------------------------------------------------------------------------
# Contract: time and inputs


def test_time_going_backwards_is_a_usage_error() -> None:
    node, _ = started_node(now=10.0)
    node.handle(Tick(12.0))
    with pytest.raises(UsageError, match="backwards"):
        node.handle(Tick(11.9))
    # The same time again is fine.
    assert node.handle(Tick(12.0)) == []


def test_unknown_input_is_a_usage_error() -> None:
    @attrs.frozen
    class Bogus:
        now: float

    node, _ = started_node()
    with pytest.raises(UsageError, match="Bogus"):
        node.handle(Bogus(1.0))  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        node.handle("Tick(1.0)")  # type: ignore[arg-type]


def test_a_node_before_any_scan_advertises_only_what_config_allows() -> None:
    node = StandardNode(gpu_config(shared_devices=()))
    assert node.device_plugin.resource_names() == ()
    assert node.next_deadline() is None
    effects = node.handle(HostObserved(two_gpus_and_vfs(), 0.0))
    assert node.device_plugin.resource_names() == (VF_RESOURCE, GPU_RESOURCE)
    assert [dict(e.fields)["resource"] for e in effects_of(effects, Log)] == [
        VF_RESOURCE,
        GPU_RESOURCE,
    ]


def test_describe_shows_reservations() -> None:
    node, kubelet = live_node(qat_config(shared_devices=()), shared_group_host())
    kubelet.allocate(QAT_RESOURCE, ("0000:3f:01.0",))
    described = node.device_plugin.describe().resource(QAT_RESOURCE)
    assert described is not None
    assert [d.healthy for d in described.devices] == [True, False, True]
    # The raw inventory does not know about allocations.
    raw = node.inventory.resource(QAT_RESOURCE)
    assert raw is not None and all(d.healthy for d in raw.devices)


def test_effects_reference_frozen_device_lists() -> None:
    node, kubelet = live_node()
    effects = node.handle(WatchStarted(kubelet.connection_of[GPU_RESOURCE], 950, 0.0))
    devices = one(effects, Publish).devices
    assert isinstance(devices, tuple)
    assert all(isinstance(d, AdvertisedDevice) for d in devices)


def test_end_stream_is_not_sent_for_a_healthy_resource() -> None:
    node, kubelet = live_node()
    effects = node.handle(HostObserved(host_without("/dev/vfio/20"), 1.0))
    assert effects_of(effects, EndStream) == []
    assert without_logs(effects) != []
