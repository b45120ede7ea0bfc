"""The node's part in moving functions to vfio-pci and back (DESIGN.md §6).

`BindingBook` (binding.py) keeps what was planned, moved and given back; these
are the steps by which `Node` feeds it and answers the shell's questions
about it, kept apart from the rest of the node's inputs.
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

__all__ = ["BindingSteps"]


class BindingSteps:
    """Mixed into `Node`: the binding inputs and the shell's two questions."""

    snapshot: HostSnapshot
    config: Config
    bindings: dict[PciAddress, BindDecision]  # the binding plan, by function
    bind_book: BindingBook
    allocations: AllocationBook
    _holders_known: bool
    _scanned: bool

    def _rebuild_inventory(self) -> list[Effect]:
        raise NotImplementedError  # Node's

    def _plan_bindings(self) -> list[Effect]:
        held = self.allocations.reserved_groups()
        self.bindings, effects = self.bind_book.replan(
            self.snapshot, self.config, held, start=self._holders_known
        )
        return list(effects)

    def bind_planned(self, address: PciAddress, driver: str | None) -> bool:
        """Whether the plan still moves `address` from `driver`.

        Binds run one at a time, and a slow driver can hold one for seconds:
        ask this when a `BindDevice`'s turn comes, since a config change or a
        rescan since it was emitted may have withdrawn it (DESIGN.md §6).
        """
        decision = self.bindings.get(address)
        return (
            decision is not None
            and decision.binds
            and decision.driver == driver
            and decision.iommu_group not in self.allocations.reserved_groups()
        )

    def _binding_finished(self, event: BindingFinished) -> list[Effect]:
        held = self.allocations.reserved_groups()
        effects: list[Effect] = list(self.bind_book.finished(event, held))
        if event.error is not None:
            # Its group will not become usable: plan again now, so that binds of
            # its siblings still queued are withdrawn (`bind_planned`) rather
            # than carried out. Only the plan: the snapshot predates the binds
            # just done, and the rescan after the batch acts on what it shows.
            held = self.allocations.reserved_groups()
            self.bindings = plan_bindings(self.snapshot, self.config, self.bind_book.failed, held)
        if any(isinstance(effect, UnbindDevice) for effect in effects):
            # Unhealthy from now on, so nothing allocates what is to be unbound.
            effects += self._rebuild_inventory()
        return effects

    def give_back_planned(self, address: PciAddress) -> bool:
        """Whether a queued `UnbindDevice` should still be carried out, now its turn has come."""
        return self.bind_book.give_back_planned(address, self.allocations.reserved_groups())

    def _unbinding_finished(self, event: UnbindingFinished) -> list[Effect]:
        effects: list[Effect] = list(self.bind_book.unbound(event))
        return effects + self._rebuild_inventory()

    def _moves_recalled(self, event: MovesRecalled) -> list[Effect]:
        if self._scanned:
            raise UsageError("MovesRecalled comes before the first HostObserved")
        recalled = self.bind_book.recall(event.moves)
        return [Log.info("moves-recalled", count=recalled)] if recalled else []
