"""The grpclib side of the device plugin API: one handler per RPC.

Each handler turns the request into a core input, lets the runtime feed it to
the node, and turns the node's Reply or Reject back into a message or a gRPC
status. No decision is made here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

import grpclib.const
import grpclib.server
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError

from dp_core import (
    AllocateAnswer,
    AllocateRequested,
    OptionsRequested,
    PluginOptions,
    PreferredAllocationRequested,
    PreferredAnswer,
    PreStartRequested,
)

from . import wire
from .proto import v1beta1 as pb

if TYPE_CHECKING:
    from .runtime import Runtime

__all__ = ["DevicePluginService"]

_M = TypeVar("_M")


async def _receive(stream: grpclib.server.Stream[Any, Any], kind: type[_M]) -> _M:
    message = await stream.recv_message()
    if not isinstance(message, kind):
        raise GRPCError(Status.INVALID_ARGUMENT, f"expected a {kind.__name__} message")
    return message


class DevicePluginService:
    """`/v1beta1.DevicePlugin/*` for every resource, on any number of sockets."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    async def get_device_plugin_options(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        await stream.recv_message()
        answer = self._runtime.call(
            stream, lambda conn, call, now: OptionsRequested(conn, call, now), PluginOptions
        )
        await stream.send_message(wire.options_message(answer))

    async def list_and_watch(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        await stream.recv_message()
        async with self._runtime.watch(stream) as updates:
            async for message in updates:
                await stream.send_message(message)

    async def get_preferred_allocation(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        request = await _receive(stream, pb.PreferredAllocationRequest)
        containers = wire.preferences(request)
        answer = self._runtime.call(
            stream,
            lambda conn, call, now: PreferredAllocationRequested(conn, call, containers, now),
            PreferredAnswer,
        )
        await stream.send_message(wire.preferred_response(answer))

    async def allocate(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        try:
            containers = wire.allocate_request(await _receive(stream, bytes))
        except wire.WireError as error:
            raise GRPCError(Status.INVALID_ARGUMENT, str(error)) from None
        answer = self._runtime.call(
            stream,
            lambda conn, call, now: AllocateRequested(conn, call, containers, now),
            AllocateAnswer,
        )
        await stream.send_message(wire.allocate_response(answer))

    async def pre_start_container(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        request = await _receive(stream, pb.PreStartContainerRequest)
        ids = tuple(request.devices_ids)
        self._runtime.call(
            stream, lambda conn, call, now: PreStartRequested(conn, call, ids, now), object
        )
        await stream.send_message(pb.PreStartContainerResponse())

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        base = "/v1beta1.DevicePlugin/"
        return {
            base + "GetDevicePluginOptions": grpclib.const.Handler(
                self.get_device_plugin_options,
                Cardinality.UNARY_UNARY,
                pb.Empty,
                pb.DevicePluginOptions,
            ),
            base + "ListAndWatch": grpclib.const.Handler(
                self.list_and_watch,
                Cardinality.UNARY_STREAM,
                pb.Empty,
                pb.ListAndWatchResponse,
            ),
            base + "GetPreferredAllocation": grpclib.const.Handler(
                self.get_preferred_allocation,
                Cardinality.UNARY_UNARY,
                pb.PreferredAllocationRequest,
                pb.PreferredAllocationResponse,
            ),
            base + "Allocate": grpclib.const.Handler(
                self.allocate,
                Cardinality.UNARY_UNARY,
                wire.Raw,
                pb.AllocateResponse,
            ),
            base + "PreStartContainer": grpclib.const.Handler(
                self.pre_start_container,
                Cardinality.UNARY_UNARY,
                pb.PreStartContainerRequest,
                pb.PreStartContainerResponse,
            ),
        }
