"""The node: one sans-IO state machine that coordinates its front ends.

`Node.handle(input)` takes one input and returns the effects to carry out, in
order. The node holds what the front ends share: the host snapshot, the
config, the one inventory (`build_inventory`, once per change), the binding
plan and moves (`Binder`), and the one ledger of IOMMU groups (`Ledger`). It
holds nothing of any front end. It handles the inputs that concern it whole
(a scan, a config, a tick, the binding reports), routes every other input to
the one front end that declares it, and tells every front end when the world
or the ledger changed (`frontend.Frontend`). The shell feeds it and carries
out what it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from .binding.binder import Binder
from .binding.book import BindingBook
from .binding.events import BindingFinished, MovesChanged, MovesRecalled, UnbindingFinished
from .binding.plan import BindDecision
from .config.config import Config
from .deviceplugin.endpoints import NAME_MAX
from .deviceplugin.frontend import DevicePluginFrontend
from .deviceplugin.registration import SocketMode
from .dra.frontend import DraFrontend
from .effects import Effect
from .errors import UsageError
from .explain import Explainer
from .frontend import Effects, Frontend, World
from .host.pci import PciAddress, PciId
from .host.snapshot import HostSnapshot
from .inputs import ConfigApplied, HostObserved, Input, Tick
from .inventory.build import build_inventory
from .ledger import Ledger
from .tally import Tally
from .timing import Timing

__all__ = ["Node"]


class Node:
    """One node's state. Not thread-safe; one caller at a time."""

    def __init__(
        self,
        config: Config,
        *,
        socket_mode: SocketMode = SocketMode.SINGLE,
        endpoint_prefix: str = "dp",
        endpoint_max_length: int = NAME_MAX,
        timing: Timing | None = None,
        pci_names: Mapping[PciId, str] | None = None,
        cdi: bool = False,
        node_name: str | None = None,
        dra_partitionable: bool = True,
        dra_device_taints: bool = True,
    ) -> None:
        self.timing = timing or Timing()
        self.config = config
        self.pci_names: Mapping[PciId, str] = pci_names or {}
        self.snapshot = HostSnapshot()
        self.inventory = build_inventory(self.snapshot, config, self.pci_names)
        self._scanned = False
        self._now = 0.0
        self.explainer = Explainer()  # what `serve` logs of what `scan` explains
        # One ledger for every front end: one IOMMU group, one holder,
        # whichever front end it came through.
        self.ledger = Ledger()
        self.binder = Binder(self.ledger)
        self.tally = Tally()
        # The front ends, in the order they hear of every change. A new front
        # end is one more entry here (and its module).
        self.device_plugin = DevicePluginFrontend(
            self,
            self.ledger,
            self.timing,
            socket_mode=socket_mode,
            endpoint_prefix=endpoint_prefix,
            endpoint_max_length=endpoint_max_length,
            cdi=cdi,
        )
        # The dra_* flags are what the config's "auto" assumes until the API
        # server shows whether it has those features (DraFeaturesObserved).
        self.dra = DraFrontend(
            self,
            self.ledger,
            node_name or "",
            partitionable=dra_partitionable,
            device_taints=dra_device_taints,
            health_resend=self.timing.health_resend,
        )
        self.frontends: tuple[Frontend, ...] = (self.device_plugin, self.dra)
        self._owner = self.device_plugin.registrar.owner  # who a connection's RPCs count for
        self._deferred: set[int] | None = None  # holders changed while the world changes
        self._handlers: dict[type[Any], Callable[[Any], Effects]] = {
            HostObserved: self._host_observed,
            ConfigApplied: self._config_applied,
            Tick: self._tick,
            BindingFinished: self._binding_finished,
            UnbindingFinished: self._unbinding_finished,
            MovesRecalled: self._moves_recalled,
        }
        for frontend in self.frontends:
            for kind, handler in frontend.handlers().items():
                if kind in self._handlers:
                    raise UsageError(f"{kind.__name__} is handled twice ({frontend.name})")
                self._handlers[kind] = handler

    # -- public API ----------------------------------------------------------

    def handle(self, event: Input) -> list[Effect]:
        handler = self._handlers.get(type(event))
        if handler is None:
            raise UsageError(f"{type(event).__name__} is not a dp_core input")
        now = getattr(event, "now", None)
        if now is not None:
            if now < self._now:
                raise UsageError(f"time went backwards: {now} after {self._now}")
            self._now = now
        moves_version = self.bind_book.moves_version
        effects: list[Effect] = handler(event)
        if self.bind_book.moves_version != moves_version:
            effects.append(MovesChanged(self.bind_book.moves()))
        for frontend in self.frontends:
            effects.extend(frontend.due(self._now))
        self.tally.observe(event, effects, self._owner)
        return effects

    def next_deadline(self) -> float | None:
        """When the shell should send a Tick if nothing else happens first."""
        deadlines = [frontend.next_deadline() for frontend in self.frontends]
        return min((d for d in deadlines if d is not None), default=None)

    @property
    def now(self) -> float:
        """The time of the latest input that carried one."""
        return self._now

    @property
    def bind_book(self) -> BindingBook:
        return self.binder.book

    @property
    def bindings(self) -> dict[PciAddress, BindDecision]:
        """The binding plan, by function."""
        return self.binder.plan

    def bind_planned(self, address: PciAddress, driver: str | None) -> bool:
        """Whether a queued `BindDevice` should still be carried out (`Binder.bind_planned`)."""
        return self.binder.bind_planned(address, driver)

    def give_back_planned(self, address: PciAddress) -> bool:
        """Whether a queued `UnbindDevice` should still be carried out, now its turn has come."""
        return self.binder.give_back_planned(address)

    # -- what the front ends may ask (frontend.Coordinator) --------------------

    def holders_changed(self, groups: Collection[int]) -> Effects:
        """Tell every front end that these groups' holders changed. While the
        world changes, they hear of it once every front end has seen the new world."""
        if not groups:
            return []
        if self._deferred is not None:
            self._deferred.update(groups)
            return []
        effects: Effects = []
        for frontend in self.frontends:
            effects.extend(frontend.holders_changed(groups))
        return effects

    def replan(self) -> Effects:
        """Holds were let go: binds and give-backs put off while they held a group may go."""
        return self._rebuild() if self.config.binding is not None else []

    # -- the host, the config, the plan -----------------------------------------

    def _host_observed(self, event: HostObserved) -> Effects:
        self.snapshot = event.snapshot
        self._scanned = True
        self.bind_book.observed(event.snapshot)
        effects = self._rebuild()
        waiting = [frontend for frontend in self.frontends if not frontend.holders_known]
        if waiting and any(d.binds for d in self.bindings.values()):
            for frontend in waiting:
                effects.extend(frontend.holders_wanted())
        return effects

    def _config_applied(self, event: ConfigApplied) -> Effects:
        self.config = event.config
        self.pci_names = event.pci_names
        self.bind_book.retry_all(self.snapshot, self.config)
        return self._rebuild()

    def _rebuild(self) -> Effects:
        start = all(frontend.holders_known for frontend in self.frontends)
        effects: Effects = self.binder.replan(self.snapshot, self.config, start=start)
        effects += self.binder.give_back_stranded()
        effects += self._rebuild_inventory()
        return effects

    def _rebuild_inventory(self) -> Effects:
        """The inventory again from the snapshot, plan and give-backs held now,
        and every front end told of it."""
        self.inventory = build_inventory(
            self.snapshot,
            self.config,
            self.pci_names,
            self.bindings,
            self.bind_book.leaving,
            self.bind_book.moving_groups,
        )
        world = World(self.snapshot, self.config, self.inventory, self._now)
        effects: Effects = []
        effects += self.explainer.changed(self.snapshot, self.config, self.inventory, self._scanned)
        outer = self._deferred
        deferred = self._deferred = outer if outer is not None else set()
        try:
            for frontend in self.frontends:
                effects.extend(frontend.world_changed(world))
        finally:
            self._deferred = outer
        if outer is None:
            effects.extend(self.holders_changed(deferred))
        return effects

    def _tick(self, event: Tick) -> Effects:
        return []  # what falls due, falls due after every input (`Frontend.due`)

    def _binding_finished(self, event: BindingFinished) -> Effects:
        effects, rebuild = self.binder.finished(event, self.snapshot, self.config)
        return effects + self._rebuild_inventory() if rebuild else list(effects)

    def _unbinding_finished(self, event: UnbindingFinished) -> Effects:
        return self.binder.unbound(event) + self._rebuild_inventory()

    def _moves_recalled(self, event: MovesRecalled) -> Effects:
        return self.binder.recalled(event, scanned=self._scanned)
