"""The one ledger: which holder has each IOMMU group (docs/design.md §5).

VFIO hands a whole IOMMU group to one user, whichever front end it came
through. Every hold therefore goes into this one book, once: a
device-plugin allocation, a group held while the kubelet syncs, a DRA
claim. The ledger sees a holder only as a `Holder`: its key, whose device
names it holds, which groups, and how to name it. Each front end has its own
kind of holder, and the ledger knows none of them; a front end's own indexes
are derived from what is booked here.

The two rules every front end keeps are here, once: a hold that would split
a group another holder has is refused (`refusal`), and a holder taken back
after a restart gets only the groups nobody else holds, the others being
reported split (`split_report`). Who may hold what, and when a hold ends, is
each front end's business.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Protocol

from .errors import UsageError

__all__ = ["Holder", "Ledger", "holds"]


class Holder(Protocol):
    @property
    def key(self) -> Hashable:
        """What tells it apart from every other holder in the ledger."""
        ...

    @property
    def frontend(self) -> str:
        """The name of the front end it came through."""
        ...

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
    """IOMMU group -> its holder, and every holder by key, oldest first.
    Not thread-safe; one caller at a time."""

    def __init__(self) -> None:
        self._by_group: dict[int, Holder] = {}
        self._by_key: dict[Hashable, Holder] = {}
        self._view = MappingProxyType(self._by_group)

    def holder(self, group: int) -> Holder | None:
        return self._by_group.get(group)

    def held(self) -> Mapping[int, Holder]:
        """Group -> its holder; a read-only view that follows the ledger."""
        return self._view

    def holding(self, key: Hashable) -> Holder | None:
        """The holder booked under `key`, if it still holds."""
        return self._by_key.get(key)

    def holders(self) -> Iterator[Holder]:
        """Every holder, oldest first, as they are now (holds may change meanwhile)."""
        return iter(list(self._by_key.values()))

    def refusal(
        self, owner: str, devices: Iterable[tuple[str, int | None]], *, takes_over: bool
    ) -> str | None:
        """Why `owner` may not hold `devices` (device ID, IOMMU group): the first
        group another holder has, named with its device and its holder; None
        if it may. With `takes_over`, a holder of `owner`'s that holds one of
        these very devices does not count: the one asking replaces it."""
        devices = list(devices)
        wanted = {device_id for device_id, _ in devices}
        for device_id, group in devices:
            holder = self._by_group.get(group) if group is not None else None
            if holder is None:
                continue
            if takes_over and holder.owner == owner and not wanted.isdisjoint(holder.device_ids):
                continue
            return f"IOMMU group {group} of device {device_id} is held by {holder.describe()}"
        return None

    def split_report(self, group: int, claimant: str) -> str | None:
        """`claimant` (a pod the kubelet lists, a claim prepared before a
        restart) has `group` already: None if nobody holds it here, else the
        report that VFIO's rule is broken, naming both."""
        holder = self._by_group.get(group)
        if holder is None:
            return None
        return f"IOMMU group {group} is split: {claimant}, and {holder.describe()} holds it"

    def hold(self, holder: Holder) -> None:
        """Give `holder` its groups; the caller has released what held them."""
        by_group = self._by_group
        groups = holder.groups
        if holder.key in self._by_key:
            raise UsageError(f"{holder.describe()} holds already")
        for group in groups:
            if group in by_group:
                taken = [g for g in groups if g in by_group]
                held_by = by_group[group].describe()
                raise UsageError(
                    f"{holder.describe()} cannot hold IOMMU groups {taken}: {held_by} holds them"
                )
        for group in groups:
            by_group[group] = holder
        self._by_key[holder.key] = holder

    def release(self, holder: Holder) -> None:
        """Free the groups `holder` still holds."""
        if self._by_key.get(holder.key) is holder:
            del self._by_key[holder.key]
        by_group = self._by_group
        for group in holder.groups:
            if by_group.get(group) is holder:
                del by_group[group]
