"""What dp is doing to the PCI functions it moves to vfio-pci, and what it did (docs/design.md §6).

`plan.plan_bindings` decides what binding would move; `BindingBook`
remembers what is in flight, what failed and what dp moved, and gives back
what dp moved of a group that cannot become usable.

Each function's move goes through the states of `MoveState`, and every
change of state goes through `TRANSITIONS`; nothing else assigns one. A
state says whether a bind is in flight, whether dp counts the function as
moved (keeps its `Move`) and whether a give-back is in flight, since these
overlap when a scan is stale: a bind can be asked again of a function
already moved (from a scan taken before the move), and a give-back can be
asked of it meanwhile. What failed (`failed`) is the plan's memory, not a
state: it lasts until the config changes or the function leaves.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Container, Iterable, Mapping

from ..config.config import Config
from ..errors import UsageError
from ..host.pci import PciAddress
from ..host.snapshot import VFIO_DRIVER, HostSnapshot
from ..log import Log
from .events import BindDevice, BindingFinished, UnbindDevice, UnbindingFinished
from .moves import Move
from .plan import BindDecision, plan_bindings, selected_for_binding

__all__ = ["TRANSITIONS", "BindingBook", "MoveEvent", "MoveState", "MoveOutcome"]


class MoveState(enum.Enum):
    IDLE = "idle"  # nothing in flight, not moved by dp (a bind may be planned or refused)
    BINDING = "binding"  # BindDevice asked, no answer yet
    MOVED = "moved"  # on vfio-pci because dp put it there
    RECALLED = "recalled"  # an earlier run moved it; the first scan has not judged it yet
    REBINDING = "rebinding"  # moved, and a bind asked again from a scan taken before the move
    GIVING_BACK = "giving-back"  # moved; UnbindDevice asked, no answer yet
    GIVING_BACK_REBINDING = "giving-back-rebinding"  # both of the above
    # Being given back, but no longer counted as moved: the config stopped
    # selecting it, or it left the host, while the give-back was in flight.
    GIVING_BACK_DISOWNED = "giving-back-disowned"
    GIVING_BACK_DISOWNED_REBINDING = "giving-back-disowned-rebinding"


class MoveEvent(enum.Enum):
    BIND_ASKED = "bind-asked"  # the plan moves it and no bind or give-back is in flight
    BIND_DONE = "bind-done"  # BindingFinished without error, the device still there
    BIND_FAILED = "bind-failed"  # BindingFinished with an error, the device still there
    # BindingFinished for a device a scan saw gone meanwhile (that scan disowned
    # any Move it had, so only a function not counted as moved sees this).
    BIND_OUTLIVED = "bind-outlived"
    BIND_WITHDRAWN = "bind-withdrawn"  # BindingFinished, withdrawn unwritten
    GIVE_BACK_ASKED = "give-back-asked"  # its IOMMU group cannot become usable
    GIVE_BACK_ENDED = "give-back-ended"  # UnbindingFinished, done or failed
    GIVE_BACK_WITHDRAWN = "give-back-withdrawn"  # UnbindingFinished, withdrawn unwritten
    DISOWNED = "disowned"  # the config stopped selecting it, or it left the host
    RECALLED = "recalled"  # MovesRecalled names it
    RECALL_CONFIRMED = "recall-confirmed"  # the first scan shows it on vfio-pci, in its group
    RECALL_REFUTED = "recall-refuted"  # the first scan shows it elsewhere, or not at all


class MoveOutcome(enum.Enum):
    """What a change of state asks of the book, besides the new state."""

    NOTHING = "nothing"
    BIND_DEVICE = "bind-device"  # emit BindDevice
    UNBIND_DEVICE = "unbind-device"  # emit UnbindDevice
    MOVE_RECORDED = "move-recorded"  # keep its Move (MovesChanged follows)
    MOVE_FORGOTTEN = "move-forgotten"  # drop its Move (MovesChanged follows)
    MOVE_RECALLED = "move-recalled"  # keep the Move an earlier run reported (already kept)


_S, _E, _O = MoveState, MoveEvent, MoveOutcome

TRANSITIONS: Mapping[tuple[MoveState, MoveEvent], tuple[MoveState, MoveOutcome]] = {
    # Binding.
    (_S.IDLE, _E.BIND_ASKED): (_S.BINDING, _O.BIND_DEVICE),
    (_S.BINDING, _E.BIND_DONE): (_S.MOVED, _O.MOVE_RECORDED),
    (_S.BINDING, _E.BIND_FAILED): (_S.IDLE, _O.NOTHING),
    (_S.BINDING, _E.BIND_OUTLIVED): (_S.IDLE, _O.NOTHING),
    (_S.BINDING, _E.BIND_WITHDRAWN): (_S.IDLE, _O.NOTHING),
    # A moved function the last scan still shows on its old driver.
    (_S.MOVED, _E.BIND_ASKED): (_S.REBINDING, _O.BIND_DEVICE),
    (_S.REBINDING, _E.BIND_DONE): (_S.MOVED, _O.MOVE_RECORDED),
    (_S.REBINDING, _E.BIND_FAILED): (_S.MOVED, _O.NOTHING),
    (_S.REBINDING, _E.BIND_WITHDRAWN): (_S.MOVED, _O.NOTHING),
    # Giving back.
    (_S.MOVED, _E.GIVE_BACK_ASKED): (_S.GIVING_BACK, _O.UNBIND_DEVICE),
    (_S.GIVING_BACK, _E.GIVE_BACK_ENDED): (_S.IDLE, _O.MOVE_FORGOTTEN),
    (_S.GIVING_BACK, _E.GIVE_BACK_WITHDRAWN): (_S.MOVED, _O.NOTHING),
    (_S.REBINDING, _E.GIVE_BACK_ASKED): (_S.GIVING_BACK_REBINDING, _O.UNBIND_DEVICE),
    (_S.GIVING_BACK_REBINDING, _E.BIND_DONE): (_S.GIVING_BACK, _O.MOVE_RECORDED),
    (_S.GIVING_BACK_REBINDING, _E.BIND_FAILED): (_S.GIVING_BACK, _O.NOTHING),
    (_S.GIVING_BACK_REBINDING, _E.BIND_WITHDRAWN): (_S.GIVING_BACK, _O.NOTHING),
    (_S.GIVING_BACK_REBINDING, _E.GIVE_BACK_ENDED): (_S.BINDING, _O.MOVE_FORGOTTEN),
    (_S.GIVING_BACK_REBINDING, _E.GIVE_BACK_WITHDRAWN): (_S.REBINDING, _O.NOTHING),
    # Disowned: dp forgets having moved it, and never gives it back again.
    (_S.MOVED, _E.DISOWNED): (_S.IDLE, _O.MOVE_FORGOTTEN),
    (_S.REBINDING, _E.DISOWNED): (_S.BINDING, _O.MOVE_FORGOTTEN),
    (_S.GIVING_BACK, _E.DISOWNED): (_S.GIVING_BACK_DISOWNED, _O.MOVE_FORGOTTEN),
    (_S.GIVING_BACK_REBINDING, _E.DISOWNED): (
        _S.GIVING_BACK_DISOWNED_REBINDING,
        _O.MOVE_FORGOTTEN,
    ),
    (_S.GIVING_BACK_DISOWNED, _E.GIVE_BACK_ENDED): (_S.IDLE, _O.NOTHING),
    (_S.GIVING_BACK_DISOWNED, _E.GIVE_BACK_WITHDRAWN): (_S.IDLE, _O.NOTHING),
    (_S.GIVING_BACK_DISOWNED_REBINDING, _E.BIND_DONE): (_S.GIVING_BACK, _O.MOVE_RECORDED),
    (_S.GIVING_BACK_DISOWNED_REBINDING, _E.BIND_FAILED): (_S.GIVING_BACK_DISOWNED, _O.NOTHING),
    (_S.GIVING_BACK_DISOWNED_REBINDING, _E.BIND_OUTLIVED): (
        _S.GIVING_BACK_DISOWNED,
        _O.NOTHING,
    ),
    (_S.GIVING_BACK_DISOWNED_REBINDING, _E.BIND_WITHDRAWN): (
        _S.GIVING_BACK_DISOWNED,
        _O.NOTHING,
    ),
    (_S.GIVING_BACK_DISOWNED_REBINDING, _E.GIVE_BACK_ENDED): (_S.BINDING, _O.NOTHING),
    (_S.GIVING_BACK_DISOWNED_REBINDING, _E.GIVE_BACK_WITHDRAWN): (_S.BINDING, _O.NOTHING),
    # Moves an earlier run made, until the first scan judges them.
    (_S.IDLE, _E.RECALLED): (_S.RECALLED, _O.MOVE_RECALLED),
    (_S.RECALLED, _E.RECALL_CONFIRMED): (_S.MOVED, _O.NOTHING),
    (_S.RECALLED, _E.RECALL_REFUTED): (_S.IDLE, _O.MOVE_FORGOTTEN),
}

_BINDING = frozenset(
    {
        _S.BINDING,
        _S.REBINDING,
        _S.GIVING_BACK_REBINDING,
        _S.GIVING_BACK_DISOWNED_REBINDING,
    }
)
_GIVING_BACK = frozenset(
    {
        _S.GIVING_BACK,
        _S.GIVING_BACK_REBINDING,
        _S.GIVING_BACK_DISOWNED,
        _S.GIVING_BACK_DISOWNED_REBINDING,
    }
)


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
        self._states: dict[PciAddress, MoveState] = {}  # absent: IDLE
        self._asked: dict[PciAddress, BindDecision] = {}  # the decision of each bind in flight
        self.failed: dict[PciAddress, str] = {}
        self.refusals: dict[PciAddress, str] = {}  # last refusal logged, to log changes only
        # On vfio-pci because dp put it there; only `_step` changes it.
        self.moved: dict[PciAddress, Move] = {}
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
        self.moves_version = 0  # changes whenever `moved` does

    def state(self, address: PciAddress) -> MoveState:
        return self._states.get(address, MoveState.IDLE)

    def _step(self, address: PciAddress, event: MoveEvent, move: Move | None = None) -> MoveOutcome:
        """Move `address` on by `event` through `TRANSITIONS`; `move` is the Move an
        outcome that keeps one keeps."""
        state = self.state(address)
        try:
            after, outcome = TRANSITIONS[(state, event)]
        except KeyError:
            raise UsageError(
                f"{address}: no transition from {state.value} on {event.value}"
            ) from None
        if after is MoveState.IDLE:
            self._states.pop(address, None)
        else:
            self._states[address] = after
        if outcome is MoveOutcome.MOVE_RECORDED or outcome is MoveOutcome.MOVE_RECALLED:
            if move is None:
                raise UsageError(f"{address}: {event.value} keeps a Move, and none came")
            self.moved[address] = move
            self.moves_version += outcome is MoveOutcome.MOVE_RECORDED
        elif outcome is MoveOutcome.MOVE_FORGOTTEN:
            del self.moved[address]
            self.moves_version += 1
        return outcome

    @property
    def in_flight(self) -> Mapping[PciAddress, BindDecision]:
        """Binds asked and not yet finished, with the decision each carries out."""
        return self._asked

    @property
    def giving_back(self) -> frozenset[PciAddress]:
        """Functions whose give-back is in flight."""
        return frozenset(a for a, state in self._states.items() if state in _GIVING_BACK)

    def _recalled(self) -> list[PciAddress]:
        """Moves an earlier run reported, until the first scan judges them."""
        return [a for a, state in self._states.items() if state is MoveState.RECALLED]

    def moves(self) -> tuple[Move, ...]:
        """What dp moved to vfio-pci, for `MovesChanged`."""
        return tuple(sorted(self.moved.values(), key=lambda move: move.address))

    def recall(self, moves: Iterable[Move]) -> int:
        """Take back what an earlier run moved; how many were new to it."""
        recalled = 0
        for move in moves:
            if move.address not in self.moved:
                self._step(move.address, MoveEvent.RECALLED, move)
                recalled += 1
        return recalled

    def _disown(self, addresses: Iterable[PciAddress]) -> None:
        """Forget having moved these (never given back, then); recalled moves wait
        for the first scan to judge them (`observed`)."""
        for address in addresses:
            if self.state(address) is not MoveState.RECALLED:
                self._step(address, MoveEvent.DISOWNED)

    def _select(self, snapshot: HostSnapshot, config: Config) -> None:
        if config.binding is None:
            self._selected = self._present = frozenset()
        else:
            self._present = frozenset(pci.address for pci in snapshot.pci_devices)
            self._outlived.update(a for a in self._asked if a not in self._present)
            selectors = config.pci_selectors()
            self._selected = frozenset(
                pci.address for pci in snapshot.pci_devices if selected_for_binding(pci, selectors)
            )
        # A device the config stops selecting (or leaves to virt-handler) may
        # go to another plugin and its VMs, whose allocations dp cannot see:
        # dp forgets having moved it, and never gives it back.
        self._disown([a for a in self.moved if a not in self._selected])

    @property
    def moving_groups(self) -> frozenset[int]:
        """IOMMU groups a bind is under way into."""
        return frozenset(d.iommu_group for d in self._asked.values() if d.iommu_group is not None)

    @property
    def leaving(self) -> frozenset[PciAddress]:
        """Functions being given back, or whose give-back ended after the last scan."""
        return frozenset(self.giving_back | self._unscanned)

    def observed(self, snapshot: HostSnapshot) -> None:
        """A scan taken after every give-back that has ended: it shows them as they are,
        and shows whether the functions recalled from an earlier run are still on vfio-pci."""
        self._unscanned.clear()
        for address in self._recalled():
            pci = snapshot.device(address)
            on_vfio = (
                pci is not None
                and pci.driver == VFIO_DRIVER
                and pci.iommu_group == self.moved[address].iommu_group
            )
            event = MoveEvent.RECALL_CONFIRMED if on_vfio else MoveEvent.RECALL_REFUTED
            self._step(address, event)

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
        self._disown([a for a in self.moved if a not in present])
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
                if start and self.state(address) in (MoveState.IDLE, MoveState.MOVED):
                    self._step(address, MoveEvent.BIND_ASKED)
                    self._asked[address] = decision
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
        decision = self._asked.pop(event.address, None)
        if decision is None:
            raise UsageError(f"no bind of {event.address} is in flight")
        if event.withdrawn:
            self._step(event.address, MoveEvent.BIND_WITHDRAWN)
            return [Log.info("bind-withdrawn", device=str(event.address))]
        effects: list[UnbindDevice | Log] = []
        # Reported after a scan saw the device gone: whatever comes back is new.
        gone = event.address not in self._present or event.address in self._outlived
        self._outlived.discard(event.address)
        if gone:
            self._step(event.address, MoveEvent.BIND_OUTLIVED)
        elif event.error is None:
            move = Move(event.address, decision.driver, decision.iommu_group, pinned=event.pinned)
            self._step(event.address, MoveEvent.BIND_DONE, move)
        else:
            self._step(event.address, MoveEvent.BIND_FAILED)
        if event.error is None:
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
            and self.state(address) not in _GIVING_BACK
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
            self._step(moved.address, MoveEvent.GIVE_BACK_ASKED)
            self.failed[moved.address] = f"given back to {moved.driver or 'no driver'}: {reason}"
            driver = moved.driver or "none"
            effects.append(Log.warning("give-back", device=device, driver=driver, reason=reason))
            effects.append(UnbindDevice(moved.address, moved.driver, reason, pinned=moved.pinned))
        return effects

    def give_back_planned(self, address: PciAddress, held_groups: Container[int]) -> bool:
        """Whether a queued give-back should still be carried out, now its turn has come."""
        moved = self.moved.get(address)
        return (
            self.state(address) in _GIVING_BACK
            and address in self._selected
            and moved is not None
            and moved.iommu_group in self._broken_groups
            and moved.iommu_group not in held_groups
        )

    def unbound(self, event: UnbindingFinished) -> list[Log]:
        """A give-back ended: the function is on its old driver, or why not, or withdrawn."""
        if self.state(event.address) not in _GIVING_BACK:
            raise UsageError(f"no give-back of {event.address} is in flight")
        device = str(event.address)
        if event.withdrawn:
            self._step(event.address, MoveEvent.GIVE_BACK_WITHDRAWN)
            return [Log.info("give-back-withdrawn", device=device)]
        moved = self.moved.get(event.address)
        self._step(event.address, MoveEvent.GIVE_BACK_ENDED)
        self._unscanned.add(event.address)
        if event.error is None:
            driver = (moved.driver if moved else None) or "none"
            return [Log.info("given-back", device=device, driver=driver)]
        return [Log.error("give-back-failed", device=device, reason=event.error)]
