"""The one inventory: what each front end offers, device class by device class.

`build_inventory` reads the host and the config once per change and labels
every resource with its front end; `classes` holds what differs between
device classes as data; `edits` what a container is given for a device.
"""

from .advertised import AdvertisedDevice, SkippedDevice
from .build import build_inventory, shared_groups
from .classes import CLASSES, DeviceClass, DeviceKind
from .edits import ContainerAllocation, DeviceSpec, container_allocation
from .readers import OFFERED_BY_DRA, mdev_resource_suffix
from .resources import Inventory, Resource
from .vfio import VFIO_CONTAINER, VFIO_PERMISSIONS, CdevState, cdev_state

__all__ = [
    "CLASSES",
    "OFFERED_BY_DRA",
    "VFIO_CONTAINER",
    "VFIO_PERMISSIONS",
    "AdvertisedDevice",
    "CdevState",
    "ContainerAllocation",
    "DeviceClass",
    "DeviceKind",
    "DeviceSpec",
    "Inventory",
    "Resource",
    "SkippedDevice",
    "build_inventory",
    "cdev_state",
    "container_allocation",
    "mdev_resource_suffix",
    "shared_groups",
]
