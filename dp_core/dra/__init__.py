"""The DRA front end (docs/design.md §10): ResourceSlices and
NodePrepareResources for every resource labelled `dra`, on the same ledger.

`frontend` holds its state and handles its inputs; `pool` what the node's
pool offers; `names` its devices' names and attributes; `claims`, `prepared`
and `metadata` what a claim is, what it was prepared with and what its
containers are given; `watch` what the kubelet's health streams are sent;
`features` which DRA features the pool uses; `slices` a pool's content as values.
"""

from .claims import ClaimHold, ClaimRef, PreparedDevice
from .effects import (
    ClaimAnswered,
    ClaimPrepared,
    ClaimRefused,
    ClaimsChanged,
    ClaimUnprepared,
    DraEffect,
    PoolChanged,
    PublishHealth,
)
from .frontend import DraFrontend
from .health import DeviceHealth, Health
from .inputs import (
    AllocatedDevice,
    ClaimFilesRemoved,
    ClaimFilesWritten,
    ClaimPrepareRequested,
    ClaimsRecalled,
    ClaimUnprepareRequested,
    DraFeaturesObserved,
    DraInput,
    HealthWatchEnded,
    HealthWatchStarted,
)
from .pool import DraDevice, dra_catalogue
from .pool_content import PoolContent
from .prepared import ClaimDevice, PreparedClaim

__all__ = [
    "AllocatedDevice",
    "ClaimAnswered",
    "ClaimDevice",
    "ClaimFilesRemoved",
    "ClaimFilesWritten",
    "ClaimHold",
    "ClaimPrepareRequested",
    "ClaimPrepared",
    "ClaimRef",
    "ClaimRefused",
    "ClaimUnprepareRequested",
    "ClaimUnprepared",
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
    "dra_catalogue",
]
