"""The one ledger: which holder has each IOMMU group (docs/design.md §5).

VFIO hands a whole IOMMU group to one user, whichever front end it came
through. Every hold therefore goes into this one book, keyed by group: a
device-plugin allocation, a group held while the kubelet syncs, a DRA claim.
The ledger sees a holder only as a `Holder`: whose device names it holds,
which groups, and how to name it. Each front end has its own kind of holder,
and the ledger knows none of them. It only refuses a hold on a group held
already; who may hold what, and when a hold ends, is each front end's
business.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Protocol

from .errors import UsageError

__all__ = ["Holder", "Ledger", "holds"]


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


class Ledger:
    """IOMMU group -> its holder. Not thread-safe; one caller at a time."""

    def __init__(self) -> None:
        self._by_group: dict[int, Holder] = {}
        self._view = MappingProxyType(self._by_group)

    def holder(self, group: int) -> Holder | None:
        return self._by_group.get(group)

    def held(self) -> Mapping[int, Holder]:
        """Group -> its holder; a read-only view that follows the ledger."""
        return self._view

    def hold(self, holder: Holder) -> None:
        """Give `holder` its groups; the caller has released what held them."""
        by_group = self._by_group
        groups = holder.groups
        for group in groups:
            if group in by_group:
                taken = [g for g in groups if g in by_group]
                held_by = by_group[group].describe()
                raise UsageError(
                    f"{holder.describe()} cannot hold IOMMU groups {taken}: {held_by} holds them"
                )
        for group in groups:
            by_group[group] = holder

    def release(self, holder: Holder) -> None:
        """Free the groups `holder` still holds."""
        by_group = self._by_group
        for group in holder.groups:
            if by_group.get(group) is holder:
                del by_group[group]
