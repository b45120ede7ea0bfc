"""What the device-plugin front end asks the shell to do, as frozen effects."""

from __future__ import annotations

import attrs

from ..errors import StatusCode
from ..inventory.advertised import AdvertisedDevice
from .answers import Answer, PluginOptions

__all__ = [
    "AttributeConnection",
    "DevicePluginEffect",
    "EndStream",
    "HealthChanged",
    "KubeletCheckpointWanted",
    "Publish",
    "RefreshAllocations",
    "Register",
    "RegistrationsSettled",
    "Reject",
    "Reply",
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
class RegistrationsSettled:
    """Every resource is registered and has its connection again, after some
    had not: the Registers asked for since have all settled. Sent once per
    such change (`notices`), with the input that made the last one live; a
    node without resources sends none."""


@attrs.frozen
class KubeletCheckpointWanted:
    """Whether to read the kubelet's checkpoint again each time it is written,
    and feed it (`KubeletCheckpointObserved`): while the kubelet syncs its pods
    and a write could still change what is held (`sync`). Sent when it
    changes; until the first, it is not wanted."""

    wanted: bool = attrs.field(validator=attrs.validators.instance_of(bool))


DevicePluginEffect = (
    Register
    | AttributeConnection
    | Publish
    | EndStream
    | Reply
    | Reject
    | HealthChanged
    | RefreshAllocations
    | RegistrationsSettled
    | KubeletCheckpointWanted
)
