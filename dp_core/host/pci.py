"""PCI addresses and PCI functions as the kernel describes them in sysfs."""

from __future__ import annotations

import re
from collections.abc import Callable

import attrs

__all__ = ["PciAddress", "PciDevice", "PciId", "VfioDevEntry"]

_ADDRESS = re.compile(
    r"^(?P<domain>[0-9a-fA-F]{4,8}):(?P<bus>[0-9a-fA-F]{2}):"
    r"(?P<slot>[0-9a-fA-F]{2})\.(?P<function>[0-7])$"
)


def _in_range(limit: int) -> Callable[[object, attrs.Attribute[int], int], None]:
    def check(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
        if isinstance(value, bool) or not 0 <= value <= limit:
            raise ValueError(f"PCI {attribute.name} {value:#x} is out of range 0..{limit:#x}")

    return check


@attrs.frozen(order=True)
class PciAddress:
    """A PCI function address, `DDDD:BB:SS.F` (domain, bus, slot, function)."""

    domain: int = attrs.field(validator=_in_range(0xFFFFFFFF))
    bus: int = attrs.field(validator=_in_range(0xFF))
    slot: int = attrs.field(validator=_in_range(0x1F))
    function: int = attrs.field(validator=_in_range(0x7))

    @classmethod
    def parse(cls, text: str) -> PciAddress:
        match = _ADDRESS.match(text.strip())
        if match is None:
            raise ValueError(f"{text!r} is not a PCI address of the form DDDD:BB:SS.F")
        return cls(
            int(match["domain"], 16),
            int(match["bus"], 16),
            int(match["slot"], 16),
            int(match["function"], 16),
        )

    def __str__(self) -> str:
        return f"{self.domain:04x}:{self.bus:02x}:{self.slot:02x}.{self.function:x}"


@attrs.frozen(order=True)
class PciId:
    """A vendor:device pair, the key that selectors and default names use."""

    vendor: int = attrs.field(validator=_in_range(0xFFFF))
    device: int = attrs.field(validator=_in_range(0xFFFF))

    @classmethod
    def parse(cls, text: str) -> PciId:
        """Parse `VVVV:DDDD`, hex, any case."""
        match = re.fullmatch(r"([0-9a-fA-F]{4}):([0-9a-fA-F]{4})", text.strip())
        if match is None:
            raise ValueError(f"{text!r} is not VVVV:DDDD hex")
        return cls(int(match[1], 16), int(match[2], 16))

    def __str__(self) -> str:
        return f"{self.vendor:04x}:{self.device:04x}"


@attrs.frozen
class VfioDevEntry:
    """A function's `vfio-dev/<name>` entry in sysfs: its VFIO character device.

    The kernel adds the entry when vfio-pci takes the function (Linux 6.1 and
    later), and a `dev` file inside it only when it is built with
    `CONFIG_VFIO_DEVICE_CDEV`; only then does `/dev/vfio/devices/<name>` exist
    to be opened. `problem` says why the entry could not be read (then `name`
    may be empty): the function keeps the group interface.
    """

    name: str = ""
    has_dev: bool = False
    problem: str = ""

    @property
    def host_path(self) -> str | None:
        """`/dev/vfio/devices/<name>` when the kernel offers that node, else None."""
        if not self.name or not self.has_dev or self.problem:
            return None
        return f"/dev/vfio/devices/{self.name}"


# PCI base class 0x06 is "bridge device"; the kernel puts bridges in the group of
# the devices behind them, but VFIO does not need them bound to vfio-pci.
_BRIDGE_BASE_CLASS = 0x06


@attrs.frozen
class PciDevice:
    """One PCI function as read from `/sys/bus/pci/devices/<address>`."""

    address: PciAddress
    vendor: int = attrs.field(validator=_in_range(0xFFFF))
    device: int = attrs.field(validator=_in_range(0xFFFF))
    class_code: int = attrs.field(validator=_in_range(0xFFFFFF))
    driver: str | None = None
    iommu_group: int | None = None
    numa_node: int | None = attrs.field(default=None)
    physfn: PciAddress | None = None
    virtfns: tuple[PciAddress, ...] = ()
    # Virtual functions the kernel says are enabled (sysfs sriov_numvfs; 0 when
    # the function cannot have any); None when that, or a virtfn link, could
    # not be read.
    sriov_numvfs: int | None = 0
    boot_vga: bool = False
    # The `vfio-dev/` entry; None when sysfs shows none (not on vfio-pci, or a
    # kernel older than 6.1).
    vfio_dev: VfioDevEntry | None = None

    @numa_node.validator
    def _check_numa(self, attribute: attrs.Attribute[int | None], value: int | None) -> None:
        if value is not None and value < 0:
            raise ValueError("numa_node must be None (unknown) or >= 0; sysfs -1 means unknown")

    @property
    def pci_id(self) -> PciId:
        return PciId(self.vendor, self.device)

    @property
    def is_bridge(self) -> bool:
        return self.class_code >> 16 == _BRIDGE_BASE_CLASS

    @property
    def is_virtual_function(self) -> bool:
        return self.physfn is not None
