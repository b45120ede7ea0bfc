"""What a ListAndWatch stream is to send next."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpclib.const
from grpclib.exceptions import GRPCError

__all__ = ["StreamSlot"]


class StreamSlot:
    """Latest device list for one ListAndWatch stream.

    Each list replaces the one before, so a slow reader only ever gets the
    newest; nothing queues up behind a stalled kubelet.
    """

    def __init__(self) -> None:
        self.latest: bytes | None = None
        self.ended: str | None = None
        self.ready = asyncio.Event()

    def publish(self, message: bytes) -> None:
        self.latest = message
        self.ready.set()

    def end(self, reason: str) -> None:
        self.ended = reason
        self.ready.set()

    async def updates(self) -> AsyncIterator[bytes]:
        while True:
            await self.ready.wait()
            self.ready.clear()
            if self.ended is not None:
                raise GRPCError(grpclib.const.Status.UNAVAILABLE, self.ended)
            message, self.latest = self.latest, None
            if message is not None:
                yield message
