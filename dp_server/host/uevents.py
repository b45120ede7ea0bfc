"""Kernel uevents: the kernel's own word that a device came, went or changed driver.

Most host changes dp cares about show in `/dev/vfio`, which the file watch
follows: a function bound to vfio-pci or an mdev created makes a node there.
Some do not: virtual functions made by `sriov_numvfs` appear without a driver,
a function hot-plugged or given to a host driver touches no VFIO node. sysfs
itself cannot be watched (kernfs sends no inotify events for new devices), so
those would wait for the periodic rescan. The kernel announces each of them
on its uevent netlink socket (`NETLINK_KOBJECT_UEVENT`, multicast group 1,
what udev listens to): `add`, `remove`, `bind`, `unbind` with the device's
`SUBSYSTEM`. Any process may listen, in any network namespace of the initial
user namespace (`lib/kobject_uevent.c`), so a DaemonSet's container hears them.

A message is `ACTION@DEVPATH` and `KEY=VALUE` fields, each NUL-terminated
(`kobject_uevent_env`). Messages that udev re-broadcasts (group 2, a
`libudev` header) are not asked for.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import AsyncIterator, Collection
from typing import NamedTuple

__all__ = ["RELEVANT_SUBSYSTEMS", "Uevent", "UeventMonitor", "parse_uevent"]

_log = logging.getLogger("dp.runtime")

NETLINK_KOBJECT_UEVENT = 15  # include/uapi/linux/netlink.h
_KERNEL_GROUP = 1  # the kernel's own events (udev's re-broadcasts are group 2)
# The devices a host snapshot is made of: PCI functions and mdevs (and their drivers).
RELEVANT_SUBSYSTEMS = frozenset({"pci", "mdev"})
_RECEIVE_BUFFER = 1 << 20  # a burst of VFs is a few hundred bytes per event
_SETTLE = 0.02  # seconds to gather an event's followers (`add` is followed by `bind`)


class Uevent(NamedTuple):
    action: str
    devpath: str
    subsystem: str


def parse_uevent(data: bytes) -> Uevent | None:
    """A kernel uevent message, or None for anything else (udev's, truncated, garbage)."""
    parts = data.split(b"\0")
    header, _, devpath = parts[0].partition(b"@")
    if not devpath or not header.isalpha():
        return None
    fields = dict(part.partition(b"=")[::2] for part in parts[1:] if b"=" in part)
    try:
        return Uevent(
            header.decode("ascii"),
            devpath.decode("utf-8", "replace"),
            fields.get(b"SUBSYSTEM", b"").decode("utf-8", "replace"),
        )
    except UnicodeDecodeError:
        return None


class UeventMonitor:
    """Tells the loop, once per burst, that a relevant device changed.

    `open()` returns None (and logs why) where the socket cannot be had; dp
    then relies on the file watch and the periodic rescan, as before.
    """

    def __init__(self, sock: socket.socket, subsystems: Collection[str]) -> None:
        self._sock = sock
        self._subsystems = frozenset(subsystems)
        self._seen = asyncio.Event()

    @classmethod
    def open(cls, subsystems: Collection[str] = RELEVANT_SUBSYSTEMS) -> UeventMonitor | None:
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_KOBJECT_UEVENT)
        except (OSError, AttributeError) as error:  # AttributeError: no AF_NETLINK here
            _log.warning("uevents-unavailable", extra={"dp_fields": {"reason": str(error)}})
            return None
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RECEIVE_BUFFER)
            sock.bind((0, _KERNEL_GROUP))
            sock.setblocking(False)
        except OSError as error:
            sock.close()
            _log.warning("uevents-unavailable", extra={"dp_fields": {"reason": str(error)}})
            return None
        return cls(sock, subsystems)

    def _drain(self) -> bool:
        """Read every waiting message; whether any concerned a relevant device."""
        relevant = False
        while True:
            try:
                data = self._sock.recv(65536)
            except BlockingIOError:
                return relevant
            except OSError as error:
                if error.errno == errno.ENOBUFS:
                    relevant = True  # events were dropped: whatever they were, look again
                    continue
                raise
            event = parse_uevent(data)
            if event is not None and event.subsystem in self._subsystems:
                relevant = True

    def _readable(self) -> None:
        try:
            relevant = self._drain()
        except OSError as error:
            _log.warning("uevents-failed", extra={"dp_fields": {"reason": str(error)}})
            relevant = True
        if relevant:
            self._seen.set()

    async def changes(self) -> AsyncIterator[None]:
        """Yields after each burst of relevant events, until closed or cancelled."""
        loop = asyncio.get_running_loop()
        loop.add_reader(self._sock.fileno(), self._readable)
        try:
            while True:
                await self._seen.wait()
                # A device's events come in a row (`add`, then `bind`): one look for all.
                await asyncio.sleep(_SETTLE)
                self._seen.clear()
                yield
        finally:
            loop.remove_reader(self._sock.fileno())
            self._sock.close()
