"""What the DRA front end asks the shell to do, as frozen effects."""

from __future__ import annotations

import attrs

from .claims import ClaimRef, PreparedDevice
from .health import DeviceHealth
from .pool_content import PoolContent
from .prepared import PreparedClaim

__all__ = [
    "ClaimAnswered",
    "ClaimPrepared",
    "ClaimRefused",
    "ClaimUnprepared",
    "ClaimsChanged",
    "DraEffect",
    "PoolChanged",
    "PublishHealth",
    "ReadClaim",
]


@attrs.frozen
class ReadClaim:
    """Call `call` waits for `claim` to be read from the API server: its
    allocation (`ClaimRead`) or why it cannot be had (`ClaimUnreadable`),
    fed with the same `call`. The core asks only for a claim it has not
    prepared."""

    call: int
    claim: ClaimRef


@attrs.frozen
class ClaimPrepared:
    """The claim of call `call` is prepared (its groups held): write its CDI
    specs and KEP-5304 metadata (`cdi.claims`, `metadata`), then feed
    `ClaimFilesWritten` with the same `call`. The same claim prepared again
    gets an equal `prepared`."""

    call: int
    prepared: PreparedClaim


@attrs.frozen
class ClaimRefused:
    """Answer call `call` for `claim` with `error` in its own entry; nothing was held.

    `reason` says why in one CamelCase word, as a Kubernetes Event's reason:
    `IOMMUGroupHeld`, `DeviceUnhealthy`, `DeviceNotOffered`, `OtherPool`,
    `DriverOff`, or `ClaimUnreadable` (the shell could not read the claim).
    """

    call: int
    claim: ClaimRef
    error: str
    reason: str = "Refused"


@attrs.frozen
class ClaimUnprepared:
    """`claim` is released (its groups are free): remove its CDI specs and
    metadata, then feed `ClaimFilesRemoved` with the same `call`. `prepared`
    is what was released, or None when the claim was not prepared here
    (unprepared already, or never)."""

    call: int
    claim: ClaimRef
    prepared: PreparedClaim | None


@attrs.frozen
class ClaimAnswered:
    """Answer call `call` for `claim`, once its files are in place or gone:
    `devices` for a prepared claim (each with its CDI IDs), or `error` when
    its files could not be written or removed (empty when all went well)."""

    call: int
    claim: ClaimRef
    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


@attrs.frozen
class ClaimsChanged:
    """The prepared claims changed; `prepared` is all of them now, sorted by UID.

    The shell keeps it in the state directory and hands it back with
    `ClaimsRecalled` when dp starts again.
    """

    prepared: tuple[PreparedClaim, ...]


@attrs.frozen
class PoolChanged:
    """The node's pool is now `content`: publish it as ResourceSlices."""

    content: PoolContent


@attrs.frozen
class PublishHealth:
    """Send `devices`, the health of every device of the driver, on health stream
    `stream`, as determined at `at` (the core's clock), for the kubelet to hold
    for `valid_for` seconds (`health_check_timeout_seconds`)."""

    stream: int
    devices: tuple[DeviceHealth, ...]
    at: float
    valid_for: int


DraEffect = (
    ReadClaim
    | ClaimPrepared
    | ClaimRefused
    | ClaimUnprepared
    | ClaimAnswered
    | ClaimsChanged
    | PoolChanged
    | PublishHealth
)
