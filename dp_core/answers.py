"""What the core answers a kubelet request with, carried by `Reply` (docs/design.md §3)."""

from __future__ import annotations

import attrs

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
class DeviceSpec:
    container_path: str
    host_path: str
    permissions: str


@attrs.frozen
class ContainerAllocation:
    envs: tuple[tuple[str, str], ...] = ()
    devices: tuple[DeviceSpec, ...] = ()
    mounts: tuple[tuple[str, str, bool], ...] = ()
    annotations: tuple[tuple[str, str], ...] = ()
    # Fully qualified CDI names (`vendor/class=name`) of the devices, when the
    # node keeps CDI specs and theirs are in place (`node_cdi`).
    cdi_devices: tuple[str, ...] = ()


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
