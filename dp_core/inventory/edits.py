"""What a container is given for devices: its device nodes and variables.

Both front ends hand a container the same edits for the same device (an
Allocate's answer, a prepared claim's CDI spec), so they are made here, once.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from ..config.names import env_var_name
from .advertised import AdvertisedDevice
from .resources import Resource

__all__ = ["ContainerAllocation", "DeviceSpec", "container_allocation"]


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
    # node keeps CDI specs and theirs are in place (`cdi.resources`).
    cdi_devices: tuple[str, ...] = ()


def container_allocation(
    resource: Resource, devices: Sequence[AdvertisedDevice]
) -> ContainerAllocation:
    """What one container gets for `devices` of `resource` (KubeVirt's conventions).

    Host paths are always the host's `/dev/...`; the env var lists the IDs in
    request order, which KubeVirt relies on to map devices to the VM.
    """
    paths: list[str] = []
    for device in devices:
        for path in device.host_paths:
            if path not in paths:
                paths.append(path)
    specs = tuple(DeviceSpec(path, path, resource.permissions) for path in paths)
    prefix = resource.device_class.env_prefix
    envs: tuple[tuple[str, str], ...] = ()
    if prefix is not None:
        envs = ((env_var_name(prefix, resource.name), ",".join(d.id for d in devices)),)
    return ContainerAllocation(envs=envs, devices=specs)
