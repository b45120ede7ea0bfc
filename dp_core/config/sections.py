"""The config's sections besides the device entries: the shared character
devices (`SharedDevice`), how PCI resources are named (`Naming`), which VFIO
interface containers get (`Vfio`), the DRA front end (`Dra`) and which
devices dp may move to vfio-pci (`Binding`).

Each is a value type that validates itself at construction; none depends on
another, and `Config` (`config`) checks them against the entries.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Literal

import attrs

from ..host.snapshot import VFIO_DRIVER
from .errors import ConfigError, valid_resource_name
from .names import DEFAULT_DOMAIN, resource_name_error

__all__ = [
    "DEFAULT_SHARED_DEVICES",
    "DRA_FEATURE_SETTINGS",
    "VFIO_INTERFACES",
    "Binding",
    "Dra",
    "DraFeatureSetting",
    "Naming",
    "SharedDevice",
    "Vfio",
    "VfioInterface",
    "driver_name_error",
]


_PERMISSION_LETTERS = frozenset("rwm")


@attrs.frozen
class SharedDevice:
    """A character device handed to any number of containers, like `/dev/kvm`."""

    resource_name: str = attrs.field(validator=valid_resource_name)
    path: str = attrs.field()
    count: int = attrs.field(default=110)
    permissions: str = attrs.field(default="rw")
    enabled: bool = True

    @path.validator
    def _check_path(self, attribute: attrs.Attribute[str], value: str) -> None:
        name = value.removeprefix("/dev/")
        if not value.startswith("/dev/") or not name.strip("/") or ".." in name.split("/"):
            raise ConfigError(f"{value!r} is not an absolute path under /dev/")

    @count.validator
    def _check_count(self, attribute: attrs.Attribute[int], value: int) -> None:
        # The kubelet reads at most 4 MiB per ListAndWatch message.
        if isinstance(value, bool) or not 1 <= value <= 10_000:
            raise ConfigError(f"{value!r} is not a count between 1 and 10000")

    @permissions.validator
    def _check_permissions(self, attribute: attrs.Attribute[str], value: str) -> None:
        if not value or not set(value) <= _PERMISSION_LETTERS:
            raise ConfigError(f"{value!r} is not one or more of the letters r, w, m")


# The devices KubeVirt's virt-handler advertises on every node (1000 of each;
# dp's default count is 110, the kubelet's default pod limit).
DEFAULT_SHARED_DEVICES: tuple[SharedDevice, ...] = (
    SharedDevice("devices.kubevirt.io/kvm", "/dev/kvm"),
    SharedDevice("devices.kubevirt.io/tun", "/dev/net/tun"),
    SharedDevice("devices.kubevirt.io/vhost-net", "/dev/vhost-net"),
)


@attrs.frozen
class Naming:
    """How PCI resources are named when the config gives no resourceName."""

    source: Literal["vendor-device", "pci-ids"] = attrs.field(default="vendor-device")
    domain: str = attrs.field(default=DEFAULT_DOMAIN)
    pci_ids_path: str | None = None

    @source.validator
    def _check_source(self, attribute: attrs.Attribute[str], value: str) -> None:
        if value not in ("vendor-device", "pci-ids"):
            raise ConfigError(f"{value!r} is not one of 'vendor-device', 'pci-ids'")

    @domain.validator
    def _check_domain(self, attribute: attrs.Attribute[str], value: str) -> None:
        error = resource_name_error(f"{value}/x")
        if error is not None:
            raise ConfigError(f"{value!r} is not a usable resource domain: {error}")


VfioInterface = Literal["group", "group+cdev", "iommufd"]
VFIO_INTERFACES: tuple[VfioInterface, ...] = ("group", "group+cdev", "iommufd")


@attrs.frozen
class Vfio:
    """Which VFIO interface a container is given for a PCI device or an mdev (docs/design.md §9).

    - `group`: `/dev/vfio/vfio` and `/dev/vfio/<group>`, the legacy interface;
    - `group+cdev` (the default, what KubeVirt 1.9's own plugin gives): the
      group nodes, plus `/dev/vfio/devices/vfioN` of each function whose node
      exists;
    - `iommufd`: `/dev/iommu` and `/dev/vfio/devices/vfioN` only, for
      consumers that open iommufd themselves (Kata; NVIDIA's plugin with
      iommufd on).

    A device is Healthy only while every node it would be given exists. An
    mdev is given its nodes by the same rule: it is a VFIO device of its own,
    in a group of its own, with a character device of its own.
    """

    interface: VfioInterface = attrs.field(default="group+cdev")

    @interface.validator
    def _check_interface(self, attribute: attrs.Attribute[str], value: str) -> None:
        if value not in VFIO_INTERFACES:
            choices = ", ".join(repr(choice) for choice in VFIO_INTERFACES)
            raise ConfigError(f"{value!r} is not one of {choices}")


_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


# Whether the cluster has a DRA feature: "auto" learns it from what the API
# server keeps of a ResourceSlice dp writes; true or false is the operator's word.
DraFeatureSetting = Literal["auto"] | bool
DRA_FEATURE_SETTINGS: tuple[DraFeatureSetting, ...] = ("auto", True, False)


def _check_feature_setting(
    instance: object, attribute: attrs.Attribute[DraFeatureSetting], value: DraFeatureSetting
) -> None:
    if value != "auto" and not isinstance(value, bool):
        raise ConfigError(f"{value!r} is not auto, true or false")


@attrs.frozen
class Dra:
    """The DRA front end (docs/design.md §10), on when a config has this section.

    `driver_name` names the driver in ResourceSlices, claims and the kubelet's
    plugin registry: a DNS subdomain of at most 63 characters (the API's
    DriverNameMaxLength), such as `vfio.dp.example.com`.

    `partitionable_devices` (shared counters, KEP-4815) and `device_taints`
    (KEP-5055) say whether the cluster has those features; "auto" (the
    default) starts as if it had and follows what the API server keeps of
    the slices dp writes (`dra.features`).
    """

    driver_name: str = attrs.field()
    partitionable_devices: DraFeatureSetting = attrs.field(
        default="auto", validator=_check_feature_setting
    )
    device_taints: DraFeatureSetting = attrs.field(default="auto", validator=_check_feature_setting)

    @driver_name.validator
    def _check_driver_name(self, attribute: attrs.Attribute[str], value: str) -> None:
        if len(value) > 63 or not _DNS_SUBDOMAIN.fullmatch(value):
            raise ConfigError(
                f"{value!r} is not a DNS subdomain of at most 63 characters "
                "(lower-case letters, digits, '-' and '.'), such as 'vfio.dp.example.com'"
            )


# Linux driver names are short identifiers; anything else in a config is a typo
# or a path, and must never reach a sysfs path the server writes to.
_DRIVER_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def driver_name_error(name: object) -> str | None:
    """Why `name` cannot be a driver dp takes a device from, or None."""
    if not isinstance(name, str) or not _DRIVER_NAME.match(name) or name in (".", ".."):
        return f"{name!r} is not a kernel driver name such as 'nouveau'"
    if name == VFIO_DRIVER:
        return f"{name!r} is where devices are moved to, not from"
    return None


def _driver_names(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


@attrs.frozen
class Binding:
    """Which selected devices the server may move to vfio-pci itself (docs/design.md §6).

    Without a `Binding` the server never writes to sysfs. With one, a selected
    function held by one of `replace_drivers` (or, with `bind_unbound`, held by
    no driver) is moved to vfio-pci, unless a safety rule refuses it
    (`dp_core.binding`). Devices no selector names are never touched.
    """

    replace_drivers: tuple[str, ...] = attrs.field(default=(), converter=_driver_names)
    bind_unbound: bool = False

    @replace_drivers.validator
    def _check_drivers(
        self, attribute: attrs.Attribute[tuple[str, ...]], value: tuple[str, ...]
    ) -> None:
        for name in value:
            error = driver_name_error(name)
            if error is not None:
                raise ConfigError(error)
        repeated = sorted(name for name in value if value.count(name) > 1)
        if repeated:
            raise ConfigError(f"{repeated[0]!r} is listed twice")
