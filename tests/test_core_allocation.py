"""Allocate, IOMMU group reservations and GetPreferredAllocation (docs/design.md §5, §7)."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dp_core import (
    AdvertisedDevice,
    AllocateAnswer,
    AllocationsObserved,
    Config,
    ContainerAllocation,
    ContainerPreference,
    DeviceSpec,
    HealthChanged,
    HostObserved,
    Log,
    MdevDevice,
    MdevType,
    MediatedDevice,
    Node,
    PciAddress,
    PciHostDevice,
    PermittedHostDevices,
    PreferredAllocationRequested,
    PreferredAnswer,
    PreStartAnswer,
    PreStartRequested,
    Publish,
    RefreshAllocations,
    Reject,
    Reply,
    SharedDevice,
    StatusCode,
    Timing,
    preferred_devices,
)

from core_builders import (
    AUDIO,
    GPU,
    GPU_RESOURCE,
    QAT_RESOURCE,
    VF_RESOURCE,
    Kubelet,
    effects_of,
    live_node,
    one,
    pci,
    qat_config,
    shared_group_host,
    snapshot,
)

T4_A = "0000:3b:00.0"  # group 10, NUMA 0
T4_B = "0000:af:00.0"  # group 20, NUMA 1
QAT_0, QAT_1, QAT_2 = "0000:3f:01.0", "0000:3f:01.1", "0000:3f:01.2"  # groups 40, 40, 41


def answer_of(effects: list[object]) -> AllocateAnswer:
    reply = one(effects, Reply)  # type: ignore[arg-type]
    assert isinstance(reply.answer, AllocateAnswer)
    return reply.answer


def rejection(effects: list[object]) -> Reject:
    assert effects_of(effects, Reply) == []  # type: ignore[arg-type]
    return one(effects, Reject)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# What a container gets


def test_allocate_pci_devices_in_request_order() -> None:
    node, kubelet = live_node()
    (container,) = answer_of(kubelet.allocate(GPU_RESOURCE, (T4_B, T4_A))).containers
    assert container.envs == (("PCI_RESOURCE_NVIDIA_COM_T4", f"{T4_B},{T4_A}"),)
    assert container.devices == (
        DeviceSpec("/dev/vfio/vfio", "/dev/vfio/vfio", "mrw"),
        DeviceSpec("/dev/vfio/20", "/dev/vfio/20", "mrw"),
        DeviceSpec("/dev/vfio/10", "/dev/vfio/10", "mrw"),
    )
    assert container.mounts == () and container.annotations == ()


@pytest.mark.parametrize(
    ("request_ids", "env"),
    [
        ((T4_A,), T4_A),
        ((T4_B,), T4_B),
        ((T4_A, T4_B), f"{T4_A},{T4_B}"),
        ((T4_B, T4_A), f"{T4_B},{T4_A}"),
    ],
)
def test_env_lists_ids_as_requested(request_ids: tuple[str, ...], env: str) -> None:
    node, kubelet = live_node()
    (container,) = answer_of(kubelet.allocate(GPU_RESOURCE, request_ids)).containers
    assert dict(container.envs) == {"PCI_RESOURCE_NVIDIA_COM_T4": env}


def test_one_group_node_per_distinct_group() -> None:
    node, kubelet = live_node(qat_config(shared_devices=()), shared_group_host())
    (container,) = answer_of(kubelet.allocate(QAT_RESOURCE, (QAT_1, QAT_0, QAT_2))).containers
    assert [d.host_path for d in container.devices] == [
        "/dev/vfio/vfio",
        "/dev/vfio/40",
        "/dev/vfio/41",
    ]
    assert dict(container.envs) == {"PCI_RESOURCE_INTEL_COM_QAT": f"{QAT_1},{QAT_0},{QAT_2}"}


def test_each_container_gets_its_own_answer() -> None:
    node, kubelet = live_node()
    answer = answer_of(kubelet.allocate(VF_RESOURCE, ("0000:3d:01.0",), ("0000:3d:01.2",)))
    assert [dict(c.envs) for c in answer.containers] == [
        {"PCI_RESOURCE_INTEL_COM_QAT_VF": "0000:3d:01.0"},
        {"PCI_RESOURCE_INTEL_COM_QAT_VF": "0000:3d:01.2"},
    ]
    assert [c.devices[1].host_path for c in answer.containers] == ["/dev/vfio/30", "/dev/vfio/32"]


UUID_A = "4b20d080-1b54-4048-85b3-a6a62d165c01"
UUID_B = "4b20d080-1b54-4048-85b3-a6a62d165c02"


def test_allocate_mdevs() -> None:
    parent = PciAddress.parse(T4_A)
    host = snapshot(
        [pci(T4_A, GPU, 10, driver="nvidia")],
        mdev_types=(MdevType(parent, "nvidia-222", "GRID T4-1Q"),),
        mdevs=(
            MdevDevice(UUID_A, parent, "nvidia-222", 100),
            MdevDevice(UUID_B, parent, "nvidia-222", 101),
        ),
    )
    config = Config(
        permitted_host_devices=PermittedHostDevices(
            mediated_devices=(MediatedDevice("GRID T4-1Q", "nvidia.com/GRID_T4-1Q"),)
        ),
        shared_devices=(),
    )
    node, kubelet = live_node(config, host)
    (container,) = answer_of(kubelet.allocate("nvidia.com/GRID_T4-1Q", (UUID_B, UUID_A))).containers
    assert container.envs == (("MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-1Q", f"{UUID_B},{UUID_A}"),)
    assert [d.host_path for d in container.devices] == [
        "/dev/vfio/vfio",
        "/dev/vfio/101",
        "/dev/vfio/100",
    ]


def test_allocate_shared_device_gives_its_node_once() -> None:
    config = Config(shared_devices=(SharedDevice("devices.kubevirt.io/kvm", "/dev/kvm", 5),))
    node, kubelet = live_node(config, snapshot([]))
    effects = kubelet.allocate("devices.kubevirt.io/kvm", ("kvm-3", "kvm-0"))
    assert answer_of(effects).containers == (
        ContainerAllocation(devices=(DeviceSpec("/dev/kvm", "/dev/kvm", "rw"),)),
    )
    # Shared devices reserve nothing and can be handed out again and again.
    assert len(node.device_plugin.allocations) == 0
    assert answer_of(kubelet.allocate("devices.kubevirt.io/kvm", ("kvm-3",)))


# ---------------------------------------------------------------------------
# Bad requests


def test_unknown_id_is_invalid_argument_naming_it() -> None:
    node, kubelet = live_node()
    reject = rejection(kubelet.allocate(GPU_RESOURCE, (T4_A, "0000:99:00.0")))
    assert reject.status is StatusCode.INVALID_ARGUMENT
    assert "0000:99:00.0" in reject.message and GPU_RESOURCE in reject.message
    assert len(node.device_plugin.allocations) == 0


def test_id_of_another_resource_is_unknown() -> None:
    node, kubelet = live_node()
    reject = rejection(kubelet.allocate(GPU_RESOURCE, ("0000:3d:01.0",)))
    assert reject.status is StatusCode.INVALID_ARGUMENT


def test_huge_id_gets_a_short_message() -> None:
    node, kubelet = live_node()
    huge = "x" * 10_000
    reject = rejection(kubelet.allocate(GPU_RESOURCE, (huge,)))
    assert reject.status is StatusCode.INVALID_ARGUMENT
    assert len(reject.message) < 300
    assert "10000 characters" in reject.message
    assert "xxxx" in reject.message


def test_duplicate_id_is_invalid_argument() -> None:
    node, kubelet = live_node()
    reject = rejection(kubelet.allocate(GPU_RESOURCE, (T4_A, T4_B, T4_A)))
    assert reject.status is StatusCode.INVALID_ARGUMENT
    assert T4_A in reject.message and "twice" in reject.message
    assert len(node.device_plugin.allocations) == 0


def test_unhealthy_device_is_refused() -> None:
    host = snapshot([pci(T4_A, GPU, 10), pci(T4_B, GPU, 20)], missing_nodes=("/dev/vfio/20",))
    node, kubelet = live_node(host=host)
    reject = rejection(kubelet.allocate(GPU_RESOURCE, (T4_B,)))
    assert reject.status is StatusCode.FAILED_PRECONDITION
    assert T4_B in reject.message and "/dev/vfio/20 does not exist" in reject.message


def test_a_refused_container_allocates_nothing_for_the_others() -> None:
    node, kubelet = live_node()
    rejection(kubelet.allocate(GPU_RESOURCE, (T4_A,), ("0000:99:00.0",)))
    assert len(node.device_plugin.allocations) == 0
    assert all(d.healthy for d in node.device_plugin.advertised(GPU_RESOURCE))


def test_prestart_validates_ids() -> None:
    node, kubelet = live_node()
    connection = kubelet.connection_of[GPU_RESOURCE]
    ok = node.handle(PreStartRequested(connection, 1, (T4_A,), 0.0))
    assert ok == [Reply(1, PreStartAnswer())]
    bad = node.handle(PreStartRequested(connection, 2, ("nope",), 0.0))
    assert rejection(bad).status is StatusCode.INVALID_ARGUMENT
    assert "nope" in rejection(bad).message


# ---------------------------------------------------------------------------
# IOMMU group reservations


def held_by_group_host() -> tuple[Node, Kubelet]:
    return live_node(qat_config(shared_devices=()), shared_group_host())


def test_allocation_reserves_the_whole_group() -> None:
    node, kubelet = held_by_group_host()
    stream = kubelet.stream_of[QAT_RESOURCE]
    effects = kubelet.allocate(QAT_RESOURCE, (QAT_0,))
    answer_of(effects)
    publish = one(effects, Publish)
    assert publish.stream == stream and publish.resource == QAT_RESOURCE
    health = {d.id: d for d in publish.devices}
    assert health[QAT_0].healthy and health[QAT_2].healthy
    sibling = health[QAT_1]
    assert not sibling.healthy
    assert "IOMMU group 40" in sibling.reason and QAT_0 in sibling.reason
    assert "allocation #1" in sibling.reason
    report = one(effects, HealthChanged)
    assert (report.resource, report.device_id, report.healthy) == (QAT_RESOURCE, QAT_1, False)
    assert node.device_plugin.advertised(QAT_RESOURCE) == publish.devices


def test_allocating_a_sibling_is_refused_naming_group_and_holder() -> None:
    node, kubelet = held_by_group_host()
    kubelet.allocate(QAT_RESOURCE, (QAT_0,))
    effects = kubelet.allocate(QAT_RESOURCE, (QAT_1,))
    reject = rejection(effects)
    assert reject.status is StatusCode.FAILED_PRECONDITION
    assert "IOMMU group 40" in reject.message
    assert QAT_0 in reject.message and "allocation #1" in reject.message
    refresh = one(effects, RefreshAllocations)
    assert "IOMMU group 40" in refresh.reason
    assert len(node.device_plugin.allocations) == 1


def test_a_sibling_in_another_resource_is_reserved_too() -> None:
    host = snapshot([pci(T4_A, GPU, 10), pci("0000:3b:00.1", AUDIO, 10, class_code=0x040300)])
    config = Config(
        permitted_host_devices=PermittedHostDevices(
            pci_host_devices=(
                PciHostDevice(GPU, GPU_RESOURCE),
                PciHostDevice(AUDIO, "nvidia.com/audio"),
            )
        ),
        shared_devices=(),
    )
    node, kubelet = live_node(config, host)
    effects = kubelet.allocate(GPU_RESOURCE, (T4_A,))
    publish = one(effects, Publish)
    assert publish.resource == "nvidia.com/audio"
    assert publish.stream == kubelet.stream_of["nvidia.com/audio"]
    assert not publish.devices[0].healthy
    assert GPU_RESOURCE in publish.devices[0].reason
    reject = rejection(kubelet.allocate("nvidia.com/audio", ("0000:3b:00.1",)))
    assert reject.status is StatusCode.FAILED_PRECONDITION
    assert "IOMMU group 10" in reject.message and GPU_RESOURCE in reject.message


def test_a_request_for_the_whole_group_is_one_holder() -> None:
    node, kubelet = held_by_group_host()
    answer_of(kubelet.allocate(QAT_RESOURCE, (QAT_0, QAT_1)))
    (allocation,) = node.device_plugin.allocations.all()
    assert allocation.groups == (40,)
    assert all(d.healthy for d in node.device_plugin.advertised(QAT_RESOURCE))


def test_reallocating_a_device_replaces_its_old_allocation() -> None:
    node, kubelet = held_by_group_host()
    answer_of(kubelet.allocate(QAT_RESOURCE, (QAT_0,)))
    answer_of(kubelet.allocate(QAT_RESOURCE, (QAT_0,)))
    (allocation,) = node.device_plugin.allocations.all()
    assert allocation.serial == 2 and allocation.device_ids == (QAT_0,)
    # Taking the whole group next replaces it again, with no conflict.
    answer_of(kubelet.allocate(QAT_RESOURCE, (QAT_1, QAT_0)))
    (allocation,) = node.device_plugin.allocations.all()
    assert allocation.device_ids == (QAT_1, QAT_0)


def _allocate_at(node: Node, kubelet: Kubelet, ids: tuple[str, ...], now: float) -> None:
    kubelet.now = now
    answer_of(kubelet.allocate(QAT_RESOURCE, ids))


def test_release_waits_for_the_grace_period() -> None:
    node, kubelet = live_node(
        qat_config(shared_devices=()), shared_group_host(), timing=Timing(release_grace=30.0)
    )
    _allocate_at(node, kubelet, (QAT_0,), 10.0)
    effects = node.handle(AllocationsObserved({}, 39.9))
    assert effects == []
    assert len(node.device_plugin.allocations) == 1
    assert not node.device_plugin.advertised(QAT_RESOURCE)[1].healthy


def test_release_after_grace_makes_siblings_healthy_again() -> None:
    node, kubelet = live_node(
        qat_config(shared_devices=()), shared_group_host(), timing=Timing(release_grace=30.0)
    )
    _allocate_at(node, kubelet, (QAT_0,), 10.0)
    effects = node.handle(AllocationsObserved({QAT_RESOURCE: frozenset()}, 40.0))
    assert len(node.device_plugin.allocations) == 0
    publish = one(effects, Publish)
    assert publish.stream == kubelet.stream_of[QAT_RESOURCE]
    assert all(d.healthy for d in publish.devices)
    report = one(effects, HealthChanged)
    assert (report.device_id, report.healthy) == (QAT_1, True)
    # The sibling can be allocated now.
    _allocate_at(node, kubelet, (QAT_1,), 41.0)


def test_a_held_device_is_not_released() -> None:
    node, kubelet = live_node(
        qat_config(shared_devices=()), shared_group_host(), timing=Timing(release_grace=30.0)
    )
    _allocate_at(node, kubelet, (QAT_0,), 10.0)
    held = {QAT_RESOURCE: frozenset({QAT_0}), "other.com/x": frozenset({QAT_1})}
    assert node.handle(AllocationsObserved(held, 100.0)) == []
    assert len(node.device_plugin.allocations) == 1
    # Held under another resource's name does not count.
    effects = node.handle(AllocationsObserved({"other.com/x": frozenset({QAT_0})}, 101.0))
    assert len(node.device_plugin.allocations) == 0
    assert one(effects, Publish).resource == QAT_RESOURCE


def test_group_of_an_unhealthy_host_change_stays_reserved() -> None:
    """A rescan while a group is held keeps the sibling Unhealthy."""
    node, kubelet = held_by_group_host()
    answer_of(kubelet.allocate(QAT_RESOURCE, (QAT_0,)))
    node.handle(HostObserved(shared_group_host(), 1.0))
    assert [d.healthy for d in node.device_plugin.advertised(QAT_RESOURCE)] == [True, False, True]


# ---------------------------------------------------------------------------
# GetPreferredAllocation


def dev(device_id: str, numa: int | None, group: int | None) -> AdvertisedDevice:
    return AdvertisedDevice(device_id, True, numa_node=numa, iommu_group=group)


NUMA_HOST = [
    dev("a0", 0, 1),
    dev("a1", 0, 2),
    dev("b0", 1, 3),
    dev("b1", 1, 4),
    dev("b2", 1, 5),
]
GROUP_HOST = [
    dev("x1", 0, 1),
    dev("x2", 0, 1),
    dev("y1", 0, 2),
    dev("z1", 0, 3),
]


@pytest.mark.parametrize(
    ("available", "must", "size", "expected"),
    [
        pytest.param(NUMA_HOST, [], 3, ("b0", "b1", "b2"), id="one-numa-node-that-fits"),
        pytest.param(NUMA_HOST, [], 2, ("b0", "b1"), id="fullest-node-first"),
        pytest.param(NUMA_HOST, ["a0"], 2, ("a0", "a1"), id="stay-on-must-node"),
        pytest.param(NUMA_HOST, ["a0"], 3, ("a0", "a1", "b0"), id="spill-when-it-must"),
        pytest.param(NUMA_HOST, ["b2", "a0"], 2, ("b2", "a0"), id="must-only-in-order"),
        pytest.param(NUMA_HOST, [], 9, ("b0", "b1", "b2", "a0", "a1"), id="all-when-too-few"),
        pytest.param(NUMA_HOST, [], 0, (), id="nothing"),
        pytest.param(GROUP_HOST, [], 2, ("x1", "x2"), id="whole-group"),
        pytest.param(GROUP_HOST, [], 1, ("y1",), id="do-not-split-a-group"),
        pytest.param(GROUP_HOST, ["x1"], 2, ("x1", "x2"), id="fill-must-group-first"),
        pytest.param(GROUP_HOST, [], 3, ("x1", "x2", "y1"), id="fewest-groups"),
        pytest.param([dev("n1", None, None), dev("n2", None, 7)], [], 1, ("n1",),
                     id="unknown-numa-and-group"),
    ],
)  # fmt: skip
def test_preferred_devices_table(
    available: list[AdvertisedDevice], must: list[str], size: int, expected: tuple[str, ...]
) -> None:
    by_id = {d.id: d for d in available}
    assert preferred_devices(available, [by_id[i] for i in must], size) == expected
    # The order the kubelet lists the available devices in does not matter.
    assert preferred_devices(available[::-1], [by_id[i] for i in must], size) == expected


def test_preferred_allocation_through_node() -> None:
    node, kubelet = live_node()
    connection = kubelet.connection_of[VF_RESOURCE]
    vfs = ("0000:3d:01.0", "0000:3d:01.1", "0000:3d:01.2", "0000:3d:01.3")
    effects = node.handle(
        PreferredAllocationRequested(
            connection,
            5,
            [
                ContainerPreference(vfs, (), 2),
                ContainerPreference(vfs, ("0000:3d:01.3",), 2),
            ],
            kubelet.now,
        )
    )
    assert effects == [
        Reply(
            5,
            PreferredAnswer((("0000:3d:01.0", "0000:3d:01.1"), ("0000:3d:01.3", "0000:3d:01.2"))),
        )
    ]


def test_preferred_allocation_rejects_unknown_ids() -> None:
    node, kubelet = live_node()
    connection = kubelet.connection_of[GPU_RESOURCE]
    effects = node.handle(
        PreferredAllocationRequested(
            connection, 6, [ContainerPreference((T4_A, "bogus"), (), 1)], kubelet.now
        )
    )
    assert rejection(effects).status is StatusCode.INVALID_ARGUMENT
    assert "bogus" in rejection(effects).message


@st.composite
def preference_cases(
    draw: st.DrawFn,
) -> tuple[list[AdvertisedDevice], list[AdvertisedDevice], int]:
    count = draw(st.integers(0, 12))
    devices = [
        dev(
            f"d{index:02d}",
            draw(st.sampled_from([None, 0, 1, 2])),
            draw(st.sampled_from([None, 1, 2, 3, 4, 5])),
        )
        for index in range(count)
    ]
    available = [d for d in devices if draw(st.booleans())]
    size = draw(st.integers(0, count + 2))
    must_pool = [d for d in devices if draw(st.booleans())]
    must = draw(st.permutations(must_pool))[:size]
    return draw(st.permutations(available)), must, size


@settings(max_examples=200, deadline=None)
@given(preference_cases())
def test_preferred_devices_properties(
    case: tuple[list[AdvertisedDevice], list[AdvertisedDevice], int],
) -> None:
    available, must, size = case
    result = preferred_devices(available, must, size)
    pool = {d.id for d in available} | {d.id for d in must}
    must_ids = [d.id for d in must]
    assert len(result) == min(size, len(pool))
    assert set(result) <= pool
    assert len(set(result)) == len(result)
    assert list(result[: len(must_ids)]) == must_ids
    # Deterministic, and blind to the order of the available list.
    assert preferred_devices(available, must, size) == result
    assert preferred_devices(sorted(available, key=lambda d: d.id), must, size) == result


@settings(max_examples=200, deadline=None)
@given(preference_cases())
def test_preferred_devices_stay_on_one_numa_node_when_they_can(
    case: tuple[list[AdvertisedDevice], list[AdvertisedDevice], int],
) -> None:
    available, _, size = case
    counts: dict[int | None, int] = {}
    for device in available:
        counts[device.numa_node] = counts.get(device.numa_node, 0) + 1
    result = preferred_devices(available, [], size)
    nodes = {d.numa_node for d in available if d.id in result}
    if size and any(count >= size for count in counts.values()):
        assert len(nodes) == 1


@settings(max_examples=200, deadline=None)
@given(preference_cases())
def test_preferred_devices_use_fewest_whole_groups(
    case: tuple[list[AdvertisedDevice], list[AdvertisedDevice], int],
) -> None:
    available, _, size = case
    # One NUMA node, and every group small enough to be taken whole.
    available = [attrs.evolve(d, numa_node=0) for d in available if d.iommu_group is not None]
    groups: dict[int | None, int] = {}
    for device in available:
        groups[device.iommu_group] = groups.get(device.iommu_group, 0) + 1
    if not groups or max(groups.values()) > size:
        return
    result = preferred_devices(available, [], size)
    used = {d.iommu_group for d in available if d.id in result}
    target = min(size, len(available))
    fewest, covered = 0, 0
    for group_size in sorted(groups.values(), reverse=True):
        if covered >= target:
            break
        covered += group_size
        fewest += 1
    assert len(used) == fewest


def test_two_containers_of_one_allocate_cannot_split_a_group() -> None:
    """Each container is checked against the others of the same call, not only the book."""
    node, kubelet = live_node(qat_config(shared_devices=()), shared_group_host())
    effects = kubelet.allocate(QAT_RESOURCE, ("0000:3f:01.0",), ("0000:3f:01.1",))
    assert effects_of(effects, Reply) == []
    (reject,) = effects_of(effects, Reject)
    assert reject.status is StatusCode.FAILED_PRECONDITION
    assert "IOMMU group 40" in reject.message
    assert len(node.device_plugin.allocations) == 0


def test_devices_pods_hold_that_no_allocation_records_reserve_their_groups() -> None:
    """dp restarted while a VM held QAT_0: the new node has no allocation of it,
    but PodResources says a pod holds it. Its group is reserved as if the node
    had allocated it, so the sibling is not handed to the next VM."""
    node, kubelet = live_node(
        qat_config(shared_devices=()), shared_group_host(), timing=Timing(release_grace=30.0)
    )
    effects = node.handle(AllocationsObserved({QAT_RESOURCE: frozenset({QAT_0})}, 5.0))
    adopted = [e for e in effects if isinstance(e, Log) and e.event == "adopted"]
    assert [dict(e.fields) for e in adopted] == [
        {"resource": QAT_RESOURCE, "devices": QAT_0, "groups": "40"}
    ]
    report = one(effects, HealthChanged)
    assert (report.device_id, report.healthy) == (QAT_1, False)
    kubelet.now = 6.0
    rejected = one(kubelet.allocate(QAT_RESOURCE, (QAT_1,)), Reject)
    assert (
        rejected.status is StatusCode.FAILED_PRECONDITION and "IOMMU group 40" in rejected.message
    )
    # Seen again, it is the same reservation; the pod gone, it is released after the grace.
    assert node.handle(AllocationsObserved({QAT_RESOURCE: frozenset({QAT_0})}, 20.0)) == []
    effects = node.handle(AllocationsObserved({}, 40.0))
    assert len(node.device_plugin.allocations) == 0
    assert one(effects, HealthChanged).healthy


def test_a_group_found_split_is_reported_once_while_it_lasts() -> None:
    node, kubelet = live_node(
        qat_config(shared_devices=()), shared_group_host(), timing=Timing(release_grace=30.0)
    )
    _allocate_at(node, kubelet, (QAT_0,), 10.0)
    # Another pod holds the sibling, which this node never handed out.
    held = {QAT_RESOURCE: frozenset({QAT_0, QAT_1})}
    splits = [
        [e for e in node.handle(AllocationsObserved(held, now)) if isinstance(e, Log)]
        for now in (11.0, 12.0)
    ]
    assert [(e.level, e.event) for e in splits[0]] == [("error", "group-split")]
    assert QAT_1 in str(dict(splits[0][0].fields)["detail"])
    assert splits[1] == []  # once, not at every poll
    assert len(node.device_plugin.allocations) == 1  # the split is not papered over


def test_an_allocation_log_renders_its_fields_when_read_and_compares_as_pairs() -> None:
    from dp_core.deviceplugin.allocations import Allocation, allocation_log

    allocation = Allocation(7, QAT_RESOURCE, (QAT_0, QAT_1), (40, 41), 1.0)
    log = allocation_log("released", allocation)
    pairs = (("resource", QAT_RESOURCE), ("devices", f"{QAT_0},{QAT_1}"), ("groups", "40,41"))
    assert (log.level, log.event) == ("info", "released")
    assert tuple(log.fields) == pairs and dict(log.fields) == dict(pairs)
    assert len(log.fields) == 3 and log.fields[1] == pairs[1] and log.fields[1:] == pairs[1:]
    # The same line as one built from the rendered pairs, wherever effects are compared.
    rendered = Log("info", "released", pairs)
    assert log == rendered and rendered == log and hash(log) == hash(rendered)
    assert log != Log("info", "released", pairs[:2])
    assert allocation_log("released", attrs.evolve(allocation, groups=(40,))) != log
    # What it keeps until then is the allocation, not the rendered text.
    assert not any(isinstance(value, str) for value in _held_by(log.fields))


def _held_by(fields: object) -> list[object]:
    slots = getattr(type(fields), "__slots__", ())
    return [getattr(fields, name) for name in slots]
