"""Core answers <-> kubelet protobuf messages. The only place that knows both."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from grpclib.const import Status
from grpclib.encoding.proto import ProtoCodec

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
    "PreEncodedCodec",
    "encoded_device_list",
    "allocate_response",
    "options_message",
    "preferences",
    "preferred_response",
]

STATUS: dict[StatusCode, Status] = {code: Status(code.value) for code in StatusCode}


class PreEncodedCodec(ProtoCodec):
    """ProtoCodec that also sends bytes as they are.

    A device list goes to every stream of its resource unchanged, so it is
    encoded once when it changes rather than once per stream and send.
    """

    def encode(self, message: Any, message_type: Any) -> bytes:
        if isinstance(message, bytes):
            return message
        return super().encode(message, message_type)


def encoded_device_list(devices: Iterable[AdvertisedDevice]) -> bytes:
    """`ListAndWatchResponse` bytes, written directly.

    The one message that is large and hot: a registration storm after a
    kubelet restart encodes every resource's list, 1,000 devices for kvm.
    betterproto2 takes about 30 us a device; this takes about 1 us and gives
    the same bytes (tests compare the two, and decode with Google's runtime).
    """
    out = bytearray()
    for device in devices:
        body = _string_field(1, device.id) + _string_field(2, device.health)
        if device.numa_node is not None:
            node = _varint_field(1, device.numa_node) if device.numa_node else b""
            body += _length_delimited(3, _length_delimited(1, node))
        out += _length_delimited(1, body)
    return bytes(out)


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int64 on the wire: two's complement, ten bytes
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _varint_field(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _string_field(number: int, text: str) -> bytes:
    # proto3 leaves a field at its default (the empty string) off the wire.
    return _length_delimited(number, text.encode()) if text else b""


def _length_delimited(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


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
