"""The node's part in moving functions to vfio-pci and back (docs/design.md §6).

`BindingPlanner` holds the binding plan and the `BindingBook` (book.py), which
keeps what was planned, moved and given back. `Node` owns one and feeds it
the binding inputs; it decides whether a queued write still goes when its
turn comes (`WriteDue`). Nothing moves into an IOMMU group the ledger says is
held, whichever front end holds it. The inventory is the node's: `finished`
says when it must be rebuilt.
"""

from __future__ import annotations

from ..config.config import Config
from ..errors import UsageError
from ..host.pci import PciAddress
from ..host.snapshot import HostSnapshot
from ..ledger import Ledger
from ..log import Log
from .book import BindingBook
from .events import (
    BindDevice,
    BindingFinished,
    MovesRecalled,
    UnbindDevice,
    UnbindingFinished,
    WriteDue,
)
from .plan import BindDecision, plan_bindings

Effects = list[BindDevice | UnbindDevice | Log]

__all__ = ["BindingPlanner"]


class BindingPlanner:
    """The binding plan and book of one node, and the binding inputs' handling."""

    def __init__(self, ledger: Ledger) -> None:
        self.book = BindingBook()
        self.plan: dict[PciAddress, BindDecision] = {}  # the binding plan, by function
        self._held = ledger.held()  # which IOMMU groups are held, by any front end

    def replan(self, snapshot: HostSnapshot, config: Config, *, start: bool) -> Effects:
        """Plan again for this host and config; with `start`, start the binds it makes."""
        held = self._held
        self.plan, effects = self.book.replan(snapshot, config, held, start=start)
        return list(effects)

    def give_back_stranded(self) -> Effects:
        return list(self.book.give_back_stranded(self._held))

    def still_planned(self, due: WriteDue) -> bool:
        """Whether the write whose turn has come still goes: the plan still
        moves the function from the driver it was asked with, or still gives
        it back, and no front end holds its group (docs/design.md §6)."""
        write = due.write
        if isinstance(write, UnbindDevice):
            if write.address not in self.book.giving_back:
                raise UsageError(f"WriteDue: no give-back of {write.address} is in flight")
            return self.book.give_back_planned(write.address, self._held)
        if write.address not in self.book.in_flight:
            raise UsageError(f"WriteDue: no bind of {write.address} is in flight")
        decision = self.plan.get(write.address)
        return (
            decision is not None
            and decision.binds
            and decision.driver == write.driver
            and decision.iommu_group not in self._held
        )

    def finished(
        self, event: BindingFinished, snapshot: HostSnapshot, config: Config
    ) -> tuple[Effects, bool]:
        """A bind ended; its effects, and whether the inventory must be rebuilt."""
        held = self._held
        effects: Effects = list(self.book.finished(event, held))
        if event.error is not None:
            # Its group will not become usable: plan again now, so that binds of
            # its siblings still queued are withdrawn (`still_planned`) rather
            # than carried out. Only the plan: the snapshot predates the binds
            # just done, and the rescan after the batch acts on what it shows.
            held = self._held
            self.plan = plan_bindings(snapshot, config, self.book.failed, held)
        # After a give-back starts: unhealthy from now on, so nothing allocates
        # what is to be unbound.
        return effects, any(isinstance(effect, UnbindDevice) for effect in effects)

    def unbound(self, event: UnbindingFinished) -> Effects:
        """A give-back ended; the inventory must be rebuilt after it."""
        return list(self.book.unbound(event))

    def recalled(self, event: MovesRecalled, *, scanned: bool) -> Effects:
        if scanned:
            raise UsageError("MovesRecalled comes before the first HostObserved")
        recalled = self.book.recall(event.moves)
        return [Log.info("moves-recalled", count=recalled)] if recalled else []
