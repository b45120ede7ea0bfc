"""ListAndWatch streams: what each is to send next."""

from __future__ import annotations

from dp_core import AdvertisedDevice
from dp_server.deviceplugin import wire
from dp_server.rpc import StreamSlot

__all__ = ["Streams"]


class Streams:
    """Every ListAndWatch stream, by id, with the device lists they are sent.

    Every stream of a resource is sent the same list, and after a kubelet
    restart the same list again: each list is encoded once, when it changes.
    """

    def __init__(self) -> None:
        self._slots: dict[int, StreamSlot[bytes]] = {}
        self._encoded: dict[str, tuple[object, bytes]] = {}

    def __len__(self) -> int:
        return len(self._slots)

    def open(self, stream: int) -> StreamSlot[bytes]:
        slot: StreamSlot[bytes] = StreamSlot()
        self._slots[stream] = slot
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
