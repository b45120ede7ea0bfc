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
    "WriteDecided",
    "WriteDue",
]


@attrs.frozen
class BindDevice:
    """Move a PCI function to vfio-pci (docs/design.md §6).

    The shell writes `vfio-pci` to its `driver_override`, unbinds it from
    `driver` (when it has one) and asks the kernel to probe it, checking first
    that `driver` still holds it. Binds run one at a time: when its turn
    comes, the shell asks whether it still goes (`WriteDue`), and once it has
    been carried out answers with `BindingFinished`, then a fresh
    `HostObserved`.
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
    it to `driver` (None: leaves it without one). Like a bind, it asks
    `WriteDue` when its turn comes, and answers with `UnbindingFinished`,
    then a fresh `HostObserved`.
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

    `error` is None when it did what it was asked. `withdrawn`: nothing was
    written, and `error` is then None. The node withdraws a write the plan no
    longer wants itself, when its turn comes (`WriteDue`); the shell reports
    one withdrawn when the write was found done already (a bind of a function
    on vfio-pci).
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
    vfio-pci; withdrawn when the function was on vfio-pci already. `pinned`: its
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
    back on the driver it was taken from."""


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
class WriteDue:
    """The turn of a queued `BindDevice` or `UnbindDevice` has come; `call`
    pairs it with its answer, `WriteDecided`.

    Writes run one at a time, and a slow driver can hold one for seconds: a
    config change or a rescan since the effect was emitted may have taken it
    out of the plan. The node decides now, and withdraws it itself if so.
    """

    call: int
    write: BindDevice | UnbindDevice
    now: float


@attrs.frozen
class WriteDecided:
    """The answer to `WriteDue` `call`: carry the write out (and report it with
    `BindingFinished` or `UnbindingFinished`), or not: the node has withdrawn
    it already, and nothing is written or reported."""

    call: int
    carry_out: bool
