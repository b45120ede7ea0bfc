"""What the operator asked for: which devices to serve, under which names, on
which front end.

`config` holds the whole `Config`, `entries` the `permittedHostDevices`
entries and the front-end names, `sections` the other sections (shared
devices, naming, VFIO, DRA, binding), `errors` the `ConfigError` they raise,
and `names` the naming rules of resources.
"""

from .config import (
    ANOTHER_PLUGIN_SERVES,
    DEFAULT_SHARED_DEVICES,
    DEVICE_PLUGIN,
    DRA,
    DRA_FEATURE_SETTINGS,
    FRONTENDS,
    VFIO_INTERFACES,
    VIRT_HANDLER_SERVES,
    Binding,
    Config,
    ConfigError,
    Dra,
    DraFeatureSetting,
    FrontendName,
    MediatedDevice,
    Naming,
    PciHostDevice,
    PermittedHostDevices,
    SharedDevice,
    Vfio,
    VfioInterface,
    driver_name_error,
)
from .names import parse_pci_ids, resource_name_error

__all__ = [
    "parse_pci_ids",
    "resource_name_error",
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
