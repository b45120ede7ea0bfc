"""Register calls to the kubelet, over one channel to kubelet.sock at a time.

Each call's outcome goes to the core as `RegistrationSucceeded` or
`RegistrationFailed`, whatever happened; the core decides what comes next.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from grpclib.const import Status
from grpclib.exceptions import GRPCError

from dp_core import Input, Register, RegistrationFailed, RegistrationSucceeded

from . import wire
from .pod_resources import describe_error
from .sockets import PluginSockets
from .transport import KubeletChannel, SentUnary

__all__ = ["REGISTER_PATH", "RegisterClient"]

REGISTER_PATH = "/v1beta1.Registration/Register"


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
        self._channel: KubeletChannel | None = None
        self._users: dict[KubeletChannel, int] = {}

    def retire(self) -> None:
        """Stop using the channel to kubelet.sock; close it once no call uses it.

        A Register still on its way must be let finish rather than cut off:
        the kubelet may act on it (and dial) whatever happens to our side.
        """
        channel, self._channel = self._channel, None
        if channel is not None and not self._users.get(channel):
            channel.close()

    def close(self) -> None:
        """Close every channel, whether a call uses it or not: dp is stopping.

        A call whose request went out at once, but whose task was cancelled
        before it started, never gives its channel back.
        """
        channels = set(self._users)
        if self._channel is not None:
            channels.add(self._channel)
        self._channel = None
        self._users.clear()
        for channel in channels:
            channel.close()

    def call(self, effect: Register) -> Coroutine[Any, Any, None]:
        """Start `effect`'s Register; the coroutine returned takes its outcome to the core.

        When its socket is listening and the channel is connected, as for
        every registration after the first, the request is sent before this
        returns: the core asks for a Register while it handles the previous
        registration's GetDevicePluginOptions, and the kubelet gets the
        request before that call's reply.
        """
        request = wire.register_request(effect.endpoint, effect.resource, effect.options)
        sent = None
        channel = self._channel
        if channel is not None and self._sockets.is_listening(effect.endpoint):
            sent = channel.send_unary(REGISTER_PATH, request)
            if sent is not None:
                self._use(channel)
        return self._complete(effect, request, channel if sent is not None else None, sent)

    def _use(self, channel: KubeletChannel) -> None:
        self._users[channel] = self._users.get(channel, 0) + 1

    async def _complete(
        self,
        effect: Register,
        request: bytes,
        channel: KubeletChannel | None,
        sent: SentUnary | None,
    ) -> None:
        try:
            if sent is not None:
                await sent.reply(self.timeout)
            else:
                await self._sockets.ensure(
                    effect.endpoint, effect.resource if effect.own_socket else None
                )
                if self._channel is None:
                    self._channel = KubeletChannel(
                        path=str(self.kubelet_socket), codec=wire.PreEncodedCodec()
                    )
                channel = self._channel
                self._use(channel)
                await channel.unary(REGISTER_PATH, request, self.timeout)
        except Exception as error:  # noqa: BLE001 - every failure must reach the core
            if not isinstance(error, GRPCError) and channel is self._channel:
                self.retire()
            reason = describe_error(error)
            # Timed out: the kubelet may still be handling it, and dial late.
            unanswered = isinstance(error, TimeoutError) or (
                isinstance(error, GRPCError) and error.status is Status.DEADLINE_EXCEEDED
            )
            self._feed(
                RegistrationFailed(
                    effect.resource, effect.attempt, reason, self._now(), unanswered=unanswered
                )
            )
        else:
            self._feed(RegistrationSucceeded(effect.resource, effect.attempt, self._now()))
        finally:
            if channel is not None:
                self._users[channel] -= 1
                if not self._users[channel]:
                    del self._users[channel]
                    if channel is not self._channel:
                        channel.close()
