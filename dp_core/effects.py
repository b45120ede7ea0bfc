"""What the node asks the shell to do, as frozen effects: the union `Effect`.

Each part of the core has its own (`deviceplugin.effects`, `dra.effects`,
binding's moves, the CDI specs), and every one logs (`Log`). Every effect
class is importable from here.
"""

from __future__ import annotations

from .binding.events import BindDevice, MovesChanged, UnbindDevice, WriteDecided
from .cdi.spec import CdiSpecsChanged
from .deviceplugin.effects import (
    AttributeConnection,
    DevicePluginEffect,
    EndStream,
    HealthChanged,
    KubeletCheckpointWanted,
    Publish,
    RefreshAllocations,
    Register,
    RegistrationsSettled,
    Reject,
    Reply,
)
from .dra.effects import (
    ClaimAnswered,
    ClaimPrepared,
    ClaimRefused,
    ClaimsChanged,
    ClaimUnprepared,
    DraEffect,
    PoolChanged,
    PublishHealth,
    ReadClaim,
)
from .log import Log

__all__ = [
    "AttributeConnection",
    "BindDevice",
    "CdiSpecsChanged",
    "ClaimAnswered",
    "ClaimPrepared",
    "ClaimRefused",
    "ClaimUnprepared",
    "ClaimsChanged",
    "Effect",
    "EndStream",
    "HealthChanged",
    "KubeletCheckpointWanted",
    "Log",
    "MovesChanged",
    "PoolChanged",
    "Publish",
    "PublishHealth",
    "ReadClaim",
    "RefreshAllocations",
    "Register",
    "RegistrationsSettled",
    "Reject",
    "Reply",
    "UnbindDevice",
    "WriteDecided",
]

Effect = (
    DevicePluginEffect
    | BindDevice
    | UnbindDevice
    | WriteDecided
    | MovesChanged
    | CdiSpecsChanged
    | DraEffect
    | Log
)
