"""What a DRA claim is to the core: its reference, and the devices it was prepared with.

The kubelet names a claim by namespace, name and UID in NodePrepareResources
and NodeUnprepareResources; a prepared claim is answered with the devices it
got, each named by pool and device as its ResourceSlice publishes them.
"""

from __future__ import annotations

import attrs

__all__ = ["ClaimRef", "PreparedDevice"]


@attrs.frozen
class ClaimRef:
    """A ResourceClaim as the kubelet names it; the UID tells apart a claim made again."""

    namespace: str
    uid: str
    name: str


@attrs.frozen
class PreparedDevice:
    """One device of a prepared claim, as NodePrepareResources returns it.

    An empty `request_names` means the device serves every request of the claim.
    """

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
