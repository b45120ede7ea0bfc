"""Plain descriptions of whole hosts, and the sysfs trees and snapshots they imply.

A `Topology` is what a host *is* (its PCI functions, IOMMU groups, drivers,
mediated devices and device nodes), written down without any filesystem. From
one description this module derives two things that must agree:

- `write_sysfs`: a `/sys` and `/dev` tree laid out the way the kernel lays them
  out (device directories nested under their bridges, `bus/pci/devices/*`
  symlinks, `driver`/`iommu_group`/`physfn`/`virtfnN` links, mdev types and
  mdevs), so the scanner can be tested against disk;
- `to_snapshot`: the `HostSnapshot` a correct scanner must return for that tree,
  so core tests can skip the disk entirely and scanner tests can compare.

`fixture_topology` is the static node committed under `fixtures/sysfs/`;
`generate_topology` makes random but valid hosts of any size for benchmarks;
`build_topology` turns a list of hardware "units" (a GPU with its audio
function, an SR-IOV card, a bridge with drives behind it...) into a topology
with addresses and group numbers assigned the way the kernel would, and is
shared by the random generator and the hypothesis strategies.
"""

from __future__ import annotations

import os
import random
import re
import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs

from dp_core import (
    VFIO_DRIVER,
    HostSnapshot,
    IommuGroup,
    MdevDevice,
    MdevType,
    PciAddress,
    PciDevice,
)

__all__ = [
    "BRIDGES",
    "ENDPOINTS",
    "GPUS",
    "GPU_AUDIO",
    "SHARED_DEV_PATHS",
    "SRIOV_CARDS",
    "VGPU_TYPES",
    "Bridged",
    "Function",
    "FakeMdev",
    "FakeMdevType",
    "FakePci",
    "MdevParent",
    "Multifunction",
    "Sriov",
    "Topology",
    "Unit",
    "build_topology",
    "fixture_topology",
    "generate_topology",
    "to_snapshot",
    "write_sysfs",
]

# The character devices every VM wants, as KubeVirt's handler serves them.
SHARED_DEV_PATHS: tuple[str, ...] = ("/dev/kvm", "/dev/net/tun", "/dev/vhost-net")

VFIO_CONTAINER = "/dev/vfio/vfio"
MDEV_DRIVER = "vfio_mdev"
_VGA_CLASS = 0x0300  # base class 0x03, subclass 0x00: only these get `boot_vga`
_BRIDGE_BASE_CLASS = 0x06
_GROUP_NODE = re.compile(r"^/dev/vfio/[0-9]+$")


def _is_bridge(class_code: int) -> bool:
    return class_code >> 16 == _BRIDGE_BASE_CLASS


# --------------------------------------------------------------------------
# The description


@attrs.frozen
class FakePci:
    """One PCI function of a described host.

    `upstream` is the bridge whose secondary bus the function sits on (None for
    a function on a root bus); it only decides where the function's directory
    nests under `devices/`, as the kernel nests it. A virtual function has the
    same `upstream` as its physical function, because SR-IOV VFs sit on the
    PF's bus (or the next ones) and the kernel places them beside the PF.
    """

    address: PciAddress
    vendor: int
    device: int
    class_code: int
    driver: str | None = None
    group: int | None = None
    numa: int | None = None
    physfn: PciAddress | None = None
    boot_vga: bool = False
    upstream: PciAddress | None = None

    @property
    def is_bridge(self) -> bool:
        return _is_bridge(self.class_code)


@attrs.frozen
class FakeMdevType:
    """One `mdev_supported_types/<type_id>` entry of a parent function."""

    parent: PciAddress
    type_id: str
    name: str
    available_instances: int = 0
    device_api: str = "vfio-pci"


@attrs.frozen
class FakeMdev:
    """One created mediated device; the kernel gives each its own IOMMU group."""

    uuid: str
    parent: PciAddress
    type_id: str
    group: int | None = None


# Typed converters: mypy's attrs plugin cannot type a bare `converter=tuple`.
def _tuple_of_types(value: Iterable[FakeMdevType]) -> tuple[FakeMdevType, ...]:
    return tuple(value)


def _tuple_of_mdevs(value: Iterable[FakeMdev]) -> tuple[FakeMdev, ...]:
    return tuple(value)


def _frozenset_of_str(value: Iterable[str]) -> frozenset[str]:
    return frozenset(value)


def _tuple_of_functions(value: Iterable[Function]) -> tuple[Function, ...]:
    return tuple(value)


def _tuple_of_offers(value: Iterable[tuple[str, str, int]]) -> tuple[tuple[str, str, int], ...]:
    return tuple(value)


def _tuple_of_ints(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


def _address_key(address: PciAddress) -> tuple[int, int, int, int]:
    # A plain tuple: attrs' generated ordering is slow enough to matter at 10,000.
    return (address.domain, address.bus, address.slot, address.function)


def _tuple_sorted_pci(value: Iterable[FakePci]) -> tuple[FakePci, ...]:
    return tuple(sorted(value, key=lambda p: _address_key(p.address)))


@attrs.frozen
class Topology:
    """A whole host: PCI functions, mdev types, mdevs and the `/dev` nodes present.

    `dev_nodes` are host paths (`/dev/vfio/12`, `/dev/kvm`, ...) that exist on the
    described host. The constructor checks the description is one a kernel could
    produce (unique addresses, links that point at existing functions), so a
    generator bug fails where it is made rather than as a confusing scan diff.
    """

    pci: tuple[FakePci, ...] = attrs.field(default=(), converter=_tuple_sorted_pci)
    mdev_types: tuple[FakeMdevType, ...] = attrs.field(default=(), converter=_tuple_of_types)
    mdevs: tuple[FakeMdev, ...] = attrs.field(default=(), converter=_tuple_of_mdevs)
    dev_nodes: frozenset[str] = attrs.field(default=frozenset(), converter=_frozenset_of_str)

    def __attrs_post_init__(self) -> None:
        by_address: dict[PciAddress, FakePci] = {}
        for fn in self.pci:
            if fn.address in by_address:
                raise ValueError(f"PCI address {fn.address} is described twice")
            by_address[fn.address] = fn
        for fn in self.pci:
            if fn.physfn is not None:
                pf = by_address.get(fn.physfn)
                if pf is None or pf.physfn is not None:
                    raise ValueError(f"{fn.address}: physfn {fn.physfn} is not a physical function")
            if fn.upstream is not None:
                bridge = by_address.get(fn.upstream)
                if bridge is None or not bridge.is_bridge:
                    raise ValueError(f"{fn.address}: upstream {fn.upstream} is not a bridge")
            if fn.numa is not None and fn.numa < 0:
                raise ValueError(f"{fn.address}: numa must be None or >= 0")
        types = set()
        for mdev_type in self.mdev_types:
            if mdev_type.parent not in by_address:
                raise ValueError(f"mdev type {mdev_type.type_id}: no parent {mdev_type.parent}")
            key = (mdev_type.parent, mdev_type.type_id)
            if key in types:
                raise ValueError(f"mdev type {mdev_type.type_id} of {mdev_type.parent} twice")
            types.add(key)
        uuids = set()
        for mdev in self.mdevs:
            if (mdev.parent, mdev.type_id) not in types:
                raise ValueError(f"mdev {mdev.uuid}: {mdev.parent} offers no {mdev.type_id}")
            if mdev.uuid in uuids:
                raise ValueError(f"mdev {mdev.uuid} is described twice")
            uuids.add(mdev.uuid)
        # Walking upstream must end: a cycle would make write_sysfs recurse forever.
        for fn in self.pci:
            seen = {fn.address}
            current = fn
            while current.upstream is not None:
                if current.upstream in seen:
                    raise ValueError(f"{fn.address}: upstream bridges form a cycle")
                seen.add(current.upstream)
                current = by_address[current.upstream]

    @property
    def shared_dev_paths(self) -> tuple[str, ...]:
        """The present device nodes that are not VFIO nodes, e.g. `/dev/kvm`."""
        return tuple(sorted(p for p in self.dev_nodes if not _is_vfio_node(p)))


def _is_vfio_node(path: str) -> bool:
    return path == VFIO_CONTAINER or _GROUP_NODE.match(path) is not None


# --------------------------------------------------------------------------
# The expected snapshot


def to_snapshot(topology: Topology, dev_paths: Iterable[str] | None = None) -> HostSnapshot:
    """The snapshot a correct `scan_host` returns for `write_sysfs(topology, ...)`.

    The scanner always reports the VFIO nodes it finds and checks only the
    other paths it is asked about, so `dev_paths` says which non-VFIO nodes the
    scan asked for; None means all of the topology's nodes.

    Ordering is the scanner's canonical one (functions and members by address,
    groups by number, mdev types by parent and id, mdevs by UUID), because
    `HostSnapshot` compares its tuples in order.
    """
    virtfns: dict[PciAddress, list[PciAddress]] = defaultdict(list)
    for fn in topology.pci:  # already sorted by address, so virtfnN follows address
        if fn.physfn is not None:
            virtfns[fn.physfn].append(fn.address)
    devices = tuple(
        PciDevice(
            address=fn.address,
            vendor=fn.vendor,
            device=fn.device,
            class_code=fn.class_code,
            driver=fn.driver,
            iommu_group=fn.group,
            numa_node=fn.numa,
            physfn=fn.physfn,
            virtfns=tuple(virtfns.get(fn.address, ())),
            boot_vga=fn.boot_vga,
        )
        for fn in topology.pci
    )
    members: dict[int, list[PciDevice]] = defaultdict(list)
    for dev in devices:
        if dev.iommu_group is not None:
            members[dev.iommu_group].append(dev)
    for mdev in topology.mdevs:
        if mdev.group is not None:
            members.setdefault(mdev.group, [])
    groups = tuple(IommuGroup(number, tuple(members[number])) for number in sorted(members))
    mdev_types = tuple(
        MdevType(t.parent, t.type_id, t.name, t.available_instances)
        for t in sorted(topology.mdev_types, key=lambda t: (_address_key(t.parent), t.type_id))
    )
    mdevs = tuple(
        MdevDevice(m.uuid, m.parent, m.type_id, m.group)
        for m in sorted(topology.mdevs, key=lambda m: m.uuid)
    )
    wanted = None if dev_paths is None else frozenset(dev_paths)
    dev_nodes = frozenset(
        p for p in topology.dev_nodes if _is_vfio_node(p) or wanted is None or p in wanted
    )
    return HostSnapshot(
        pci_devices=devices,
        iommu_groups=groups,
        mdev_types=mdev_types,
        mdevs=mdevs,
        dev_nodes=dev_nodes,
    )


# --------------------------------------------------------------------------
# The static fixture node


def _a(text: str) -> PciAddress:
    return PciAddress.parse(text)


def fixture_topology() -> Topology:
    """The node committed under `fixtures/sysfs/`; `fixtures/sysfs/README.md` explains it.

    Group numbers follow the bus numbers where that is natural, so a reader can
    tell from `/dev/vfio/59` which device it belongs to.
    """
    t4, t4_audio, quadro = 0x1EB8, 0x10F8, 0x1E30
    nvidia, intel, samsung, plx, aspeed = 0x10DE, 0x8086, 0x144D, 0x10B5, 0x1A03
    vfio = VFIO_DRIVER
    bridge, qat_pf = _a("0000:5d:00.0"), _a("0000:6b:00.0")

    def fn(
        address: str,
        vendor: int,
        device: int,
        class_code: int,
        driver: str | None,
        group: int,
        numa: int,
        **extra: Any,
    ) -> FakePci:
        return FakePci(_a(address), vendor, device, class_code, driver, group, numa, **extra)

    pci = [
        # Boot display: never to be taken from the host.
        fn("0000:03:00.0", aspeed, 0x2000, 0x030000, "ast", 3, 0, boot_vga=True),
        # Host NIC, in use by the host, selected by nothing.
        fn("0000:18:00.0", intel, 0x1572, 0x020000, "i40e", 18, 0),
        # Tesla T4 with its audio function, both on vfio-pci: a viable group.
        fn("0000:3b:00.0", nvidia, t4, 0x030200, vfio, 59, 0),
        fn("0000:3b:00.1", nvidia, t4_audio, 0x040300, vfio, 59, 0),
        # Bridge with two NVMe drives behind it: one group of three, two endpoints.
        fn("0000:5d:00.0", plx, 0x8747, 0x060400, None, 93, 0),
        fn("0000:5e:00.0", samsung, 0xA808, 0x010802, vfio, 93, 0, upstream=bridge),
        fn("0000:5e:01.0", samsung, 0xA808, 0x010802, vfio, 93, 0, upstream=bridge),
        # QAT 4xxx PF on the host driver with four VFs on vfio-pci, each VF alone.
        fn("0000:6b:00.0", intel, 0x4940, 0x0B4000, "4xxx", 107, 0),
        fn("0000:6b:00.1", intel, 0x4941, 0x0B4000, vfio, 108, 0, physfn=qat_pf),
        fn("0000:6b:00.2", intel, 0x4941, 0x0B4000, vfio, 109, 0, physfn=qat_pf),
        fn("0000:6b:00.3", intel, 0x4941, 0x0B4000, vfio, 110, 0, physfn=qat_pf),
        fn("0000:6b:00.4", intel, 0x4941, 0x0B4000, vfio, 111, 0, physfn=qat_pf),
        # Quadro RTX 6000 on the vendor driver, serving vGPUs (mdevs).
        fn("0000:86:00.0", nvidia, quadro, 0x030000, "nvidia", 134, 1),
        # Second Tesla T4, viable, on NUMA node 1.
        fn("0000:af:00.0", nvidia, t4, 0x030200, vfio, 175, 1),
        fn("0000:af:00.1", nvidia, t4_audio, 0x040300, vfio, 175, 1),
        # Third Tesla T4: GPU on vfio-pci but audio left on snd_hda_intel -> not viable.
        fn("0000:d8:00.0", nvidia, t4, 0x030200, vfio, 216, 1),
        fn("0000:d8:00.1", nvidia, t4_audio, 0x040300, "snd_hda_intel", 216, 1),
    ]
    quadro_address = _a("0000:86:00.0")
    mdev_types = [
        FakeMdevType(quadro_address, "nvidia-259", "GRID RTX6000-4Q", 2),
        FakeMdevType(quadro_address, "nvidia-260", "GRID RTX6000-8Q", 1),
    ]
    mdevs = [
        FakeMdev("4b20d080-1b54-4048-85b3-a6a62d165c01", quadro_address, "nvidia-259", 300),
        FakeMdev("9d9bfc6e-2f41-4a34-a2d4-3a0c9e0b7d02", quadro_address, "nvidia-259", 301),
        FakeMdev("c5e1f7a2-8b3d-4e6f-9a1c-2d4b6f8e0a03", quadro_address, "nvidia-260", 302),
    ]
    vfio_groups = {p.group for p in pci if p.driver == vfio} | {m.group for m in mdevs}
    vfio_groups.discard(111)  # the last QAT VF's node is missing: its device is Unhealthy
    dev_nodes = {VFIO_CONTAINER, *SHARED_DEV_PATHS} | {f"/dev/vfio/{g}" for g in vfio_groups}
    return Topology(pci=pci, mdev_types=mdev_types, mdevs=mdevs, dev_nodes=dev_nodes)


# --------------------------------------------------------------------------
# Hardware units: what a generator composes hosts from


@attrs.frozen
class Function:
    """A PCI function before it has an address: identity and driver."""

    vendor: int
    device: int
    class_code: int
    driver: str | None = None
    boot_vga: bool = False


@attrs.frozen
class Multifunction:
    """One device on its own bus: a GPU with its audio function, a NIC, a drive.

    Functions of one device without ACS share one IOMMU group, which is what the
    kernel does for a GPU and its HDMI audio.
    """

    functions: tuple[Function, ...] = attrs.field(converter=_tuple_of_functions)
    numa: int | None = None

    @property
    def size(self) -> int:
        return len(self.functions)


@attrs.frozen
class Sriov:
    """A physical function with virtual functions; each function has its own group."""

    pf: Function
    vfs: tuple[Function, ...] = attrs.field(converter=_tuple_of_functions)
    numa: int | None = None

    @property
    def size(self) -> int:
        return 1 + len(self.vfs)


@attrs.frozen
class Bridged:
    """A conventional PCI bridge with endpoints behind it, all in the bridge's group."""

    bridge: Function
    endpoints: tuple[Function, ...] = attrs.field(converter=_tuple_of_functions)
    numa: int | None = None

    @property
    def size(self) -> int:
        return 1 + len(self.endpoints)


@attrs.frozen
class MdevParent:
    """A GPU on its vendor driver offering mdev types, with some mdevs created.

    `types` holds (type_id, name, available_instances); `mdevs` holds, per
    created mdev, the index into `types` of its type.
    """

    parent: Function
    types: tuple[tuple[str, str, int], ...] = attrs.field(converter=_tuple_of_offers)
    mdevs: tuple[int, ...] = attrs.field(converter=_tuple_of_ints, default=())
    numa: int | None = None

    @property
    def size(self) -> int:
        return 1


Unit = Multifunction | Sriov | Bridged | MdevParent


class _Buses:
    """Hands out fresh buses the way firmware numbers them, spilling into new domains."""

    def __init__(self) -> None:
        self._next = 0

    def take(self, count: int = 1) -> tuple[int, int]:
        # A unit's buses must not straddle a domain boundary.
        domain, bus = divmod(self._next, 255)
        if bus + count > 255:
            self._next = (domain + 1) * 255
            domain, bus = divmod(self._next, 255)
        self._next += count
        return domain, bus + 1


def _ari_address(domain: int, bus: int, index: int) -> PciAddress:
    # With ARI a device has up to 256 functions, spelled slot = index >> 3.
    return PciAddress(domain, bus, index >> 3, index & 7)


def build_topology(
    units: Sequence[Unit],
    *,
    iommu: bool = True,
    omit_group_nodes: Iterable[int] = (),
    shared_dev_nodes: Iterable[str] = SHARED_DEV_PATHS,
    uuid_seed: int = 0,
) -> Topology:
    """Place `units` on a host: assign buses, addresses and IOMMU groups.

    Each unit gets fresh buses in order; PCI groups are numbered in placement
    order and mdev groups after them, as the kernel numbers groups at boot and
    mdev groups on creation. With `iommu=False` no PCI function has a group (a
    host without an IOMMU, like a plain VM); mdevs still get groups, because
    vfio-mdev allocates them itself. `/dev/vfio/<n>` exists for every group with
    a function on vfio-pci and every mdev group, except the numbers in
    `omit_group_nodes`. mdev UUIDs come from `random.Random(uuid_seed)`.
    """
    pci: list[FakePci] = []
    mdev_types: list[FakeMdevType] = []
    pending_mdevs: list[tuple[PciAddress, str]] = []
    buses = _Buses()
    next_group = 0

    def group() -> int | None:
        nonlocal next_group
        if not iommu:
            return None
        next_group += 1
        return next_group - 1

    def place(
        fn: Function,
        address: PciAddress,
        group: int | None,
        numa: int | None,
        physfn: PciAddress | None = None,
        upstream: PciAddress | None = None,
    ) -> FakePci:
        made = FakePci(
            address=address,
            vendor=fn.vendor,
            device=fn.device,
            class_code=fn.class_code,
            driver=fn.driver,
            group=group,
            numa=numa,
            physfn=physfn,
            boot_vga=fn.boot_vga,
            upstream=upstream,
        )
        pci.append(made)
        return made

    for unit in units:
        if isinstance(unit, Multifunction):
            domain, bus = buses.take()
            shared = group()
            for index, fn in enumerate(unit.functions[:8]):
                place(fn, PciAddress(domain, bus, 0, index), group=shared, numa=unit.numa)
        elif isinstance(unit, Sriov):
            domain, bus = buses.take()
            pf = place(unit.pf, PciAddress(domain, bus, 0, 0), group=group(), numa=unit.numa)
            for index, fn in enumerate(unit.vfs[:255], start=1):
                place(
                    fn,
                    _ari_address(domain, bus, index),
                    group=group(),
                    numa=unit.numa,
                    physfn=pf.address,
                )
        elif isinstance(unit, Bridged):
            domain, bus = buses.take(2)
            shared = group()
            bridge = place(unit.bridge, PciAddress(domain, bus, 0, 0), group=shared, numa=unit.numa)
            for slot, fn in enumerate(unit.endpoints[:32]):
                place(
                    fn,
                    PciAddress(domain, bus + 1, slot, 0),
                    group=shared,
                    numa=unit.numa,
                    upstream=bridge.address,
                )
        else:
            domain, bus = buses.take()
            parent = place(
                unit.parent, PciAddress(domain, bus, 0, 0), group=group(), numa=unit.numa
            )
            type_ids: list[str] = []
            for type_id, name, available in unit.types:
                if type_id in type_ids:
                    continue
                type_ids.append(type_id)
                mdev_types.append(FakeMdevType(parent.address, type_id, name, available))
            for index in unit.mdevs:
                if type_ids:
                    pending_mdevs.append((parent.address, type_ids[index % len(type_ids)]))

    rng = random.Random(uuid_seed)
    mdevs: list[FakeMdev] = []
    for parent_address, type_id in pending_mdevs:
        number = next_group
        next_group += 1
        mdev_uuid = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        mdevs.append(FakeMdev(mdev_uuid, parent_address, type_id, number))

    omitted = frozenset(omit_group_nodes)
    vfio_groups = {fn.group for fn in pci if fn.driver == VFIO_DRIVER and fn.group is not None}
    vfio_groups |= {m.group for m in mdevs if m.group is not None}
    dev_nodes = {f"/dev/vfio/{g}" for g in vfio_groups if g not in omitted}
    if vfio_groups:
        dev_nodes.add(VFIO_CONTAINER)
    dev_nodes.update(shared_dev_nodes)
    return Topology(pci=pci, mdev_types=mdev_types, mdevs=mdevs, dev_nodes=dev_nodes)


# --------------------------------------------------------------------------
# Catalogue of real hardware for generated hosts (also used by dp_server.strategies).
# GPUS and ENDPOINTS: (vendor, device, class, host driver); GPU_AUDIO likewise.

GPUS: tuple[tuple[int, int, int, str], ...] = (
    (0x10DE, 0x1EB8, 0x030200, "nvidia"),  # Tesla T4
    (0x10DE, 0x20B5, 0x030200, "nvidia"),  # A100 80GB
    (0x10DE, 0x1DB6, 0x030200, "nvidia"),  # V100 32GB
    (0x10DE, 0x1E30, 0x030000, "nvidia"),  # Quadro RTX 6000
    (0x1002, 0x740F, 0x038000, "amdgpu"),  # Instinct MI210
)
GPU_AUDIO = (0x10DE, 0x10F8, 0x040300, "snd_hda_intel")
# (vendor, pf device, vf device, class, pf driver, vf host driver)
SRIOV_CARDS: tuple[tuple[int, int, int, int, str, str], ...] = (
    (0x8086, 0x4940, 0x4941, 0x0B4000, "4xxx", "4xxxvf"),  # QAT 4xxx
    (0x8086, 0x1592, 0x1889, 0x020000, "ice", "iavf"),  # E810
    (0x8086, 0x1572, 0x154C, 0x020000, "i40e", "iavf"),  # X710
    (0x15B3, 0x101B, 0x101C, 0x020700, "mlx5_core", "mlx5_core"),  # ConnectX-6
)
ENDPOINTS: tuple[tuple[int, int, int, str], ...] = (
    (0x144D, 0xA808, 0x010802, "nvme"),  # Samsung PM981
    (0x8086, 0x0A54, 0x010802, "nvme"),  # Intel P4510
    (0x8086, 0x1572, 0x020000, "i40e"),  # X710
    (0x14E4, 0x16D7, 0x020000, "bnxt_en"),  # BCM57414
    (0x1B36, 0x0010, 0x010802, "nvme"),  # QEMU NVMe
)
BRIDGES: tuple[tuple[int, int], ...] = ((0x10B5, 0x8747), (0x1A03, 0x1150), (0x8086, 0x244E))
VGPU_TYPES: tuple[tuple[str, str], ...] = (
    ("nvidia-256", "GRID RTX6000-1Q"),
    ("nvidia-257", "GRID RTX6000-2Q"),
    ("nvidia-259", "GRID RTX6000-4Q"),
    ("nvidia-260", "GRID RTX6000-8Q"),
    ("nvidia-222", "GRID T4-1Q"),
)


def _pick_driver(rng: random.Random, host_driver: str) -> str | None:
    # Mostly vfio-pci (the point of the host), some unbound, some left on the host.
    roll = rng.random()
    if roll < 0.7:
        return VFIO_DRIVER
    if roll < 0.85:
        return None
    return host_driver


def _random_units(rng: random.Random, n_devices: int, numa_nodes: int) -> Iterator[Unit]:
    def numa() -> int | None:
        if numa_nodes <= 0 or rng.random() < 0.05:
            return None
        return rng.randrange(numa_nodes)

    remaining = n_devices
    if remaining > 0:
        yield Multifunction((Function(0x1A03, 0x2000, 0x030000, "ast", boot_vga=True),), numa())
        remaining -= 1
    while remaining > 0:
        kind = rng.random()
        if kind < 0.3 or remaining == 1:
            if kind < 0.15 or remaining == 1:
                vendor, device, class_code, host = rng.choice(ENDPOINTS)
                unit: Unit = Multifunction(
                    (Function(vendor, device, class_code, _pick_driver(rng, host)),), numa()
                )
            else:
                vendor, device, class_code, host = rng.choice(GPUS)
                gpu_driver = _pick_driver(rng, host)
                # A misconfigured host leaves the audio function on its host driver.
                audio_driver = gpu_driver if rng.random() < 0.85 else GPU_AUDIO[3]
                unit = Multifunction(
                    (
                        Function(vendor, device, class_code, gpu_driver),
                        Function(*GPU_AUDIO[:3], audio_driver),
                    ),
                    numa(),
                )
        elif kind < 0.6:
            vendor, pf_id, vf_id, class_code, pf_drv, vf_drv = rng.choice(SRIOV_CARDS)
            count = min(rng.randint(0, 16), remaining - 1)
            vfs = tuple(
                Function(vendor, vf_id, class_code, _pick_driver(rng, vf_drv)) for _ in range(count)
            )
            unit = Sriov(Function(vendor, pf_id, class_code, pf_drv), vfs, numa())
        elif kind < 0.9:
            count = min(rng.randint(1, 4), remaining - 1)
            vendor, device = rng.choice(BRIDGES)
            endpoints = []
            for _ in range(count):
                e_vendor, e_device, e_class, host = rng.choice(ENDPOINTS)
                endpoints.append(Function(e_vendor, e_device, e_class, _pick_driver(rng, host)))
            bridge_driver = rng.choice((None, "pcieport"))
            unit = Bridged(Function(vendor, device, 0x060400, bridge_driver), endpoints, numa())
        else:
            vendor, device, class_code, host = rng.choice(GPUS)
            types = rng.sample(VGPU_TYPES, rng.randint(1, 3))
            offered = tuple((tid, name, rng.randint(0, 8)) for tid, name in types)
            created = tuple(rng.randrange(len(offered)) for _ in range(rng.randint(0, 4)))
            unit = MdevParent(Function(vendor, device, class_code, host), offered, created, numa())
        remaining -= unit.size
        yield unit


def generate_topology(
    n_devices: int,
    seed: int = 0,
    *,
    numa_nodes: int = 4,
    iommu: bool = True,
    missing_group_nodes: float = 0.02,
) -> Topology:
    """A random but valid host with exactly `n_devices` PCI functions.

    Deterministic from `seed`. The mix: a boot VGA device, GPUs with audio
    siblings (some with the audio left on its host driver), SR-IOV PFs with up
    to 16 VFs, bridges with up to 4 endpoints in one group, single endpoints,
    and vGPU parents with mdevs; drivers are mostly vfio-pci, some unbound, some
    host drivers; NUMA nodes 0..numa_nodes-1 with a few unknown. A fraction
    `missing_group_nodes` of VFIO group nodes is left out of `/dev/vfio`.
    """
    if n_devices < 0:
        raise ValueError("n_devices must be >= 0")
    rng = random.Random(seed)
    units = list(_random_units(rng, n_devices, numa_nodes))
    placed = build_topology(units, iommu=iommu, uuid_seed=rng.getrandbits(32))
    groups = sorted(
        int(p.rsplit("/", 1)[1]) for p in placed.dev_nodes if _GROUP_NODE.match(p) is not None
    )
    omitted = {g for g in groups if rng.random() < missing_group_nodes}
    if not omitted:
        return placed
    gone = {f"/dev/vfio/{g}" for g in omitted}
    return attrs.evolve(placed, dev_nodes=placed.dev_nodes - gone)


# --------------------------------------------------------------------------
# Writing the tree


class _Tree:
    """Writes files and relative symlinks under one root, by root-relative paths.

    Plain strings and `os` calls rather than `pathlib`: a 10,000-function host
    is about 150,000 entries, and this keeps writing it to a few seconds.
    """

    def __init__(self, root: str) -> None:
        self.root = root

    def mkdir(self, relative: str) -> None:
        os.makedirs(f"{self.root}/{relative}", exist_ok=True)

    def write(self, relative: str, text: str) -> None:
        fd = os.open(f"{self.root}/{relative}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, text.encode("ascii"))
        finally:
            os.close(fd)

    def link(self, relative: str, target: str) -> None:
        """A relative symlink through the nearest common directory, as kernfs writes them.

        So `physfn` reads `../0000:6b:00.0` and `driver` reads
        `../../../bus/pci/drivers/vfio-pci`, exactly like the kernel, and the
        tree works wherever it is copied.
        """
        link_dir = relative.split("/")[:-1]
        parts = target.split("/")
        common = 0
        while common < min(len(link_dir), len(parts)) and link_dir[common] == parts[common]:
            common += 1
        up = "../" * (len(link_dir) - common)
        os.symlink(up + "/".join(parts[common:]), f"{self.root}/{relative}")


def write_sysfs(topology: Topology, root: Path) -> tuple[Path, Path]:
    """Write `topology` as a sysfs tree `root/sys` and a device tree `root/dev`.

    The layout follows the kernel's: function directories under
    `devices/pci<domain>:<bus>/` nested below their bridges, `bus/pci/devices/*`
    and `bus/mdev/devices/*` symlinks into them, `driver` links into
    `bus/pci/drivers/<drv>` (whose directories link back), `iommu_group` links
    into `kernel/iommu_groups/<n>` (whose `devices/` link back), `physfn` and
    `virtfnN` links, and the writable files the kernel offers for rebinding
    (`driver_override`, `drivers_probe`, `bind`, `unbind`) as plain files.
    Device nodes under `dev/` are empty regular files: only existence matters.
    Output is deterministic: same topology, same tree. Returns (sys, dev).
    """
    sys_root = Path(root) / "sys"
    dev_root = Path(root) / "dev"
    tree = _Tree(os.fspath(sys_root))
    for directory in ("devices", "bus/pci/devices", "bus/pci/drivers", "kernel/iommu_groups"):
        tree.mkdir(directory)
    tree.write("bus/pci/drivers_probe", "")
    tree.write("bus/pci/drivers_autoprobe", "1\n")
    tree.write("bus/pci/rescan", "")

    by_address = {fn.address: fn for fn in topology.pci}
    paths: dict[PciAddress, str] = {}

    def path_of(fn: FakePci) -> str:
        known = paths.get(fn.address)
        if known is not None:
            return known
        if fn.upstream is None:
            base = f"devices/pci{fn.address.domain:04x}:{fn.address.bus:02x}"
        else:
            base = path_of(by_address[fn.upstream])
        made = f"{base}/{fn.address}"
        paths[fn.address] = made
        return made

    # Parents first, so nested directories exist before their children are made.
    ordered = sorted(topology.pci, key=lambda fn: path_of(fn).count("/"))
    drivers: dict[str, list[FakePci]] = defaultdict(list)
    group_members: dict[int, list[str]] = defaultdict(list)
    virtfns: dict[PciAddress, list[PciAddress]] = defaultdict(list)
    for fn in topology.pci:
        if fn.physfn is not None:
            virtfns[fn.physfn].append(fn.address)

    for fn in ordered:
        directory = paths[fn.address]
        tree.mkdir(directory)
        tree.write(f"{directory}/vendor", f"0x{fn.vendor:04x}\n")
        tree.write(f"{directory}/device", f"0x{fn.device:04x}\n")
        tree.write(f"{directory}/class", f"0x{fn.class_code:06x}\n")
        tree.write(f"{directory}/numa_node", f"{-1 if fn.numa is None else fn.numa}\n")
        tree.write(f"{directory}/driver_override", "(null)\n")
        if fn.class_code >> 8 == _VGA_CLASS:
            tree.write(f"{directory}/boot_vga", "1\n" if fn.boot_vga else "0\n")
        tree.link(f"{directory}/subsystem", "bus/pci")
        tree.link(f"bus/pci/devices/{fn.address}", directory)
        if fn.driver is not None:
            drivers[fn.driver].append(fn)
            tree.link(f"{directory}/driver", f"bus/pci/drivers/{fn.driver}")
        if fn.group is not None:
            group_members[fn.group].append(directory)
            tree.link(f"{directory}/iommu_group", f"kernel/iommu_groups/{fn.group}")
        if fn.physfn is not None:
            tree.link(f"{directory}/physfn", paths[fn.physfn])
        for index, vf in enumerate(virtfns.get(fn.address, ())):
            tree.link(f"{directory}/virtfn{index}", path_of(by_address[vf]))
        if fn.address in virtfns:
            tree.write(f"{directory}/sriov_numvfs", f"{len(virtfns[fn.address])}\n")

    for name in sorted(drivers):
        driver_dir = f"bus/pci/drivers/{name}"
        tree.mkdir(driver_dir)
        for control in ("bind", "unbind", "new_id", "remove_id"):
            tree.write(f"{driver_dir}/{control}", "")
        for fn in drivers[name]:
            tree.link(f"{driver_dir}/{fn.address}", paths[fn.address])

    mdev_driver = f"bus/mdev/drivers/{MDEV_DRIVER}"
    if topology.mdev_types or topology.mdevs:
        tree.mkdir("bus/mdev/devices")
        tree.mkdir(mdev_driver)
        tree.write(f"{mdev_driver}/bind", "")
        tree.write(f"{mdev_driver}/unbind", "")
    by_type: dict[tuple[PciAddress, str], list[FakeMdev]] = defaultdict(list)
    for mdev in topology.mdevs:
        by_type[(mdev.parent, mdev.type_id)].append(mdev)
    for mdev_type in topology.mdev_types:
        type_dir = f"{paths[mdev_type.parent]}/mdev_supported_types/{mdev_type.type_id}"
        tree.mkdir(f"{type_dir}/devices")
        tree.write(f"{type_dir}/name", f"{mdev_type.name}\n")
        tree.write(f"{type_dir}/available_instances", f"{mdev_type.available_instances}\n")
        tree.write(f"{type_dir}/device_api", f"{mdev_type.device_api}\n")
        tree.write(f"{type_dir}/create", "")
        for mdev in by_type[(mdev_type.parent, mdev_type.type_id)]:
            mdev_dir = f"{paths[mdev.parent]}/{mdev.uuid}"
            tree.mkdir(mdev_dir)
            tree.write(f"{mdev_dir}/remove", "")
            tree.link(f"{mdev_dir}/mdev_type", type_dir)
            tree.link(f"{mdev_dir}/subsystem", "bus/mdev")
            tree.link(f"{mdev_dir}/driver", mdev_driver)
            if mdev.group is not None:
                tree.link(f"{mdev_dir}/iommu_group", f"kernel/iommu_groups/{mdev.group}")
                group_members[mdev.group].append(mdev_dir)
            tree.link(f"{type_dir}/devices/{mdev.uuid}", mdev_dir)
            tree.link(f"bus/mdev/devices/{mdev.uuid}", mdev_dir)

    for number in sorted(group_members):
        group_dir = f"kernel/iommu_groups/{number}"
        tree.mkdir(f"{group_dir}/devices")
        tree.write(f"{group_dir}/type", "DMA\n")
        tree.write(f"{group_dir}/reserved_regions", "")
        for member in group_members[number]:
            tree.link(f"{group_dir}/devices/{member.rpartition('/')[2]}", member)

    dev = _Tree(os.fspath(dev_root))
    dev.mkdir("")
    for node in sorted(topology.dev_nodes):
        relative = node.removeprefix("/dev/")
        if relative == node or not relative or ".." in relative.split("/"):
            raise ValueError(f"device node {node!r} is not under /dev/")
        if "/" in relative:
            dev.mkdir(relative.rpartition("/")[0])
        dev.write(relative, "")
    return sys_root, dev_root
