"""Register calls to the kubelet, over one channel to kubelet.sock at a time.

Each call's outcome goes to the core as `RegistrationSucceeded` or
`RegistrationFailed`, whatever happened; the core decides what comes next.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from dp_core import Input, Register, RegistrationFailed, RegistrationSucceeded
from dp_server.deviceplugin import wire
from dp_server.deviceplugin.pod_resources import describe_error
from dp_server.deviceplugin.sockets import PluginSockets
from dp_server.proto import v1beta1 as pb

__all__ = ["RegisterClient"]


class RegisterClient:
    def __init__(
        self,
        kubelet_socket: Path,
        timeout: float,
        sockets: PluginSockets,
        feed: Callable[[Input], object],
        now: Callable[[], float],
    ) -> None:
        self.kubelet_socket = kubelet_socket
        self.timeout = timeout
        self._sockets = sockets
        self._feed = feed
        self._now = now
        self._channel: Channel | None = None
        self._users: dict[Channel, int] = {}

    def retire(self) -> None:
        """Stop using the channel to kubelet.sock; close it once no call uses it.

        A Register still on its way must be let finish rather than cut off:
        the kubelet may act on it (and dial) whatever happens to our side.
        """
        channel, self._channel = self._channel, None
        if channel is not None and not self._users.get(channel):
            channel.close()

    def close(self) -> None:
        """Close every channel, whether a call uses it or not: dp is stopping."""
        channels = set(self._users)
        if self._channel is not None:
            channels.add(self._channel)
        self._channel = None
        self._users.clear()
        for channel in channels:
            channel.close()

    async def call(self, effect: Register) -> None:
        """Listen on `effect`'s endpoint, call Register, take the outcome to the core."""
        request = pb.RegisterRequest(
            version="v1beta1",
            endpoint=effect.endpoint,
            resource_name=effect.resource,
            options=wire.options(effect.options),
        )
        channel = None
        try:
            await self._sockets.ensure(
                effect.endpoint, effect.resource if effect.own_socket else None
            )
            if self._channel is None:
                self._channel = Channel(path=str(self.kubelet_socket))
            channel = self._channel
            self._users[channel] = self._users.get(channel, 0) + 1
            # The deadline stays ours, not sent as grpc-timeout: grpclib rounds
            # one above 10 s down to whole seconds, and grpc-go's server resets
            # the call at it, before our own timeout could tell the core that
            # the kubelet never answered (and may still dial).
            async with asyncio.timeout(self.timeout):
                await pb.RegistrationStub(channel).register(request)
        except Exception as error:  # noqa: BLE001 - every failure must reach the core
            if not isinstance(error, GRPCError) and channel is self._channel:
                self.retire()
            # Timed out: the kubelet may still be handling it, and dial late.
            unanswered = isinstance(error, TimeoutError) or (
                isinstance(error, GRPCError) and error.status is Status.DEADLINE_EXCEEDED
            )
            self._feed(
                RegistrationFailed(
                    effect.resource,
                    effect.attempt,
                    describe_error(error),
                    self._now(),
                    unanswered=unanswered,
                )
            )
        else:
            self._feed(RegistrationSucceeded(effect.resource, effect.attempt, self._now()))
        finally:
            if channel is not None and channel in self._users:
                self._users[channel] -= 1
                if not self._users[channel]:
                    del self._users[channel]
                    if channel is not self._channel:
                        channel.close()
