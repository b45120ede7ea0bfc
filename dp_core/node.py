"""The node: one sans-IO state machine that coordinates its front ends.

`Node.handle(input)` takes one input and returns the effects to carry out, in
order. The node holds what the front ends share: the host snapshot, the
config, the one inventory (`build_inventory`, once per change), the binding
plan and moves (`BindingPlanner`), and the one ledger of IOMMU groups (`Ledger`). It
holds nothing of any front end and knows none by name: it is given a
sequence of them (`frontend.Frontend`). It handles the inputs that concern
it whole (a scan, a config, a tick, the binding reports) and routes every
other input to the one front end that declares it. What a front end's
handler changed comes back in its `Outcome`; once the handler has returned,
the node tells every front end of the groups whose holders changed, and
replans the binding when holds were let go. The shell feeds it and carries
out what it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from .binding.book import BindingBook
from .binding.events import (
    BindDevice,
    BindingFinished,
    MovesChanged,
    MovesRecalled,
    UnbindDevice,
    UnbindingFinished,
    WriteDecided,
    WriteDue,
)
from .binding.plan import BindDecision
from .binding.planner import BindingPlanner
from .config.config import Config
from .errors import UsageError
from .explain import Explainer
from .frontend import Frontend, Outcome, World
from .host.pci import PciAddress, PciId
from .host.snapshot import HostSnapshot
from .inputs import ConfigApplied, HostObserved, Tick
from .inventory.build import build_inventory
from .inventory.moves import FrontendMoves
from .ledger import Ledger
from .log import Log
from .tally import Tally

__all__ = ["Node", "NodeEffect"]

F = TypeVar("F")
E = TypeVar("E")

NodeEffect = BindDevice | UnbindDevice | WriteDecided | MovesChanged | Log
"""The effects of the node's own: moves to vfio-pci and back, and logs."""

_Step = Callable[[Any, float], Outcome[NodeEffect | E]]


class Node(Generic[E]):
    """One node's state. Not thread-safe; one caller at a time.

    `frontends` share `ledger`, the one book of IOMMU groups: each was made
    with it. They hear of every change in the order given.
    """

    def __init__(
        self,
        config: Config,
        frontends: Sequence[Frontend[E]],
        *,
        ledger: Ledger,
        pci_names: Mapping[PciId, str] | None = None,
    ) -> None:
        self.config = config
        self.pci_names: Mapping[PciId, str] = pci_names or {}
        self.snapshot = HostSnapshot()
        self.inventory = build_inventory(self.snapshot, config, self.pci_names)
        self._scanned = False
        self._now = 0.0
        self.explainer = Explainer()  # what `serve` logs of what `scan` explains
        # One ledger for every front end: one IOMMU group, one holder,
        # whichever front end it came through.
        self.ledger = ledger
        self.moves = FrontendMoves(self.inventory)  # a resource changing front ends, logged
        self.planner = BindingPlanner(self.ledger)
        self.tally = Tally()
        names = [frontend.name for frontend in frontends]
        if len(set(names)) != len(names):
            raise UsageError(f"two front ends have one name: {names}")
        self.frontends: tuple[Frontend[E], ...] = tuple(frontends)
        self._handlers: dict[type[Any], _Step[E]] = {
            HostObserved: self._host_observed,
            ConfigApplied: self._config_applied,
            Tick: self._tick,
            BindingFinished: self._binding_finished,
            UnbindingFinished: self._unbinding_finished,
            WriteDue: self._write_due,
            MovesRecalled: self._moves_recalled,
        }
        for frontend in self.frontends:
            for kind, handler in frontend.handlers().items():
                if kind in self._handlers:
                    raise UsageError(f"{kind.__name__} is handled twice ({frontend.name})")
                self._handlers[kind] = handler

    # -- public API ----------------------------------------------------------

    def handle(self, event: object) -> list[NodeEffect | E]:
        """The effects of `event`, in order: an input of the node's own (a scan,
        a config, a tick, the binding reports) or one a front end declares
        (`Input` lists those of dp's two); any other is a `UsageError`."""
        handler = self._handlers.get(type(event))
        if handler is None:
            raise UsageError(f"{type(event).__name__} is not an input of this node")
        now = getattr(event, "now", None)
        if now is not None:
            if now < self._now:
                raise UsageError(f"time went backwards: {now} after {self._now}")
            self._now = now
        moves_version = self.bind_book.moves_version
        effects = self._follow(handler(event, self._now))
        effects.extend(self.moves.observe(self.inventory, self.ledger))
        if self.bind_book.moves_version != moves_version:
            effects.append(MovesChanged(self.bind_book.moves()))
        for frontend in self.frontends:
            effects.extend(frontend.due(self._now))
        return effects

    def next_deadline(self) -> float | None:
        """When the shell should send a Tick if nothing else happens first."""
        deadlines = [frontend.next_deadline() for frontend in self.frontends]
        return min((d for d in deadlines if d is not None), default=None)

    def frontend(self, kind: type[F]) -> F:
        """The front end of class `kind`."""
        for frontend in self.frontends:
            if isinstance(frontend, kind):
                return frontend
        raise UsageError(f"this node has no {kind.__name__}")

    @property
    def now(self) -> float:
        """The time of the latest input that carried one."""
        return self._now

    @property
    def bind_book(self) -> BindingBook:
        return self.planner.book

    @property
    def bindings(self) -> dict[PciAddress, BindDecision]:
        """The binding plan, by function."""
        return self.planner.plan

    # -- after a step: the one way news travels between front ends -------------

    def _follow(self, outcome: Outcome[NodeEffect | E]) -> list[NodeEffect | E]:
        """`outcome`'s effects, then what every front end does about the holders
        it changed, then the binding replanned if it let holds go."""
        effects = list(outcome.effects)
        effects += self._tell_holders(outcome.held)
        if outcome.released and self.config.binding is not None:
            effects += self._follow(self._rebuild())
        return effects

    def _tell_holders(self, groups: frozenset[int]) -> list[NodeEffect | E]:
        if not groups:
            return []
        effects: list[NodeEffect | E] = []
        for frontend in self.frontends:
            effects.extend(frontend.holders_changed(groups))
        return effects

    # -- the host, the config, the plan -----------------------------------------

    def _host_observed(self, event: HostObserved, now: float) -> Outcome[NodeEffect | E]:
        self.snapshot = event.snapshot
        self._scanned = True
        self.tally.host_scans += 1
        self.bind_book.observed(event.snapshot)
        rebuilt = self._rebuild()
        waiting = [frontend for frontend in self.frontends if not frontend.holders_known]
        if not waiting or not any(d.binds for d in self.bindings.values()):
            return rebuilt
        wanted = [effect for frontend in waiting for effect in frontend.holders_wanted()]
        return Outcome((*rebuilt.effects, *wanted), rebuilt.held)

    def _config_applied(self, event: ConfigApplied, now: float) -> Outcome[NodeEffect | E]:
        self.config = event.config
        self.pci_names = event.pci_names
        self.bind_book.retry_all(self.snapshot, self.config)
        return self._rebuild()

    def _rebuild(self) -> Outcome[NodeEffect | E]:
        start = all(frontend.holders_known for frontend in self.frontends)
        effects: list[NodeEffect | E] = []
        effects += self.planner.replan(self.snapshot, self.config, start=start)
        effects += self.planner.give_back_stranded()
        world = self._rebuild_inventory()
        return Outcome((*effects, *world.effects), world.held)

    def _rebuild_inventory(self) -> Outcome[NodeEffect | E]:
        """The inventory again from the snapshot, plan and give-backs held now,
        and every front end told of it (the holders they changed on the way
        are told once every front end has seen the new world)."""
        self.inventory = build_inventory(
            self.snapshot,
            self.config,
            self.pci_names,
            self.bindings,
            self.bind_book.leaving,
            self.bind_book.moving_groups,
        )
        world = World(self.snapshot, self.config, self.inventory, self._now)
        effects: list[NodeEffect | E] = []
        effects += self.explainer.changed(self.snapshot, self.config, self.inventory, self._scanned)
        held: set[int] = set()
        for frontend in self.frontends:
            outcome = frontend.world_changed(world)
            effects.extend(outcome.effects)
            held |= outcome.held
        return Outcome(tuple(effects), frozenset(held))

    def _tick(self, event: Tick, now: float) -> Outcome[NodeEffect | E]:
        return Outcome()  # what falls due, falls due after every input (`Frontend.due`)

    def _binding_finished(self, event: BindingFinished, now: float) -> Outcome[NodeEffect | E]:
        effects, rebuild = self.planner.finished(event, self.snapshot, self.config)
        if not event.withdrawn:
            self.tally.bindings[event.error is None] += 1
        if not rebuild:
            return Outcome(tuple(effects))
        world = self._rebuild_inventory()
        return Outcome((*effects, *world.effects), world.held)

    def _unbinding_finished(self, event: UnbindingFinished, now: float) -> Outcome[NodeEffect | E]:
        effects = self.planner.unbound(event)
        world = self._rebuild_inventory()
        return Outcome((*effects, *world.effects), world.held)

    def _write_due(self, event: WriteDue, now: float) -> Outcome[NodeEffect | E]:
        """A queued write's turn: it goes, or the node withdraws it here."""
        if self.planner.still_planned(event):
            return Outcome((WriteDecided(event.call, carry_out=True),))
        address = event.write.address
        withdrawn = (
            self._unbinding_finished(UnbindingFinished(address, None, now, withdrawn=True), now)
            if isinstance(event.write, UnbindDevice)
            else self._binding_finished(BindingFinished(address, None, now, withdrawn=True), now)
        )
        answer = WriteDecided(event.call, carry_out=False)
        return Outcome((*withdrawn.effects, answer), withdrawn.held)

    def _moves_recalled(self, event: MovesRecalled, now: float) -> Outcome[NodeEffect | E]:
        return Outcome(tuple(self.planner.recalled(event, scanned=self._scanned)))
