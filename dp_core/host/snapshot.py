"""The host as one observation: PCI functions, IOMMU groups, mdevs and /dev nodes.

A `HostSnapshot` is plain data that the shell's scanner produces and the core
consumes; it never reads anything itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

import attrs

from .pci import PciAddress, PciDevice, VfioDevEntry

__all__ = [
    "IOMMUFD_NODE",
    "VFIO_DRIVER",
    "HostSnapshot",
    "IommuGroup",
    "MdevDevice",
    "MdevType",
    "ScanProblem",
    "Viability",
]

VFIO_DRIVER = "vfio-pci"
# iommufd's own node, present when the kernel has CONFIG_IOMMUFD.
IOMMUFD_NODE = "/dev/iommu"


# attrs' mypy plugin cannot type a generic converter, so each field gets its own.
def _pci_devices(value: Iterable[PciDevice]) -> tuple[PciDevice, ...]:
    return tuple(value)


def _groups(value: Iterable[IommuGroup]) -> tuple[IommuGroup, ...]:
    return tuple(value)


def _mdev_types(value: Iterable[MdevType]) -> tuple[MdevType, ...]:
    return tuple(value)


def _mdevs(value: Iterable[MdevDevice]) -> tuple[MdevDevice, ...]:
    return tuple(value)


def _optional_names(value: Iterable[str] | None) -> frozenset[str] | None:
    return None if value is None else frozenset(value)


def _paths(value: Iterable[str]) -> frozenset[str]:
    if type(value) is frozenset:
        return value
    # Built from a set, a frozenset gets a table twice the size one built from
    # a list gets: 256 KB instead of 128 KB for a host with 4,096 groups.
    return frozenset(list(value))


def _problems(value: Iterable[ScanProblem]) -> tuple[ScanProblem, ...]:
    return tuple(value)


@attrs.frozen
class Viability:
    """Whether VFIO can open a group, and if not, which members stop it."""

    viable: bool
    blockers: tuple[tuple[PciAddress, str], ...] = ()

    @property
    def reason(self) -> str:
        if self.viable:
            return ""
        return "; ".join(f"{address} is bound to {driver}" for address, driver in self.blockers)


_VIABLE = Viability(viable=True)


# Drivers the kernel lets a bridge keep while VFIO uses its group: port
# drivers that do no DMA of their own (`driver_managed_dma` since Linux 5.19;
# older kernels exempted every bridge header). Any other driver on a
# bridge-class function, an LPC/ISA bridge on lpc_ich say, holds the group
# from VFIO as an endpoint's driver does.
BRIDGE_PORT_DRIVERS = frozenset({"pcieport"})


def blocks_vfio(pci: PciDevice) -> bool:
    """Whether `pci`, bound as it is, keeps its IOMMU group from VFIO.

    A function with no driver, or on vfio-pci, does not; nor does a bridge on
    its port driver.
    """
    if pci.driver is None or pci.driver == VFIO_DRIVER:
        return False
    return not (pci.is_bridge and pci.driver in BRIDGE_PORT_DRIVERS)


@attrs.frozen
class IommuGroup:
    """One `/sys/kernel/iommu_groups/<number>`, holding its member functions."""

    number: int = attrs.field()
    members: tuple[PciDevice, ...] = attrs.field(converter=_pci_devices)

    @number.validator
    def _check_number(self, attribute: attrs.Attribute[int], value: int) -> None:
        if value < 0:
            raise ValueError(f"IOMMU group number must be >= 0, got {value}")

    @property
    def endpoints(self) -> tuple[PciDevice, ...]:
        return tuple(member for member in self.members if not member.is_bridge)

    @property
    def viability(self) -> Viability:
        # The inventory asks once per device, so the common answer is shared.
        blockers = tuple(
            (member.address, member.driver or "") for member in self.members if blocks_vfio(member)
        )
        return Viability(viable=False, blockers=blockers) if blockers else _VIABLE


def _parent_name(value: PciAddress | str) -> str:
    """A parent device's kernel name; a PCI address in its canonical form."""
    if isinstance(value, PciAddress):
        return str(value)
    try:
        return str(PciAddress.parse(value))
    except ValueError:
        return value


def _check_parent(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not value or "/" in value or value in (".", ".."):
        raise ValueError(f"mdev parent {value!r} is not a device name")


def _parent_address(instance: MdevType | MdevDevice) -> PciAddress | None:
    try:
        return PciAddress.parse(instance.parent)
    except ValueError:
        return None


@attrs.frozen
class MdevType:
    """A mediated device type offered by a parent, `mdev_supported_types/<type_id>`.

    `parent` is the parent device's kernel name, as `/sys/class/mdev_bus/`
    lists it: a PCI address for a GPU, but the name of a device that is no
    PCI function for others (the kernel's sample drivers' `mtty` and `mdpy`,
    s390's vfio-ap `matrix` and vfio-ccw subchannels). `parent_address` is the
    PCI address, or None for such a parent.
    """

    parent: str = attrs.field(converter=_parent_name, validator=_check_parent)
    type_id: str
    name: str
    available_instances: int | None = None
    parent_address: PciAddress | None = attrs.field(
        init=False, eq=False, repr=False, default=attrs.Factory(_parent_address, takes_self=True)
    )


@attrs.frozen
class MdevDevice:
    """A created mediated device, `/sys/bus/mdev/devices/<uuid>`.

    `parent` and `parent_address` as for `MdevType`. `vfio_dev` is its
    `vfio-dev/vfioN` entry: an mdev is a VFIO device of its own, with a
    character device on a kernel with `CONFIG_VFIO_DEVICE_CDEV`.
    """

    uuid: str
    parent: str = attrs.field(converter=_parent_name, validator=_check_parent)
    type_id: str
    iommu_group: int | None = None
    vfio_dev: VfioDevEntry | None = None
    parent_address: PciAddress | None = attrs.field(
        init=False, eq=False, repr=False, default=attrs.Factory(_parent_address, takes_self=True)
    )


@attrs.frozen
class ScanProblem:
    """Something the scanner could not read, with the path it was reading."""

    path: str
    reason: str


@attrs.frozen
class HostSnapshot:
    """Everything the core needs to know about the host at one moment.

    `dev_nodes` holds the host paths (`/dev/vfio/12`, `/dev/vfio/devices/vfio0`,
    `/dev/iommu`, `/dev/kvm`, ...) that existed when the scan ran.
    `pci_drivers` names the drivers registered on the PCI bus
    (`/sys/bus/pci/drivers/*`), or is None when they were not read.
    """

    pci_devices: tuple[PciDevice, ...] = attrs.field(default=(), converter=_pci_devices)
    iommu_groups: tuple[IommuGroup, ...] = attrs.field(default=(), converter=_groups)
    mdev_types: tuple[MdevType, ...] = attrs.field(default=(), converter=_mdev_types)
    mdevs: tuple[MdevDevice, ...] = attrs.field(default=(), converter=_mdevs)
    dev_nodes: frozenset[str] = attrs.field(default=frozenset(), converter=_paths)
    problems: tuple[ScanProblem, ...] = attrs.field(default=(), converter=_problems)
    pci_drivers: frozenset[str] | None = attrs.field(default=None, converter=_optional_names)
    _by_address: Mapping[PciAddress, PciDevice] | None = attrs.field(
        init=False, eq=False, repr=False
    )
    _by_group: Mapping[int, IommuGroup] | None = attrs.field(init=False, eq=False, repr=False)
    _by_uuid: Mapping[str, MdevDevice] | None = attrs.field(init=False, eq=False, repr=False)
    _type_names: Mapping[tuple[str, str], str] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        # Lookup tables are derived once; the snapshot itself stays immutable.
        # Functions and groups are indexed on first use only: a server keeps
        # its snapshot, and on a large host each table is 150 KB that nothing
        # in the server looks up (the inventory keeps its own while it builds).
        object.__setattr__(self, "_by_address", None)
        object.__setattr__(self, "_by_group", None)
        object.__setattr__(self, "_by_uuid", None)
        object.__setattr__(
            self,
            "_type_names",
            MappingProxyType({(t.parent, t.type_id): t.name for t in self.mdev_types}),
        )

    def device(self, address: PciAddress) -> PciDevice | None:
        by_address = self._by_address
        if by_address is None:
            by_address = MappingProxyType({d.address: d for d in self.pci_devices})
            object.__setattr__(self, "_by_address", by_address)
        return by_address.get(address)

    def group(self, number: int | None) -> IommuGroup | None:
        if number is None:
            return None
        by_group = self._by_group
        if by_group is None:
            by_group = MappingProxyType({g.number: g for g in self.iommu_groups})
            object.__setattr__(self, "_by_group", by_group)
        return by_group.get(number)

    def mdev(self, uuid: str) -> MdevDevice | None:
        by_uuid = self._by_uuid
        if by_uuid is None:
            by_uuid = MappingProxyType({m.uuid: m for m in self.mdevs})
            object.__setattr__(self, "_by_uuid", by_uuid)
        return by_uuid.get(uuid)

    def mdev_type_name(self, mdev: MdevDevice) -> str | None:
        return self._type_names.get((mdev.parent, mdev.type_id))

    def has_dev_node(self, host_path: str) -> bool:
        return host_path in self.dev_nodes

    @property
    def has_iommufd(self) -> bool:
        """Whether `/dev/iommu` existed: the kernel has iommufd (CONFIG_IOMMUFD)."""
        return IOMMUFD_NODE in self.dev_nodes
