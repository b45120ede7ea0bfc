"""What can happen to the device-plugin front end, as frozen inputs: the
kubelet coming and going, registrations, connections, the device plugin's
calls, and what PodResources says pods hold.

Time arrives as `now` (seconds on a monotonic clock) on every input that can
start or check a timer, so the same inputs always give the same effects.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

import attrs

from .checkpoint import KubeletCheckpoint

__all__ = [
    "AllocateRequested",
    "AllocationsObserved",
    "ConnectionClosed",
    "ConnectionOpened",
    "ContainerPreference",
    "DevicePluginInput",
    "KubeletCheckpointObserved",
    "KubeletStarted",
    "KubeletStopped",
    "OptionsRequested",
    "PreStartRequested",
    "PreferredAllocationRequested",
    "RegistrationFailed",
    "RegistrationSucceeded",
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
class KubeletStarted:
    """kubelet.sock appeared or was created again: every resource must register.

    `checkpoint` is the kubelet's device-manager checkpoint as read then
    (`sync`): what pods it may not list yet were given.
    """

    now: float
    checkpoint: KubeletCheckpoint = KubeletCheckpoint()


@attrs.frozen
class KubeletCheckpointObserved:
    """The kubelet wrote its checkpoint again, while `KubeletCheckpointWanted` said so."""

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


DevicePluginInput = (
    KubeletStarted
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
)
