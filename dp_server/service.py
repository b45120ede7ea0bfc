"""The grpclib side of the device plugin API: one handler per RPC.

Each handler turns the request into a core input, lets the runtime feed it to
the node, and turns the node's Reply or Reject back into a message or a gRPC
status. No decision is made here.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

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
from .unary import Answer

if TYPE_CHECKING:
    from .runtime import Runtime

__all__ = ["DevicePluginService"]


class DevicePluginService:
    """`/v1beta1.DevicePlugin/*` for every resource, on any number of sockets.

    The unary RPCs are plain functions of (connection, request bytes) to reply
    bytes, so that `dp_server.unary` can answer a whole call in the turn it is
    read; grpclib serves the rest through `_serve_unary`.
    """

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    def get_device_plugin_options(self, connection: int, request: bytes) -> bytes:
        answer = self._runtime.call(
            connection, lambda conn, call, now: OptionsRequested(conn, call, now), PluginOptions
        )
        return wire.options_message(answer)

    def get_preferred_allocation(self, connection: int, request: bytes) -> bytes:
        containers = wire.preferences(pb.PreferredAllocationRequest.parse(request))
        answer = self._runtime.call(
            connection,
            lambda conn, call, now: PreferredAllocationRequested(conn, call, containers, now),
            PreferredAnswer,
        )
        return bytes(wire.preferred_response(answer))

    def allocate(self, connection: int, request: bytes) -> bytes:
        try:
            containers = wire.allocate_request(request)
        except wire.WireError as error:
            raise GRPCError(Status.INVALID_ARGUMENT, str(error)) from None
        answer = self._runtime.call(
            connection,
            lambda conn, call, now: AllocateRequested(conn, call, containers, now),
            AllocateAnswer,
        )
        return wire.allocate_response(answer)

    def pre_start_container(self, connection: int, request: bytes) -> bytes:
        ids = tuple(pb.PreStartContainerRequest.parse(request).devices_ids)
        self._runtime.call(
            connection, lambda conn, call, now: PreStartRequested(conn, call, ids, now), object
        )
        return bytes(pb.PreStartContainerResponse())

    async def list_and_watch(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        await stream.recv_message()
        async with self._runtime.watch(stream) as updates:
            async for message in updates:
                await stream.send_message(message)

    def answers(self) -> dict[str, Answer]:
        """The unary RPCs by path."""
        return {
            _BASE + "GetDevicePluginOptions": self.get_device_plugin_options,
            _BASE + "GetPreferredAllocation": self.get_preferred_allocation,
            _BASE + "Allocate": self.allocate,
            _BASE + "PreStartContainer": self.pre_start_container,
        }

    async def _serve_unary(self, answer: Answer, stream: grpclib.server.Stream[Any, Any]) -> None:
        request = await stream.recv_message()
        if request is None:
            raise GRPCError(Status.INVALID_ARGUMENT, "the call carried no request message")
        await stream.send_message(answer(self._runtime.connection_of(stream), request))

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        answers = self.answers()
        mapping = {
            path: grpclib.const.Handler(
                functools.partial(self._serve_unary, answer),
                Cardinality.UNARY_UNARY,
                wire.Raw,  # decoded by the answer itself
                _REPLY_TYPES[path],
            )
            for path, answer in answers.items()
        }
        mapping[_BASE + "ListAndWatch"] = grpclib.const.Handler(
            self.list_and_watch, Cardinality.UNARY_STREAM, pb.Empty, pb.ListAndWatchResponse
        )
        return mapping


_BASE = "/v1beta1.DevicePlugin/"
_REPLY_TYPES: dict[str, type[Any]] = {
    _BASE + "GetDevicePluginOptions": pb.DevicePluginOptions,
    _BASE + "GetPreferredAllocation": pb.PreferredAllocationResponse,
    _BASE + "Allocate": pb.AllocateResponse,
    _BASE + "PreStartContainer": pb.PreStartContainerResponse,
}
