"""The node's part in moving functions to vfio-pci and back (docs/design.md §6).

`Binder` holds the binding plan and the `BindingBook` (binding.py), which
keeps what was planned, moved and given back. `Node` owns one and feeds it
the binding inputs; it answers the shell's two questions about queued
binds and give-backs. The inventory is the node's: `finished` says when it
must be rebuilt.
"""

from __future__ import annotations

from .allocation import AllocationBook
from .bind_plan import BindDecision, plan_bindings
from .binding import BindingBook
from .config import Config
from .effects import Effect, Log, UnbindDevice
from .errors import UsageError
from .host import HostSnapshot
from .inputs import BindingFinished, MovesRecalled, UnbindingFinished
from .pci import PciAddress

__all__ = ["Binder"]


class Binder:
    """The binding plan and book of one node, and the binding inputs' handling."""

    def __init__(self, allocations: AllocationBook) -> None:
        self.book = BindingBook()
        self.plan: dict[PciAddress, BindDecision] = {}  # the binding plan, by function
        self._allocations = allocations  # the node's: which IOMMU groups pods hold

    def replan(self, snapshot: HostSnapshot, config: Config, *, start: bool) -> list[Effect]:
        """Plan again for this host and config; with `start`, start the binds it makes."""
        held = self._allocations.reserved_groups()
        self.plan, effects = self.book.replan(snapshot, config, held, start=start)
        return list(effects)

    def give_back_stranded(self) -> list[Effect]:
        return list(self.book.give_back_stranded(self._allocations.reserved_groups()))

    def bind_planned(self, address: PciAddress, driver: str | None) -> bool:
        """Whether the plan still moves `address` from `driver`.

        Binds run one at a time, and a slow driver can hold one for seconds:
        ask this when a `BindDevice`'s turn comes, since a config change or a
        rescan since it was emitted may have withdrawn it (docs/design.md §6).
        """
        decision = self.plan.get(address)
        return (
            decision is not None
            and decision.binds
            and decision.driver == driver
            and decision.iommu_group not in self._allocations.reserved_groups()
        )

    def finished(
        self, event: BindingFinished, snapshot: HostSnapshot, config: Config
    ) -> tuple[list[Effect], bool]:
        """A bind ended; its effects, and whether the inventory must be rebuilt."""
        held = self._allocations.reserved_groups()
        effects: list[Effect] = list(self.book.finished(event, held))
        if event.error is not None:
            # Its group will not become usable: plan again now, so that binds of
            # its siblings still queued are withdrawn (`bind_planned`) rather
            # than carried out. Only the plan: the snapshot predates the binds
            # just done, and the rescan after the batch acts on what it shows.
            held = self._allocations.reserved_groups()
            self.plan = plan_bindings(snapshot, config, self.book.failed, held)
        # After a give-back starts: unhealthy from now on, so nothing allocates
        # what is to be unbound.
        return effects, any(isinstance(effect, UnbindDevice) for effect in effects)

    def give_back_planned(self, address: PciAddress) -> bool:
        """Whether a queued `UnbindDevice` should still be carried out, now its turn has come."""
        return self.book.give_back_planned(address, self._allocations.reserved_groups())

    def unbound(self, event: UnbindingFinished) -> list[Effect]:
        """A give-back ended; the inventory must be rebuilt after it."""
        return list(self.book.unbound(event))

    def recalled(self, event: MovesRecalled, *, scanned: bool) -> list[Effect]:
        if scanned:
            raise UsageError("MovesRecalled comes before the first HostObserved")
        recalled = self.book.recall(event.moves)
        return [Log.info("moves-recalled", count=recalled)] if recalled else []
