"""What the operator asked for: which devices to serve, under which names.

`Config` is the whole server config: the entries of `permittedHostDevices`
(`entries`) and the other sections (`sections`), checked against each other
here (names unique across kinds and front ends, `binding` only with PCI
selectors, `frontend: dra` only with the `dra` section). These classes
validate themselves at construction; reading YAML into them is the shell's
job (dp_server.config.loader), so a plugin author can build a `Config` in code
just as well.

The value types are re-exported here, where they were first defined, so
`dp_core.config.config` still names every one of them.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from .entries import (
    ANOTHER_PLUGIN_SERVES,
    DEVICE_PLUGIN,
    DRA,
    FRONTENDS,
    VIRT_HANDLER_SERVES,
    FrontendName,
    MediatedDevice,
    PciHostDevice,
    PermittedHostDevices,
)
from .errors import ConfigError
from .names import env_var_name
from .sections import (
    DEFAULT_SHARED_DEVICES,
    DRA_FEATURE_SETTINGS,
    VFIO_INTERFACES,
    Binding,
    Dra,
    DraFeatureSetting,
    Naming,
    SharedDevice,
    Vfio,
    VfioInterface,
    driver_name_error,
)

__all__ = [
    "ANOTHER_PLUGIN_SERVES",
    "DEFAULT_SHARED_DEVICES",
    "DEVICE_PLUGIN",
    "DRA",
    "DRA_FEATURE_SETTINGS",
    "FRONTENDS",
    "VFIO_INTERFACES",
    "VIRT_HANDLER_SERVES",
    "Binding",
    "Config",
    "ConfigError",
    "Dra",
    "DraFeatureSetting",
    "FrontendName",
    "MediatedDevice",
    "Naming",
    "PciHostDevice",
    "PermittedHostDevices",
    "SharedDevice",
    "Vfio",
    "VfioInterface",
    "driver_name_error",
]


# attrs' mypy plugin cannot type a generic converter, so each field gets its own.
def _shared_entries(value: Iterable[SharedDevice]) -> tuple[SharedDevice, ...]:
    return tuple(value)


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
