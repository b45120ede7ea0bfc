"""ListAndWatch streams: what each is to send next."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpclib.const
from grpclib.exceptions import GRPCError

from dp_core import AdvertisedDevice
from dp_server.deviceplugin import wire

__all__ = ["StreamSlot", "Streams"]


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


class Streams:
    """Every ListAndWatch stream, by id, with the device lists they are sent.

    Every stream of a resource is sent the same list, and after a kubelet
    restart the same list again: each list is encoded once, when it changes.
    """

    def __init__(self) -> None:
        self._slots: dict[int, StreamSlot] = {}
        self._encoded: dict[str, tuple[object, bytes]] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def open(self, stream: int) -> StreamSlot:
        slot = self._slots[stream] = StreamSlot()
        return slot

    def close(self, stream: int) -> None:
        self._slots.pop(stream, None)

    def publish(self, stream: int, resource: str, devices: tuple[AdvertisedDevice, ...]) -> None:
        slot = self._slots.get(stream)
        if slot is None:
            return
        cached, message = self._encoded.get(resource, (None, b""))
        if cached is not devices:
            message = wire.encoded_device_list(devices)
            self._encoded[resource] = (devices, message)
        slot.publish(message)

    def end(self, stream: int, reason: str) -> None:
        slot = self._slots.get(stream)
        if slot is not None:
            slot.end(reason)

    def end_all(self, reason: str) -> None:
        for slot in self._slots.values():
            slot.end(reason)
