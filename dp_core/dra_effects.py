"""What the DRA front end asks the shell to do, as frozen effects."""

from __future__ import annotations

import attrs

from .claims import ClaimRef
from .dra_health import DeviceHealth
from .dra_prepared import PreparedClaim
from .slices import PoolContent

__all__ = [
    "ClaimPrepared",
    "ClaimRefused",
    "ClaimUnprepared",
    "ClaimsChanged",
    "DraEffect",
    "PoolChanged",
    "PublishHealth",
]


@attrs.frozen
class ClaimPrepared:
    """Answer call `call` for its claim: write the claim's CDI spec and
    metadata (`dra_metadata`) and return its devices. The same claim prepared
    again gets an equal `prepared`."""

    call: int
    prepared: PreparedClaim


@attrs.frozen
class ClaimRefused:
    """Answer call `call` for `claim` with `error` in its own entry; nothing was held.

    `reason` says why in one CamelCase word, as a Kubernetes Event's reason:
    `IOMMUGroupHeld`, `DeviceUnhealthy`, `DeviceNotOffered`, `OtherPool` or
    `DriverOff`.
    """

    call: int
    claim: ClaimRef
    error: str
    reason: str = "Refused"


@attrs.frozen
class ClaimUnprepared:
    """Answer call `call` for `claim` without an error, and remove the claim's
    CDI spec and metadata. `prepared` is what was released, or None when the
    claim was not prepared here (unprepared already, or never)."""

    call: int
    claim: ClaimRef
    prepared: PreparedClaim | None


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
    ClaimPrepared | ClaimRefused | ClaimUnprepared | ClaimsChanged | PoolChanged | PublishHealth
)
