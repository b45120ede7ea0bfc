"""What the device-plugin front end answers a kubelet request with, carried by
`Reply` (docs/design.md §3); what a container is given is `inventory.edits`."""

from __future__ import annotations

import attrs

from ..inventory.edits import ContainerAllocation, DeviceSpec

__all__ = [
    "AllocateAnswer",
    "Answer",
    "ContainerAllocation",
    "DeviceSpec",
    "PluginOptions",
    "PreStartAnswer",
    "PreferredAnswer",
]


@attrs.frozen
class PluginOptions:
    pre_start_required: bool = False
    get_preferred_allocation_available: bool = False


@attrs.frozen
class AllocateAnswer:
    containers: tuple[ContainerAllocation, ...]


@attrs.frozen
class PreferredAnswer:
    containers: tuple[tuple[str, ...], ...]


@attrs.frozen
class PreStartAnswer:
    pass


Answer = PluginOptions | AllocateAnswer | PreferredAnswer | PreStartAnswer
