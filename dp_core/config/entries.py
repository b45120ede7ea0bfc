"""The entries of KubeVirt's `permittedHostDevices`: which PCI functions and
mdev types the operator selected, under which resource name, on which front
end, and whether dp or another plugin serves them.

`FrontendName` and its values live here because an entry's `frontend` says
which front end offers its devices; `Config` checks the entries against its
`dra` section (`config`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import attrs

from ..host.pci import PciId
from .errors import ConfigError, optional_resource_name

__all__ = [
    "ANOTHER_PLUGIN_SERVES",
    "DEVICE_PLUGIN",
    "DRA",
    "FRONTENDS",
    "VIRT_HANDLER_SERVES",
    "FrontendName",
    "MediatedDevice",
    "PciHostDevice",
    "PermittedHostDevices",
]


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
    resource_name: str | None = attrs.field(default=None, validator=optional_resource_name)
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
    resource_name: str | None = attrs.field(default=None, validator=optional_resource_name)
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
