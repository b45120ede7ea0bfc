"""A resource moving from one front end to the other, as the operator sees it: logged phases.

A config that changes an entry's `frontend` moves its resource at once: the
front end it leaves stops offering its devices (the device plugin lists none,
so the node's allocatable for the name is 0; the DRA pool drops them) and
the one it joins offers them. What the old front end gave out stays held:
a running VM keeps its IOMMU groups, which the other front end shows as
taken until they are let go. So a move has two phases, each logged once:

- `frontend-move-started`: the resource, the front end it leaves (`from`),
  the one that serves it now (`to`), and the groups of its devices that the
  old side still holds (`held_groups`, with their holders);
- `frontend-move-finished`: nothing of the old side holds a group of its
  devices any more; every device is the new front end's to give. A move with
  nothing held finishes as it starts.

A move back before the first finished ends the first (`why` says so: its
holders are on the side the resource is back on) and is a new move, so
every start is followed by exactly one finish.
`FrontendMoves.observe` is given the node's inventory and ledger after every
input; it compares inventories only when the node built a new one.
"""

from __future__ import annotations

import attrs

from ..config.config import FrontendName
from ..ledger import Holder, Ledger
from ..log import Log
from .resources import Inventory, Resource

__all__ = ["FrontendMoves", "Move"]


@attrs.frozen
class Move:
    """Resource `resource` leaving front end `source` for `target`; `groups`
    are its devices' IOMMU groups."""

    resource: str
    source: FrontendName
    target: FrontendName
    groups: frozenset[int]


def _groups(*resources: Resource | None) -> frozenset[int]:
    return frozenset(
        d.iommu_group
        for r in resources
        if r is not None
        for d in r.devices
        if d.iommu_group is not None
    )


_LET_GO = "nothing of the old side holds its devices"
_MOVED_BACK = "moved back before its holders let go"


def _finished(move: Move, why: str) -> Log:
    return Log.info(
        "frontend-move-finished",
        resource=move.resource,
        **{"from": move.source, "to": move.target},
        why=why,
    )


class FrontendMoves:
    """The moves under way, and the logs of their phases."""

    def __init__(self, inventory: Inventory) -> None:
        self._last = inventory
        self._moving: dict[str, Move] = {}

    @property
    def moving(self) -> tuple[Move, ...]:
        return tuple(self._moving[name] for name in sorted(self._moving))

    def observe(self, inventory: Inventory, ledger: Ledger) -> list[Log]:
        """The phases that began or ended since the last call."""
        if inventory is self._last and not self._moving:
            return []  # the common case: nothing built, nothing moving
        logs: list[Log] = []
        if inventory is not self._last:
            logs += self._started(self._last, inventory, ledger)
            self._last = inventory
        for name in sorted(self._moving):
            move = self._moving[name]
            if not self._held(move, ledger):
                del self._moving[name]
                logs.append(_finished(move, _LET_GO))
        return logs

    def _started(self, old: Inventory, new: Inventory, ledger: Ledger) -> list[Log]:
        logs = []
        before = {r.name: r for r in old.resources}
        for resource in new.resources:
            previous = before.get(resource.name)
            if previous is None or previous.frontend == resource.frontend:
                continue
            move = Move(
                resource.name,
                previous.frontend,
                resource.frontend,
                _groups(previous, resource),
            )
            superseded = self._moving.get(resource.name)
            if superseded is not None:
                logs.append(_finished(superseded, _MOVED_BACK))
            self._moving[resource.name] = move
            held = self._held(move, ledger)
            logs.append(
                Log.info(
                    "frontend-move-started",
                    resource=resource.name,
                    **{"from": move.source, "to": move.target},
                    held_groups=",".join(str(g) for g in sorted(held)),
                    holders="; ".join(sorted({h.describe() for h in held.values()})),
                )
            )
        return logs

    @staticmethod
    def _held(move: Move, ledger: Ledger) -> dict[int, Holder]:
        """The move's groups the old side still holds, with their holders."""
        held = ledger.held()
        return {
            group: holder
            for group in move.groups
            if (holder := held.get(group)) is not None and holder.frontend == move.source
        }
