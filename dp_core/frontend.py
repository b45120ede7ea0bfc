"""What a front end is to the node: the protocol every front end keeps.

A front end is one way pods get devices (the kubelet's device-plugin API,
DRA, or one of a plugin author's). `Node` holds the host, the config, the
one inventory, the binding plan and the one ledger; each front end holds
only its own state, and the node knows none by name.

The seam runs one way, down: the node routes each input to the one front
end that declares it (`handlers`), and the handler returns an `Outcome`:
its effects, the IOMMU groups whose holder it changed, and whether it let
holds go (binds put off while they held a group may go now). Only then,
with the handler off the stack, does the node tell every front end of the
new holders (`holders_changed`) and replan. A front end never calls the
node, nor another front end; nothing in the core is re-entrant.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

import attrs

from .config.config import Config
from .host.snapshot import HostSnapshot
from .inventory.resources import Inventory
from .metric import MetricFamily

__all__ = ["Clock", "Frontend", "Handler", "Outcome", "World"]

E_co = TypeVar("E_co", covariant=True)


@attrs.frozen
class World:
    """What every front end is told when it changes: the host, the config, the
    one inventory (each resource labelled with its front end, the binding
    plan's moves in its devices' health) and the node's clock."""

    snapshot: HostSnapshot
    config: Config
    inventory: Inventory
    now: float


def _groups(groups: Iterable[int]) -> frozenset[int]:
    return groups if isinstance(groups, frozenset) else frozenset(groups)


@attrs.frozen
class Outcome(Generic[E_co]):
    """What one step of a front end did: its effects, in order, and what the
    node must tell the others once the step has returned."""

    effects: tuple[E_co, ...] = ()
    #: The IOMMU groups whose holder in the ledger this step changed.
    held: frozenset[int] = attrs.field(default=frozenset(), converter=_groups)
    #: Holds were let go: binds and give-backs put off while they held a
    #: group may go now (the node replans the binding, if it has one).
    released: bool = False

    @classmethod
    def of(
        cls, effects: Iterable[E_co], held: Iterable[int] = (), *, released: bool = False
    ) -> Outcome[E_co]:
        return cls(tuple(effects), held, released)


Handler = Callable[[Any, float], Outcome[E_co]]
"""A front end's handler of one input kind, given the input and the node's clock."""

E = TypeVar("E")


class Clock:
    """The node's clock as a front end last heard it: the time of the step it
    is handling (inputs that carry none are handled at the node's time)."""

    def __init__(self) -> None:
        self.now = 0.0

    def handlers(self, steps: Mapping[type, Callable[[Any], Outcome[E]]]) -> dict[type, Handler[E]]:
        """`steps` as the node calls them: each told the time first."""
        return {kind: self._clocked(step) for kind, step in steps.items()}

    def _clocked(self, step: Callable[[Any], Outcome[E]]) -> Handler[E]:
        def handle(event: Any, now: float) -> Outcome[E]:
            self.now = now
            return step(event)

        return handle


class Frontend(Protocol[E_co]):
    """One front end, as the node drives it. `E_co` is the union of its effects."""

    @property
    def name(self) -> str:
        """Its name, unique on the node. dp's two are also config labels
        (`frontend:`, `FrontendName`): each offers the resources of the
        inventory labelled with its name."""
        ...

    @property
    def holders_known(self) -> bool:
        """Whether it knows every IOMMU group its holders hold: moves to vfio-pci
        wait until every front end does."""
        ...

    def handlers(self) -> Mapping[type, Handler[E_co]]:
        """The inputs it handles, each with its handler; no two front ends share one."""
        ...

    def world_changed(self, world: World) -> Outcome[E_co]:
        """The host, the config or the binding plan changed: take the inventory again."""
        ...

    def holders_changed(self, groups: Collection[int]) -> Sequence[E_co]:
        """The ledger's holders of `groups` changed (whoever changed them)."""
        ...

    def holders_wanted(self) -> Sequence[E_co]:
        """Binds wait for `holders_known`: what it does to learn them sooner."""
        ...

    def due(self, now: float) -> Sequence[E_co]:
        """After every input (a `Tick` among them): what its deadlines make due at
        `now`, and the effects that tell the shell of a change in its state the
        shell acts on (the shell reads no front end's state)."""
        ...

    def next_deadline(self) -> float | None:
        """When something of its own falls due, should no input come first (then
        the shell sends a `Tick`)."""
        ...

    def metrics(self) -> Sequence[MetricFamily]:
        """Its metric families (`metrics.collect` joins the node's and each front end's)."""
        ...
