"""One server stream's next message, for streams whose every message is the whole state.

A ListAndWatch device list and a DRA health list each replace the one
before, so a slow reader only ever gets the newest; nothing queues up
behind a stalled kubelet.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Generic, TypeVar

import grpclib.const
from grpclib.exceptions import GRPCError

__all__ = ["StreamSlot"]

T = TypeVar("T")


class StreamSlot(Generic[T]):
    """The latest message for one stream, or why it ended."""

    def __init__(self) -> None:
        self.latest: T | None = None
        self.ended: str | None = None
        self.ready = asyncio.Event()

    def publish(self, message: T) -> None:
        self.latest = message
        self.ready.set()

    def end(self, reason: str) -> None:
        self.ended = reason
        self.ready.set()

    async def updates(self) -> AsyncIterator[T]:
        """Each newest message as it comes; UNAVAILABLE with the reason once ended."""
        while True:
            await self.ready.wait()
            self.ready.clear()
            if self.ended is not None:
                raise GRPCError(grpclib.const.Status.UNAVAILABLE, self.ended)
            message, self.latest = self.latest, None
            if message is not None:
                yield message
