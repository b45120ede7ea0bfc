"""Concurrent Register calls on one connection are handled concurrently.

The kubelet (grpc-go) runs each Register in a goroutine of its own, and the
server relies on it: it sends the next Register on the same connection while
the kubelet is still dialling for the previous one. An emulator that took
Register calls one at a time would deadlock the plugin below, whose first
GetDevicePluginOptions only answers once the second Register has reached the
kubelet.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

import grpclib.server
from grpclib.client import Channel
from grpclib.const import Cardinality, Handler

from dp_server.proto import v1beta1 as bp
from dp_testing.emulator import KubeletEmulator

WAIT = 10.0
FIRST, SECOND = "example.com/first", "example.com/second"


class HoldingPlugin:
    """Holds the first options call until the kubelet has seen the second Register."""

    def __init__(self, kubelet: KubeletEmulator) -> None:
        self.kubelet = kubelet
        self.first_dialled = asyncio.Event()
        self.options_calls = 0

    async def _get_options(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        await stream.recv_message()
        self.options_calls += 1
        if self.options_calls == 1:
            self.first_dialled.set()
            seen = await asyncio.to_thread(
                self.kubelet.wait_for, lambda k: bool(k.events_of("register", SECOND)), WAIT
            )
            assert seen, "the second Register never reached the kubelet"
        await stream.send_message(bp.DevicePluginOptions())

    async def _list_and_watch(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        await stream.recv_message()
        await stream.send_message(bp.ListAndWatchResponse(devices=[]))
        await asyncio.Event().wait()

    def __mapping__(self) -> dict[str, Handler]:
        p = "/v1beta1.DevicePlugin/"
        return {
            p + "GetDevicePluginOptions": Handler(
                self._get_options, Cardinality.UNARY_UNARY, bp.Empty, bp.DevicePluginOptions
            ),
            p + "ListAndWatch": Handler(
                self._list_and_watch, Cardinality.UNARY_STREAM, bp.Empty, bp.ListAndWatchResponse
            ),
        }


async def test_second_register_is_handled_while_the_first_is_dialling() -> None:
    with tempfile.TemporaryDirectory(prefix="dp-") as tmp:
        sock_dir = Path(tmp)
        kubelet = KubeletEmulator(sock_dir, dial_timeout=WAIT).start()
        plugin = HoldingPlugin(kubelet)
        server = grpclib.server.Server([plugin])
        await server.start(path=str(sock_dir / "p.sock"))
        channel = Channel(path=str(kubelet.socket_path))  # one connection for both
        stub = bp.RegistrationStub(channel)

        def register(resource: str) -> Any:
            request = bp.RegisterRequest(
                version="v1beta1", endpoint="p.sock", resource_name=resource
            )
            return asyncio.create_task(stub.register(request, timeout=WAIT + 5))

        try:
            first = register(FIRST)
            await asyncio.wait_for(plugin.first_dialled.wait(), WAIT)
            second = register(SECOND)
            await asyncio.gather(first, second)
            assert await asyncio.to_thread(kubelet.wait_registered, [FIRST, SECOND], WAIT)
            times = {(e.kind, e.resource): e.time for e in kubelet.events}
            # The second handler started while the first was still inside its dial.
            assert times["register", FIRST] < times["register", SECOND]
            assert times["register", SECOND] < times["options", FIRST]
        finally:
            channel.close()
            await asyncio.to_thread(kubelet.stop)
            server.close()
            await server.wait_closed()
