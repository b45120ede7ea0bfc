"""The device plugin API's RPCs, one grpclib handler each.

Each handler reads its request, turns it into a core input on the connection
the call arrived on (`connections.current_connection`), hands it to the node
through `NodeCalls`, and turns the node's `Reply` into a message or its
`Reject` into a gRPC status. No decision is made here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import grpclib.const
import grpclib.server
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError

from dp_core import (
    AllocateRequested,
    Input,
    OptionsRequested,
    PreferredAllocationRequested,
    PreStartRequested,
    Reject,
    Reply,
)
from dp_server.deviceplugin import wire
from dp_server.deviceplugin.connections import NoConnection, current_connection
from dp_server.proto import v1beta1 as pb
from dp_server.rpc import read_request

__all__ = ["SERVICE_PREFIX", "DevicePluginService", "NodeCalls"]

SERVICE_PREFIX = "/v1beta1.DevicePlugin/"

MakeInput = Callable[[int, int, float], Input]  # (connection, call, now) -> input


class NodeCalls(Protocol):
    """What the service needs of the runtime."""

    def call(self, connection: int, make: MakeInput) -> Reply | Reject | None:
        """Feed one call's input; return the node's answer to it (None: it gave none)."""

    def watch(self, connection: int) -> AbstractAsyncContextManager[AsyncIterator[bytes]]:
        """A ListAndWatch stream on `connection`: the encoded device lists to send."""


class DevicePluginService:
    """`/v1beta1.DevicePlugin/*` for every resource, on any number of sockets."""

    def __init__(self, node: NodeCalls) -> None:
        self._node = node

    async def get_device_plugin_options(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        await read_request(stream)
        answer = self._answer(lambda conn, call, now: OptionsRequested(conn, call, now))
        await stream.send_message(wire.options(answer))

    async def get_preferred_allocation(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        containers = wire.preferences(await read_request(stream))
        answer = self._answer(
            lambda conn, call, now: PreferredAllocationRequested(conn, call, containers, now)
        )
        await stream.send_message(wire.preferred_response(answer))

    async def allocate(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        try:
            containers = wire.allocate_request(await read_request(stream))
        except wire.WireError as error:
            raise GRPCError(Status.INVALID_ARGUMENT, str(error)) from None
        answer = self._answer(
            lambda conn, call, now: AllocateRequested(conn, call, containers, now)
        )
        await stream.send_message(wire.allocate_response(answer))

    async def pre_start_container(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        ids = tuple((await read_request(stream)).devices_ids)
        self._answer(lambda conn, call, now: PreStartRequested(conn, call, ids, now))
        await stream.send_message(pb.PreStartContainerResponse())

    async def list_and_watch(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        await read_request(stream)
        async with self._node.watch(_connection()) as updates:
            async for message in updates:
                await stream.send_message(message)

    def _answer(self, make: MakeInput) -> Any:
        outcome = self._node.call(_connection(), make)
        if isinstance(outcome, Reject):
            raise GRPCError(wire.STATUS[outcome.status], outcome.message)
        if outcome is None:
            raise GRPCError(Status.INTERNAL, "the core gave no answer")
        return outcome.answer

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        unary, stream = Cardinality.UNARY_UNARY, Cardinality.UNARY_STREAM
        return {
            SERVICE_PREFIX + name: grpclib.const.Handler(handler, cardinality, request, reply)
            for name, handler, cardinality, request, reply in (
                (
                    "GetDevicePluginOptions",
                    self.get_device_plugin_options,
                    unary,
                    pb.Empty,
                    pb.DevicePluginOptions,
                ),
                (
                    "GetPreferredAllocation",
                    self.get_preferred_allocation,
                    unary,
                    pb.PreferredAllocationRequest,
                    pb.PreferredAllocationResponse,
                ),
                # Read strictly by wire.allocate_request, not by betterproto2,
                # which would take garbled bytes for a request without devices.
                ("Allocate", self.allocate, unary, wire.Raw, pb.AllocateResponse),
                (
                    "PreStartContainer",
                    self.pre_start_container,
                    unary,
                    pb.PreStartContainerRequest,
                    pb.PreStartContainerResponse,
                ),
                ("ListAndWatch", self.list_and_watch, stream, pb.Empty, pb.ListAndWatchResponse),
            )
        }


def _connection() -> int:
    try:
        return current_connection()
    except NoConnection:
        raise GRPCError(Status.UNAVAILABLE, "connection is not tracked") from None
