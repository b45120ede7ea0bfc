"""The device-plugin front end: the kubelet's device-plugin API (docs/design.md
§3-§5) for every resource labelled `device-plugin`.

`frontend` holds its state and handles its inputs; `registration` is
registration and one-socket attribution, through the table of registration
phases in `phases`; `calls` the answers to the kubelet's calls; `allocations`
its holds on the ledger; `sync` whether PodResources can be trusted yet;
`checkpoint` what the kubelet's own checkpoint says; `notices` what the
shell hears of its state by change, and `view` what monitoring reads of it.
"""

from .allocations import Allocation, AllocationBook, UnlistedHold, allocation_log
from .answers import (
    AllocateAnswer,
    Answer,
    ContainerAllocation,
    DeviceSpec,
    PluginOptions,
    PreferredAnswer,
    PreStartAnswer,
)
from .checkpoint import CheckpointEntry, KubeletCheckpoint
from .effects import (
    AttributeConnection,
    DevicePluginEffect,
    EndStream,
    HealthChanged,
    KubeletCheckpointWanted,
    Publish,
    RefreshAllocations,
    Register,
    RegistrationsSettled,
    Reject,
    Reply,
)
from .endpoints import NAME_MAX, endpoint_name, min_endpoint_length
from .frontend import DevicePluginFrontend
from .inputs import (
    AllocateRequested,
    AllocationsObserved,
    ConnectionClosed,
    ConnectionOpened,
    ContainerPreference,
    DevicePluginInput,
    KubeletCheckpointObserved,
    KubeletStarted,
    KubeletStopped,
    OptionsRequested,
    PreferredAllocationRequested,
    PreStartRequested,
    RegistrationFailed,
    RegistrationSucceeded,
    WatchEnded,
    WatchStarted,
)
from .preferred import preferred_devices
from .registration import Phase, Registrar, SocketMode
from .sync import SyncPhase
from .view import DevicePluginView

__all__ = [
    "NAME_MAX",
    "AllocateAnswer",
    "AllocateRequested",
    "Allocation",
    "AllocationBook",
    "AllocationsObserved",
    "Answer",
    "AttributeConnection",
    "CheckpointEntry",
    "ConnectionClosed",
    "ConnectionOpened",
    "ContainerAllocation",
    "ContainerPreference",
    "DeviceSpec",
    "DevicePluginEffect",
    "DevicePluginFrontend",
    "DevicePluginInput",
    "DevicePluginView",
    "EndStream",
    "HealthChanged",
    "KubeletCheckpoint",
    "KubeletCheckpointObserved",
    "KubeletCheckpointWanted",
    "KubeletStarted",
    "KubeletStopped",
    "OptionsRequested",
    "Phase",
    "PluginOptions",
    "PreStartAnswer",
    "PreStartRequested",
    "PreferredAllocationRequested",
    "PreferredAnswer",
    "Publish",
    "RefreshAllocations",
    "Register",
    "Registrar",
    "RegistrationFailed",
    "RegistrationSucceeded",
    "RegistrationsSettled",
    "Reject",
    "Reply",
    "SocketMode",
    "SyncPhase",
    "UnlistedHold",
    "WatchEnded",
    "WatchStarted",
    "allocation_log",
    "endpoint_name",
    "min_endpoint_length",
    "preferred_devices",
]
