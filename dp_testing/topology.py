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
random hosts of any size come from `dp_testing.generator`.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs

from dp_core import (
    IOMMUFD_NODE,
    VFIO_DRIVER,
    HostSnapshot,
    IommuGroup,
    MdevDevice,
    MdevType,
    PciAddress,
    PciDevice,
    VfioDevEntry,
)

__all__ = [
    "SHARED_DEV_PATHS",
    "FakeMdev",
    "FakeMdevType",
    "FakePci",
    "Topology",
    "fixture_topology",
    "iommufd_guest_topology",
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
_CDEV_NODE = re.compile(r"^/dev/vfio/devices/vfio[0-9]+$")
_CDEV_NAME = re.compile(r"^vfio[0-9]+$")
_PCI_NAME = re.compile(r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


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
    `vfio_dev` names its `vfio-dev/<name>` entry (`vfio0`), which has a `dev`
    file when `vfio_dev_file` (a kernel with CONFIG_VFIO_DEVICE_CDEV); whether
    `/dev/vfio/devices/<name>` exists is up to the topology's `dev_nodes`.
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
    vfio_dev: str | None = None
    vfio_dev_file: bool = True

    @property
    def is_bridge(self) -> bool:
        return _is_bridge(self.class_code)


@attrs.frozen
class FakeMdevType:
    """One `mdev_supported_types/<type_id>` entry of a parent device.

    `parent` is a PCI function's address, or the name of a parent that is no
    PCI function: a virtual device, as the kernel's sample drivers register
    (`mtty` is `/sys/devices/virtual/mtty/mtty`).
    """

    parent: PciAddress | str
    type_id: str
    name: str
    available_instances: int = 0
    device_api: str = "vfio-pci"


@attrs.frozen
class FakeMdev:
    """One created mediated device; the kernel gives each its own IOMMU group.

    `vfio_dev` and `vfio_dev_file` as for `FakePci`: an mdev is a VFIO device
    of its own, with its `vfio-dev/vfioN` entry from Linux 6.1.
    """

    uuid: str
    parent: PciAddress | str
    type_id: str
    group: int | None = None
    vfio_dev: str | None = None
    vfio_dev_file: bool = True


# Typed converters: mypy's attrs plugin cannot type a bare `converter=tuple`.
def _tuple_of_types(value: Iterable[FakeMdevType]) -> tuple[FakeMdevType, ...]:
    return tuple(value)


def _tuple_of_mdevs(value: Iterable[FakeMdev]) -> tuple[FakeMdev, ...]:
    return tuple(value)


def _frozenset_of_str(value: Iterable[str]) -> frozenset[str]:
    return frozenset(value)


def _address_key(address: PciAddress) -> tuple[int, int, int, int]:
    # A plain tuple: attrs' generated ordering is slow enough to matter at 10,000.
    return (address.domain, address.bus, address.slot, address.function)


def _parent_key(parent: PciAddress | str) -> tuple[int, tuple[int, int, int, int], str]:
    """PCI parents by address, then the others by name: the scanner's order."""
    if isinstance(parent, str):
        return (1, (0, 0, 0, 0), parent)
    return (0, _address_key(parent), "")


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
        cdevs = [fn.vfio_dev for fn in (*self.pci, *self.mdevs) if fn.vfio_dev is not None]
        for name in cdevs:
            if _CDEV_NAME.match(name) is None:
                raise ValueError(f"vfio-dev entry {name!r} is not vfio<N>")
            if cdevs.count(name) > 1:
                raise ValueError(f"vfio-dev entry {name} is described twice")
        types = set()
        for mdev_type in self.mdev_types:
            parent = mdev_type.parent
            if isinstance(parent, str):
                if (
                    not re.fullmatch(r"[A-Za-z0-9_.-]+", parent)
                    or parent in (".", "..")
                    or _PCI_NAME.match(parent)
                ):
                    raise ValueError(
                        f"mdev type {mdev_type.type_id}: {parent!r} is no virtual device name"
                    )
            elif parent not in by_address:
                raise ValueError(f"mdev type {mdev_type.type_id}: no parent {parent}")
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
    """Nodes the scanner always reports: VFIO's, its character devices, iommufd's."""
    return (
        path in (VFIO_CONTAINER, IOMMUFD_NODE)
        or _GROUP_NODE.match(path) is not None
        or _CDEV_NODE.match(path) is not None
    )


# --------------------------------------------------------------------------
# The expected snapshot


def _vfio_dev_entry(device: FakePci | FakeMdev) -> VfioDevEntry | None:
    if device.vfio_dev is None:
        return None
    return VfioDevEntry(device.vfio_dev, has_dev=device.vfio_dev_file)


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
            sriov_numvfs=len(virtfns.get(fn.address, ())),
            boot_vga=fn.boot_vga,
            vfio_dev=_vfio_dev_entry(fn),
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
        for t in sorted(topology.mdev_types, key=lambda t: (_parent_key(t.parent), t.type_id))
    )
    mdevs = tuple(
        MdevDevice(m.uuid, m.parent, m.type_id, m.group, _vfio_dev_entry(m))
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
        # write_sysfs makes a driver directory for each driver some function uses.
        pci_drivers=sorted({fn.driver for fn in topology.pci if fn.driver is not None}),
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
        # The first three show the VFIO character device's three shapes: a
        # `vfio-dev/vfio0` with `dev` and its node; `vfio1` with `dev` but no
        # /dev/vfio/devices/vfio1; `vfio2` without `dev`, as a kernel without
        # CONFIG_VFIO_DEVICE_CDEV writes it. (One kernel writes one shape or
        # the other; the mix is here so every shape is on one node.)
        fn("0000:6b:00.0", intel, 0x4940, 0x0B4000, "4xxx", 107, 0),
        fn("0000:6b:00.1", intel, 0x4941, 0x0B4000, vfio, 108, 0, physfn=qat_pf, vfio_dev="vfio0"),
        fn("0000:6b:00.2", intel, 0x4941, 0x0B4000, vfio, 109, 0, physfn=qat_pf, vfio_dev="vfio1"),
        fn(
            "0000:6b:00.3",
            intel,
            0x4941,
            0x0B4000,
            vfio,
            110,
            0,
            physfn=qat_pf,
            vfio_dev="vfio2",
            vfio_dev_file=False,
        ),
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
    # A kernel with VFIO character devices has iommufd too.
    dev_nodes |= {IOMMUFD_NODE, "/dev/vfio/devices/vfio0"}
    return Topology(pci=pci, mdev_types=mdev_types, mdevs=mdevs, dev_nodes=dev_nodes)


def iommufd_guest_topology() -> Topology:
    """A q35 guest on Linux 6.12 with iommufd, as the real-kernel tier saw it.

    What `tests/test_real_kernel_iommufd.py` boots, in the shapes that kernel
    showed: an e1000e on vfio-pci with its VFIO character device
    (`vfio-dev/vfio0` with `dev`, `/dev/vfio/devices/vfio0`) and `/dev/iommu`;
    an NVMe controller on its host driver; and the kernel's sample mdev drivers,
    whose parents are no PCI function but virtual devices
    (`/sys/devices/virtual/mtty/mtty`, `.../mdpy/mdpy`, linked from
    `/sys/class/mdev_bus/`), each mdev in an IOMMU group of its own, numbered
    after the PCI groups as it was created, and with a character device of its
    own (`vfio-dev/vfio1`, `/dev/vfio/devices/vfio1`).
    """
    intel, redhat = 0x8086, 0x1B36
    host_bridge = _a("0000:00:00.0")
    pci = [
        FakePci(host_bridge, intel, 0x29C0, 0x060000, None, 0),
        FakePci(_a("0000:00:01.0"), redhat, 0x000C, 0x060400, "pcieport", 1),
        FakePci(_a("0000:00:02.0"), redhat, 0x000C, 0x060400, "pcieport", 2),
        FakePci(
            _a("0000:01:00.0"), redhat, 0x0010, 0x010802, "nvme", 4, upstream=_a("0000:00:01.0")
        ),
        FakePci(
            _a("0000:02:00.0"),
            intel,
            0x10D3,
            0x020000,
            VFIO_DRIVER,
            5,
            upstream=_a("0000:00:02.0"),
            vfio_dev="vfio0",
        ),
    ]
    mdev_types = [
        FakeMdevType("mtty", "mtty-1", "Single port serial", 24),
        FakeMdevType("mtty", "mtty-2", "Dual port serial", 10),
        FakeMdevType("mdpy", "mdpy-hd", "mdpy-hd", 4),
        FakeMdevType("mdpy", "mdpy-vga", "mdpy-vga", 3),
        FakeMdevType("mdpy", "mdpy-xga", "mdpy-xga", 4),
    ]
    mdevs = [
        FakeMdev("83b8f4f2-509f-382f-3c1e-e6bfe0fa1001", "mtty", "mtty-2", 6, vfio_dev="vfio1"),
        FakeMdev("83b8f4f2-509f-382f-3c1e-e6bfe0fa1002", "mdpy", "mdpy-vga", 7, vfio_dev="vfio2"),
    ]
    dev_nodes = {VFIO_CONTAINER, IOMMUFD_NODE, "/dev/vfio/5", "/dev/vfio/6", "/dev/vfio/7"}
    dev_nodes |= {f"/dev/vfio/devices/vfio{n}" for n in range(3)}
    return Topology(pci=pci, mdev_types=mdev_types, mdevs=mdevs, dev_nodes=dev_nodes)


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


# The character major the kernel gave VFIO devices on one machine; any will do.
_VFIO_CDEV_MAJOR = 237


def _write_vfio_dev(tree: _Tree, entry: str, dev_file: bool) -> None:
    """`vfio-dev/vfioN` as the kernel writes it; `dev` only with VFIO character devices."""
    tree.mkdir(entry)
    name = entry.rpartition("/")[2]
    if dev_file:
        minor = int(name.removeprefix("vfio"))
        tree.write(f"{entry}/dev", f"{_VFIO_CDEV_MAJOR}:{minor}\n")
        tree.write(
            f"{entry}/uevent",
            f"MAJOR={_VFIO_CDEV_MAJOR}\nMINOR={minor}\nDEVNAME=vfio/devices/{name}\n",
        )
    else:
        tree.write(f"{entry}/uevent", "")


def write_sysfs(topology: Topology, root: Path) -> tuple[Path, Path]:
    """Write `topology` as a sysfs tree `root/sys` and a device tree `root/dev`.

    The layout follows the kernel's: function directories under
    `devices/pci<domain>:<bus>/` nested below their bridges, `bus/pci/devices/*`
    and `bus/mdev/devices/*` symlinks into them, `driver` links into
    `bus/pci/drivers/<drv>` (whose directories link back), `iommu_group` links
    into `kernel/iommu_groups/<n>` (whose `devices/` link back), `physfn` and
    `virtfnN` links, `vfio-dev/vfioN` entries, and the writable files the
    kernel offers for rebinding (`driver_override`, `drivers_probe`, `bind`,
    `unbind`) as plain files.
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
        if fn.vfio_dev is not None:
            _write_vfio_dev(tree, f"{directory}/vfio-dev/{fn.vfio_dev}", fn.vfio_dev_file)

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
        tree.mkdir("class/mdev_bus")

    def parent_dir(parent: PciAddress | str) -> str:
        # A virtual parent is `devices/virtual/<class>/<name>`; the sample
        # drivers name the class after the device.
        return f"devices/virtual/{parent}/{parent}" if isinstance(parent, str) else paths[parent]

    by_type: dict[tuple[PciAddress | str, str], list[FakeMdev]] = defaultdict(list)
    for mdev in topology.mdevs:
        by_type[(mdev.parent, mdev.type_id)].append(mdev)
    for parent in dict.fromkeys(t.parent for t in topology.mdev_types):
        directory = parent_dir(parent)
        tree.mkdir(directory)
        # The kernel links every parent into class/mdev_bus by its device name.
        tree.link(f"class/mdev_bus/{directory.rpartition('/')[2]}", directory)
    for mdev_type in topology.mdev_types:
        type_dir = f"{parent_dir(mdev_type.parent)}/mdev_supported_types/{mdev_type.type_id}"
        tree.mkdir(f"{type_dir}/devices")
        tree.write(f"{type_dir}/name", f"{mdev_type.name}\n")
        tree.write(f"{type_dir}/available_instances", f"{mdev_type.available_instances}\n")
        tree.write(f"{type_dir}/device_api", f"{mdev_type.device_api}\n")
        tree.write(f"{type_dir}/create", "")
        for mdev in by_type[(mdev_type.parent, mdev_type.type_id)]:
            mdev_dir = f"{parent_dir(mdev.parent)}/{mdev.uuid}"
            tree.mkdir(mdev_dir)
            tree.write(f"{mdev_dir}/remove", "")
            tree.link(f"{mdev_dir}/mdev_type", type_dir)
            tree.link(f"{mdev_dir}/subsystem", "bus/mdev")
            tree.link(f"{mdev_dir}/driver", mdev_driver)
            if mdev.group is not None:
                tree.link(f"{mdev_dir}/iommu_group", f"kernel/iommu_groups/{mdev.group}")
                group_members[mdev.group].append(mdev_dir)
            if mdev.vfio_dev is not None:
                _write_vfio_dev(tree, f"{mdev_dir}/vfio-dev/{mdev.vfio_dev}", mdev.vfio_dev_file)
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
