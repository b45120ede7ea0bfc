"""Whoever holds IOMMU groups in the ledger, as the ledger sees it: nothing
more than whose device names it holds, which groups, and how to name it.

Each front end has its own kind of holder (a device-plugin allocation, a
group held while the kubelet syncs, a DRA claim); the ledger never looks
further, so it knows no front end.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["Holder", "holds"]


class Holder(Protocol):
    @property
    def owner(self) -> str:
        """Whose names `device_ids` are: a device-plugin resource, a DRA driver's pool."""
        ...

    @property
    def device_ids(self) -> tuple[str, ...]:
        """The devices it holds, by `owner`'s names."""
        ...

    @property
    def groups(self) -> tuple[int, ...]:
        """The IOMMU groups it holds: sorted, each once."""
        ...

    def describe(self) -> str:
        """It, for a person: `allocation #3 of nvidia.com/T4 (0000:3b:00.0)`."""
        ...


def holds(holder: Holder, owner: str, device_id: str) -> bool:
    """Whether `holder` holds `owner`'s device `device_id` itself (as opposed to
    holding the device's IOMMU group through another member)."""
    return holder.owner == owner and device_id in holder.device_ids
