"""The one ledger: which holder has each IOMMU group (docs/design.md §5).

VFIO hands a whole IOMMU group to one user, whichever front end it came
through. Every hold therefore goes into this one book, keyed by group: a
device-plugin allocation, a group held while the kubelet syncs, a DRA claim.
The ledger only refuses a hold on a group held already; who may hold what,
and when a hold ends, is each front end's business.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from ..errors import UsageError
from .holder import Holder

__all__ = ["Ledger"]


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
        taken = [g for g in holder.groups if g in by_group]
        if taken:
            held_by = by_group[taken[0]].describe()
            raise UsageError(
                f"{holder.describe()} cannot hold IOMMU groups {taken}: {held_by} holds them"
            )
        for group in holder.groups:
            by_group[group] = holder

    def release(self, holder: Holder) -> None:
        """Free the groups `holder` still holds."""
        by_group = self._by_group
        for group in holder.groups:
            if by_group.get(group) is holder:
                del by_group[group]
