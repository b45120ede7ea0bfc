"""What the operator asked for: which devices to serve, under which names.

These classes validate themselves at construction; reading YAML into them is
the shell's job (dp_server.config.loader), so a plugin author can build a
`Config` in code just as well.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Literal

import attrs

from ..host.pci import PciId
from ..host.snapshot import VFIO_DRIVER
from .names import DEFAULT_DOMAIN, env_var_name, resource_name_error

__all__ = [
    "DEFAULT_SHARED_DEVICES",
    "DEVICE_PLUGIN",
    "DRA",
    "FRONTENDS",
    "Binding",
    "Config",
    "ConfigError",
    "DRA_FEATURE_SETTINGS",
    "Dra",
    "DraFeatureSetting",
    "FrontendName",
    "MediatedDevice",
    "Naming",
    "PciHostDevice",
    "PermittedHostDevices",
    "SharedDevice",
    "VFIO_INTERFACES",
    "ANOTHER_PLUGIN_SERVES",
    "VIRT_HANDLER_SERVES",
    "Vfio",
    "VfioInterface",
    "driver_name_error",
]


class ConfigError(ValueError):
    """A config value the server cannot use; the message names the value."""


def _valid_resource_name(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    error = resource_name_error(value)
    if error is not None:
        raise ConfigError(error)


def _optional_resource_name(
    instance: object, attribute: attrs.Attribute[str | None], value: str | None
) -> None:
    if value is not None:
        _valid_resource_name(instance, attribute, value)  # type: ignore[arg-type]


# Which front end offers an entry's devices: the kubelet's device-plugin API,
# or DRA (ResourceSlices and NodePrepareResources) when `dra` is configured.
FrontendName = Literal["device-plugin", "dra"]
DEVICE_PLUGIN: FrontendName = "device-plugin"
DRA: FrontendName = "dra"
FRONTENDS: tuple[FrontendName, ...] = (DEVICE_PLUGIN, DRA)


def _check_frontend(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if value not in FRONTENDS:
        raise ConfigError(f"{value!r} is not one of {', '.join(repr(f) for f in FRONTENDS)}")


def _check_entry_frontend(entry: PciHostDevice | MediatedDevice) -> None:
    if entry.frontend == DRA and entry.virt_handler_serves:
        raise ConfigError(
            "frontend: dra and externalResourceProvider: false contradict each other: "
            "KubeVirt's virt-handler serves the device"
        )


class _ServedBy:
    """Who serves an entry's devices, by KubeVirt's `externalResourceProvider`.

    In KubeVirt (virt-handler's device manager, pkg/virt-handler/device-manager)
    `true` means virt-handler leaves the devices to an outside device plugin,
    such as dp; `false`, KubeVirt's default, means virt-handler serves them
    itself. An entry of dp's own config that does not say is dp's: dp's config
    lists what dp serves. The KubeVirt CR form reads an absent flag as KubeVirt
    does, as `false` (dp_server.config.loader).
    """

    __slots__ = ()
    external_resource_provider: bool | None
    another_plugin: bool

    @property
    def virt_handler_serves(self) -> bool:
        """Whether KubeVirt's virt-handler serves these devices, so dp must not."""
        return self.external_resource_provider is False

    @property
    def not_served_because(self) -> str | None:
        """Why dp leaves the entry to another plugin; None when dp serves it."""
        if self.virt_handler_serves:
            return VIRT_HANDLER_SERVES
        if self.another_plugin:
            return ANOTHER_PLUGIN_SERVES
        return None

    @property
    def served_because(self) -> str:
        """Why dp serves the entry, or why it leaves it to another plugin."""
        if self.external_resource_provider is None:
            return "dp's config lists it"
        return self.not_served_because or (
            "externalResourceProvider is true: KubeVirt leaves it to an outside plugin"
        )


# Why dp leaves an entry alone: two plugins must not register one resource name.
VIRT_HANDLER_SERVES = (
    "externalResourceProvider is false (KubeVirt's default): virt-handler serves it"
)
# An entry a KubeVirt CR leaves to outside plugins that dp was not told to serve
# (`dp-server --kubevirt-resources`): another outside plugin, such as NVIDIA's
# GPU operator, serves it.
ANOTHER_PLUGIN_SERVES = (
    "externalResourceProvider is true, but --kubevirt-resources does not name it: "
    "another outside plugin serves it"
)


@attrs.frozen
class PciHostDevice(_ServedBy):
    """KubeVirt's `permittedHostDevices.pciHostDevices[]` entry."""

    pci_vendor_selector: PciId
    resource_name: str | None = attrs.field(default=None, validator=_optional_resource_name)
    external_resource_provider: bool | None = None
    frontend: FrontendName = attrs.field(default=DEVICE_PLUGIN, validator=_check_frontend)
    # Set by the KubeVirt CR reader alone, never written in a config.
    another_plugin: bool = attrs.field(default=False, kw_only=True)

    def __attrs_post_init__(self) -> None:
        _check_entry_frontend(self)


@attrs.frozen
class MediatedDevice(_ServedBy):
    """KubeVirt's `permittedHostDevices.mediatedDevices[]` entry."""

    mdev_name_selector: str = attrs.field()
    resource_name: str | None = attrs.field(default=None, validator=_optional_resource_name)
    external_resource_provider: bool | None = None
    frontend: FrontendName = attrs.field(default=DEVICE_PLUGIN, validator=_check_frontend)
    # Set by the KubeVirt CR reader alone, never written in a config.
    another_plugin: bool = attrs.field(default=False, kw_only=True)

    @mdev_name_selector.validator
    def _check_selector(self, attribute: attrs.Attribute[str], value: str) -> None:
        if not value.strip():
            raise ConfigError(f"{value!r} is empty; give an mdev type name such as 'GRID T4-1Q'")

    def __attrs_post_init__(self) -> None:
        _check_entry_frontend(self)


# attrs' mypy plugin cannot type a generic converter, so each field gets its own.
def _pci_entries(value: Iterable[PciHostDevice]) -> tuple[PciHostDevice, ...]:
    return tuple(value)


def _mdev_entries(value: Iterable[MediatedDevice]) -> tuple[MediatedDevice, ...]:
    return tuple(value)


def _shared_entries(value: Iterable[SharedDevice]) -> tuple[SharedDevice, ...]:
    return tuple(value)


@attrs.frozen
class PermittedHostDevices:
    pci_host_devices: tuple[PciHostDevice, ...] = attrs.field(default=(), converter=_pci_entries)
    mediated_devices: tuple[MediatedDevice, ...] = attrs.field(default=(), converter=_mdev_entries)

    def __attrs_post_init__(self) -> None:
        seen: set[PciId] = set()
        for entry in self.pci_host_devices:
            if entry.pci_vendor_selector in seen:
                raise ConfigError(
                    f"pciVendorSelector {str(entry.pci_vendor_selector).upper()!r} is listed twice"
                )
            seen.add(entry.pci_vendor_selector)
        mdev_names: set[str] = set()
        for mdev in self.mediated_devices:
            if mdev.mdev_name_selector in mdev_names:
                raise ConfigError(f"mdevNameSelector {mdev.mdev_name_selector!r} is listed twice")
            mdev_names.add(mdev.mdev_name_selector)


_PERMISSION_LETTERS = frozenset("rwm")


@attrs.frozen
class SharedDevice:
    """A character device handed to any number of containers, like `/dev/kvm`."""

    resource_name: str = attrs.field(validator=_valid_resource_name)
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


@attrs.frozen
class Config:
    """The whole server config.

    `permitted_host_devices` of None means no selector was given: every PCI
    function already bound to vfio-pci is served under a derived name, and
    nothing is ever rebound.
    """

    permitted_host_devices: PermittedHostDevices | None = None
    shared_devices: tuple[SharedDevice, ...] = attrs.field(
        default=DEFAULT_SHARED_DEVICES, converter=_shared_entries
    )
    naming: Naming = Naming()
    binding: Binding | None = None
    vfio: Vfio = Vfio()
    dra: Dra | None = None

    def __attrs_post_init__(self) -> None:
        self._check_frontends()
        if self.binding is not None and (
            self.permitted_host_devices is None or not self.permitted_host_devices.pci_host_devices
        ):
            raise ConfigError(
                "binding needs permittedHostDevices.pciHostDevices: only devices a selector "
                "names are ever rebound"
            )
        names = [d.resource_name for d in self.shared_devices]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigError(f"shared device {duplicates[0]!r} is listed twice")
        if self.permitted_host_devices is None:
            return
        pci_names = {
            e.resource_name for e in self.permitted_host_devices.pci_host_devices if e.resource_name
        }
        mdev_names = {
            e.resource_name for e in self.permitted_host_devices.mediated_devices if e.resource_name
        }
        for clash in sorted((pci_names & mdev_names) | ((pci_names | mdev_names) & set(names))):
            raise ConfigError(f"resource {clash!r} is named for two kinds of device")
        # KubeVirt's env var names fold '/' and '.' to '_', so two names can
        # collide, and the kubelet keeps only one of two equal env keys.
        seen: dict[str, str] = {}
        for name in sorted(pci_names | mdev_names):
            folded = env_var_name("", name)
            if folded in seen:
                raise ConfigError(
                    f"resources {seen[folded]!r} and {name!r} would share the env var "
                    f"suffix {folded!r}"
                )
            seen[folded] = name

    def _check_frontends(self) -> None:
        if self.permitted_host_devices is None:
            return
        entries: tuple[PciHostDevice | MediatedDevice, ...] = (
            *self.permitted_host_devices.pci_host_devices,
            *self.permitted_host_devices.mediated_devices,
        )
        if self.dra is None:
            lists: tuple[tuple[str, tuple[PciHostDevice | MediatedDevice, ...]], ...] = (
                ("pciHostDevices", self.permitted_host_devices.pci_host_devices),
                ("mediatedDevices", self.permitted_host_devices.mediated_devices),
            )
            for key, listed in lists:
                for index, entry in enumerate(listed):
                    if entry.frontend == DRA:
                        raise ConfigError(
                            f"permittedHostDevices.{key}[{index}].frontend is dra, which "
                            "needs the dra section with its driverName"
                        )
        fronts: dict[str, set[str]] = {}
        for entry in entries:
            if entry.resource_name:
                fronts.setdefault(entry.resource_name, set()).add(entry.frontend)
        for name, used in sorted(fronts.items()):
            if len(used) > 1:
                raise ConfigError(
                    f"resource {name!r} is on both front ends: a device is offered by one"
                )

    def pci_selectors(self) -> dict[tuple[int, int], PciHostDevice]:
        """(vendor, device) -> the pciHostDevices entry selecting it; selectors are unique.

        Keyed by a plain tuple, which hashes far faster than a PciId, for
        lookups of every function on a large host.
        """
        if self.permitted_host_devices is None:
            return {}
        return {
            (e.pci_vendor_selector.vendor, e.pci_vendor_selector.device): e
            for e in self.permitted_host_devices.pci_host_devices
        }

    @property
    def enabled_shared_devices(self) -> tuple[SharedDevice, ...]:
        return tuple(d for d in self.shared_devices if d.enabled)
