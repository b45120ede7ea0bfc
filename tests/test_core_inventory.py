"""What each resource advertises: selection, naming, health (docs/design.md §5, §7)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dp_core import (
    AdvertisedDevice,
    Config,
    DeviceKind,
    HostSnapshot,
    IommuGroup,
    MdevDevice,
    MdevType,
    MediatedDevice,
    Naming,
    PciAddress,
    PciHostDevice,
    PermittedHostDevices,
    SharedDevice,
    build_inventory,
)
from dp_core.dra.names import mdev_attributes

from core_builders import (
    AUDIO,
    BRIDGE_CLASS,
    GPU,
    GPU_RESOURCE,
    VF,
    VF_RESOURCE,
    gpu_config,
    pci,
    snapshot,
)

NO_SHARED: tuple[SharedDevice, ...] = ()


def only(inventory_resources: object, name: str) -> tuple[AdvertisedDevice, ...]:
    return inventory_resources.resource(name).devices  # type: ignore[attr-defined,no-any-return]


def config_for(*entries: PciHostDevice, **kwargs: object) -> Config:
    return Config(
        permitted_host_devices=PermittedHostDevices(pci_host_devices=entries),
        shared_devices=NO_SHARED,
        **kwargs,  # type: ignore[arg-type]
    )


# ---------------------------------------------------------------------------
# Selection


@pytest.mark.parametrize(
    ("driver", "entry", "advertised", "healthy", "reason_part", "skip_part"),
    [
        pytest.param("vfio-pci", PciHostDevice(GPU, GPU_RESOURCE), True, True, "", None, id="vfio"),
        pytest.param(None, PciHostDevice(GPU, GPU_RESOURCE), True, False, "not bound", None,
                     id="no-driver"),
        pytest.param("nvidia", PciHostDevice(GPU, GPU_RESOURCE), False, None, None,
                     "host driver nvidia", id="host-driver"),
        pytest.param("vfio-pci", PciHostDevice(GPU, GPU_RESOURCE, external_resource_provider=True),
                     True, True, "", None, id="left-to-outside-plugins"),
        pytest.param("vfio-pci", PciHostDevice(GPU, GPU_RESOURCE, external_resource_provider=False),
                     False, None, None, "virt-handler serves it", id="virt-handlers"),
        pytest.param("nvidia", PciHostDevice(GPU, GPU_RESOURCE, external_resource_provider=False),
                     False, None, None, "virt-handler serves it", id="virt-handlers-host-driver"),
    ],
)  # fmt: skip
def test_pci_selection(
    driver: str | None,
    entry: PciHostDevice,
    advertised: bool,
    healthy: bool | None,
    reason_part: str | None,
    skip_part: str | None,
) -> None:
    host = snapshot([pci("0000:3b:00.0", GPU, 10, driver=driver)])
    inventory = build_inventory(host, config_for(entry))
    resource = inventory.resource(GPU_RESOURCE)
    if advertised:
        assert resource is not None and resource.kind is DeviceKind.PCI
        (device,) = resource.devices
        assert device.id == "0000:3b:00.0"
        assert device.healthy is healthy
        assert device.health == ("Healthy" if healthy else "Unhealthy")
        assert reason_part is not None and reason_part in device.reason
        assert inventory.skipped == ()
    else:
        assert resource is None
        (skipped,) = inventory.skipped
        assert skipped.id == "0000:3b:00.0"
        assert skipped.resource_name == GPU_RESOURCE
        assert skipped.driver == driver
        assert skip_part is not None and skip_part in skipped.reason


def test_unselected_vendor_device_is_neither_advertised_nor_skipped() -> None:
    host = snapshot([pci("0000:3b:00.0", GPU, 10), pci("0000:3b:00.1", AUDIO, 10)])
    inventory = build_inventory(host, config_for(PciHostDevice(GPU, GPU_RESOURCE)))
    assert inventory.names == (GPU_RESOURCE,)
    assert [d.id for d in only(inventory, GPU_RESOURCE)] == ["0000:3b:00.0"]
    assert inventory.skipped == ()


@pytest.mark.parametrize("permitted", [True, False], ids=["selected", "auto"])
@pytest.mark.parametrize("driver", ["vfio-pci", None, "pcieport"])
def test_bridges_are_never_selected(permitted: bool, driver: str | None) -> None:
    bridge_id = GPU  # even a bridge that matches a selector
    host = snapshot([pci("0000:00:01.0", bridge_id, 10, driver=driver, class_code=BRIDGE_CLASS)])
    config = (
        config_for(PciHostDevice(bridge_id, GPU_RESOURCE))
        if permitted
        else Config(shared_devices=NO_SHARED)
    )
    inventory = build_inventory(host, config)
    assert inventory.resources == ()
    assert inventory.skipped == ()


def test_auto_mode_serves_only_vfio_devices_under_vendor_device_names() -> None:
    host = snapshot(
        [
            pci("0000:3b:00.0", GPU, 10, driver="vfio-pci"),
            pci("0000:3b:00.1", AUDIO, 10, driver="snd_hda_intel", class_code=0x040300),
            pci("0000:af:00.0", GPU, 20, driver="nvidia"),
            pci("0000:d8:00.0", VF, 30, driver=None),
            pci("0000:d8:00.1", VF, 31, driver="vfio-pci"),
        ]
    )
    inventory = build_inventory(host, Config(shared_devices=NO_SHARED))
    assert inventory.names == ("devices.kubevirt.io/10de_1eb8", "devices.kubevirt.io/8086_4941")
    assert [d.id for d in only(inventory, "devices.kubevirt.io/10de_1eb8")] == ["0000:3b:00.0"]
    assert [d.id for d in only(inventory, "devices.kubevirt.io/8086_4941")] == ["0000:d8:00.1"]
    # Auto mode never reports devices it was not asked about as skipped.
    assert inventory.skipped == ()


def test_auto_mode_uses_the_configured_domain() -> None:
    host = snapshot([pci("0000:3b:00.0", GPU, 10)])
    inventory = build_inventory(
        host, Config(shared_devices=NO_SHARED, naming=Naming(domain="gpus.example.com"))
    )
    assert inventory.names == ("gpus.example.com/10de_1eb8",)


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        ({GPU: "TU104GL [Tesla T4]"}, "devices.kubevirt.io/TU104GL_TESLA_T4"),
        ({GPU: "TU106 [GeForce RTX 2060 Rev. A]"},
         "devices.kubevirt.io/TU106_GEFORCE_RTX_2060_REV__A"),
        ({}, "devices.kubevirt.io/10de_1eb8"),  # not in the database
        ({GPU: "[]()"}, "devices.kubevirt.io/10de_1eb8"),  # empty once normalized
        ({GPU: "X" * 80}, "devices.kubevirt.io/10de_1eb8"),  # too long for a name
    ],
)  # fmt: skip
def test_pci_ids_naming(names: dict[object, str], expected: str) -> None:
    host = snapshot([pci("0000:3b:00.0", GPU, 10)])
    config = Config(shared_devices=NO_SHARED, naming=Naming(source="pci-ids"))
    inventory = build_inventory(host, config, names)  # type: ignore[arg-type]
    assert inventory.names == (expected,)


def test_pci_ids_naming_applies_to_selectors_without_a_resource_name() -> None:
    host = snapshot([pci("0000:3b:00.0", GPU, 10), pci("0000:d8:00.1", VF, 31)])
    config = config_for(
        PciHostDevice(GPU), PciHostDevice(VF, VF_RESOURCE), naming=Naming(source="pci-ids")
    )
    inventory = build_inventory(host, config, {GPU: "TU104GL [Tesla T4]", VF: "ignored"})
    assert inventory.names == ("devices.kubevirt.io/TU104GL_TESLA_T4", VF_RESOURCE)


def test_vendor_device_naming_ignores_the_database() -> None:
    host = snapshot([pci("0000:3b:00.0", GPU, 10)])
    inventory = build_inventory(host, config_for(PciHostDevice(GPU)), {GPU: "TU104GL [Tesla T4]"})
    assert inventory.names == ("devices.kubevirt.io/10de_1eb8",)


# ---------------------------------------------------------------------------
# Health of VFIO devices


def _audio(driver: str | None) -> object:
    return pci("0000:3b:00.1", AUDIO, 10, driver=driver, class_code=0x040300)


@pytest.mark.parametrize(
    ("members", "missing", "healthy", "reason_parts"),
    [
        pytest.param([_audio("vfio-pci")], (), True, [""], id="group-all-vfio"),
        pytest.param([_audio(None)], (), True, [""], id="sibling-without-driver-is-fine"),
        pytest.param([_audio("snd_hda_intel")], (), False,
                     ["IOMMU group 10 is not viable", "0000:3b:00.1", "snd_hda_intel"],
                     id="group-not-viable"),
        pytest.param([pci("0000:00:03.0", VF, 10, driver="pcieport", class_code=BRIDGE_CLASS)],
                     (), True, [""], id="bridge-on-host-driver-does-not-block"),
        pytest.param([], ("/dev/vfio/10",), False, ["/dev/vfio/10 does not exist"],
                     id="group-node-missing"),
        pytest.param([], ("/dev/vfio/vfio",), False, ["/dev/vfio/vfio does not exist"],
                     id="container-missing"),
    ],
)  # fmt: skip
def test_vfio_device_health(
    members: list[object], missing: tuple[str, ...], healthy: bool, reason_parts: list[str]
) -> None:
    host = snapshot([pci("0000:3b:00.0", GPU, 10), *members], missing_nodes=missing)  # type: ignore[list-item]
    (device,) = only(build_inventory(host, gpu_config(shared_devices=())), GPU_RESOURCE)
    assert device.healthy is healthy
    for part in reason_parts:
        assert part in device.reason
    if healthy:
        assert device.reason == ""
    assert device.iommu_group == 10
    assert device.host_paths == ("/dev/vfio/vfio", "/dev/vfio/10")


def test_device_without_iommu_group_is_unhealthy_and_has_no_paths() -> None:
    host = snapshot([pci("0000:3b:00.0", GPU, None)])
    (device,) = only(build_inventory(host, gpu_config(shared_devices=())), GPU_RESOURCE)
    assert not device.healthy
    assert "no IOMMU group" in device.reason
    assert device.host_paths == ()


def test_group_missing_from_the_group_list_is_unhealthy() -> None:
    device_pci = pci("0000:3b:00.0", GPU, 10)
    host = HostSnapshot(
        pci_devices=[device_pci], dev_nodes={"/dev/vfio/vfio", "/dev/vfio/10"}, iommu_groups=[]
    )
    (device,) = only(build_inventory(host, gpu_config(shared_devices=())), GPU_RESOURCE)
    assert not device.healthy
    assert "IOMMU group 10" in device.reason


def test_unbound_device_reason_wins_over_group_problems() -> None:
    host = snapshot([pci("0000:3b:00.0", GPU, 10, driver=None)], missing_nodes=("/dev/vfio/10",))
    (device,) = only(build_inventory(host, gpu_config(shared_devices=())), GPU_RESOURCE)
    assert not device.healthy
    assert "not bound" in device.reason


def test_devices_carry_numa_node_and_driver() -> None:
    host = snapshot([pci("0000:3b:00.0", GPU, 10, numa=1), pci("0000:af:00.0", GPU, 20, numa=None)])
    devices = only(build_inventory(host, gpu_config(shared_devices=())), GPU_RESOURCE)
    assert [(d.id, d.numa_node, d.driver) for d in devices] == [
        ("0000:3b:00.0", 1, "vfio-pci"),
        ("0000:af:00.0", None, "vfio-pci"),
    ]


def test_devices_are_listed_in_address_order() -> None:
    addresses = ["0000:af:00.0", "0000:3b:00.0", "0001:00:00.0", "0000:3b:00.2"]
    host = snapshot([pci(a, GPU, 10 + i) for i, a in enumerate(addresses)])
    devices = only(build_inventory(host, gpu_config(shared_devices=())), GPU_RESOURCE)
    assert [d.id for d in devices] == sorted(addresses, key=PciAddress.parse)


# ---------------------------------------------------------------------------
# Mediated devices

PARENT = PciAddress.parse("0000:3b:00.0")
UUID_A = "4b20d080-1b54-4048-85b3-a6a62d165c01"
UUID_B = "4b20d080-1b54-4048-85b3-a6a62d165c02"
UUID_C = "4b20d080-1b54-4048-85b3-a6a62d165c03"


def mdev_host(missing: tuple[str, ...] = (), group_b: int | None = 101) -> HostSnapshot:
    return snapshot(
        [pci("0000:3b:00.0", GPU, 10, driver="nvidia", numa=1)],
        mdev_types=(
            MdevType(PARENT, "nvidia-222", "GRID T4-1Q", 15),
            MdevType(PARENT, "nvidia-223", "GRID T4-2Q", 7),
        ),
        mdevs=(
            MdevDevice(UUID_B, PARENT, "nvidia-222", group_b),
            MdevDevice(UUID_A, PARENT, "nvidia-222", 100),
            MdevDevice(UUID_C, PARENT, "nvidia-223", 102),
        ),
        missing_nodes=missing,
    )


def mdev_config(*entries: MediatedDevice) -> Config:
    return Config(
        permitted_host_devices=PermittedHostDevices(mediated_devices=entries),
        shared_devices=NO_SHARED,
    )


def test_mdevs_are_selected_by_type_name() -> None:
    inventory = build_inventory(
        mdev_host(), mdev_config(MediatedDevice("GRID T4-1Q", "nvidia.com/GRID_T4-1Q"))
    )
    assert inventory.names == ("nvidia.com/GRID_T4-1Q",)
    resource = inventory.resource("nvidia.com/GRID_T4-1Q")
    assert resource is not None and resource.kind is DeviceKind.MDEV
    assert [d.id for d in resource.devices] == [UUID_A, UUID_B]
    assert all(d.healthy for d in resource.devices)
    assert [d.host_paths for d in resource.devices] == [
        ("/dev/vfio/vfio", "/dev/vfio/100"),
        ("/dev/vfio/vfio", "/dev/vfio/101"),
    ]
    # The parent's NUMA node is the mdev's.
    assert {d.numa_node for d in resource.devices} == {1}
    # The parent GPU (on a host driver) is not selected by an mdev selector.
    assert inventory.skipped == ()


def test_mdev_selector_without_name_derives_one() -> None:
    inventory = build_inventory(mdev_host(), mdev_config(MediatedDevice("GRID T4-2Q")))
    assert inventory.names == ("devices.kubevirt.io/GRID_T4-2Q",)
    assert [d.id for d in only(inventory, "devices.kubevirt.io/GRID_T4-2Q")] == [UUID_C]


def test_auto_mode_serves_every_mdev_type() -> None:
    inventory = build_inventory(mdev_host(), Config(shared_devices=NO_SHARED))
    assert inventory.names == ("devices.kubevirt.io/GRID_T4-1Q", "devices.kubevirt.io/GRID_T4-2Q")


def test_an_mdev_virt_handler_serves_is_skipped() -> None:
    inventory = build_inventory(
        mdev_host(),
        mdev_config(
            MediatedDevice("GRID T4-2Q", "nvidia.com/q2", external_resource_provider=False)
        ),
    )
    assert inventory.resources == ()
    (skipped,) = inventory.skipped
    assert (skipped.id, skipped.resource_name) == (UUID_C, "nvidia.com/q2")
    assert (
        skipped.reason
        == "externalResourceProvider is false (KubeVirt's default): virt-handler serves it"
    )
    # Left to an outside plugin, dp serves it.
    outside = MediatedDevice("GRID T4-2Q", "nvidia.com/q2", external_resource_provider=True)
    assert build_inventory(mdev_host(), mdev_config(outside)).names == ("nvidia.com/q2",)


def test_mdev_of_unknown_type_is_ignored() -> None:
    host = snapshot([], mdevs=(MdevDevice(UUID_A, PARENT, "nvidia-999", 100),))
    assert build_inventory(host, Config(shared_devices=NO_SHARED)).resources == ()


@pytest.mark.parametrize(
    ("missing", "group_b", "reason_part"),
    [
        (("/dev/vfio/101",), 101, "/dev/vfio/101 does not exist"),
        (("/dev/vfio/vfio",), 101, "/dev/vfio/vfio does not exist"),
        ((), None, "no IOMMU group"),
    ],
)
def test_mdev_health(missing: tuple[str, ...], group_b: int | None, reason_part: str) -> None:
    inventory = build_inventory(
        mdev_host(missing, group_b), mdev_config(MediatedDevice("GRID T4-1Q", "nvidia.com/q1"))
    )
    device = inventory.resource("nvidia.com/q1").device(UUID_B)  # type: ignore[union-attr]
    assert device is not None and not device.healthy
    assert reason_part in device.reason


# An mdev's parent is not always a PCI function: Linux's sample drivers hang
# theirs off a virtual device (`/sys/devices/virtual/mtty/mtty`), as s390's
# vfio-ap (`matrix`) and vfio-ccw (a subchannel) do. Such an mdev is served
# all the same, with its own group, and with no NUMA node or parent bus ID.
@pytest.mark.parametrize(
    ("parent", "numa", "parent_bus_id"),
    [
        (PARENT, 1, "0000:3b:00.0"),  # a GPU on its vendor driver
        ("0000:3b:00.0", 1, "0000:3b:00.0"),  # the same, by the name class/mdev_bus gives
        ("mtty", None, None),  # the kernel's samples/vfio-mdev/mtty.c
        ("matrix", None, None),  # s390's vfio-ap
        ("0.0.0313", None, None),  # an s390 subchannel, vfio-ccw
    ],
)
def test_mdev_parents_that_are_no_pci_function(
    parent: PciAddress | str, numa: int | None, parent_bus_id: str | None
) -> None:
    host = snapshot(
        [pci("0000:3b:00.0", GPU, 10, driver="nvidia", numa=1)],
        mdev_types=(MdevType(parent, "mtty-2", "Dual port serial", 12),),
        mdevs=(MdevDevice(UUID_A, parent, "mtty-2", 6), MdevDevice(UUID_B, parent, "mtty-2", 7)),
    )
    config = mdev_config(MediatedDevice("Dual port serial", "example.com/serial"))
    inventory = build_inventory(host, config)
    devices = only(inventory, "example.com/serial")
    assert [(d.id, d.healthy, d.numa_node, d.iommu_group) for d in devices] == [
        (UUID_A, True, numa, 6),
        (UUID_B, True, numa, 7),
    ]
    assert [d.host_paths for d in devices] == [
        ("/dev/vfio/vfio", "/dev/vfio/6"),
        ("/dev/vfio/vfio", "/dev/vfio/7"),
    ]
    attributes, problems = mdev_attributes(host.mdevs[0], host, "example.com/serial")
    found = dict(attributes)
    assert problems == ()
    assert (found["mdevUUID"], found["mdevType"], found["iommuGroup"]) == (UUID_A, "mtty-2", 6)
    assert found.get("parentPciBusID") == parent_bus_id
    assert found.get("numaNode") == numa
    assert ("vendorID" in found) is (parent_bus_id is not None)


@pytest.mark.parametrize("bad", ["", "a/b", ".", ".."])
def test_an_mdev_parent_is_a_device_name(bad: str) -> None:
    with pytest.raises(ValueError, match="is not a device name"):
        MdevType(bad, "t", "T")
    with pytest.raises(ValueError, match="is not a device name"):
        MdevDevice(UUID_A, bad, "t")


@given(
    st.builds(
        PciAddress,
        st.integers(0, 0xFFFF),
        st.integers(0, 0xFF),
        st.integers(0, 0x1F),
        st.integers(0, 7),
    )
)
def test_a_pci_parent_is_its_canonical_address(address: PciAddress) -> None:
    # However the address is spelled, a PCI parent is one name with one address,
    # so the types of an mdev's parent are always found.
    for spelling in (address, str(address), str(address).upper()):
        mdev_type = MdevType(spelling, "t", "T")
        assert (mdev_type.parent, mdev_type.parent_address) == (str(address), address)
        assert mdev_type == MdevType(address, "t", "T")


# ---------------------------------------------------------------------------
# Shared devices


@pytest.mark.parametrize("count", [1, 9, 10, 110, 1000, 10_000])
def test_shared_device_count_and_ids(count: int) -> None:
    config = Config(shared_devices=(SharedDevice("devices.kubevirt.io/kvm", "/dev/kvm", count),))
    host = snapshot([])
    resource = build_inventory(host, config).resource("devices.kubevirt.io/kvm")
    assert resource is not None and resource.kind is DeviceKind.SHARED
    ids = [d.id for d in resource.devices]
    assert len(ids) == count
    assert len(set(ids)) == count
    assert all(len(i) <= 63 for i in ids)
    assert all(i.startswith("kvm-") for i in ids)
    assert all(d.healthy and d.host_paths == ("/dev/kvm",) for d in resource.devices)


def test_shared_device_ids_stay_short_for_long_names() -> None:
    long_name = "example.com/" + "a" * 63
    config = Config(shared_devices=(SharedDevice(long_name, "/dev/kvm", 10_000),))
    resource = build_inventory(snapshot([]), config).resource(long_name)
    assert resource is not None
    ids = [d.id for d in resource.devices]
    assert max(len(i) for i in ids) == 63
    assert len(set(ids)) == 10_000


def test_shared_device_unhealthy_when_node_missing() -> None:
    config = Config(shared_devices=(SharedDevice("devices.kubevirt.io/tun", "/dev/net/tun", 3),))
    host = snapshot([], extra_nodes=("/dev/kvm",))
    resource = build_inventory(host, config).resource("devices.kubevirt.io/tun")
    assert resource is not None
    assert [d.healthy for d in resource.devices] == [False, False, False]
    assert all("/dev/net/tun does not exist" in d.reason for d in resource.devices)


def test_shared_device_permissions_are_carried() -> None:
    config = Config(shared_devices=(SharedDevice("example.com/fuse", "/dev/fuse", 2, "r"),))
    host = snapshot([], extra_nodes=("/dev/fuse",))
    resource = build_inventory(host, config).resource("example.com/fuse")
    assert resource is not None and resource.permissions == "r"


def test_disabled_shared_devices_are_absent() -> None:
    config = Config(
        shared_devices=(
            SharedDevice("devices.kubevirt.io/kvm", "/dev/kvm", 2),
            SharedDevice("devices.kubevirt.io/tun", "/dev/net/tun", 2, enabled=False),
        )
    )
    assert build_inventory(snapshot([]), config).names == ("devices.kubevirt.io/kvm",)


def test_default_shared_devices_are_kubevirts() -> None:
    inventory = build_inventory(snapshot([]), Config())
    assert inventory.names == (
        "devices.kubevirt.io/kvm",
        "devices.kubevirt.io/tun",
        "devices.kubevirt.io/vhost-net",
    )
    assert all(len(r.devices) == 110 for r in inventory.resources)


# ---------------------------------------------------------------------------
# Whole inventory


def test_resources_are_sorted_by_name() -> None:
    host = snapshot(
        [pci("0000:3b:00.0", GPU, 10), pci("0000:d8:00.1", VF, 31, class_code=0x0B4000)],
        mdev_types=(MdevType(PARENT, "t", "A type"),),
        mdevs=(MdevDevice(UUID_A, PARENT, "t", 100),),
    )
    config = Config(
        permitted_host_devices=PermittedHostDevices(
            pci_host_devices=(
                PciHostDevice(GPU, "zzz.example/gpu"), PciHostDevice(VF, "aaa.example/vf")
            ),
            mediated_devices=(MediatedDevice("A type", "mmm.example/mdev"),),
        ),
        shared_devices=(SharedDevice("bbb.example/kvm", "/dev/kvm", 1),),
    )  # fmt: skip
    inventory = build_inventory(host, config)
    assert inventory.names == (
        "aaa.example/vf",
        "bbb.example/kvm",
        "mmm.example/mdev",
        "zzz.example/gpu",
    )
    assert [r.kind for r in inventory.resources] == [
        DeviceKind.PCI,
        DeviceKind.SHARED,
        DeviceKind.MDEV,
        DeviceKind.PCI,
    ]


def test_two_selectors_can_share_one_resource() -> None:
    host = snapshot([pci("0000:3b:00.0", GPU, 10), pci("0000:3b:00.1", AUDIO, 10)])
    config = config_for(
        PciHostDevice(GPU, "example.com/gpu"), PciHostDevice(AUDIO, "example.com/gpu")
    )
    inventory = build_inventory(host, config)
    assert [d.id for d in only(inventory, "example.com/gpu")] == ["0000:3b:00.0", "0000:3b:00.1"]


def test_inventory_is_a_pure_function_of_its_inputs() -> None:
    host = snapshot([pci("0000:3b:00.0", GPU, 10), pci("0000:3b:00.1", AUDIO, 10, driver=None)])
    config = gpu_config()
    assert build_inventory(host, config) == build_inventory(host, config)
    reordered = HostSnapshot(
        pci_devices=tuple(reversed(host.pci_devices)),
        iommu_groups=[IommuGroup(10, tuple(reversed(host.iommu_groups[0].members)))],
        dev_nodes=host.dev_nodes,
    )
    assert build_inventory(reordered, config) == build_inventory(host, config)


def test_a_derived_name_never_mixes_two_kinds_of_device() -> None:
    # Auto mode names this GPU devices.kubevirt.io/10de_1eb8; a shared device
    # configured under the same name must not be merged into that resource.
    clash = SharedDevice("devices.kubevirt.io/10de_1eb8", "/dev/kvm", count=2)
    host = snapshot([pci("0000:3b:00.0", GPU, 10)])
    inventory = build_inventory(host, Config(shared_devices=(clash,)))
    resource = inventory.resource("devices.kubevirt.io/10de_1eb8")
    assert resource is not None and resource.kind is DeviceKind.PCI
    assert [d.id for d in resource.devices] == ["0000:3b:00.0"]
    skipped = {s.id: s.reason for s in inventory.skipped}
    assert "already served for pci devices" in skipped["10de_1eb8-0"]
