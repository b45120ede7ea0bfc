"""The DeviceClass a cluster needs for each resource dp serves through DRA, from the config.

For each `frontend: dra` entry dp serves, one class:

- `extendedResourceName` is the name the device-plugin front end would
  advertise for the entry, so a pod (a KubeVirt launcher pod) that asks
  `resources.limits: {<name>: 1}` is served through DRA on a node that has
  the name at 0 allocatable (KEP-5004), and by the device plugin on a node
  that still offers it: the move from one front end to the other changes
  nothing in a VM's spec.
- Its selector takes exactly that resource's devices: the driver, and the
  `resourceName` attribute dp publishes for every function or mdev
  (`names.RESOURCE_NAME`, in the driver's domain). A whole-group device has
  `resourceName` `iommu-group`, so it is never selected: a pod asking for one
  T4 gets one function, as Allocate would give it.
- Its name is the resource's name folded to a DNS subdomain under the
  driver's: `nvidia.com/TU104GL_Tesla_T4` of `vfio.dp.example.com` is
  `tu104gl-tesla-t4.nvidia.com.vfio.dp.example.com`.

Written by dp from its own config (`dp-server device-classes`), so the classes
never drift from what dp publishes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import attrs

from ..config.config import DRA, Config, MediatedDevice, PciHostDevice
from ..config.names import default_pci_resource_name, pci_ids_resource_name
from ..host.pci import PciId
from ..inventory.readers import mdev_resource_suffix
from .names import RESOURCE_NAME

__all__ = ["DraDeviceClass", "device_class_name", "device_classes", "dra_resource_names"]

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_MAX_NAME = 253


@attrs.frozen
class DraDeviceClass:
    """One DeviceClass: its name, the extended resource it stands for, its CEL selector."""

    name: str
    extended_resource_name: str
    expression: str


def device_class_name(resource: str, driver: str) -> str:
    """`nvidia.com/TU104GL_Tesla_T4`, `vfio.dp.example.com` ->
    `tu104gl-tesla-t4.nvidia.com.vfio.dp.example.com`; ValueError when the
    name cannot be folded into a DNS subdomain."""
    domain, _, short = resource.partition("/")
    name = f"{short}.{domain}".lower().replace("_", "-") + f".{driver}"
    if len(name) > _MAX_NAME or not all(_DNS_LABEL.fullmatch(p) for p in name.split(".")):
        raise ValueError(
            f"resource {resource!r}: {name!r} is not a DNS subdomain of at most "
            f"{_MAX_NAME} characters, so it cannot name a DeviceClass"
        )
    return name


def _entry_name(
    entry: PciHostDevice | MediatedDevice, config: Config, pci_names: Mapping[PciId, str]
) -> str:
    if entry.resource_name:
        return entry.resource_name
    domain = config.naming.domain
    if isinstance(entry, MediatedDevice):
        return f"{domain}/{mdev_resource_suffix(entry.mdev_name_selector)}"
    if config.naming.source == "pci-ids":
        return pci_ids_resource_name(entry.pci_vendor_selector, pci_names, domain)
    return default_pci_resource_name(entry.pci_vendor_selector, domain)


def dra_resource_names(
    config: Config, pci_names: Mapping[PciId, str] | None = None
) -> tuple[str, ...]:
    """The names of the resources dp serves through DRA, in the config's order, each once."""
    permitted = config.permitted_host_devices
    if config.dra is None or permitted is None:
        return ()
    entries: tuple[PciHostDevice | MediatedDevice, ...] = (
        *permitted.pci_host_devices,
        *permitted.mediated_devices,
    )
    names: dict[str, None] = {}
    for entry in entries:
        if entry.frontend == DRA and entry.not_served_because is None:
            names[_entry_name(entry, config, pci_names or {})] = None
    return tuple(names)


def device_classes(
    config: Config, pci_names: Mapping[PciId, str] | None = None
) -> tuple[tuple[DraDeviceClass, ...], tuple[str, ...]]:
    """A class per resource dp serves through DRA, and why any could not be made."""
    if config.dra is None:
        return (), ("the config has no dra section: no resource is served through DRA",)
    driver = config.dra.driver_name
    found: list[DraDeviceClass] = []
    problems: list[str] = []
    by_name: dict[str, str] = {}
    for resource in dra_resource_names(config, pci_names):
        try:
            name = device_class_name(resource, driver)
        except ValueError as error:
            problems.append(str(error))
            continue
        if name in by_name:
            problems.append(
                f"resources {by_name[name]!r} and {resource!r} would both name DeviceClass "
                f"{name!r}; rename one of them"
            )
            continue
        by_name[name] = resource
        expression = (
            f'device.driver == "{driver}" && '
            f'device.attributes["{driver}"].{RESOURCE_NAME} == "{resource}"'
        )
        found.append(DraDeviceClass(name, resource, expression))
    return tuple(found), tuple(problems)
