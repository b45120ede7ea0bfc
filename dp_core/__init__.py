"""dp_core: the pure state machine of a device-plugin server (no I/O)."""

from .config import (
    DEFAULT_SHARED_DEVICES,
    Config,
    ConfigError,
    MediatedDevice,
    Naming,
    PciHostDevice,
    PermittedHostDevices,
    SharedDevice,
)
from .host import VFIO_DRIVER, HostSnapshot, IommuGroup, MdevDevice, MdevType, ScanProblem
from .pci import PciAddress, PciDevice, PciId

__all__ = [
    "DEFAULT_SHARED_DEVICES",
    "VFIO_DRIVER",
    "Config",
    "ConfigError",
    "HostSnapshot",
    "IommuGroup",
    "MdevDevice",
    "MdevType",
    "MediatedDevice",
    "Naming",
    "PciAddress",
    "PciDevice",
    "PciHostDevice",
    "PciId",
    "PermittedHostDevices",
    "ScanProblem",
    "SharedDevice",
]
