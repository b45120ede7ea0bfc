"""The DRA front end (docs/design.md §10): ResourceSlices and
NodePrepareResources for every resource labelled `dra`, on the same ledger.

`frontend` holds its state and handles its inputs; `lifecycle` a claim's
life on the node (read, prepared, its files, unprepared); `pool` what the
node's pool offers; `names` its devices' names and attributes; `claims`, `prepared`
and `metadata` what a claim is, what it was prepared with and what its
containers are given; `watch` what the kubelet's health streams are sent;
`features` which DRA features the pool uses; `slices` a pool's content as values.
"""

from .claims import ClaimHold, ClaimRef, PreparedDevice
from .deviceclasses import DraDeviceClass, device_class_name, device_classes
from .effects import (
    ClaimAnswered,
    ClaimPrepared,
    ClaimRefused,
    ClaimsChanged,
    ClaimUnprepared,
    DraEffect,
    PoolChanged,
    PublishHealth,
    ReadClaim,
)
from .extended import EXTENDED_RESOURCE_CLAIM_ANNOTATION, request_envs
from .frontend import DraFrontend
from .health import DeviceHealth, Health
from .inputs import (
    AllocatedDevice,
    ClaimFilesRemoved,
    ClaimFilesWritten,
    ClaimPrepareRequested,
    ClaimRead,
    ClaimsRecalled,
    ClaimUnprepareRequested,
    ClaimUnreadable,
    DraFeaturesObserved,
    DraInput,
    HealthWatchEnded,
    HealthWatchStarted,
)
from .metadata import attribute_json, request_metadata
from .names import MEMBER_COUNT, MEMBERS, PCI_BUS_ID, Attributes
from .pool import DraDevice, dra_catalogue
from .pool_content import (
    MAX_COUNTER_SETS_PER_SLICE,
    MAX_DEVICES_PER_SLICE_ADVANCED,
    AttributeValue,
    CounterConsumption,
    CounterSet,
    DeviceTaint,
    PoolContent,
    PoolDevice,
    Version,
)
from .prepared import ClaimDevice, PreparedClaim

__all__ = [
    "DraDeviceClass",
    "device_class_name",
    "device_classes",
    "EXTENDED_RESOURCE_CLAIM_ANNOTATION",
    "request_envs",
    "AttributeValue",
    "CounterConsumption",
    "CounterSet",
    "DeviceTaint",
    "MAX_COUNTER_SETS_PER_SLICE",
    "MAX_DEVICES_PER_SLICE_ADVANCED",
    "PoolDevice",
    "Version",
    "Attributes",
    "MEMBERS",
    "MEMBER_COUNT",
    "PCI_BUS_ID",
    "attribute_json",
    "request_metadata",
    "AllocatedDevice",
    "ClaimAnswered",
    "ClaimDevice",
    "ClaimFilesRemoved",
    "ClaimFilesWritten",
    "ClaimHold",
    "ClaimPrepareRequested",
    "ClaimPrepared",
    "ClaimRead",
    "ClaimRef",
    "ClaimRefused",
    "ClaimUnprepareRequested",
    "ClaimUnprepared",
    "ClaimUnreadable",
    "ClaimsChanged",
    "ClaimsRecalled",
    "DeviceHealth",
    "DraDevice",
    "DraEffect",
    "DraFeaturesObserved",
    "DraFrontend",
    "DraInput",
    "Health",
    "HealthWatchEnded",
    "HealthWatchStarted",
    "PoolChanged",
    "PoolContent",
    "PreparedClaim",
    "PreparedDevice",
    "PublishHealth",
    "ReadClaim",
    "dra_catalogue",
]
