"""The core's counters and metric families, without an event loop."""

from __future__ import annotations

import attrs
import pytest

from dp_core import (
    VFIO_DRIVER,
    AllocationsObserved,
    Binding,
    BindingFinished,
    Config,
    ConnectionOpened,
    HostObserved,
    HostSnapshot,
    KubeletStarted,
    MetricFamily,
    OptionsRequested,
    PciAddress,
    PciHostDevice,
    PciId,
    PermittedHostDevices,
    RegistrationFailed,
    Sample,
    StandardNode,
    UnbindingFinished,
    WatchStarted,
    collect,
)

from core_builders import (
    AUDIO,
    GPU,
    GPU_RESOURCE,
    QAT_RESOURCE,
    VF,
    VF_RESOURCE,
    gpu_config,
    live_node,
    pci,
    qat_config,
    shared_group_host,
    snapshot,
    started_node,
    two_gpus_and_vfs,
)


def values(node: StandardNode) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (family.name, sample.labels): sample.value
        for family in collect(node)
        for sample in family.samples
    }


def phases(got: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, str]:
    """The one-hot phase gauge, read back; fails unless exactly one phase is set."""
    seen: dict[str, list[str]] = {}
    for (name, labels), value in got.items():
        if name == "dp_resource_registration_phase":
            (_, resource), (_, phase) = labels
            seen.setdefault(resource, [])
            if value:
                seen[resource].append(phase)
    assert all(len(set_) == 1 for set_ in seen.values()), seen
    return {resource: set_[0] for resource, set_ in seen.items()}


def rpcs(method: str, resource: str, code: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    labels = (("method", method), ("resource", resource), ("code", code))
    return "dp_rpcs_total", labels


def test_a_served_allocate_is_counted_with_its_devices_and_held_until_released() -> None:
    node, kubelet = live_node()
    kubelet.allocate(GPU_RESOURCE, ("0000:3b:00.0",))
    kubelet.allocate(VF_RESOURCE, ("0000:3d:01.0", "0000:3d:01.1"))
    got = values(node)
    assert got[rpcs("Allocate", GPU_RESOURCE, "OK")] == 1
    assert got[rpcs("Allocate", VF_RESOURCE, "OK")] == 1
    assert got["dp_allocated_devices_total", (("resource", VF_RESOURCE),)] == 2
    assert got["dp_resource_allocated_devices", (("resource", VF_RESOURCE),)] == 2
    assert got["dp_resource_allocated_devices", (("resource", GPU_RESOURCE),)] == 1
    # PodResources no longer lists them: the gauge drops, the counter stays.
    node.handle(AllocationsObserved({}, 100.0))
    got = values(node)
    assert got["dp_resource_allocated_devices", (("resource", VF_RESOURCE),)] == 0
    assert got["dp_allocated_devices_total", (("resource", VF_RESOURCE),)] == 2


@pytest.mark.parametrize(
    ("devices", "code"),
    [
        (("0000:00:00.0",), "INVALID_ARGUMENT"),
        (("0000:3b:00.0", "0000:3b:00.0"), "INVALID_ARGUMENT"),
    ],
)
def test_a_rejected_allocate_counts_under_its_status_and_hands_out_nothing(
    devices: tuple[str, ...], code: str
) -> None:
    node, kubelet = live_node()
    kubelet.allocate(GPU_RESOURCE, devices)
    got = values(node)
    assert got[rpcs("Allocate", GPU_RESOURCE, code)] == 1
    assert rpcs("Allocate", GPU_RESOURCE, "OK") not in got
    assert ("dp_allocated_devices_total", (("resource", GPU_RESOURCE),)) not in got


def test_rpcs_on_an_unattributed_connection_count_without_a_resource() -> None:
    node, kubelet = live_node()
    stray = kubelet.fresh()
    node.handle(ConnectionOpened(stray, 0.0, None))
    node.handle(OptionsRequested(stray, kubelet.fresh(), 0.0))
    node.handle(WatchStarted(stray, kubelet.fresh(), 0.0))
    got = values(node)
    assert got[rpcs("GetDevicePluginOptions", "", "UNAVAILABLE")] == 1
    assert got[rpcs("ListAndWatch", "", "UNAVAILABLE")] == 1


def test_registrations_kubelet_starts_and_scans_are_counted() -> None:
    node, effects = started_node()
    node.handle(RegistrationFailed(GPU_RESOURCE, 1, "refused", 1.0))
    node.handle(KubeletStarted(2.0))
    node.handle(HostObserved(two_gpus_and_vfs(), 3.0))
    got = values(node)
    assert got["dp_registrations_total", (("resource", GPU_RESOURCE), ("result", "failed"))] == 1
    assert ("dp_registrations_total", (("resource", GPU_RESOURCE), ("result", "ok"))) not in got
    assert got["dp_kubelet_starts_total", ()] == 2
    assert got["dp_host_scans_total", ()] == 2


NIC = PciId(0x8086, 0x1572)


def nics(*drivers: str) -> HostSnapshot:
    devices = [
        pci(f"0000:18:00.{n}", NIC, 18 + n, driver=driver, class_code=0x020000)
        for n, driver in enumerate(drivers)
    ]
    return attrs.evolve(snapshot(devices), pci_drivers=frozenset({VFIO_DRIVER, "i40e"}))


def test_binds_in_flight_failed_and_done_are_reported() -> None:
    config = Config(
        PermittedHostDevices((PciHostDevice(NIC),)),
        shared_devices=(),
        binding=Binding(("i40e",)),
    )
    node = StandardNode(config)
    node.handle(KubeletStarted(0.0))
    node.handle(AllocationsObserved({}, 0.0))  # PodResources answered: binds may start
    node.handle(HostObserved(nics("i40e", "i40e"), 1.0))
    got = values(node)
    assert got["dp_bind_functions", (("state", "in_flight"),)] == 2
    node.handle(BindingFinished(PciAddress.parse("0000:18:00.0"), None, 2.0))
    node.handle(BindingFinished(PciAddress.parse("0000:18:00.1"), "EBUSY", 2.0))
    got = values(node)
    assert got["dp_bind_functions", (("state", "in_flight"),)] == 0
    assert got["dp_bind_functions", (("state", "failed"),)] == 1
    assert got["dp_binds_total", (("result", "ok"),)] == 1
    assert got["dp_binds_total", (("result", "failed"),)] == 1
    assert got["dp_bind_functions", (("state", "giving_back"),)] == 0


def test_functions_being_given_back_are_reported() -> None:
    """Two functions of one IOMMU group: the second's bind fails, so the first
    goes back to its driver."""
    config = Config(
        PermittedHostDevices((PciHostDevice(NIC),)),
        shared_devices=(),
        binding=Binding(("i40e",)),
    )
    devices = [pci(f"0000:18:00.{n}", NIC, 18, driver="i40e", class_code=0x020000) for n in (0, 1)]
    node = StandardNode(config)
    node.handle(KubeletStarted(0.0))
    node.handle(AllocationsObserved({}, 0.0))
    node.handle(
        HostObserved(
            attrs.evolve(snapshot(devices), pci_drivers=frozenset({VFIO_DRIVER, "i40e"})), 1.0
        )
    )
    node.handle(BindingFinished(PciAddress.parse("0000:18:00.0"), None, 2.0))
    node.handle(BindingFinished(PciAddress.parse("0000:18:00.1"), "EBUSY", 2.0))
    got = values(node)
    assert got["dp_bind_functions", (("state", "giving_back"),)] == 1
    assert got["dp_bind_functions", (("state", "failed"),)] == 2
    node.handle(UnbindingFinished(PciAddress.parse("0000:18:00.0"), None, 3.0))
    assert values(node)["dp_bind_functions", (("state", "giving_back"),)] == 0


def test_gauges_follow_health_registration_and_streams() -> None:
    # The first T4's audio function is on its host driver: that group is not viable.
    host = snapshot(
        [
            pci("0000:3b:00.0", GPU, 10),
            pci("0000:3b:00.1", AUDIO, 10, driver="snd_hda_intel", class_code=0x040300),
            pci("0000:af:00.0", GPU, 20),
            *(pci(f"0000:3d:01.{n}", VF, 30 + n, class_code=0x0B4000) for n in range(4)),
        ]
    )
    node, effects = started_node(host=host)
    got = values(node)
    assert got["dp_resource_devices", (("resource", GPU_RESOURCE), ("health", "unhealthy"))] == 1
    assert got["dp_resource_devices", (("resource", GPU_RESOURCE), ("health", "healthy"))] == 1
    assert got["dp_resource_devices", (("resource", VF_RESOURCE), ("health", "healthy"))] == 4
    changed = ("dp_health_changes_total", (("resource", GPU_RESOURCE), ("health", "unhealthy")))
    assert got[changed] == 1
    # One socket: one Register at a time, the other resource waits its turn.
    assert phases(got) == {VF_RESOURCE: "registering", GPU_RESOURCE: "waiting"}
    node, kubelet = live_node()
    got = values(node)
    assert phases(got) == {VF_RESOURCE: "live", GPU_RESOURCE: "live"}
    for resource in (GPU_RESOURCE, VF_RESOURCE):
        assert got["dp_resource_streams", (("resource", resource),)] == 1


def test_a_sibling_held_by_an_allocation_is_reserved_not_unhealthy() -> None:
    node, kubelet = live_node(qat_config(shared_devices=()), shared_group_host())
    kubelet.allocate(QAT_RESOURCE, ("0000:3f:01.0",))
    got = values(node)
    qat = ("resource", QAT_RESOURCE)
    # 3f:01.1 shares group 40 with the allocated 3f:01.0: Unhealthy to the kubelet,
    # but nothing is wrong with it.
    assert got["dp_resource_devices", (qat, ("health", "healthy"))] == 2
    assert got["dp_resource_devices", (qat, ("health", "reserved"))] == 1
    assert got["dp_resource_devices", (qat, ("health", "unhealthy"))] == 0
    # Released: healthy again.
    node.handle(AllocationsObserved({}, 100.0))
    got = values(node)
    assert got["dp_resource_devices", (qat, ("health", "healthy"))] == 3
    assert got["dp_resource_devices", (qat, ("health", "reserved"))] == 0


def test_error_and_unattributed_counters_exist_from_the_start() -> None:
    node, kubelet = live_node()
    got = values(node)
    methods = ["Allocate", "GetDevicePluginOptions", "GetPreferredAllocation"]
    methods += ["ListAndWatch", "PreStartContainer"]
    assert {labels[0][1]: v for (n, labels), v in got.items() if n == "dp_rpc_errors_total"} == {
        method: 0 for method in methods
    }
    assert got["dp_unattributed_rpcs_total", ()] == 0
    kubelet.allocate(GPU_RESOURCE, ("0000:00:00.0",))
    stray = kubelet.fresh()
    node.handle(ConnectionOpened(stray, 0.0, None))
    node.handle(OptionsRequested(stray, kubelet.fresh(), 0.0))
    got = values(node)
    assert got["dp_rpc_errors_total", (("method", "Allocate"),)] == 1
    assert got["dp_rpc_errors_total", (("method", "GetDevicePluginOptions"),)] == 1
    assert got["dp_unattributed_rpcs_total", ()] == 1


def test_families_are_unique_and_each_has_one_label_set() -> None:
    node, kubelet = live_node(gpu_config())
    kubelet.allocate(GPU_RESOURCE, ("0000:00:00.0",))
    families = collect(node)
    names = [family.name for family in families]
    assert len(names) == len(set(names))
    for family in families:
        label_sets = {tuple(k for k, _ in sample.labels) for sample in family.samples}
        assert len(label_sets) <= 1, family.name
        keys = [sample.labels for sample in family.samples]
        assert len(keys) == len(set(keys)), family.name


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: MetricFamily("gauge", "dp-bad", "x", ()), "not a metric name"),
        (lambda: MetricFamily("counter", "dp_things", "x", ()), "must end in _total"),
        (lambda: MetricFamily("histogram", "dp_x", "x", ()), "must be in"),  # type: ignore[arg-type]
        (lambda: Sample((("__name", "x"),), 1), "not a metric label name"),
        (lambda: Sample((("0zone", "x"),), 1), "not a metric label name"),
    ],
)
def test_malformed_families_are_refused_at_construction(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]
