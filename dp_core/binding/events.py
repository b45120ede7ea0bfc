"""What binding asks the shell to do (effects), and what the shell tells it back
(inputs): moves to vfio-pci and back, and what dp moved, kept across restarts."""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from ..host.pci import PciAddress
from .moves import Move

__all__ = [
    "BindDevice",
    "BindingFinished",
    "MovesChanged",
    "MovesRecalled",
    "UnbindDevice",
    "UnbindingFinished",
]


@attrs.frozen
class BindDevice:
    """Move a PCI function to vfio-pci (docs/design.md §6).

    The shell writes `vfio-pci` to its `driver_override`, unbinds it from
    `driver` (when it has one) and asks the kernel to probe it, checking first
    that `driver` still holds it. It answers with `BindingFinished`, then a
    fresh `HostObserved`.
    """

    address: PciAddress
    driver: str | None


@attrs.frozen
class UnbindDevice:
    """Give a function dp moved to vfio-pci back to `driver`, the one it took it from.

    The core asks this only for functions it moved itself whose IOMMU group
    cannot become usable (a sibling's move failed), so the host gets the
    whole group back rather than half of it. The shell unbinds it from
    vfio-pci (checking first that vfio-pci still holds it), clears its
    `driver_override` (or, if `pinned`, writes `driver` there again) and binds
    it to `driver` (None: leaves it without one).
    It answers with `UnbindingFinished`, then a fresh `HostObserved`.
    """

    address: PciAddress
    driver: str | None
    reason: str
    # Its driver_override named `driver` before dp moved it: write that back.
    pinned: bool = attrs.field(default=False, kw_only=True)


@attrs.frozen
class MovesChanged:
    """What dp has moved to vfio-pci changed; `moves` is all of it now.

    The shell keeps it where a restarted dp finds it and hands it back with
    `MovesRecalled`: a dp restarted between moving part of an IOMMU group and
    giving it back still knows which functions it took from which driver.
    """

    moves: tuple[Move, ...]


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
