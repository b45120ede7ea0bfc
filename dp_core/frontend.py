"""What a front end is to the node: the protocol both front ends keep.

A front end is one way pods get devices (the kubelet's device-plugin API,
DRA). `Node` holds the host, the config, the one inventory, the binding plan
and the one ledger; each front end holds only its own state. The node routes
each input to the one front end that declares it (`handlers`) and tells every
front end when the world changed (`world_changed`: a scan, a config, the
binding plan) and when the ledger's holders of some IOMMU groups changed
(`holders_changed`), whoever changed them. A front end that changes the
ledger says so through the `Coordinator` the node gives it, and never calls
another front end.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol

import attrs

from .config.config import Config, FrontendName
from .host.snapshot import HostSnapshot
from .inventory.resources import Inventory

__all__ = ["Coordinator", "Effects", "Frontend", "Handler", "World"]

#: Effects as they pass between the node and its front ends. Each is one of
#: `dp_core.Effect`'s members; that union is made above the front ends whose
#: effects it joins (`dp_core.effects`), so here a list of them is typed loosely.
Effects = list[Any]
Handler = Callable[[Any], Effects]


@attrs.frozen
class World:
    """What every front end is told when it changes: the host, the config, the
    one inventory (each resource labelled with its front end, the binding
    plan's moves in its devices' health) and the node's clock."""

    snapshot: HostSnapshot
    config: Config
    inventory: Inventory
    now: float


class Coordinator(Protocol):
    """What a front end may ask of the node that holds it."""

    @property
    def now(self) -> float:
        """The time of the input being handled (the node's clock)."""
        ...

    @property
    def inventory(self) -> Inventory:
        """The one inventory, as last built."""
        ...

    def holders_changed(self, groups: Collection[int]) -> Effects:
        """These groups' holders changed: what every front end does about it."""
        ...

    def replan(self) -> Effects:
        """Holds were let go: binds put off while they held a group may go now."""
        ...


class Frontend(Protocol):
    """One front end, as the node drives it."""

    @property
    def name(self) -> FrontendName:
        """Its config label (`frontend:`): the resources of the inventory it offers."""
        ...

    @property
    def holders_known(self) -> bool:
        """Whether it knows every IOMMU group its holders hold: moves to vfio-pci
        wait until every front end does."""
        ...

    def handlers(self) -> Mapping[type, Handler]:
        """The inputs it handles, each with its handler; no two front ends share one."""
        ...

    def world_changed(self, world: World) -> Effects:
        """The host, the config or the binding plan changed: take the inventory again."""
        ...

    def holders_changed(self, groups: Collection[int]) -> Effects:
        """The ledger's holders of `groups` changed (whoever changed them)."""
        ...

    def holders_wanted(self) -> Effects:
        """Binds wait for `holders_known`: what it does to learn them sooner."""
        ...

    def due(self, now: float) -> Effects:
        """After every input (a `Tick` among them): what its deadlines make due at `now`."""
        ...

    def next_deadline(self) -> float | None:
        """When something of its own falls due, should no input come first (then
        the shell sends a `Tick`)."""
        ...
