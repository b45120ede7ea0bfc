"""Core answers <-> kubelet protobuf messages. The only place that knows both."""

from __future__ import annotations

from collections.abc import Iterable

from grpclib.const import Status

from dp_core import (
    AdvertisedDevice,
    AllocateAnswer,
    ContainerPreference,
    PluginOptions,
    PreferredAnswer,
    StatusCode,
)

from .proto import v1beta1 as pb

__all__ = [
    "STATUS",
    "allocate_response",
    "device_list",
    "options_message",
    "preferences",
    "preferred_response",
]

STATUS: dict[StatusCode, Status] = {code: Status(code.value) for code in StatusCode}


def device_list(devices: Iterable[AdvertisedDevice]) -> pb.ListAndWatchResponse:
    return pb.ListAndWatchResponse(
        devices=[
            pb.Device(
                id=device.id,
                health=device.health,
                topology=(
                    pb.TopologyInfo(nodes=[pb.NumaNode(id=device.numa_node)])
                    if device.numa_node is not None
                    else None
                ),
            )
            for device in devices
        ]
    )


def options_message(options: PluginOptions) -> pb.DevicePluginOptions:
    return pb.DevicePluginOptions(
        pre_start_required=options.pre_start_required,
        get_preferred_allocation_available=options.get_preferred_allocation_available,
    )


def allocate_response(answer: AllocateAnswer) -> pb.AllocateResponse:
    return pb.AllocateResponse(
        container_responses=[
            pb.ContainerAllocateResponse(
                envs=dict(container.envs),
                mounts=[
                    pb.Mount(container_path=c, host_path=h, read_only=ro)
                    for c, h, ro in container.mounts
                ],
                devices=[
                    pb.DeviceSpec(
                        container_path=spec.container_path,
                        host_path=spec.host_path,
                        permissions=spec.permissions,
                    )
                    for spec in container.devices
                ],
                annotations=dict(container.annotations),
            )
            for container in answer.containers
        ]
    )


def preferences(request: pb.PreferredAllocationRequest) -> tuple[ContainerPreference, ...]:
    return tuple(
        ContainerPreference(
            available=tuple(c.available_deviceIDs),
            must_include=tuple(c.must_include_deviceIDs),
            size=c.allocation_size,
        )
        for c in request.container_requests
    )


def preferred_response(answer: PreferredAnswer) -> pb.PreferredAllocationResponse:
    return pb.PreferredAllocationResponse(
        container_responses=[
            pb.ContainerPreferredAllocationResponse(device_i_ds=list(ids))
            for ids in answer.containers
        ]
    )
