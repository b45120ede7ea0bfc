"""What a DRA claim is to the core: its reference, the devices it was
prepared with, and its hold on the ledger.

The kubelet names a claim by namespace, name and UID in NodePrepareResources
and NodeUnprepareResources; a prepared claim is answered with the devices it
got, each named by pool and device as its ResourceSlice publishes them. A
prepared claim holds the IOMMU groups of its devices (`ClaimHold`) until it
is unprepared.
"""

from __future__ import annotations

from collections.abc import Hashable

import attrs

from ..config.config import DRA

__all__ = ["ClaimHold", "ClaimRef", "PreparedDevice"]


@attrs.frozen
class ClaimRef:
    """A ResourceClaim as the kubelet names it; the UID tells apart a claim made again."""

    namespace: str
    uid: str
    name: str

    @property
    def path(self) -> str:
        """`namespace/name`."""
        return f"{self.namespace}/{self.name}"

    def describe(self) -> str:
        """How messages name it: `namespace/name (UID uid)`."""
        return f"{self.path} (UID {self.uid})"


@attrs.frozen
class PreparedDevice:
    """One device of a prepared claim, as NodePrepareResources returns it.

    An empty `request_names` means the device serves every request of the claim.
    """

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]


@attrs.frozen
class ClaimHold:
    """A prepared claim's hold on the ledger: `device_ids` are devices of the
    DRA front end's pool (whose names are its `owner`'s, `dra`)."""

    claim: ClaimRef
    device_ids: tuple[str, ...]
    groups: tuple[int, ...]  # sorted, each once

    @property
    def key(self) -> Hashable:
        return ClaimHold.key_of(self.claim)

    @property
    def frontend(self) -> str:
        return DRA

    @staticmethod
    def key_of(claim: ClaimRef) -> Hashable:
        """The ledger's key of `claim`'s hold."""
        return ("claim", claim.uid)

    @property
    def owner(self) -> str:
        return DRA

    def describe(self) -> str:
        return f"claim {self.claim.describe()}"
