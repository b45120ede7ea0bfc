"""Everything that can happen to a device-plugin server, as frozen inputs.

Time arrives as `now` (seconds on a monotonic clock) on every input that can
start or check a timer, so the same inputs always give the same effects.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

import attrs

from .cdi import CdiSpecsWritten
from .config import Config
from .dra_inputs import DraInput
from .host import HostSnapshot
from .kubelet_checkpoint import KubeletCheckpoint
from .moves import Move
from .pci import PciAddress, PciId

__all__ = [
    "AllocateRequested",
    "AllocationsObserved",
    "BindingFinished",
    "ConfigApplied",
    "ConnectionClosed",
    "ConnectionOpened",
    "ContainerPreference",
    "HostObserved",
    "Input",
    "KubeletCheckpointObserved",
    "KubeletStarted",
    "KubeletStopped",
    "OptionsRequested",
    "PreStartRequested",
    "PreferredAllocationRequested",
    "RegistrationFailed",
    "RegistrationSucceeded",
    "Tick",
    "UnbindingFinished",
    "WatchEnded",
    "WatchStarted",
]


def _ids(value: object) -> tuple[str, ...]:
    return tuple(str(item) for item in value)  # type: ignore[attr-defined]


def _id_lists(value: object) -> tuple[tuple[str, ...], ...]:
    return tuple(_ids(item) for item in value)  # type: ignore[attr-defined]


def _frozen_mapping(value: Mapping[str, frozenset[str]]) -> Mapping[str, frozenset[str]]:
    return MappingProxyType({key: frozenset(ids) for key, ids in value.items()})


@attrs.frozen
class HostObserved:
    """A fresh scan of the host."""

    snapshot: HostSnapshot
    now: float


@attrs.frozen
class ConfigApplied:
    """A (re)loaded config, with the PCI ID database names if that mode is on."""

    config: Config
    now: float
    pci_names: Mapping[PciId, str] = attrs.field(factory=dict, eq=False)


@attrs.frozen
class KubeletStarted:
    """kubelet.sock appeared or was created again: every resource must register.

    `checkpoint` is the kubelet's device-manager checkpoint as read then
    (kubelet_sync): what pods it may not list yet were given.
    """

    now: float
    checkpoint: KubeletCheckpoint = KubeletCheckpoint()


@attrs.frozen
class KubeletCheckpointObserved:
    """The kubelet wrote its checkpoint again (`Node.wants_kubelet_checkpoint`)."""

    checkpoint: KubeletCheckpoint
    now: float


@attrs.frozen
class KubeletStopped:
    """kubelet.sock is gone: registering is pointless until it comes back."""

    now: float


@attrs.frozen
class RegistrationSucceeded:
    resource: str
    attempt: int
    now: float


@attrs.frozen
class RegistrationFailed:
    """A Register call failed; `unanswered` when it ended without the kubelet's
    answer (it timed out), so the kubelet may still act on it and dial."""

    resource: str
    attempt: int
    reason: str
    now: float
    unanswered: bool = False


@attrs.frozen
class ConnectionOpened:
    """A kubelet connection was accepted.

    `listener` names the resource when the connection came in on that
    resource's own socket (per-resource mode), and is None on the shared one.
    """

    connection: int
    now: float
    listener: str | None = None


@attrs.frozen
class ConnectionClosed:
    connection: int
    now: float


@attrs.frozen
class OptionsRequested:
    connection: int
    call: int
    now: float


@attrs.frozen
class WatchStarted:
    """ListAndWatch opened; `stream` identifies it in later Publish effects."""

    connection: int
    stream: int
    now: float


@attrs.frozen
class WatchEnded:
    stream: int


@attrs.frozen
class ContainerPreference:
    available: tuple[str, ...] = attrs.field(converter=_ids)
    must_include: tuple[str, ...] = attrs.field(converter=_ids)
    size: int = attrs.field()

    @size.validator
    def _check_size(self, attribute: attrs.Attribute[int], value: int) -> None:
        if value < 0:
            raise ValueError(f"allocation size must be >= 0, got {value}")


def _preferences(value: Iterable[ContainerPreference]) -> tuple[ContainerPreference, ...]:
    return tuple(value)


@attrs.frozen
class PreferredAllocationRequested:
    connection: int
    call: int
    containers: tuple[ContainerPreference, ...] = attrs.field(converter=_preferences)
    now: float


@attrs.frozen
class AllocateRequested:
    """One Allocate call; `containers` holds each container request's device IDs."""

    connection: int
    call: int
    containers: tuple[tuple[str, ...], ...] = attrs.field(converter=_id_lists)
    now: float


@attrs.frozen
class PreStartRequested:
    connection: int
    call: int
    device_ids: tuple[str, ...] = attrs.field(converter=_ids)
    now: float


@attrs.frozen
class AllocationsObserved:
    """What the PodResources API says active pods hold, per resource."""

    held: Mapping[str, frozenset[str]] = attrs.field(converter=_frozen_mapping, eq=False)
    now: float


@attrs.frozen
class _WritesFinished:
    """The shell carried out an effect that writes to a function's sysfs files.

    `error` is None when it did what it was asked. `withdrawn`: when its turn
    came, the node said it is no longer planned, so nothing was written, and
    `error` is then None.
    """

    address: PciAddress
    error: str | None
    now: float
    withdrawn: bool = attrs.field(default=False, kw_only=True)

    def __attrs_post_init__(self) -> None:
        if self.withdrawn and self.error is not None:
            raise ValueError(f"a withdrawn {type(self).__name__} wrote nothing, so has no error")


@attrs.frozen
class BindingFinished(_WritesFinished):
    """A `BindDevice` was carried out: `error` is None when the function is on
    vfio-pci; withdrawn when `Node.bind_planned` said no (a config change or a
    rescan since, or the function was on vfio-pci already). `pinned`: its
    driver_override named the driver it was taken from, which a give-back
    must write there again."""

    pinned: bool = attrs.field(default=False, kw_only=True)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.pinned and (self.error is not None or self.withdrawn):
            raise ValueError("only a bind that moved the function knows what held it")


@attrs.frozen
class UnbindingFinished(_WritesFinished):
    """An `UnbindDevice` was carried out: `error` is None when the function is
    back on the driver it was taken from; withdrawn when
    `Node.give_back_planned` said no (the config changed or dropped the device,
    or an allocation holds its group)."""


def _moves(value: Iterable[Move]) -> tuple[Move, ...]:
    return tuple(value)


@attrs.frozen
class MovesRecalled:
    """At start, before the first `HostObserved`: the moves an earlier run
    reported last (`MovesChanged`). A recalled function the first scan does
    not show on vfio-pci has been moved since, and is forgotten."""

    moves: tuple[Move, ...] = attrs.field(converter=_moves)

    @moves.validator
    def _once_each(
        self, attribute: attrs.Attribute[tuple[Move, ...]], value: tuple[Move, ...]
    ) -> None:
        addresses = [move.address for move in value]
        twice = sorted({a for a in addresses if addresses.count(a) > 1})
        if twice:
            raise ValueError(f"moved twice: {', '.join(map(str, twice))}")


@attrs.frozen
class Tick:
    now: float


Input = (
    HostObserved
    | ConfigApplied
    | KubeletStarted
    | KubeletCheckpointObserved
    | KubeletStopped
    | RegistrationSucceeded
    | RegistrationFailed
    | ConnectionOpened
    | ConnectionClosed
    | OptionsRequested
    | WatchStarted
    | WatchEnded
    | PreferredAllocationRequested
    | AllocateRequested
    | PreStartRequested
    | AllocationsObserved
    | BindingFinished
    | UnbindingFinished
    | MovesRecalled
    | CdiSpecsWritten
    | DraInput
    | Tick
)
