"""What the core asks the shell to do, as frozen effects."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from .advertised import AdvertisedDevice
from .answers import Answer, PluginOptions
from .cdi import CdiSpecsChanged
from .dra_effects import DraEffect
from .errors import StatusCode
from .moves import Move
from .pci import PciAddress

__all__ = [
    "AttributeConnection",
    "BindDevice",
    "Effect",
    "EndStream",
    "Log",
    "Publish",
    "RefreshAllocations",
    "Register",
    "Reject",
    "Reply",
    "HealthChanged",
    "UnbindDevice",
]


@attrs.frozen
class Register:
    """Call the kubelet's Register for `resource`.

    `own_socket` is True in per-resource mode, where the shell must be
    listening on `endpoint` for this resource alone before it calls.
    """

    resource: str
    endpoint: str
    options: PluginOptions
    attempt: int
    own_socket: bool = False


@attrs.frozen
class AttributeConnection:
    """Connection `connection` is attributed to `resource` (docs/design.md §4)."""

    connection: int
    resource: str


@attrs.frozen
class Publish:
    """Send `devices` as the whole device list on one ListAndWatch stream."""

    stream: int
    resource: str
    devices: tuple[AdvertisedDevice, ...]


@attrs.frozen
class EndStream:
    stream: int
    reason: str


@attrs.frozen
class Reply:
    call: int
    answer: Answer


@attrs.frozen
class Reject:
    call: int
    status: StatusCode
    message: str


@attrs.frozen
class HealthChanged:
    """A device's health changed: it turned unhealthy, or healthy again (`healthy`)."""

    resource: str
    device_id: str
    healthy: bool
    reason: str


@attrs.frozen
class RefreshAllocations:
    """Ask the PodResources API now rather than at the next poll."""

    reason: str


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
class Log:
    level: str
    event: str
    # Pairs, in order; a sequence that renders them when read may stand in
    # for the tuple (see `allocation._AllocationFields`).
    fields: Sequence[tuple[str, object]] = ()

    @classmethod
    def info(cls, event: str, **fields: object) -> Log:
        return cls("info", event, tuple(fields.items()))

    @classmethod
    def warning(cls, event: str, **fields: object) -> Log:
        return cls("warning", event, tuple(fields.items()))

    @classmethod
    def error(cls, event: str, **fields: object) -> Log:
        return cls("error", event, tuple(fields.items()))


Effect = (
    Register
    | AttributeConnection
    | Publish
    | EndStream
    | Reply
    | Reject
    | HealthChanged
    | RefreshAllocations
    | BindDevice
    | UnbindDevice
    | MovesChanged
    | CdiSpecsChanged
    | DraEffect
    | Log
)
