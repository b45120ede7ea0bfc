"""Everything that can happen to a node, as frozen inputs: the union `Input`.

The node handles the inputs that concern it whole (a host scan, a config, a
tick) and the binding ones; each front end declares its own (`deviceplugin.
inputs`, `dra.inputs`), and the CDI specs' report goes to the front end that
keeps them. Every input class is importable from here.

Time arrives as `now` (seconds on a monotonic clock) on every input that can
start or check a timer, so the same inputs always give the same effects.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from .binding.events import BindingFinished, MovesRecalled, UnbindingFinished, WriteDue
from .cdi.spec import CdiSpecsWritten
from .config.config import Config
from .deviceplugin.inputs import (
    AllocateRequested,
    AllocationsObserved,
    ConnectionClosed,
    ConnectionOpened,
    ContainerPreference,
    DevicePluginInput,
    KubeletCheckpointObserved,
    KubeletStarted,
    KubeletStopped,
    OptionsRequested,
    PreferredAllocationRequested,
    PreStartRequested,
    RegistrationFailed,
    RegistrationSucceeded,
    WatchEnded,
    WatchStarted,
)
from .dra.inputs import (
    ClaimFilesRemoved,
    ClaimFilesWritten,
    ClaimPrepareRequested,
    ClaimRead,
    ClaimsRecalled,
    ClaimUnprepareRequested,
    ClaimUnreadable,
    DraFeaturesObserved,
    DraInput,
    HealthWatchEnded,
    HealthWatchStarted,
)
from .host.pci import PciId
from .host.snapshot import HostSnapshot

__all__ = [
    "AllocateRequested",
    "AllocationsObserved",
    "BindingFinished",
    "CdiSpecsWritten",
    "ClaimFilesRemoved",
    "ClaimFilesWritten",
    "ClaimPrepareRequested",
    "ClaimRead",
    "ClaimUnprepareRequested",
    "ClaimUnreadable",
    "ClaimsRecalled",
    "ConfigApplied",
    "ConnectionClosed",
    "ConnectionOpened",
    "ContainerPreference",
    "DraFeaturesObserved",
    "HealthWatchEnded",
    "HealthWatchStarted",
    "HostObserved",
    "Input",
    "KubeletCheckpointObserved",
    "KubeletStarted",
    "KubeletStopped",
    "MovesRecalled",
    "OptionsRequested",
    "PreStartRequested",
    "PreferredAllocationRequested",
    "RegistrationFailed",
    "RegistrationSucceeded",
    "Tick",
    "UnbindingFinished",
    "WatchEnded",
    "WatchStarted",
    "WriteDue",
]


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
class Tick:
    """`Node.next_deadline()` passed with nothing else happening."""

    now: float


Input = (
    HostObserved
    | ConfigApplied
    | Tick
    | DevicePluginInput
    | BindingFinished
    | UnbindingFinished
    | WriteDue
    | MovesRecalled
    | CdiSpecsWritten
    | DraInput
)
