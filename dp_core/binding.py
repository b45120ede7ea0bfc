"""What dp is doing to the PCI functions it moves to vfio-pci, and what it did (DESIGN.md §6).

`bind_plan.plan_bindings` decides what binding would move; `BindingBook`
remembers what is in flight, what failed and what dp moved, and gives back
what dp moved of a group that cannot become usable.
"""

from __future__ import annotations

from collections.abc import Collection, Container, Iterable

from .bind_plan import BindDecision, plan_bindings, selected_for_binding
from .config import Config
from .effects import BindDevice, Log, UnbindDevice
from .errors import UsageError
from .host import VFIO_DRIVER, HostSnapshot
from .inputs import BindingFinished, UnbindingFinished
from .moves import Move
from .pci import PciAddress

__all__ = ["BindingBook"]


class BindingBook:
    """Binds in flight, binds that failed, and what dp moved, by function address.

    A group is moved one function at a time. When one of them fails, the
    group cannot become usable, and the members dp already moved would sit
    on vfio-pci, of use to neither the host nor a VM: they are given back to
    the driver they were taken from (`UnbindDevice`), and count as failed, so
    that no plan moves them again until the config changes. Only what the
    current config still selects is ever given back.
    """

    def __init__(self) -> None:
        self.in_flight: dict[PciAddress, BindDecision] = {}
        self.failed: dict[PciAddress, str] = {}
        self.refusals: dict[PciAddress, str] = {}  # last refusal logged, to log changes only
        self.moved: dict[PciAddress, Move] = {}  # on vfio-pci because dp put it there
        self.giving_back: set[PciAddress] = set()
        # IOMMU group -> the member whose move failed, and why the group is stuck.
        self._broken_groups: dict[int, tuple[PciAddress, str]] = {}
        self._selected: frozenset[PciAddress] = frozenset()
        self._present: frozenset[PciAddress] = frozenset()  # in the last scan
        # Binds in flight whose device a scan has seen gone since they were
        # asked: whatever their result, it is about a device that is no more.
        self._outlived: set[PciAddress] = set()
        self._put_off: dict[PciAddress, int] = {}  # logged once each, while it lasts
        # Give-backs that ended (done or failed) since the last scan: the
        # snapshot shows them as they were before, and they must not look
        # usable until a scan shows where they are now.
        self._unscanned: set[PciAddress] = set()
        # Moves an earlier run reported (`recall`), until the first scan says
        # whether they are still on vfio-pci.
        self._recalled: set[PciAddress] = set()
        self.moves_version = 0  # changes whenever `moved` does

    def moves(self) -> tuple[Move, ...]:
        """What dp moved to vfio-pci, for `MovesChanged`."""
        return tuple(sorted(self.moved.values(), key=lambda move: move.address))

    def recall(self, moves: Iterable[Move]) -> int:
        """Take back what an earlier run moved; how many were new to it."""
        recalled = 0
        for move in moves:
            if move.address not in self.moved:
                self.moved[move.address] = move
                self._recalled.add(move.address)
                recalled += 1
        return recalled

    def _forget_moves(self, addresses: Iterable[PciAddress]) -> None:
        for address in addresses:
            if self.moved.pop(address, None) is not None:
                self.moves_version += 1

    def _select(self, snapshot: HostSnapshot, config: Config) -> None:
        if config.binding is None:
            self._selected = self._present = frozenset()
        else:
            self._present = frozenset(pci.address for pci in snapshot.pci_devices)
            self._outlived.update(a for a in self.in_flight if a not in self._present)
            selectors = config.pci_selectors()
            self._selected = frozenset(
                pci.address for pci in snapshot.pci_devices if selected_for_binding(pci, selectors)
            )
        # A device the config stops selecting may go to another plugin and
        # its VMs (`externalResourceProvider`), whose allocations dp cannot
        # see: dp forgets having moved it, and never gives it back.
        # Recalled moves wait for the first scan to judge them (`observed`).
        self._forget_moves(
            [a for a in self.moved if a not in self._selected and a not in self._recalled]
        )

    @property
    def moving_groups(self) -> frozenset[int]:
        """IOMMU groups a bind is under way into."""
        return frozenset(
            d.iommu_group for d in self.in_flight.values() if d.iommu_group is not None
        )

    @property
    def leaving(self) -> frozenset[PciAddress]:
        """Functions being given back, or whose give-back ended after the last scan."""
        return frozenset(self.giving_back | self._unscanned)

    def observed(self, snapshot: HostSnapshot) -> None:
        """A scan taken after every give-back that has ended: it shows them as they are,
        and shows whether the functions recalled from an earlier run are still on vfio-pci."""
        self._unscanned.clear()
        if self._recalled:
            on_vfio = {
                address
                for address in self._recalled
                if (pci := snapshot.device(address)) is not None
                and pci.driver == VFIO_DRIVER
                and pci.iommu_group == self.moved[address].iommu_group
            }
            self._forget_moves(self._recalled - on_vfio)
            self._recalled.clear()

    def retry_all(self, snapshot: HostSnapshot, config: Config) -> None:
        """The config changed: every function may be tried again."""
        self.failed.clear()
        self._broken_groups.clear()
        self._put_off.clear()
        self._select(snapshot, config)

    def forget_gone(self, present: Collection[PciAddress]) -> None:
        """A function that left the host and came back is a new device: try it again."""
        for book in (self.failed, self.refusals):
            for address in [a for a in book if a not in present]:
                del book[address]
        self._forget_moves([a for a in self.moved if a not in present and a not in self._recalled])
        for group, (address, _) in list(self._broken_groups.items()):
            if address not in present:
                del self._broken_groups[group]

    def replan(
        self,
        snapshot: HostSnapshot,
        config: Config,
        held_groups: Container[int] = (),
        *,
        start: bool = True,
    ) -> tuple[dict[PciAddress, BindDecision], list[BindDevice | Log]]:
        """The plan for this host and config, and the binds and refusals it starts.

        With `start` false the plan is made but no bind starts: before the
        kubelet has said which IOMMU groups pods hold, a group a running VM
        uses would look free.
        """
        self._select(snapshot, config)
        if self.failed or self.refusals or self.moved or self._broken_groups:
            # `_select` listed what is present when binding is on; else list it here.
            present = self._present or {pci.address for pci in snapshot.pci_devices}
            self.forget_gone(present)
        plan = plan_bindings(snapshot, config, self.failed, held_groups)
        effects: list[BindDevice | Log] = []
        for address, decision in plan.items():
            if decision.binds:
                self.refusals.pop(address, None)
                if start and address not in self.in_flight and address not in self.giving_back:
                    self.in_flight[address] = decision
                    effects.append(
                        Log.info("bind", device=str(address), driver=decision.driver or "none")
                    )
                    effects.append(BindDevice(address, decision.driver))
            elif self.refusals.get(address) != decision.refusal:
                self.refusals[address] = decision.refusal
                effects.append(
                    Log.warning("bind-refused", device=str(address), reason=decision.refusal)
                )
        return plan, effects

    def finished(
        self, event: BindingFinished, held_groups: Container[int]
    ) -> list[UnbindDevice | Log]:
        """A bind in flight ended: carried out, failed, or withdrawn unwritten.

        `held_groups` are the IOMMU groups allocations hold: nothing in them
        is given back, since a VM may be using it.
        """
        decision = self.in_flight.pop(event.address, None)
        if decision is None:
            raise UsageError(f"no bind of {event.address} is in flight")
        if event.withdrawn:
            return [Log.info("bind-withdrawn", device=str(event.address))]
        effects: list[UnbindDevice | Log] = []
        # Reported after a scan saw the device gone: whatever comes back is new.
        gone = event.address not in self._present or event.address in self._outlived
        self._outlived.discard(event.address)
        if event.error is None:
            if not gone:
                move = Move(
                    event.address, decision.driver, decision.iommu_group, pinned=event.pinned
                )
                self.moved[event.address] = move
                self.moves_version += 1
            effects.append(Log.info("bound", device=str(event.address), driver=VFIO_DRIVER))
        else:
            effects.append(
                Log.warning("bind-failed", device=str(event.address), reason=event.error)
            )
            if not gone:
                self.failed[event.address] = event.error
            if decision.iommu_group is not None and not gone:
                why = f"{event.address}, in the same IOMMU group, could not be moved to vfio-pci"
                self._broken_groups.setdefault(decision.iommu_group, (event.address, why))
        if decision.iommu_group in self._broken_groups:
            effects += self._give_back(decision.iommu_group, held_groups)
        return effects

    def give_back_stranded(self, held_groups: Container[int]) -> list[UnbindDevice | Log]:
        """Give-backs put off while an allocation held the group, or withdrawn
        when their turn came then, that can go ahead now."""
        effects: list[UnbindDevice | Log] = []
        for group in list(self._broken_groups):
            if group not in held_groups:
                effects += self._give_back(group, held_groups)
        return effects

    def _give_back(self, group: int, held_groups: Container[int]) -> list[UnbindDevice | Log]:
        """Give back what dp moved of a group that cannot become usable.

        Only what the config selects now: dp writes to no device it does not
        select. What an allocation holds waits (`give_back_stranded`).
        """
        _, reason = self._broken_groups[group]
        stranded = [
            moved
            for address, moved in self.moved.items()
            if moved.iommu_group == group
            and address not in self.giving_back
            and address in self._selected
        ]
        effects: list[UnbindDevice | Log] = []
        for moved in stranded:
            device = str(moved.address)
            if group in held_groups:
                if self._put_off.get(moved.address) != group:
                    self._put_off[moved.address] = group
                    held = f"{reason}, but an allocation holds IOMMU group {group}"
                    effects.append(Log.warning("give-back-put-off", device=device, reason=held))
                continue
            self._put_off.pop(moved.address, None)
            self.giving_back.add(moved.address)
            self.failed[moved.address] = f"given back to {moved.driver or 'no driver'}: {reason}"
            driver = moved.driver or "none"
            effects.append(Log.warning("give-back", device=device, driver=driver, reason=reason))
            effects.append(UnbindDevice(moved.address, moved.driver, reason, pinned=moved.pinned))
        return effects

    def give_back_planned(self, address: PciAddress, held_groups: Container[int]) -> bool:
        """Whether a queued give-back should still be carried out, now its turn has come."""
        moved = self.moved.get(address)
        return (
            address in self.giving_back
            and address in self._selected
            and moved is not None
            and moved.iommu_group in self._broken_groups
            and moved.iommu_group not in held_groups
        )

    def unbound(self, event: UnbindingFinished) -> list[Log]:
        """A give-back ended: the function is on its old driver, or why not, or withdrawn."""
        if event.address not in self.giving_back:
            raise UsageError(f"no give-back of {event.address} is in flight")
        self.giving_back.discard(event.address)
        device = str(event.address)
        if event.withdrawn:
            return [Log.info("give-back-withdrawn", device=device)]
        moved = self.moved.get(event.address)
        self._forget_moves([event.address])
        self._unscanned.add(event.address)
        if event.error is None:
            driver = (moved.driver if moved else None) or "none"
            return [Log.info("given-back", device=device, driver=driver)]
        return [Log.error("give-back-failed", device=device, reason=event.error)]
