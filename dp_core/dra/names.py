"""How a device offered through DRA is named, and the attributes it carries.

A device's name is a DNS label derived from what identifies it on the host
(its PCI address, its mdev UUID), so it is the same after every restart and
a claim's allocation still names it. Its attributes are what a DeviceClass
or a claim selects on and what KubeVirt 1.9 reads from the KEP-5304 metadata:
`resource.kubernetes.io/pciBusID` for a PCI function and `mdevUUID` for an
mdev (kubevirt/kubevirt `pkg/dra/metadata/types.go`).

Attribute rules (`k8s.io/api/resource/v1` `QualifiedName`): a C identifier of
at most 32 characters, optionally after a DNS subdomain of at most 63 and a
`/`; a name without a domain is in the driver's. String values are at most 64
characters; a device has at most 32 attributes and capacities together.
"""

from __future__ import annotations

import re

from ..host.pci import PciAddress, PciDevice
from ..host.snapshot import HostSnapshot, MdevDevice
from .pool_content import MAX_ATTRIBUTE_VALUE_LENGTH, MAX_ATTRIBUTES_AND_CAPACITIES, AttributeValue

__all__ = [
    "GROUP_RESOURCE",
    "IOMMU_GROUP",
    "MDEV_UUID",
    "NUMA_NODE",
    "PCI_BUS_ID",
    "RESOURCE_NAME",
    "Attributes",
    "attribute_name_error",
    "dns_label_error",
    "group_attributes",
    "group_device_name",
    "mdev_attributes",
    "mdev_device_name",
    "pci_attributes",
    "pci_device_name",
]

# The keys KubeVirt 1.9 reads (pkg/dra/metadata: PCIBusIDAttribute, MDevUUIDAttribute).
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
MDEV_UUID = "mdevUUID"
# dp's own, in the driver's domain.
RESOURCE_NAME = "resourceName"
VENDOR_ID = "vendorID"
DEVICE_ID = "deviceID"
CLASS_ID = "classID"
NUMA_NODE = "numaNode"
IOMMU_GROUP = "iommuGroup"
PF_PCI_BUS_ID = "pfPciBusID"
PARENT_PCI_BUS_ID = "parentPciBusID"
MDEV_TYPE = "mdevType"
# A device standing for a whole IOMMU group: its `resourceName`, which no
# device-plugin resource has, so a DeviceClass that selects a resource's
# devices never selects it; what it holds, and the resource of its lead.
GROUP_RESOURCE = "iommu-group"
LEAD_RESOURCE_NAME = "leadResourceName"
MEMBERS = "members"
MEMBER_COUNT = "memberCount"

Attributes = tuple[tuple[str, AttributeValue], ...]

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DNS_LABEL_MAX = 63
_DOMAIN_MAX = 63
_ID_MAX = 32


def dns_label_error(name: str) -> str | None:
    """Why `name` is not a DNS label (RFC 1123, as Kubernetes checks it), or None."""
    if len(name) > _DNS_LABEL_MAX:
        return f"{name!r} is longer than {_DNS_LABEL_MAX} characters"
    if not _DNS_LABEL.fullmatch(name):
        return f"{name!r} is not a DNS label (lower-case letters, digits and '-')"
    return None


def attribute_name_error(name: str) -> str | None:
    """Why `name` is not a device attribute's `QualifiedName`, or None."""
    domain, slash, identifier = name.rpartition("/")
    if slash and (not domain or len(domain) > _DOMAIN_MAX or not _DNS_SUBDOMAIN.fullmatch(domain)):
        return f"attribute {name!r}: {domain!r} is not a DNS subdomain of at most {_DOMAIN_MAX}"
    if len(identifier) > _ID_MAX or not _C_IDENTIFIER.fullmatch(identifier):
        return f"attribute {name!r}: {identifier!r} is not a C identifier of at most {_ID_MAX}"
    return None


def pci_device_name(address: PciAddress) -> str:
    """`0000:3b:00.0` -> `pci-0000-3b-00-0`."""
    return f"pci-{address.domain:04x}-{address.bus:02x}-{address.slot:02x}-{address.function:x}"


def group_device_name(group: int) -> str:
    """IOMMU group 93 -> `iommu-group-93`."""
    return f"iommu-group-{group}"


def mdev_device_name(uuid: str) -> str | None:
    """`mdev-<uuid>` in lower case, or None when the UUID cannot make a DNS label."""
    name = f"mdev-{uuid.lower()}"
    return None if dns_label_error(name) else name


def _hex(value: int, digits: int) -> str:
    return f"{value:0{digits}x}"


def _checked(pairs: list[tuple[str, AttributeValue]]) -> tuple[Attributes, tuple[str, ...]]:
    """The pairs the API accepts, sorted by name, and why any other was left out."""
    kept: list[tuple[str, AttributeValue]] = []
    problems: list[str] = []
    for name, value in pairs:
        error = attribute_name_error(name)
        if error is None and isinstance(value, str) and len(value) > MAX_ATTRIBUTE_VALUE_LENGTH:
            error = (
                f"attribute {name!r}: {value!r} is longer than "
                f"{MAX_ATTRIBUTE_VALUE_LENGTH} characters"
            )
        if error is not None:
            problems.append(f"{error}; left out")
            continue
        kept.append((name, value))
    if len(kept) > MAX_ATTRIBUTES_AND_CAPACITIES:
        dropped = [name for name, _ in kept[MAX_ATTRIBUTES_AND_CAPACITIES:]]
        problems.append(f"more than {MAX_ATTRIBUTES_AND_CAPACITIES} attributes; left out {dropped}")
        kept = kept[:MAX_ATTRIBUTES_AND_CAPACITIES]
    return tuple(sorted(kept, key=lambda pair: pair[0])), tuple(problems)


def _common(
    pci: PciDevice | None, resource_name: str, numa: int | None, group: int | None
) -> list[tuple[str, AttributeValue]]:
    pairs: list[tuple[str, AttributeValue]] = [(RESOURCE_NAME, resource_name)]
    if pci is not None:
        pairs += [
            (VENDOR_ID, _hex(pci.vendor, 4)),
            (DEVICE_ID, _hex(pci.device, 4)),
            (CLASS_ID, _hex(pci.class_code, 6)),
        ]
    if numa is not None:
        pairs.append((NUMA_NODE, numa))
    if group is not None:
        pairs.append((IOMMU_GROUP, group))
    return pairs


def pci_attributes(pci: PciDevice, resource_name: str) -> tuple[Attributes, tuple[str, ...]]:
    """A PCI function's attributes, and why any was left out."""
    pairs = _common(pci, resource_name, pci.numa_node, pci.iommu_group)
    pairs.insert(0, (PCI_BUS_ID, str(pci.address)))
    if pci.physfn is not None:
        pairs.append((PF_PCI_BUS_ID, str(pci.physfn)))
    return _checked(pairs)


def group_attributes(
    lead: PciDevice, lead_resource: str, members: tuple[PciAddress, ...]
) -> tuple[Attributes, tuple[str, ...]]:
    """A whole group's attributes: its lead function's PCI address (what KubeVirt
    reads), IDs and NUMA node, so a selector written for a function finds every
    attribute it names, with `resourceName` `iommu-group`; the lead's resource
    name; and the members, by address (left out past 64 characters) and count."""
    pairs = _common(lead, GROUP_RESOURCE, lead.numa_node, lead.iommu_group)
    pairs.insert(0, (PCI_BUS_ID, str(lead.address)))
    pairs += [(LEAD_RESOURCE_NAME, lead_resource), (MEMBER_COUNT, len(members))]
    pairs.append((MEMBERS, ",".join(str(m) for m in members)))
    return _checked(pairs)


def mdev_attributes(
    mdev: MdevDevice, snapshot: HostSnapshot, resource_name: str
) -> tuple[Attributes, tuple[str, ...]]:
    """An mdev's attributes (the parent's IDs and NUMA node), and why any was left out.

    A parent that is no PCI function (a virtual device, as the kernel's sample
    drivers and s390's vfio-ap have) gives no IDs, NUMA node or bus ID.
    """
    address = mdev.parent_address
    parent = None if address is None else snapshot.device(address)
    numa = parent.numa_node if parent is not None else None
    pairs = _common(parent, resource_name, numa, mdev.iommu_group)
    pairs += [(MDEV_UUID, mdev.uuid), (MDEV_TYPE, mdev.type_id)]
    if address is not None:
        pairs.append((PARENT_PCI_BUS_ID, str(address)))
    return _checked(pairs)
