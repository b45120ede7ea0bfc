"""Random but valid hosts of any size, built from hardware units.

`build_topology` turns a list of hardware "units" (a GPU with its audio
function, an SR-IOV card, a bridge with drives behind it, a vGPU parent) into
a `Topology` with addresses and IOMMU group numbers assigned the way the kernel
would; `generate_topology` draws such units at random from a seed. Benchmarks
use the generator, and `dp_testing.strategies` draws the same units with
hypothesis.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterable, Iterator, Sequence

import attrs

from dp_core import VFIO_DRIVER, PciAddress
from dp_testing.topology import (
    _GROUP_NODE,
    SHARED_DEV_PATHS,
    VFIO_CONTAINER,
    FakeMdev,
    FakeMdevType,
    FakePci,
    Topology,
)

__all__ = [
    "BRIDGES",
    "ENDPOINTS",
    "GPUS",
    "GPU_AUDIO",
    "SRIOV_CARDS",
    "VGPU_TYPES",
    "VIRTUAL_MDEV_PARENTS",
    "Bridged",
    "Function",
    "MdevParent",
    "Multifunction",
    "Sriov",
    "Unit",
    "VirtualMdevParent",
    "build_topology",
    "generate_topology",
]


def _tuple_of_functions(value: Iterable[Function]) -> tuple[Function, ...]:
    return tuple(value)


def _tuple_of_offers(value: Iterable[tuple[str, str, int]]) -> tuple[tuple[str, str, int], ...]:
    return tuple(value)


def _tuple_of_ints(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


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


@attrs.frozen
class VirtualMdevParent:
    """An mdev parent that is no PCI function: a virtual device by name.

    The kernel's sample drivers (`mtty`, `mdpy`) register such parents, as
    s390's vfio-ap (`matrix`) does. `types` and `mdevs` as for `MdevParent`;
    a second unit of a name already placed is left out.
    """

    name: str
    types: tuple[tuple[str, str, int], ...] = attrs.field(converter=_tuple_of_offers)
    mdevs: tuple[int, ...] = attrs.field(converter=_tuple_of_ints, default=())

    @property
    def size(self) -> int:
        return 0


Unit = Multifunction | Sriov | Bridged | MdevParent | VirtualMdevParent


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
    pending_mdevs: list[tuple[PciAddress | str, str]] = []
    virtual_parents: set[str] = set()
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

    def offer(
        parent: PciAddress | str, types: Iterable[tuple[str, str, int]], made: Iterable[int]
    ) -> None:
        type_ids: list[str] = []
        for type_id, name, available in types:
            if type_id in type_ids:
                continue
            type_ids.append(type_id)
            mdev_types.append(FakeMdevType(parent, type_id, name, available))
        for index in made:
            if type_ids:
                pending_mdevs.append((parent, type_ids[index % len(type_ids)]))

    for unit in units:
        if isinstance(unit, VirtualMdevParent):
            if unit.name not in virtual_parents:
                virtual_parents.add(unit.name)
                offer(unit.name, unit.types, unit.mdevs)
        elif isinstance(unit, Multifunction):
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
            offer(parent.address, unit.types, unit.mdevs)

    rng = random.Random(uuid_seed)
    mdevs: list[FakeMdev] = []
    for parent_name, type_id in pending_mdevs:
        number = next_group
        next_group += 1
        mdev_uuid = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        mdevs.append(FakeMdev(mdev_uuid, parent_name, type_id, number))

    omitted = frozenset(omit_group_nodes)
    vfio_groups = {fn.group for fn in pci if fn.driver == VFIO_DRIVER and fn.group is not None}
    vfio_groups |= {m.group for m in mdevs if m.group is not None}
    dev_nodes = {f"/dev/vfio/{g}" for g in vfio_groups if g not in omitted}
    if vfio_groups:
        dev_nodes.add(VFIO_CONTAINER)
    dev_nodes.update(shared_dev_nodes)
    return Topology(pci=pci, mdev_types=mdev_types, mdevs=mdevs, dev_nodes=dev_nodes)


# --------------------------------------------------------------------------
# Catalogue of real hardware for generated hosts (also used by dp_testing.strategies).
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
# Parents that are no PCI function, with the types their drivers offer
# (the kernel's samples/vfio-mdev, s390's vfio-ap).
VIRTUAL_MDEV_PARENTS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("mtty", (("mtty-1", "Single port serial"), ("mtty-2", "Dual port serial"))),
    ("mdpy", (("mdpy-vga", "mdpy-vga"), ("mdpy-xga", "mdpy-xga"), ("mdpy-hd", "mdpy-hd"))),
    ("matrix", (("vfio_ap-passthrough", "VFIO AP Passthrough Device"),)),
)
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
